#!/usr/bin/env python3
"""Build the pinned ggml and the qtts native kernels, then generate the cffi binding.

Steps, each skipped when its result is already cached:
  1. fetch the sdist named in native/ggml.lock from the package registry and verify its sha256;
  2. CMake Release build of ggml (CPU always; BLAS/CUDA/Vulkan/Metal/Hexagon by
     QTTS_GGML_BACKENDS) into a prefix under the cache, keyed by (version, options, compiler);
  3. compile native/ops (our own fused kernels) against that prefix: once per ISA variant into
     one library that picks the best variant the CPU runs when it is loaded (ops/dispatch.c);
  4. preprocess the installed headers and write the out-of-line ABI cffi module
     engine/ggml/_ggml_cffi.py plus engine/ggml/_native.json (where the libraries are).

Two flavours, cached apart (the options are part of the key):
  * native (default, `make native`): ggml with GGML_NATIVE and the kernels with -march=native:
    the fastest code for this machine, and only for machines with the same instruction sets;
  * portable (QTTS_PORTABLE=1, the Docker image): ggml's CPU backend built once per x86-64 ISA
    level as loadable modules (GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS, ggml loads the best one
    the CPU runs) and the kernels as AMX-BF16, AVX-512 BF16/VNNI, AVX-512, AVX2 and baseline
    variants behind one runtime dispatch: runs on any x86-64 CPU.

The cache lives in $QTTS_CACHE_DIR (default ~/.cache/qtts) so every clone on a machine shares one
compiled ggml. Nothing here runs at inference time and nothing is downloaded at run time.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

NATIVE = Path(__file__).resolve().parent
REPO = NATIVE.parent
GGML_PKG = REPO / "engine" / "ggml"

# ggml's x86-64 CPU backend variants under GGML_CPU_ALL_VARIANTS (ggml/src/CMakeLists.txt of the
# pinned version), oldest first.
X86_CPU_VARIANTS = ["x64", "sse42", "sandybridge", "ivybridge", "piledriver", "haswell",
                    "skylakex", "cannonlake", "cascadelake", "icelake", "cooperlake", "zen4",
                    "alderlake", "sapphirerapids"]

# Names a user may put in QTTS_GGML_BACKENDS, and the CMake switch each one turns on.
BACKEND_OPTIONS: dict[str, list[str]] = {
    "blas": ["-DGGML_BLAS=ON", "-DGGML_BLAS_VENDOR=OpenBLAS"],
    "cuda": ["-DGGML_CUDA=ON"],
    "vulkan": ["-DGGML_VULKAN=ON"],
    "metal": ["-DGGML_METAL=ON"],
    "hexagon": ["-DGGML_HEXAGON=ON"],
    "rpc": ["-DGGML_RPC=ON"],
}
# BLAS and RPC give CPU-only machines a real second backend: BLAS shares the CPU's buffer type,
# RPC (a local rpc server process) has its own, like an accelerator.
DEFAULT_BACKENDS = "blas,rpc"

HEADERS = ["ggml.h", "ggml-alloc.h", "ggml-backend.h", "ggml-cpu.h", "gguf.h"]
BACKEND_HEADERS = {"rpc": "ggml-rpc.h"}
OPS_HEADER = NATIVE / "ops" / "qtts_ops.h"


def log(msg: str) -> None:
    print(f"[native] {msg}", flush=True)


def fail(msg: str) -> None:
    print(f"[native] error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def cache_root() -> Path:
    return Path(os.environ.get("QTTS_CACHE_DIR", Path.home() / ".cache" / "qtts")).expanduser()


def read_lock() -> dict[str, str]:
    with open(NATIVE / "ggml.lock", "rb") as f:
        return tomllib.load(f)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_sdist(lock: dict[str, str]) -> Path:
    """Return the verified sdist archive, downloading it from the registry once."""
    dl = cache_root() / "downloads"
    dl.mkdir(parents=True, exist_ok=True)
    archive = dl / lock["archive"]
    if not archive.exists():
        log(f"fetching {lock['name']}=={lock['version']} (sdist) from the package registry")
        # With the build tools present and isolation off, pip saves the sdist in ~2 s instead of
        # building a throwaway isolated environment first (measured when this was written).
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q",
             "scikit-build-core~=1.0.0", "setuptools-scm~=10.2"],
            check=True,
        )
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             "--no-build-isolation", "-d", str(dl), f"{lock['name']}=={lock['version']}"],
            check=True,
        )
    digest = sha256_of(archive)
    if digest != lock["sha256"]:
        archive.unlink()
        fail(f"{archive.name}: sha256 {digest} does not match ggml.lock ({lock['sha256']}); "
             "deleted it, run again to re-download")
    return archive


def unpack(archive: Path, lock: dict[str, str]) -> Path:
    src_root = cache_root() / "src" / lock["version"]
    source = src_root / lock["source_dir"]
    if not (source / "CMakeLists.txt").exists():
        tmp = Path(tempfile.mkdtemp(dir=cache_root()))
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        if src_root.exists():
            shutil.rmtree(src_root)
        src_root.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(src_root)
    return source


def compiler_id() -> str:
    out = subprocess.run(["cc", "--version"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()[0]


def portable_requested() -> bool:
    raw = os.environ.get("QTTS_PORTABLE", "0").strip().lower()
    if raw not in ("0", "1", "", "false", "true", "no", "yes"):
        fail(f"QTTS_PORTABLE={raw!r}: use 1 (portable build, any CPU) or 0 (native build)")
    return raw in ("1", "true", "yes")


def requested_cpu_variants(portable: bool) -> list[str] | None:
    """QTTS_CPU_VARIANTS: a subset of ggml's CPU variants for the portable build (None: all).

    All 14 x86-64 variants take ~14 times the CPU backend's compile time; a machine that builds
    for itself and a few others (a developer's, the test suite's) may name fewer. The baseline
    variant (x64 on x86-64) is always added so that the build still runs on any CPU.
    """
    raw = os.environ.get("QTTS_CPU_VARIANTS", "").strip().lower()
    if not portable or not raw or raw == "all":  # the native build has one CPU backend
        return None
    names = sorted({n.strip() for n in raw.split(",") if n.strip()})
    unknown = [n for n in names if n not in X86_CPU_VARIANTS]
    if unknown or platform.machine().lower() not in ("x86_64", "amd64"):
        fail(f"QTTS_CPU_VARIANTS: unknown variant(s) {', '.join(unknown) or raw} (x86-64 only); "
             f"known: all, {', '.join(X86_CPU_VARIANTS)}")
    return sorted({"x64", *names}, key=X86_CPU_VARIANTS.index)


def requested_backends() -> list[str]:
    raw = os.environ.get("QTTS_GGML_BACKENDS", DEFAULT_BACKENDS)
    names = sorted({n.strip().lower() for n in raw.split(",") if n.strip()} - {"cpu"})
    unknown = [n for n in names if n not in BACKEND_OPTIONS]
    if unknown:
        fail(f"QTTS_GGML_BACKENDS: unknown backend(s) {', '.join(unknown)}; "
             f"known: cpu, {', '.join(BACKEND_OPTIONS)}")
    return names


def check_prerequisites(backends: list[str]) -> None:
    if "blas" in backends:
        probe = subprocess.run(["pkg-config", "--exists", "openblas"], capture_output=True)
        if shutil.which("pkg-config") is None or probe.returncode != 0:
            fail("the BLAS backend needs OpenBLAS: apt-get install libopenblas-dev pkg-config "
                 "(make does this), or set QTTS_GGML_BACKENDS=cpu")
    if "cuda" in backends and shutil.which("nvcc") is None:
        fail("the CUDA backend needs nvcc on PATH")


CUBLAS_WHEEL = "nvidia-cublas==13.1.1.3"  # matches the local nvcc 13.0; the toolkit lacks cuBLAS


def cublas_lib_dir() -> Path:
    """Where the cuBLAS wheel's shared libraries are unpacked."""
    return cache_root() / "cublas" / CUBLAS_WHEEL.split("==")[1] / "nvidia" / "cu13" / "lib"


