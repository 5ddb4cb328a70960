"""The files `qtts synth`, `qtts decode` and `qtts make-model` write: whole or not at all
(a full disk or Ctrl-C leaves no truncated file that opens as valid), under any name the file
system takes, and a failed write is one line naming the file or option with the system's
reason, never a traceback."""

from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from cli.main import main
from engine.tools import make_model

FRAME = 1920  # samples per codec frame
FILE_LIMIT = 64 * 1024  # bytes: what _run_limited lets a file grow to


@pytest.fixture(autouse=True)
def _cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QTTS_BACKEND", "cpu")
    monkeypatch.setenv("QTTS_THREADS", "1")


def _synth(model: Path, out: Path, codes: Path) -> list[str]:
    return ["synth", "Hi.", "--model", str(model), "--voice", "ryan", "--seed", "1",
            "--max-frames", "2", "-o", str(out), "--save-codes", str(codes)]


def _failing_write_bytes(target: str, exc: BaseException
                         ) -> Callable[[Path, bytes | memoryview], int]:  # fmt: skip
    """``Path.write_bytes`` that writes half of ``target``'s bytes and then fails with ``exc``
    (a disk filling up, or Ctrl-C, in the middle of the write); other files are written."""
    real = Path.write_bytes

    def write_bytes(self: Path, data: bytes | memoryview) -> int:
        if not self.name.startswith(target):
            return real(self, data)
        real(self, memoryview(data)[: len(data) // 2])
        raise exc

    return write_bytes


@pytest.mark.parametrize("option", ["--out", "--save-codes"])
@pytest.mark.parametrize(("exc", "status"), [
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), 2),
    (KeyboardInterrupt(), 130),
])  # fmt: skip
def test_a_write_cut_short_leaves_no_file(tiny_gguf: Path, tmp_path: Path, option: str,
                                          exc: BaseException, status: int,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A full disk or Ctrl-C in the middle of writing the WAV or the codes leaves no file
    behind (there was a truncated WAV that players open as valid, and a 0-byte .npy), and the
    full disk is one line naming the option with errno's text (np.save's traceback before;
    libsndfile said only "System error.")."""
    wav, npy = tmp_path / "o.wav", tmp_path / "c.npy"
    target = wav if option == "--out" else npy
    monkeypatch.setattr(Path, "write_bytes", _failing_write_bytes(target.name, exc))
    assert main(_synth(tiny_gguf, wav, npy)) == status
    err = capsys.readouterr().err.splitlines()
    if status == 2:
        assert err[-1] == f"qtts: {option}: {target}: cannot be written (No space left on device)"
    else:
        assert err[-1] == "qtts: interrupted"
    assert not any(p.name.startswith(target.name) for p in tmp_path.iterdir())


def _limit_file_size() -> None:
    # any file written past FILE_LIMIT fails with EFBIG (Python ignores SIGXFSZ): a disk that
    # fills up in the middle of a write, for this process alone and without root
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))


def _run_limited(*argv: str) -> str:
    """``qtts ARGV`` with files limited to FILE_LIMIT bytes; its one line on stderr."""
    res = subprocess.run([sys.executable, "-m", "cli", *argv], capture_output=True, text=True,
                         timeout=120, preexec_fn=_limit_file_size)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    return res.stderr.splitlines()[-1]


def test_a_wav_the_disk_cannot_hold_is_not_left_behind(tiny_gguf: Path, tmp_path: Path) -> None:
    """The write really failing in the OS (not a stand-in for it): no truncated WAV."""
    codes, wav = tmp_path / "c.npy", tmp_path / "o.wav"
    np.save(codes, np.ones((16, 12), np.int32))
    assert 12 * FRAME * 4 > FILE_LIMIT
    err = _run_limited("decode", "--model", str(tiny_gguf), "--codes", str(codes), "--out",
                       str(wav), "--precision", "exact")
    assert err == f"qtts: --out: {wav}: cannot be written (File too large)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npy"]


def test_a_checkpoint_the_disk_cannot_hold_is_not_left_behind(tmp_path: Path) -> None:
    """`make-model --keep-checkpoint` on a full disk: one line with the system's reason (a
    ValueError about an unwritten tensor hid it) and no truncated safetensors file."""
    out = tmp_path / "m"
    err = _run_limited("make-model", str(out), "--size", "tiny", "--keep-checkpoint",
                       "--no-progress")
    assert err == f"qtts: {out}: cannot write (File too large)"
    assert list(out.rglob("*.safetensors")) == []


def test_make_model_interrupted_leaves_no_checkpoint_file(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:  # fmt: skip
    """Ctrl-C while make-model writes the weights: exit 130 with one line (it was 1 with a
    traceback ending in the writer's ValueError), and no truncated safetensors file."""
    real, calls = make_model.generate_tensor, iter(range(1000))

    def generate_tensor(*args: Any, **kwargs: Any) -> Any:
        if next(calls) == 40:  # in the middle of speech_tokenizer/model.safetensors
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(make_model, "generate_tensor", generate_tensor)
    out = tmp_path / "m"
    assert main(["make-model", str(out), "--size", "tiny", "--keep-checkpoint",
                 "--no-progress"]) == 130
    assert capsys.readouterr().err.splitlines() == ["qtts: interrupted"]
    assert list(out.rglob("*.safetensors")) == []


def test_names_that_are_not_utf8(tiny_gguf: Path, tmp_path: Path) -> None:
    """Any name the file system takes is written under exactly that name (a name that is not
    UTF-8 ended the whole synthesis in soundfile's UnicodeEncodeError)."""
    wav, npy, decoded = (tmp_path / os.fsdecode(n) for n in (b"\xff.wav", b"\xfe.npy", b"\xfd.wav"))
    assert main(_synth(tiny_gguf, wav, npy)) == 0
    assert main(["decode", "--model", str(tiny_gguf), "--codes", str(npy), "--out",
                 str(decoded), "--precision", "exact"]) == 0
    assert sorted(os.listdir(os.fsencode(tmp_path))) == [b"\xfd.wav", b"\xfe.npy", b"\xff.wav"]
    assert np.load(npy).shape == (16, 2)
    for name in (wav, decoded):
        audio, rate = sf.read(os.fsencode(name), dtype="float32")
        assert rate == 24000 and audio.shape == (2 * FRAME,)
