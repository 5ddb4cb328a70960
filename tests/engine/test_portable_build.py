"""The portable native build (QTTS_PORTABLE=1) on a CPU without AVX-512, emulated by qemu-user.

A copy of the package is built portable (ggml's CPU backend per ISA level, loaded by score;
qtts's kernels per ISA level behind one dispatch) and run twice: on this machine and under
``qemu-x86_64 -cpu Haswell`` (AVX2, no AVX-512). Under the emulated CPU ``qtts info`` must name
the AVX2 variants, ``qtts decode`` of the parity fixture must match the official PyTorch decoder
to the decoder tolerance (1e-4, as the native build does in tests/parity), and nothing may
execute an illegal instruction (a SIGILL ends the process). A
control program that does use AVX-512 must die under the same emulated CPU: without that, the
test could not fail.

The portable ggml is cached in ~/.cache/qtts like every build (``make native-portable`` warms it;
built here otherwise, which takes a while). QTTS_CPU_VARIANTS picks its CPU variants (the
Makefile's default: x64, haswell, sapphirerapids).
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf

REPO = Path(__file__).resolve().parents[2]
QEMU = shutil.which("qemu-x86_64")
CPU_MODEL = "Haswell"  # AVX2 + FMA + F16C + BMI2, no AVX-512: x86-64-v3
VARIANTS = os.environ.get("QTTS_CPU_VARIANTS") or "haswell,sapphirerapids"
TOLERANCE = 1e-4  # the decoder's (exact mode) against the reference

pytestmark = [
    pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64",
                       reason="the emulated-CPU test runs on x86-64 Linux"),
    pytest.mark.skipif(QEMU is None,
                       reason="SKIPPED LOUDLY: qemu-x86_64 not found: apt-get install qemu-user "
                              "(make test does this); the portable build is NOT checked"),
]


def _entry() -> list[str]:
    """The command line's module (``cli`` once it is a package of its own)."""
    return ["-m", "cli"] if (REPO / "cli" / "__main__.py").exists() else ["-m", "engine.cli"]


def _copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "_ggml_cffi.py", "_native.json")
    for name in ("engine", "native", "cli", "service"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, dest / name, ignore=ignore)