def link_cublas(prefix: Path) -> None:
    """Put the wheel's cuBLAS beside libggml-cuda, which finds its dependencies via $ORIGIN."""
    src = cublas_lib_dir()
    if not src.is_dir():
        return  # the toolkit's own cuBLAS is on the loader's path
    for lib in src.glob("libcublas*.so.*"):
        link = lib_dir(prefix) / lib.name
        if not link.exists():
            link.symlink_to(lib)


def cublas_from_pypi() -> list[str]:
    """CMake options pointing at cuBLAS from its PyPI wheel, when the CUDA toolkit has none."""
    nvcc = shutil.which("nvcc")
    assert nvcc is not None
    toolkit = Path(nvcc).resolve().parent.parent
    if (toolkit / "include" / "cublas_v2.h").exists():
        return []
    root = cache_root() / "cublas" / CUBLAS_WHEEL.split("==")[1]
    inc, libs = root / "nvidia" / "cu13" / "include", cublas_lib_dir()
    if not (inc / "cublas_v2.h").exists():
        import zipfile

        log(f"fetching {CUBLAS_WHEEL} (the CUDA toolkit here has no cuBLAS)")
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "-d", tmp, CUBLAS_WHEEL], check=True)
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as z:
                z.extractall(root)
        for name in ("libcublas", "libcublasLt"):
            link = libs / f"{name}.so"
            if not link.exists():
                link.symlink_to(f"{name}.so.13")
    return [
        f"-DCUDA_cublas_LIBRARY={libs / 'libcublas.so'}",
        f"-DCUDA_cublasLt_LIBRARY={libs / 'libcublasLt.so'}",
        f"-DCMAKE_CUDA_FLAGS=-I{inc}",
        f"-DCMAKE_CXX_FLAGS=-I{inc}",
    ]


