"""The commands' arguments that need more than argparse's own checks: output files, checked
before any work is done (a synthesis that runs for a minute and then cannot write its file has
wasted that minute, and a libsndfile error from the write is a traceback, not a one-line
message naming the option), the writing of those files (whole or not at all), and numbers with
a range."""

from __future__ import annotations

import argparse
import io
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


def write_file(path: Path, data: bytes | memoryview, option: str) -> None:
    """``data`` as the file ``path`` for ``option``, whole or not at all: it goes to a
    temporary sibling that then replaces ``path``, and on any failure (a full disk, Ctrl-C)
    the sibling is removed, so no truncated file is left that a player or numpy would open as
    valid. An ``OSError`` is a one-line ``InputError`` that keeps the system's reason."""
    tmp = path.with_name(path.name + ".part")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException as exc:  # KeyboardInterrupt too: its half-written file must go
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise InputError(option, f"{path}: cannot be written ({exc.strerror or exc})"
                             ) from None
        raise


def write_wav(path: Path, audio: Any, sample_rate: int, option: str) -> None:
    """``audio`` as a 32-bit float WAV at ``path``; a failed write is a one-line error.

    The WAV is encoded in memory (as large as ``audio``) and written by :func:`write_file`:
    libsndfile writing the file itself reports a full disk only as "System error.", leaves
    the truncated file, and cannot open a name that is not UTF-8."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, audio, sample_rate, subtype="FLOAT", format="WAV")
    write_file(path, buf.getbuffer(), option)


def write_npy(path: Path, array: Any, option: str) -> None:
    """``array`` as an ``.npy`` file at ``path``, written as :func:`write_wav` writes."""
    import numpy as np  # (here, as soundfile above: `qtts --help` need not load it)

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    write_file(path, buf.getbuffer(), option)


def count(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer of at least ``minimum`` and at most ``maximum`` (if
    given); argparse names the option."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{v} must be >= {minimum}")
        if maximum is not None and v > maximum:
            raise argparse.ArgumentTypeError(f"{v} must be <= {maximum}")
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
