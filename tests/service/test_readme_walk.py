"""The README walk: every example command of README.md and docs/service.md, read from the
Markdown and run as written (only the address changes, to the test server's port) against a
real ``qtts serve``, answers 200 with valid audio.

The server is what ``make run`` starts (``qtts serve`` with default settings) on the tiny
synthetic model, so the walk stays fast; how long the README's text example takes on the
default model is measured by bench/weights.py, not here.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import soundfile as sf

from tests.service.doc_examples import Example, examples
from tests.service.helpers import ROOT, Server, decoded_seconds, serving

# Examples that do not talk to the service, and why the walk leaves them to a person.
NOT_RUN = {
    "make": "`make run` is the server this test starts (a real `qtts serve`); `make test` is "
            "this suite",
    "qtts": "`qtts convert` needs a released checkpoint, which a clone does not have",
}
HTTP = [e for e in examples() if e.is_http]


@pytest.fixture(scope="module")
def walk_server(service_model: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[Server]:
    yield from serving(service_model, tmp_path_factory.mktemp("walk"))


def test_every_example_is_walked_or_explained() -> None:
    found = examples()
    assert {e.program for e in HTTP if e.lang == "sh"} == {"curl"}
    assert len([e for e in HTTP if "/tts" in e.text]) >= 2  # text and codes
    assert any("/v1/audio/speech" in e.text for e in HTTP)
    assert any(e.lang == "python" for e in HTTP)
    for e in found:
        if not e.is_http:
            assert e.program in NOT_RUN, f"{e.doc}:{e.line}: an example the walk cannot run"


def _make_dry_run(target: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("QTTS_")}
    run = subprocess.run(["make", "-n", "--no-print-directory", target], cwd=ROOT,
                         env={**clean, **env}, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip().splitlines()


def test_the_walked_server_is_make_run(tmp_path: Path) -> None:
    """`make run` starts `qtts serve` on the model it names, like the walk's server (which only
    sets the address, one thread and JSON logs); its default model is the full Q4_0 one."""
    serve = _make_dry_run("run", QTTS_MODEL="/m.gguf")[-1]
    assert serve == "QTTS_MODEL=/m.gguf .venv/bin/qtts serve"
    made = _make_dry_run("model", QTTS_CACHE_DIR=str(tmp_path))[-1]
    default = tmp_path / "models" / "synthetic-full-q4_0-seed0-v2"
    assert made.split() == [".venv/bin/qtts", "make-model", f"{default}/", "--size", "full",
                            "--dtype", "q4_0", "--seed", "0"]


def _new_request_lines(server: Server, before: int) -> list[dict[str, Any]]:
    """The request log lines since ``before`` (each is written just after a response's last
    byte, so it may trail the client by a moment)."""
    deadline = time.monotonic() + 10
    while len(lines := server.request_lines()) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    return lines[before:]


@pytest.mark.parametrize("example", HTTP, ids=[f"{e.doc}:{e.line}" for e in HTTP])
def test_example_answers_with_audio(example: Example, walk_server: Server,
                                    tmp_path: Path) -> None:
    host, port = "127.0.0.1", walk_server.port
    before = len(walk_server.request_lines())
    if example.lang == "python":
        script = tmp_path / "example.py"
        script.write_text(example.at(host, port), encoding="utf-8")
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-c", example.at(host, port)]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, timeout=300)
    where = f"{example.doc}:{example.line}"
    assert run.returncode == 0, f"{where}: exit {run.returncode}\n{run.stderr.decode()}"
    if "/readyz" in example.text:
        assert json.loads(run.stdout)["status"] == "ready", where
        return
    lines = _new_request_lines(walk_server, before)
    assert [rec["status"] for rec in lines] == [200], f"{where}: {lines}"
    out = example.output_file()
    if out is None:  # the Python client example reads the stream itself
        return
    data = (tmp_path / out).read_bytes()
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE", f"{where}: not a WAV file"
    info = sf.info(io.BytesIO(data))
    assert info.samplerate == 24000 and info.channels == 1, where
    seconds = decoded_seconds(data, "wav")
    assert seconds > 0 and abs(seconds - float(lines[0]["audio_seconds"])) < 0.01, where
