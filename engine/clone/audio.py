"""Reference audio as users have it: any container/codec PyAV decodes, any rate, any channels.

Decoded with PyAV (FFmpeg) to float32, mixed to mono by the channel mean (as the reference
does), resampled to 24 kHz with soxr at high quality -- the resampler and length rule of the
reference's ``librosa.resample`` (``res_type="soxr_hq"``, output ``ceil(n * 24000 / sr)``
samples). Problems are ``InputError`` on field ``ref_audio`` with one line that names them.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.errors import InputError

SAMPLE_RATE = 24000
MIN_SECONDS = 1.0
DEFAULT_MAX_SECONDS = 30.0
SILENCE_PEAK = 1e-3  # a reference whose loudest sample is below this carries no voice
FIELD = "ref_audio"

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class DecodedAudio:
    """Mono float32 samples at their own rate."""

    samples: F32
    sample_rate: int


def decode(src: bytes | str | os.PathLike[str], max_seconds: float | None = None
           ) -> DecodedAudio:
    """Decode the first audio stream of a file or bytes (wav, flac, mp3, ogg, m4a, ...).

    ``max_seconds``: stop and refuse the audio as soon as more than that has been decoded. A
    compressed file's size says little about its length (a megabyte of FLAC silence decodes to
    hours, gigabytes of samples), so the cap must hold while decoding, not after.
    """
    import av

    name = "the audio" if isinstance(src, bytes) else str(src)
    try:
        container = av.open(io.BytesIO(src) if isinstance(src, bytes) else os.fspath(src),
                            mode="r")
    except FileNotFoundError:
        raise InputError(FIELD, f"{name}: file not found") from None
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise InputError(FIELD, f"{name} cannot be decoded as audio ({exc})") from None
    try:
        streams = [s for s in container.streams if s.type == "audio"]
        if not streams:
            raise InputError(FIELD, f"{name} has no audio stream")
        stream = streams[0]
        pieces: list[F32] = []
        rate, total = 0, 0
        for frame in container.decode(stream):
            assert isinstance(frame, av.AudioFrame)
            arr: npt.NDArray[Any] = frame.to_ndarray()
            rate = int(frame.sample_rate)
            n_ch = len(frame.layout.channels)
            arr = _as_float(arr)
            if frame.format.is_planar:
                mono = arr.reshape(n_ch, -1).mean(axis=0, dtype=np.float32)
            else:
                mono = arr.reshape(-1, n_ch).mean(axis=1, dtype=np.float32)
            pieces.append(np.ascontiguousarray(mono, dtype=np.float32))
            total += mono.shape[0]
            if max_seconds is not None and total > max_seconds * rate:
                raise InputError(FIELD, _too_long(f"is over {max_seconds:g} s long", max_seconds))
    except InputError:
        raise
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise InputError(FIELD, f"{name} cannot be decoded as audio ({exc})") from None
    finally:
        container.close()
    if not pieces or rate <= 0:
        raise InputError(FIELD, f"{name} holds no audio samples")
    return DecodedAudio(np.concatenate(pieces), rate)


def _as_float(arr: npt.NDArray[Any]) -> F32:
    # integer PCM to [-1, 1): signed by its full scale, unsigned (8-bit WAV, AIFF) about its
    # midpoint, as libsndfile reads it
    if arr.dtype.kind == "u":
        mid = float(np.iinfo(arr.dtype.type).max // 2 + 1)
        return (arr.astype(np.float32) - np.float32(mid)) / np.float32(mid)
    if arr.dtype.kind == "i":
        scale = float(np.iinfo(arr.dtype.type).max) + 1.0
        return arr.astype(np.float32) / np.float32(scale)
    return arr.astype(np.float32, copy=False)


def _too_long(what: str, max_seconds: float) -> str:
    """The message for a reference over the cap (``what``: how long it is)."""
    return f"{what}; the limit is {max_seconds:g} s (trim it: 5-15 s of clean speech clone best)"


def resample(samples: F32, sr: int, target: int = SAMPLE_RATE) -> F32:
    """soxr high-quality resampling with the reference's output length."""
    x = np.ascontiguousarray(samples, dtype=np.float32)
    if sr == target:
        return x
    import soxr  # type: ignore[import-untyped]

    y = np.asarray(soxr.resample(x, sr, target, quality="soxr_hq"), dtype=np.float32)
    n = math.ceil(x.shape[0] * target / sr)
    if y.shape[0] < n:
        y = np.pad(y, (0, n - y.shape[0]))
    return np.ascontiguousarray(y[:n])


def check(samples: F32, sr: int, max_seconds: float = DEFAULT_MAX_SECONDS) -> None:
    """Refuse audio that is too short, too long, silent or not finite."""
    seconds = samples.shape[0] / sr
    if seconds < MIN_SECONDS:
        raise InputError(FIELD, f"is {seconds:.2f} s long; a voice needs at least "
                         f"{MIN_SECONDS:g} s of speech")  # fmt: skip
    if seconds > max_seconds:
        raise InputError(FIELD, _too_long(f"is {seconds:.1f} s long", max_seconds))
    if not np.isfinite(samples).all():
        raise InputError(FIELD, "contains NaN or infinite samples")
    if float(np.abs(samples).max()) < SILENCE_PEAK:
        raise InputError(FIELD, "is silent (no sample above -60 dBFS)")


def load_reference(src: bytes | str | os.PathLike[str],
                   max_seconds: float = DEFAULT_MAX_SECONDS) -> F32:  # fmt: skip
    """Decode, check and resample reference audio to 24 kHz mono float32."""
    audio = decode(src, max_seconds)
    check(audio.samples, audio.sample_rate, max_seconds)
    return resample(audio.samples, audio.sample_rate)