def cmake_options(backends: list[str], portable: bool) -> list[str]:
    opts = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON",
        "-DGGML_BUILD_TESTS=OFF",
        "-DGGML_BUILD_EXAMPLES=OFF",
        "-DGGML_LLAMAFILE=ON",  # tiled GEMM: faster matmul convs (docs/performance.md)
        "-DGGML_CCACHE=OFF",
        "-DCMAKE_INSTALL_RPATH=$ORIGIN",  # libggml.so must find libggml-cpu.so.0 beside it
    ]
    if portable:
        # No GGML_NATIVE: every backend a loadable module beside libggml (installed into lib/,
        # so their $ORIGIN rpath finds libggml-base), the CPU one once per ISA level where ggml
        # has a list of levels (x86-64, arm64); ggml_backend_load_all picks the best at load.
        opts += ["-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=ON",
                 "-DCMAKE_INSTALL_LIBDIR=lib", "-DCMAKE_INSTALL_BINDIR=lib"]
        if platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64"):
            opts.append("-DGGML_CPU_ALL_VARIANTS=ON")
    for name in backends:
        opts += BACKEND_OPTIONS[name]
    if "cuda" in backends:
        # No libcuda.so on build machines without a GPU driver: NO_VMM drops the driver API;
        # the architecture must be explicit ("native" needs a GPU). 90 = H100/H200.
        opts += [
            "-DGGML_CUDA_NO_VMM=ON",
            f"-DCMAKE_CUDA_ARCHITECTURES={os.environ.get('QTTS_CUDA_ARCH', '90')}",
            *cublas_from_pypi(),
        ]
    return opts


def ops_sources() -> list[Path]:
    return sorted((NATIVE / "ops").glob("*.[ch]"))


def build_key(lock: dict[str, str], opts: list[str], cpu_variants: list[str] | None) -> str:
    h = hashlib.sha256()
    h.update(lock["sha256"].encode())
    h.update("\0".join(opts).encode())
    if cpu_variants is not None:
        h.update(("\0cpu-variants=" + ",".join(cpu_variants)).encode())
    h.update(compiler_id().encode())
    return h.hexdigest()[:12]


