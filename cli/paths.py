"""The commands' arguments that need more than argparse's own checks: output files, checked
before any work is done (a synthesis that runs for a minute and then cannot write its file has
wasted that minute, and a libsndfile error from the write is a traceback, not a one-line
message naming the option), and numbers with a range."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.errors import InputError


def output_file(path: str, option: str, suffixes: tuple[str, ...]) -> Path:
    """``path`` for ``option`` (e.g. ``--out``): a file name ending in one of ``suffixes``
    (what the command writes: numpy adds ``.npy`` to a name without it, libsndfile picks the
    container by it), in an existing, writable folder, and not a folder or device itself."""
    p = Path(path)
    if not path.strip() or p.name in ("", ".", ".."):
        raise InputError(option, f"{path!r}: not a file name")
    if p.is_dir():
        raise InputError(option, f"{path}: is a folder; give a file name")
    if p.exists() and not p.is_file():
        raise InputError(option, f"{path}: exists and is not a regular file")
    if p.suffix.lower() not in suffixes:
        raise InputError(option, f"{path}: the name must end in {' or '.join(suffixes)}")
    if not p.parent.is_dir():
        raise InputError(option, f"{path}: folder {p.parent} does not exist")
    if not os.access(p.parent, os.W_OK | os.X_OK):
        raise InputError(option, f"{path}: folder {p.parent} is not writable")
    return p


def write_wav(path: Path, audio: Any, sample_rate: int, option: str) -> None:
    """``audio`` as a 32-bit float WAV at ``path``; a failed write is a one-line error."""
    import soundfile as sf

    try:
        sf.write(str(path), audio, sample_rate, subtype="FLOAT", format="WAV")
    except (OSError, RuntimeError) as exc:  # soundfile's errors are RuntimeErrors
        raise InputError(option, f"{path}: cannot be written ({exc})") from None


def count(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer of at least ``minimum`` (argparse names the option)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{v} must be >= {minimum}")
        return v

    return parse


def positive_seconds(text: str) -> float:
    """An argparse ``type``: a finite number of seconds above 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds above 0")
    return v
