"""Reference audio as users have it: any container/codec PyAV decodes, any rate, any channels.

Decoded as the reference decodes it: with libsndfile where it reads the file (wav, flac, ogg,
mp3, aiff, ...), else with PyAV (FFmpeg: m4a, webm, ...), to float32, mixed to mono by the
channel mean (as the reference does), resampled to 24 kHz with soxr at high quality -- the
resampler and length rule of the reference's ``librosa.resample`` (``res_type="soxr_hq"``,
output ``ceil(n * 24000 / sr)`` samples). Problems are ``InputError`` on field ``ref_audio``
with one line that names them.
"""

from __future__ import annotations

import io
import logging
import math
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
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
_NATIVE_SAID_BYTES = 2048  # of a decoder's notes kept for the log (one per bad frame)

log = logging.getLogger("qtts.clone")
_STDERR_BORROWED = threading.Lock()

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class DecodedAudio:
    """Mono float32 samples at their own rate."""

    samples: F32
    sample_rate: int
    # the largest swing of any one channel before the mix (0.0 for a mono file): a mix that
    # is silent although a channel is not had channels that cancel
    channel_peak: float = 0.0


def decode(src: bytes | str | os.PathLike[str], max_seconds: float | None = None
           ) -> DecodedAudio:
    """Decode the first audio stream of a file or bytes (wav, flac, mp3, ogg, m4a, ...).

    ``max_seconds``: stop and refuse the audio as soon as more than that has been decoded. A
    compressed file's size says little about its length (a megabyte of FLAC silence decodes to
    hours, gigabytes of samples), so the cap must hold while decoding, not after.
    """
    name = "the audio" if isinstance(src, bytes) else str(src)
    with _native_stderr_logged(name):
        decoded = _decode_sndfile(src, name, max_seconds)
        return decoded if decoded is not None else _decode_av(src, name, max_seconds)