def _cmake_build(build_dir: Path, targets: list[str]) -> None:
    cmd = ["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2)]
    if targets:
        cmd += ["--target", *targets]
    build = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if build.returncode != 0:
        print(build.stdout[-20000:], file=sys.stderr)
        fail(f"ggml build failed (exit {build.returncode}); its output is above")


def _install_subset(source: Path, build_dir: Path, prefix: Path) -> None:
    """`cmake --install` wants every variant's file; with a subset built, copy what was: the
    libraries (their rpath is already $ORIGIN: CMAKE_BUILD_WITH_INSTALL_RPATH) and headers."""
    (prefix / "lib").mkdir(parents=True)
    (prefix / "include").mkdir()
    for lib in sorted(build_dir.rglob("libggml*.so*")):
        if "CMakeFiles" in lib.parts:
            continue
        dest = prefix / "lib" / lib.name
        if lib.is_symlink():
            dest.symlink_to(os.readlink(lib))
        else:
            shutil.copy2(lib, dest)
    for header in sorted((source / "include").glob("*.h")):
        shutil.copy2(header, prefix / "include" / header.name)


def build_ggml(source: Path, prefix: Path, opts: list[str],
               cpu_variants: list[str] | None = None, backends: Sequence[str] = ()) -> float:
    """Configure, build and install ggml into prefix; returns the seconds it took. With
    ``cpu_variants``, only those CPU-backend variants are compiled (portable build)."""
    started = time.perf_counter()
    build_dir = prefix.parent / (prefix.name + ".build")
    if build_dir.exists():
        shutil.rmtree(build_dir)
    log(f"building ggml into {prefix} (this happens once per machine and option set)")
    if cpu_variants is not None:
        log(f"CPU backend variants: {', '.join(cpu_variants)} (QTTS_CPU_VARIANTS)")
        opts = [*opts, "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON"]
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), "-Wno-dev", *opts,
                    f"-DCMAKE_INSTALL_PREFIX={prefix}"],
                   check=True, stdout=subprocess.DEVNULL)
    if cpu_variants is None:
        _cmake_build(build_dir, [])
        subprocess.run(["cmake", "--install", str(build_dir)], check=True,
                       stdout=subprocess.DEVNULL)
    else:
        # the chosen modules, then libggml alone ("ggml/fast": without the dependency on every
        # backend module that GGML_BACKEND_DL gives it)
        _cmake_build(build_dir, ["ggml-base", *(f"ggml-cpu-{v}" for v in cpu_variants),
                                 *(f"ggml-{b}" for b in backends)])
        _cmake_build(build_dir, ["ggml/fast"])
        _install_subset(source, build_dir, prefix)
    shutil.rmtree(build_dir)
    return time.perf_counter() - started


def lib_dir(prefix: Path) -> Path:
    for name in ("lib", "lib64"):
        if (prefix / name / "libggml.so").exists():
            return prefix / name
    fail(f"{prefix}: no libggml.so after install")
    raise AssertionError  # unreachable; fail() exits


# The kernels' ISA variants in the portable build, best first: (name, compiler flags). The
# library's dispatcher (ops/dispatch.c) runs the first one whose instructions the CPU and the OS
# support; the names and their order are dispatch.c's too.
X86_OPS_VARIANTS: list[tuple[str, list[str]]] = [
    ("amx_bf16", ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mamx-tile",
                  "-mamx-bf16", "-mamx-int8"]),
    ("avx512_bf16", ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"]),
    ("avx512_vnni", ["-march=x86-64-v4", "-mavx512vnni"]),
    ("avx512", ["-march=x86-64-v4"]),
    ("avx2", ["-march=x86-64-v3"]),
    ("scalar", ["-march=x86-64"]),
]
OPS_FLAGS = ["-O3", "-fPIC", "-fopenmp", "-std=c11", "-Wall", "-Wextra"]
DISPATCH = NATIVE / "ops" / "dispatch.c"


def ops_variants(portable: bool) -> list[tuple[str, list[str]]]:
    """The variants the kernels are compiled as: all ISA levels, or this machine's alone."""
    if not portable:
        return [("native", ["-march=native"])]
    if platform.machine().lower() in ("x86_64", "amd64"):
        return X86_OPS_VARIANTS
    return [("generic", [])]  # other CPUs: the portable C paths at the compiler's baseline