@pytest.fixture(scope="module")
def portable_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the package whose binding points at the portable build."""
    tree = tmp_path_factory.mktemp("portable") / "qtts"
    _copy_tree(tree)
    env = {**os.environ, "QTTS_PORTABLE": "1", "QTTS_CPU_VARIANTS": VARIANTS}
    built = subprocess.run([sys.executable, str(tree / "native" / "build.py")], env=env,
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stdout + built.stderr
    return tree


def _qtts(tree: Path, args: list[str], cpu: str | None = None,
          timeout: float = 600) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, *_entry(), *args]
    if cpu is not None:
        assert QEMU is not None
        cmd = [QEMU, "-cpu", cpu, *cmd]
    env = {**os.environ, "PYTHONPATH": str(tree), "QTTS_BACKEND": "cpu", "QTTS_THREADS": "2",
           "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("QTTS_CUSTOM_OPS", None)
    # cwd: `python -m` puts the working folder first on sys.path, before PYTHONPATH
    p = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=timeout)
    assert p.returncode != -signal.SIGILL, f"illegal instruction: {' '.join(cmd)}\n{p.stderr}"
    assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}{p.stderr}"
    return p


def _field(info: str, prefix: str) -> str:
    for line in info.splitlines():
        if line.strip().startswith(prefix):
            return line.strip()[len(prefix):].strip()
    raise AssertionError(f"no {prefix!r} line in qtts info:\n{info}")


def _host_has_avx512() -> bool:
    return " avx512f " in Path("/proc/cpuinfo").read_text().replace("\n", " ")


def test_the_emulated_cpu_lacks_avx512(tmp_path: Path) -> None:
    """Control: an AVX-512 instruction under the same qemu CPU model is illegal."""
    if shutil.which("cc") is None:
        pytest.skip("needs cc")
    src = tmp_path / "zmm.c"
    src.write_text("int main(void) { __asm__ volatile(\"vpxord %%zmm1, %%zmm1, %%zmm1\" ::: "
                   "\"xmm1\"); return 0; }\n")
    subprocess.run(["cc", "-O1", "-mavx512f", str(src), "-o", str(tmp_path / "zmm")], check=True)
    assert QEMU is not None
    p = subprocess.run([QEMU, "-cpu", CPU_MODEL, str(tmp_path / "zmm")], capture_output=True)
    assert p.returncode == -signal.SIGILL, p.returncode


def test_info_picks_the_avx2_variants_on_a_cpu_without_avx512(portable_tree: Path) -> None:
    emulated = _qtts(portable_tree, ["info"], cpu=CPU_MODEL).stdout
    assert "portable" in _field(emulated, "flavour:")
    assert _field(emulated, "CPU backend:") == "libggml-cpu-haswell.so"
    assert "AVX2" in _field(emulated, "CPU features:").split()
    assert "AVX512" not in _field(emulated, "CPU features:").split()
    kernels = _field(emulated, "qtts kernels:")
    assert kernels.startswith(
        "avx2 (built: amx_bf16, avx512_bf16, avx512_vnni, avx512, avx2, scalar)")
    assert _field(emulated, "snake:") == "avx2"
    assert _field(emulated, "conv1d_tm:") == "avx2 (block 16)"
    assert _field(emulated, "conv1d_tm_bf16:") == "portable C"
    assert _field(emulated, "conv1d_wino_bf16:") == "portable C"
    assert _field(emulated, "gemm_i8:") == "portable C"
    assert _field(emulated, "gemv_q4:") == "avx2"
    assert _field(emulated, "attn_causal:") == "avx2"
    assert _field(emulated, "attn_step:") == "avx2"
    assert _field(emulated, "attn_window:") == "avx2"
    assert _field(emulated, "conv1d_wino_f32:") == "avx2"

    native = _qtts(portable_tree, ["info"]).stdout
    assert _field(native, "CPU backend:").startswith("libggml-cpu-")
    if _host_has_avx512():  # the same files run better code on this CPU
        assert _field(native, "qtts kernels:").startswith(("amx_bf16", "avx512"))
        assert _field(native, "snake:") == "avx512"


def _decode(tree: Path, gguf: Path, codes: Path, out: Path, cpu: str | None = None
            ) -> np.ndarray[Any, Any]:
    _qtts(tree, ["decode", "--model", str(gguf), "--codes", str(codes), "--out", str(out),
                 "--precision", "exact"], cpu=cpu)
    wav, rate = sf.read(out, dtype="float32")
    assert rate == 24000
    return np.asarray(wav)


def test_decode_under_emulation_matches_the_reference(portable_tree: Path, tmp_path: Path
                                                      ) -> None:
    """The parity fixture (random weights of a sane gain) decoded by the native build, the
    portable build on this CPU and the portable build on the emulated CPU: each within the
    decoder tolerance of the official PyTorch decoder, as tests/parity checks the native one."""
    from tests.parity.marks import MISSING

    if MISSING:
        pytest.skip(f"PARITY REFERENCE NOT INSTALLED ({MISSING}): run `make parity-env`; "
                    "test_decode_under_emulation_matches_the_native_build still runs")
    import torch

    from engine.tools.convert import convert
    from tests.parity import reference as ref

    torch.set_num_threads(2)
    folder = ref.make_reference_tokenizer_dir(ref.default_cache_dir(), "tiny", seed=0)
    codes = ref.random_codes(12, seed=1)
    expected = ref.reference_stage_outputs(ref.load_reference_decoder(folder),
                                           codes)["wav"].reshape(-1)
    assert float(np.std(expected)) > 0.01  # not silence, not saturated noise
    gguf = tmp_path / "decoder.gguf"
    convert(folder, gguf, dtype="f32", progress=False)
    np.save(tmp_path / "codes.npy", codes)
    runs = {
        "native": _decode(REPO, gguf, tmp_path / "codes.npy", tmp_path / "native.wav"),
        "portable": _decode(portable_tree, gguf, tmp_path / "codes.npy",
                            tmp_path / "portable.wav"),
        "emulated": _decode(portable_tree, gguf, tmp_path / "codes.npy",
                            tmp_path / "emulated.wav", cpu=CPU_MODEL),
    }
    for name, wav in runs.items():
        assert wav.shape == expected.shape, name
        err = float(np.abs(wav - expected).max())
        assert err <= TOLERANCE, (name, err)


def test_decode_under_emulation_matches_the_native_build(portable_tree: Path, tiny_gguf: Path,
                                                        tmp_path: Path) -> None:
    """The test suite's tiny model (no reference needed). Its random weights drive most samples
    into the +-1 clip and amplify float rounding, so the bound here is a signal-to-error ratio
    of the emulated (AVX2) run to the native one; the portable build on this CPU is expected
    to be as close as the native build is to itself within the tolerance."""
    codes = np.random.default_rng(5).integers(0, 2048, size=(16, 6)).astype(np.int64)
    np.save(tmp_path / "codes.npy", codes)
    ref = _decode(REPO, tiny_gguf, tmp_path / "codes.npy", tmp_path / "native.wav")
    assert ref.size == 6 * 1920 and np.abs(ref).max() > 0
    portable = _decode(portable_tree, tiny_gguf, tmp_path / "codes.npy",
                       tmp_path / "portable.wav")
    emulated = _decode(portable_tree, tiny_gguf, tmp_path / "codes.npy",
                       tmp_path / "emulated.wav", cpu=CPU_MODEL)
    assert portable.shape == emulated.shape == ref.shape
    backend = _field(_qtts(portable_tree, ["info"]).stdout, "CPU backend:")
    if _host_has_avx512() and backend == "libggml-cpu-haswell.so":
        # ggml's AVX-512 variant (sapphirerapids) needs AMX, which e.g. a Zen 4 lacks: the
        # portable build's ggml nodes run AVX2 code here, the native build's AVX-512 code
        assert _snr_db(ref, portable) >= 80.0
    else:
        assert float(np.abs(portable - ref).max()) <= TOLERANCE
    assert _snr_db(ref, emulated) >= 80.0


def _snr_db(ref: np.ndarray[Any, Any], got: np.ndarray[Any, Any]) -> float:
    err = float(np.sum((got - ref).astype(np.float64) ** 2))
    return float(10 * np.log10(float(np.sum(ref.astype(np.float64) ** 2)) / max(err, 1e-30)))


def test_the_image_builds_the_portable_variant() -> None:
    """The Dockerfile's builder runs native/build.py with QTTS_PORTABLE=1 (its default)."""
    text = (REPO / "Dockerfile").read_text()
    builder = text.split("FROM ")[1]  # stage 1, the builder
    arg = builder.index("ARG QTTS_PORTABLE=1")
    assert arg < builder.index("native/build.py"), "QTTS_PORTABLE must be set before the build"
    assert "ARG QTTS_CPU_VARIANTS=all" in builder
