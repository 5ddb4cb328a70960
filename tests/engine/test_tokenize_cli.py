"""``qtts tokenize``: ids, pieces and JSON from a model's stored tokenizer; clean errors."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from cli.main import main
from engine.gguf_model import open_model
from engine.tools.convert import convert

TEXT = "Hello, world! 你好 🎉 <|im_start|>assistant\n"


def _expected(gguf: Path, text: str) -> list[int]:
    model = open_model(gguf)
    try:
        return [int(i) for i in model.tokenizer().encode(text).ids]
    finally:
        model.close()


def test_ids(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tokenize", "--model", str(tiny_gguf), TEXT]) == 0
    out = capsys.readouterr().out
    assert [int(x) for x in out.split()] == _expected(tiny_gguf, TEXT)


def test_tokens_are_the_text(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tokenize", "--model", str(tiny_gguf), "--tokens", TEXT]) == 0
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    ids = [int(line.split("\t")[0]) for line in lines]
    pieces = [json.loads(line.split("\t", 1)[1]) for line in lines]
    assert ids == _expected(tiny_gguf, TEXT)
    assert "<|im_start|>" in pieces  # a special token is one piece
    # whole characters come back; a character split over tokens shows as byte escapes
    joined = "".join(pieces)
    if "\\x" not in joined:
        assert joined == unicodedata.normalize("NFC", TEXT)


def test_json(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tokenize", "--model", str(tiny_gguf), "--json", "--tokens", "a b"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ids"] == _expected(tiny_gguf, "a b") and out["count"] == len(out["ids"])
    assert "".join(out["tokens"]) == "a b"


def test_stdin_through_the_console_script(tiny_gguf: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "cli", "tokenize", "--model",
                           str(tiny_gguf)], input="speak", capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert [int(x) for x in done.stdout.split()] == _expected(tiny_gguf, "speak")


def test_an_endless_stdin_is_refused_in_one_line(tiny_gguf: Path) -> None:
    from cli.tokenize import MAX_STDIN_CHARS

    with open("/dev/zero", "rb") as endless:  # (it once ran until memory ran out)
        done = subprocess.run([sys.executable, "-m", "cli", "tokenize", "--model",
                               str(tiny_gguf)], stdin=endless, capture_output=True, text=True,
                              check=False, timeout=120)
    assert done.returncode == 2
    assert f"text: stdin holds more than {MAX_STDIN_CHARS} characters" in done.stderr
    assert "Traceback" not in done.stderr


def test_errors_are_one_line(tiny_model_dir: Path, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tokenize", "--model", str(tmp_path / "missing.gguf"), "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing.gguf" in err and "not found" in err
    dec_only = tmp_path / "decoder.gguf"
    convert(tiny_model_dir, dec_only, dtype="f32", parts="decoder", progress=False)
    assert main(["tokenize", "--model", str(dec_only), "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "decoder-only" in err


def test_bytes_that_are_not_utf8_on_the_command_line(tiny_gguf: Path) -> None:
    """A shell hands over bytes; Python makes lone surrogates of those that are not UTF-8,
    which the tokenizer cannot take: one line naming the text, not a traceback."""
    done = subprocess.run([sys.executable.encode(), b"-m", b"cli", b"tokenize", b"--model",
                           str(tiny_gguf).encode(), b"a\xffb"], capture_output=True, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.decode().splitlines()[-1] == (
        "qtts: text: has a lone surrogate U+DCFF at character 1: not valid Unicode text")
    assert b"Traceback" not in done.stderr


def test_a_reader_that_stops_early_is_no_traceback(tiny_gguf: Path) -> None:
    """``qtts tokenize ... | head``: the closed pipe ends the command quietly."""
    text = "one two three four five " * 4000  # output far beyond the pipe's buffer
    done = subprocess.run(
        f"{shlex.quote(sys.executable)} -m cli tokenize --model {shlex.quote(str(tiny_gguf))} "
        "--tokens | head -c 100", shell=True, input=text, capture_output=True, text=True,
        timeout=120)
    assert len(done.stdout) == 100
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