def compile_ops(prefix: Path, variants: list[tuple[str, list[str]]], out: Path) -> None:
    """Link native/ops into ``out``: every kernel source once per variant (its symbols suffixed
    by qtts_variant.h) plus the dispatcher, compiled for the baseline, that forwards to one."""
    ops_dir = NATIVE / "ops"
    libs = lib_dir(prefix)
    kernels = [p for p in sorted(ops_dir.glob("*.c")) if p != DISPATCH]
    inc = [f"-I{prefix / 'include'}", f"-I{ops_dir}"]
    with tempfile.TemporaryDirectory() as tmp:
        jobs: list[list[str]] = []
        objs: list[str] = []
        for name, flags in variants:
            for src in kernels:
                obj = f"{tmp}/{src.stem}.{name}.o"
                jobs.append(["cc", *OPS_FLAGS, *flags, *inc, "-include",
                             str(ops_dir / "qtts_variant.h"), f"-DQTTS_VARIANT={name}",
                             "-c", str(src), "-o", obj])
                objs.append(obj)
        obj = f"{tmp}/dispatch.o"
        jobs.append(["cc", *OPS_FLAGS, *inc, *(f"-DQTTS_OPS_HAVE_{n}" for n, _ in variants),
                     "-c", str(DISPATCH), "-o", obj])
        objs.append(obj)
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            for proc in pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True),
                                 jobs):
                if proc.returncode != 0:
                    print(proc.stderr[-20000:], file=sys.stderr)
                    fail(f"compiling {proc.args[-3]} failed; the compiler's output is above")
        link = subprocess.run(["cc", "-shared", "-fopenmp", *objs, f"-L{libs}", "-lggml-base",
                               "-lggml", "-lm", "-Wl,-rpath,$ORIGIN", "-o", str(out)],
                              capture_output=True, text=True)
        if link.returncode != 0:
            print(link.stderr[-20000:], file=sys.stderr)
            fail("linking libqtts_ops failed (a new external function missing from "
                 "native/ops/qtts_variant.h shows as a multiple definition); output above")


def build_ops(prefix: Path, portable: bool) -> Path | None:
    """Compile native/ops/*.c into libqtts_ops next to libggml (cached by sources, variants and
    compiler)."""
    if not any(p != DISPATCH for p in ops_sources() if p.suffix == ".c"):
        return None
    variants = ops_variants(portable)
    h = hashlib.sha256()
    for p in ops_sources():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(repr((variants, OPS_FLAGS, compiler_id())).encode())
    out = lib_dir(prefix) / f"libqtts_ops.{h.hexdigest()[:12]}.so"
    if not out.exists():
        log(f"compiling native/ops as {', '.join(n for n, _ in variants)}")
        tmp_out = out.with_suffix(".tmp")
        compile_ops(prefix, variants, tmp_out)
        tmp_out.rename(out)
    return out


# ---------------------------------------------------------------------------------------------
# cffi binding from the real headers

FAKE_LIBC = ["stdbool.h", "stddef.h", "stdint.h", "stdio.h", "stdarg.h", "stdlib.h", "string.h"]


def preprocess(include_dir: Path, extra_headers: list[Path], backends: list[str]
               ) -> tuple[str, str]:
    """Run the headers through cpp with empty libc stand-ins; returns (declarations, macros)."""
    with tempfile.TemporaryDirectory() as tmp:
        fake = Path(tmp) / "fake"
        fake.mkdir()
        for name in FAKE_LIBC:
            (fake / name).write_text("")
        wrapper = Path(tmp) / "all.h"
        headers = HEADERS + [BACKEND_HEADERS[b] for b in backends if b in BACKEND_HEADERS]
        lines = [f'#include "{h}"' for h in headers]
        lines += [f'#include "{p}"' for p in extra_headers]
        wrapper.write_text("\n".join(lines) + "\n")
        flags = ["-nostdinc", f"-I{fake}", f"-I{include_dir}", "-U__GNUC__",
                 "-D__attribute__(x)=", "-D__restrict=", "-D__restrict__=", "-D__extension__=",
                 "-D__inline=", "-D_Noreturn=", "-D__declspec(x)="]
        decls = subprocess.run(["gcc", "-E", "-P", *flags, str(wrapper)],
                               capture_output=True, text=True, check=True).stdout
        macros = subprocess.run(["gcc", "-E", "-dM", *flags, str(wrapper)],
                                capture_output=True, text=True, check=True).stdout
    return decls, macros


def clean_declarations(decls: str, macros: str) -> str:
    """Make the preprocessed headers digestible for cffi: no ``extern``, no ``sizeof`` in constant
    expressions, no typedef declared twice, and the integer macros as ``#define`` lines."""
    decls = re.sub(r"\bextern\s+", "", decls)
    decls = decls.replace("sizeof(int32_t)", "4")
    decls = re.sub(r"static const size_t GGML_TENSOR_SIZE = sizeof\(struct ggml_tensor\);", "",
                   decls)
    # cffi rejects a typedef declared twice (legal C11: ggml-alloc.h and ggml-backend.h both do).
    seen: set[str] = set()
    out: list[str] = []
    for stmt in re.split(r"(?<=;)\n", decls):
        m = re.fullmatch(r"\s*typedef\s+struct\s+\w+\s*\*\s*(\w+)\s*;\s*", stmt)
        if m:
            if m.group(1) in seen:
                continue
            seen.add(m.group(1))
        out.append(stmt)
    decls = "\n".join(out)
    wanted = []
    for line in macros.splitlines():
        m = re.fullmatch(
            r"#define ((?:GGML|GGUF|QTTS)_[A-Z0-9_]+) (-?(?:0x[0-9a-fA-F]+|\d+))[uUlL]*",
            line.strip())
        if m:
            wanted.append(f"#define {m.group(1)} {m.group(2)}")
    return "\n".join(wanted) + "\n" + decls


