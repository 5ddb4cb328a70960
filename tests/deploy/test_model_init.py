"""deploy/model/model-init.sh, the init container of every qtts pod, run for real: under
busybox's sh and applets (what the model image, busybox, runs; Debian package `busybox`,
installed by deploy/ci/install-tools.sh) and under the system's sh + coreutils.

A right checksum puts the verified model in place, read-only; a wrong one stops the pod
before anything is copied, with one FATAL line naming both digests; bad configuration is
exit 2 with a line naming the variable."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.conftest import DEPLOY, _apt_root, _missing

SCRIPT = DEPLOY / "model" / "model-init.sh"
APPLETS = ("sh", "sha256sum", "cut", "tr", "dirname", "mkdir", "cp", "chmod", "mv", "rm", "wc",
           "cat")


@pytest.fixture(params=["busybox", "system"])
def shell_env(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """(command prefix, PATH) for one of the two userlands."""
    if request.param == "system":
        return ["sh"], {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return _busybox(tmp_path)


def _busybox(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """busybox's sh, with only busybox applets on PATH (the model image's userland)."""
    busybox = shutil.which("busybox")
    if busybox is None:
        _missing("busybox (Debian package busybox)", _apt_root())
    assert busybox is not None
    bindir = tmp_path / "busybox-bin"
    bindir.mkdir()
    for applet in APPLETS:
        (bindir / applet).symlink_to(busybox)
    return [str(bindir / "sh")], {"PATH": str(bindir)}


def _model(tmp_path: Path, size: int = 3 * 1024 * 1024 + 17) -> tuple[Path, str]:
    src = tmp_path / "image" / "model" / "model.gguf"
    src.parent.mkdir(parents=True)
    data = b"GGUF" + os.urandom(size - 4)
    src.write_bytes(data)
    return src, hashlib.sha256(data).hexdigest()


def _run(shell: tuple[list[str], dict[str, str]], env: dict[str, str]
         ) -> subprocess.CompletedProcess[str]:
    prefix, path_env = shell
    return subprocess.run([*prefix, str(SCRIPT)], capture_output=True, text=True, timeout=60,
                          env={**path_env, **env})


def test_right_checksum_puts_the_model_in_place(shell_env: tuple[list[str], dict[str, str]],
                                                tmp_path: Path) -> None:
    src, digest = _model(tmp_path)
    dest = tmp_path / "models" / "model.gguf"
    env = {"QTTS_MODEL_SRC": str(src), "QTTS_MODEL_DEST": str(dest),
           "QTTS_MODEL_SHA256": digest.upper(), "QTTS_MODEL_VERSION": "v7"}
    p = _run(shell_env, env)
    assert p.returncode == 0, p.stderr
    assert dest.read_bytes() == src.read_bytes()
    assert dest.stat().st_mode & 0o777 == 0o444
    assert os.listdir(dest.parent) == ["model.gguf"], "a partial file was left"
    assert f"model v7 verified (sha256 {digest}, {src.stat().st_size} bytes)" in p.stderr
    # a restarted init container finds it in place and copies nothing
    p = _run(shell_env, env)
    assert p.returncode == 0 and "already in place" in p.stderr, p.stderr


def test_wrong_checksum_fails_fast_with_one_clear_line(
        shell_env: tuple[list[str], dict[str, str]], tmp_path: Path) -> None:
    src, digest = _model(tmp_path)
    wrong = hashlib.sha256(b"another model").hexdigest()
    dest = tmp_path / "models" / "model.gguf"
    p = _run(shell_env, {"QTTS_MODEL_SRC": str(src), "QTTS_MODEL_DEST": str(dest),
                         "QTTS_MODEL_SHA256": wrong, "QTTS_MODEL_VERSION": "v8"})
    assert p.returncode == 1
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("qtts-model-init: FATAL: sha256 mismatch"), line
    assert f"expected {wrong}, got {digest}" in line and "v8" in line and str(src) in line
    # nothing was copied: the source is checked first
    assert not dest.parent.exists()


def test_a_corrupted_copy_never_replaces_the_model(
        shell_env: tuple[list[str], dict[str, str]], tmp_path: Path) -> None:
    """A model already in the volume with the wrong content is replaced by a verified copy."""
    src, digest = _model(tmp_path)
    dest = tmp_path / "models" / "model.gguf"
    dest.parent.mkdir()
    dest.write_bytes(b"GGUF truncated")
    p = _run(shell_env, {"QTTS_MODEL_SRC": str(src), "QTTS_MODEL_DEST": str(dest),
                         "QTTS_MODEL_SHA256": digest})
    assert p.returncode == 0, p.stderr
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == digest


@pytest.mark.parametrize(("value", "code", "words"), [
    (None, 2, "QTTS_MODEL_SHA256 is not set"),
    ("abc123", 2, "is not a sha256"),
    ("g" * 64, 2, "is not a sha256"),
    ("0" * 63, 2, "is not a sha256"),
])
def test_bad_configuration_is_exit_2(shell_env: tuple[list[str], dict[str, str]],
                                     tmp_path: Path, value: str | None, code: int,
                                     words: str) -> None:
    src, _ = _model(tmp_path, 1024)
    env = {"QTTS_MODEL_SRC": str(src), "QTTS_MODEL_DEST": str(tmp_path / "m" / "model.gguf")}
    if value is not None:
        env["QTTS_MODEL_SHA256"] = value
    p = _run(shell_env, env)
    assert p.returncode == code and words in p.stderr, p.stderr
    assert p.stderr.startswith("qtts-model-init: FATAL:")


def test_missing_source_names_it(shell_env: tuple[list[str], dict[str, str]],
                                 tmp_path: Path) -> None:
    p = _run(shell_env, {"QTTS_MODEL_SRC": str(tmp_path / "nope.gguf"),
                         "QTTS_MODEL_DEST": str(tmp_path / "m" / "model.gguf"),
                         "QTTS_MODEL_SHA256": "0" * 64})
    assert p.returncode == 1 and f"{tmp_path / 'nope.gguf'} not found" in p.stderr


def test_the_model_image_runs_this_script() -> None:
    dockerfile = (DEPLOY / "model" / "Dockerfile").read_text()
    assert "COPY --from=scripts --chmod=0755 model-init.sh /usr/local/bin/qtts-model-init" in (
        dockerfile)
    assert 'ENTRYPOINT ["/usr/local/bin/qtts-model-init"]' in dockerfile
    assert "/model/model.gguf" in dockerfile and "QTTS_MODEL_SRC:-/model/model.gguf" in (
        SCRIPT.read_text())
    assert os.access(SCRIPT, os.X_OK)


def test_the_pod_configuration_stops_a_wrong_model(rendered: dict[str, list[dict[str, Any]]],
                                                   tmp_path: Path) -> None:
    """The init container as the cpu overlay renders it -- its command, the model ConfigMap
    (envFrom) and its env, paths moved under tmp -- refuses a model that is not the one the
    overlay names, under busybox."""
    docs = rendered["cpu"]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    (init,) = dep["spec"]["template"]["spec"]["initContainers"]
    assert init["command"] == ["/usr/local/bin/qtts-model-init"]
    env = dict(cm["data"])
    env.update({e["name"]: e["value"] for e in init["env"]})
    src, digest = _model(tmp_path)
    assert env["QTTS_MODEL_SHA256"] != digest
    env["QTTS_MODEL_SRC"] = str(src)
    env["QTTS_MODEL_DEST"] = str(tmp_path / env["QTTS_MODEL_DEST"].lstrip("/"))
    p = _run(_busybox(tmp_path), env)
    assert p.returncode == 1
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("qtts-model-init: FATAL: sha256 mismatch")
    assert f"version {env['QTTS_MODEL_VERSION']}" in line
    assert f"expected {env['QTTS_MODEL_SHA256']}, got {digest}" in line