@contextmanager
def _native_stderr_logged(name: str) -> Iterator[None]:
    """What the native decoders write to the process's stderr while they read ``name`` goes
    to the log as one warning instead. libmpg123 (libsndfile's MP3 reader) prints notes on a
    damaged or oddly tagged MP3 ("Note: Illegal Audio-MPEG-Header ...", "Warning: Xing
    stream size off ...", the last without a newline): straight into a server's JSON log
    lines, the next of which it broke. fd 2 is the process's: one decode at a time borrows it
    (two threads interleaving their swaps left it on a closed temporary file)."""
    with _STDERR_BORROWED:
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (AttributeError, OSError, ValueError):  # no fd 2 to borrow: leave it alone
            yield
            return
        with tempfile.TemporaryFile() as said:
            os.dup2(said.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                said.seek(0)
                text = said.read(_NATIVE_SAID_BYTES).decode("utf-8", "replace")
                # (also when the decode failed: the notes may say why)
                lines = [line.strip() for line in text.splitlines() if line.strip()]
                if lines:
                    log.warning("%s: its decoder said: %s", name, " | ".join(lines))


class _Mono:
    """Mono pieces as they are decoded, refused once past the cap."""

    def __init__(self, max_seconds: float | None) -> None:
        self.max_seconds = max_seconds
        self.pieces: list[F32] = []
        self.total = 0
        self.length_s: float | None = None  # the container's own length of the stream
        self.channel_peak = 0.0

    def add_channels(self, block: F32, rate: int) -> None:
        """A block of [frames, channels] samples, mixed to mono as the reference mixes them."""
        if block.shape[1] == 1:
            self.add(block[:, 0], rate)
            return
        if block.shape[0]:  # (half of each channel's range: no copy of the block)
            swing = float((block.max(axis=0) - block.min(axis=0)).max()) / 2
            self.channel_peak = max(self.channel_peak, swing)
        self.add(block.mean(axis=1, dtype=np.float32), rate)

    def add(self, mono: F32, rate: int) -> None:
        if self.length_s is not None:  # (an AAC encoder's padding past it is not audio)
            mono = mono[: max(0, round(self.length_s * rate) - self.total)]
        self.pieces.append(np.ascontiguousarray(mono, dtype=np.float32))
        self.total += mono.shape[0]
        if self.max_seconds is not None and self.total > self.max_seconds * rate:
            raise InputError(FIELD, _too_long(f"is over {self.max_seconds:g} s long",
                                              self.max_seconds))

    def audio(self, name: str, rate: int) -> DecodedAudio:
        if not self.total or rate <= 0:
            raise InputError(FIELD, f"{name} holds no audio samples")
        return DecodedAudio(np.concatenate(self.pieces), rate, self.channel_peak)


# samples (frames x channels) per libsndfile read: a few reads for a typical reference, and
# what one read holds stays ~0.5 MB whatever the file's channels (a compressed file of
# hundreds of channels of silence is small); the cap bounds the mono samples kept
_SNDFILE_READ_SAMPLES = 1 << 17


def _decode_sndfile(src: bytes | str | os.PathLike[str], name: str,
                    max_seconds: float | None) -> DecodedAudio | None:
    """libsndfile's reading (None: it does not read this format; PyAV is asked next). It
    reads a WAV in one call where PyAV hands over a thousand-sample frame at a time."""
    import soundfile as sf

    try:
        f = sf.SoundFile(io.BytesIO(src) if isinstance(src, bytes) else os.fspath(src))
    except (RuntimeError, TypeError, ValueError):  # (sf.LibsndfileError is a RuntimeError;
        return None  # a missing file too: PyAV's open then says "file not found")
    mono = _Mono(max_seconds)
    with f:
        rate = int(f.samplerate)
        try:
            # from a seek to the start, as ``soundfile.read`` reads: libsndfile's Opus reader
            # asked for a large block first thing, unseeked, starts ~250 samples late
            if f.seekable():
                f.seek(0)
            frames = max(1, _SNDFILE_READ_SAMPLES // max(1, f.channels))
            while (block := f.read(frames, dtype="float32", always_2d=True)).size:
                mono.add_channels(block, rate)
        except RuntimeError as exc:  # sf.LibsndfileError
            raise InputError(FIELD, f"{name} cannot be decoded as audio ({exc})") from None
    return mono.audio(name, rate)


def _decode_av(src: bytes | str | os.PathLike[str], name: str,
               max_seconds: float | None) -> DecodedAudio:
    import av

    try:
        container = av.open(io.BytesIO(src) if isinstance(src, bytes) else os.fspath(src),
                            mode="r")
    except FileNotFoundError:
        raise InputError(FIELD, f"{name}: file not found") from None
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise InputError(FIELD, f"{name} cannot be decoded as audio ({_reason(exc)})") from None
    mono = _Mono(max_seconds)
    rate = 0
    try:
        streams = [s for s in container.streams if s.type == "audio"]
        if not streams:
            raise InputError(FIELD, f"{name} has no audio stream")
        if container.format.name.startswith("mov") and streams[0].duration and \
                streams[0].time_base:  # (MP4/M4A give it exactly; raw streams only estimate)
            mono.length_s = float(streams[0].duration * streams[0].time_base)
        for frame in container.decode(streams[0]):
            assert isinstance(frame, av.AudioFrame)
            arr: npt.NDArray[Any] = _as_float(frame.to_ndarray())
            rate = int(frame.sample_rate)
            n_ch = len(frame.layout.channels)
            mono.add_channels(arr.reshape(n_ch, -1).T if frame.format.is_planar else
                              arr.reshape(-1, n_ch), rate)
    except InputError:
        raise
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise InputError(FIELD, f"{name} cannot be decoded as audio ({_reason(exc)})") from None
    finally:
        container.close()
    return mono.audio(name, rate)


def _reason(exc: Exception) -> str:
    """FFmpeg's words for why (``Invalid data found when processing input``), without PyAV's
    errno and the ``'<none>'`` it names a memory file by."""
    return str(getattr(exc, "strerror", None) or exc)


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


def check(samples: F32, sr: int, max_seconds: float = DEFAULT_MAX_SECONDS,
          channel_peak: float = 0.0) -> None:
    """Refuse audio that is too short, too long, silent or not finite. ``channel_peak``:
    ``DecodedAudio``'s, for a silent mix of channels that are not silent."""
    seconds = samples.shape[0] / sr
    if seconds < MIN_SECONDS:
        # (rounded down: 0.9996 s is not "1.00 s long" for a 1 s minimum)
        raise InputError(FIELD, f"is {math.floor(seconds * 1000) / 1000:g} s long; a voice "
                         f"needs at least {MIN_SECONDS:g} s of speech")
    if seconds > max_seconds:
        raise InputError(FIELD, _too_long(f"is {seconds:.1f} s long", max_seconds))
    if not np.isfinite(samples).all():
        raise InputError(FIELD, "contains NaN or infinite samples")
    # (about its mean: a constant offset, DC, is no sound)
    if float(np.abs(samples - samples.mean(dtype=np.float64)).max()) < SILENCE_PEAK:
        if channel_peak >= SILENCE_PEAK:
            raise InputError(FIELD, "is silent once its channels are mixed to mono, as cloning "
                             "hears it: they cancel out (one is the other inverted, or nearly); "
                             "send one channel")
        raise InputError(FIELD, "is silent (no sample above -60 dBFS)")


def load_reference(src: bytes | str | os.PathLike[str],
                   max_seconds: float = DEFAULT_MAX_SECONDS) -> F32:  # fmt: skip
    """Decode, check and resample reference audio to 24 kHz mono float32."""
    audio = decode(src, max_seconds)
    check(audio.samples, audio.sample_rate, max_seconds, audio.channel_peak)
    return resample(audio.samples, audio.sample_rate)