def write_binding(prefix: Path, ops_lib: Path | None, opts: list[str], key: str,
                  build_seconds: float | None, backends: list[str], portable: bool,
                  cpu_variants: list[str] | None) -> None:
    import cffi

    extra = [OPS_HEADER] if ops_lib is not None and OPS_HEADER.exists() else []
    decls, macros = preprocess(prefix / "include", extra, backends)
    cdef = clean_declarations(decls, macros)
    ffi = cffi.FFI()
    ffi.cdef(cdef)
    ffi.set_source("_ggml_cffi", None)
    target = GGML_PKG / "_ggml_cffi.py"
    with tempfile.TemporaryDirectory() as tmp:
        generated = Path(tmp) / "_ggml_cffi.py"
        ffi.emit_python_code(str(generated))
        shutil.copyfile(generated, target)
    info = {
        "ggml_name": read_lock()["name"],
        "ggml_version": read_lock()["ggml_version"],
        "build_key": key,
        "prefix": str(prefix),
        "lib_dir": str(lib_dir(prefix)),
        "libggml": str(lib_dir(prefix) / "libggml.so"),
        "ops_lib": str(ops_lib) if ops_lib else None,
        "backends": ["cpu", *backends],
        "portable": portable,
        "cpu_variants": (cpu_variants or "all") if portable else "native",
        "ops_variants": [n for n, _ in ops_variants(portable)] if ops_lib else [],
        "cmake_options": opts,
        "build_seconds": build_seconds,
    }
    (GGML_PKG / "_native.json").write_text(json.dumps(info, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild ggml even if cached")
    parser.add_argument("--no-binding", action="store_true",
                        help="only build (or find cached) ggml and the kernels; leave "
                             "engine/ggml's binding as it is (warms the cache)")
    args = parser.parse_args()

    # Two builds on one machine (parallel CI jobs, a developer and a test) must not share a
    # half-written prefix: hold an exclusive lock on the cache for the whole run.
    cache_root().mkdir(parents=True, exist_ok=True)
    with open(cache_root() / ".build.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        _build(args.force, not args.no_binding)


def _build(force: bool, binding: bool) -> None:
    lock = read_lock()
    portable = portable_requested()
    backends = requested_backends()
    check_prerequisites(backends)
    opts = cmake_options(backends, portable)
    cpu_variants = requested_cpu_variants(portable)
    key = build_key(lock, opts, cpu_variants)
    prefix = cache_root() / "ggml" / f"{lock['ggml_version']}-{key}"
    done = prefix / ".complete"
    build_seconds: float | None = None
    if force or not done.exists():
        source = unpack(fetch_sdist(lock), lock)
        if prefix.exists():
            shutil.rmtree(prefix)
        build_seconds = build_ggml(source, prefix, opts, cpu_variants, backends)
        done.write_text(json.dumps({"seconds": round(build_seconds, 1)}) + "\n")
        log(f"ggml built in {build_seconds:.1f} s")
    else:
        build_seconds = json.loads(done.read_text()).get("seconds")
        log(f"ggml {lock['ggml_version']} cached at {prefix}")
    if "cuda" in backends:
        link_cublas(prefix)
    ops_lib = build_ops(prefix, portable)
    if not binding:
        log(f"{'portable' if portable else 'native'} build ready at {prefix}")
        return
    write_binding(prefix, ops_lib, opts, key, build_seconds, backends, portable, cpu_variants)
    log(f"binding written to {GGML_PKG / '_ggml_cffi.py'} "
        f"({'portable: any CPU of this architecture' if portable else 'native: this CPU'})")


if __name__ == "__main__":
    main()
