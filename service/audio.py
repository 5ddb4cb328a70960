"""Audio encoders for streamed and whole-file responses, and time-stretch for ``speed``.

Every encoder takes float32 mono chunks in [-1, 1] at the model's sample rate and returns bytes
as soon as the codec allows:

* ``pcm``  raw s16le, byte for byte what arrives.
* ``wav``  one RIFF header, then s16le. Streamed: the header's sizes are 0xFFFFFFFF ("unknown",
  the convention ffmpeg, libsndfile and browsers accept); whole file: exact sizes. Never a
  second header.
* ``mp3`` (libmp3lame), ``opus`` (libopus in Ogg, 20 ms pages), ``aac`` (ADTS), ``flac``:
  ffmpeg's encoders through PyAV, muxed into a sink that cannot seek, so each chunk's packets go
  out at once (FLAC waits for a full block of its encoder, 2304 samples at 24 kHz; MP3/AAC
  hold one codec frame).

FLAC is sent as a whole file unless the client asks for a stream (``stream: true`` given
explicitly, ``stream_wanted``): a streamed FLAC cannot know its length when it starts, so its
STREAMINFO says total_samples = 0 ("unknown", legal FLAC that ffmpeg and browsers play) and
libsndfile (python-soundfile) refuses it. The whole file carries the count and the MD5.

``speed`` other than 1 is done by ffmpeg's ``atempo`` filter (WSOLA time-scale modification:
tempo changes, pitch does not), chained for factors outside 0.5..2, streaming too.
"""

from __future__ import annotations

import io
import struct
from fractions import Fraction
from typing import Any

import numpy as np

CONTENT_TYPES = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
}

# Formats sent as a whole file unless the client explicitly asks for a stream: their streamed
# form is not readable by every common decoder (see the module docstring).
WHOLE_UNLESS_ASKED = frozenset({"flac"})


def stream_wanted(fmt: str, stream: bool, stream_given: bool) -> bool:
    """Whether to stream a response: as asked, except that a format in ``WHOLE_UNLESS_ASKED``
    streams only when ``stream`` was given explicitly (the request default is to stream)."""
    if fmt in WHOLE_UNLESS_ASKED and not stream_given:
        return False
    return stream


# format -> (container, codec, bit rate)
_AV = {
    "mp3": ("mp3", "libmp3lame", 64000),
    "opus": ("ogg", "libopus", 32000),
    "aac": ("adts", "aac", 64000),
    "flac": ("flac", "flac", 0),
}


def to_s16(x: np.ndarray[Any, Any]) -> bytes:
    """float32 [-1, 1] -> little-endian signed 16-bit PCM bytes."""
    y = np.clip(np.asarray(x, dtype=np.float32), -1.0, 1.0) * 32767.0
    out: bytes = np.rint(y).astype("<i2").tobytes()
    return out


def wav_header(n_samples: int | None, sample_rate: int) -> bytes:
    """A 44-byte PCM s16 mono WAV header; ``None`` = streaming (sizes unknown: 0xFFFFFFFF)."""
    if n_samples is None:
        data_size = riff_size = 0xFFFFFFFF
    else:
        data_size = n_samples * 2
        riff_size = 36 + data_size
    return (
        b"RIFF"
        + struct.pack("<I", riff_size)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data_size)
    )


class Encoder:
    """Streaming encoder: ``encode(chunk)`` and ``finish()`` return the bytes ready to send."""

    format = "pcm"

    @property
    def content_type(self) -> str:
        return CONTENT_TYPES[self.format]

    def encode(self, chunk: np.ndarray[Any, Any]) -> bytes:
        return to_s16(chunk)

    def finish(self) -> bytes:
        return b""


class WavStreamEncoder(Encoder):
    format = "wav"

    def __init__(self, sample_rate: int) -> None:
        self._started = False
        self._rate = sample_rate

    def encode(self, chunk: np.ndarray[Any, Any]) -> bytes:
        head = b""
        if not self._started:
            head = wav_header(None, self._rate)
            self._started = True
        return head + to_s16(chunk)

    def finish(self) -> bytes:
        return b"" if self._started else wav_header(None, self._rate)


class _Sink:
    """A write-only file for PyAV: no ``seek``, so muxers write strictly in order."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def write(self, b: Any) -> int:
        self.buf += bytes(b)
        return len(b)

    def take(self) -> bytes:
        out = bytes(self.buf)
        self.buf.clear()
        return out


class AvEncoder(Encoder):
    """mp3 / opus / aac / flac through ffmpeg (PyAV), incremental."""

    def __init__(self, fmt: str, sample_rate: int) -> None:
        import av

        self.format = fmt
        container, codec, bit_rate = _AV[fmt]
        self._sink = _Sink()
        opts = {"page_duration": "20000"} if container == "ogg" else {}
        self._out = av.open(self._sink, "w", format=container, options=opts)
        stream: Any = self._out.add_stream(codec, rate=sample_rate, layout="mono")
        self._stream = stream
        if bit_rate:
            stream.bit_rate = bit_rate
        self._rate = sample_rate
        self._pts = 0
        self._closed = False
        # FLAC is lossless: it takes the s16 samples ``pcm`` and ``wav`` send (from floats,
        # swresample scaled by 32768 where ``to_s16`` scales by 32767: +-1 in ~20 % of them)
        self._s16 = fmt == "flac"
        if self._s16:
            # the header goes out now, with its MD5 and length left unset: written at the first
            # packet, a stream shorter than one block (2304 samples; a frame is 1920) wrote it
            # after the encoder's flush, which puts a wrong MD5 in it
            self._out.start_encoding()

    def encode(self, chunk: np.ndarray[Any, Any]) -> bytes:
        import av

        x = np.ascontiguousarray(chunk, dtype=np.float32).reshape(1, -1)
        if x.shape[1] == 0:
            return self._sink.take()
        if self._s16:
            frame = av.AudioFrame.from_ndarray(np.frombuffer(to_s16(x), "<i2").reshape(1, -1),
                                               format="s16", layout="mono")
        else:
            frame = av.AudioFrame.from_ndarray(x, format="flt", layout="mono")
        frame.sample_rate = self._rate
        frame.pts = self._pts
        frame.time_base = Fraction(1, self._rate)
        self._pts += x.shape[1]
        for packet in self._stream.encode(frame):
            self._out.mux(packet)
        return self._sink.take()

    def finish(self) -> bytes:
        if not self._closed:
            for packet in self._stream.encode(None):
                self._out.mux(packet)
            self._out.close()
            self._closed = True
        return self._sink.take()

    def close(self) -> None:
        """Release the codec without flushing (an abandoned stream)."""
        if not self._closed:
            self._closed = True
            try:
                self._out.close()
            except Exception:
                pass


def make_encoder(fmt: str, sample_rate: int) -> Encoder:
    """The streaming encoder of ``fmt`` (wav | pcm | flac | mp3 | opus | aac)."""
    if fmt == "pcm":
        return Encoder()
    if fmt == "wav":
        return WavStreamEncoder(sample_rate)
    if fmt in _AV:
        return AvEncoder(fmt, sample_rate)
    raise ValueError(f"unknown audio format {fmt!r}")


def encode_whole(fmt: str, audio: np.ndarray[Any, Any], sample_rate: int) -> bytes:
    """A complete file of ``audio`` (float32 mono) with exact sizes in its headers."""
    if fmt == "pcm":
        return to_s16(audio)
    if fmt == "wav":
        return wav_header(len(audio), sample_rate) + to_s16(audio)
    if fmt == "flac":
        # a seekable file lets the FLAC muxer write the total sample count and MD5
        import soundfile as sf

        buf = io.BytesIO()
        sf.write(buf, np.frombuffer(to_s16(audio), "<i2"), sample_rate, format="FLAC",
                 subtype="PCM_16")  # (the samples ``pcm`` sends: libsndfile scales by 32768)
        return buf.getvalue()
    enc = AvEncoder(fmt, sample_rate)
    return enc.encode(audio) + enc.finish()


class TimeStretch:
    """Tempo change by ``speed`` (0.25..4) with ffmpeg ``atempo``; pitch is kept.

    ``push(chunk)`` returns what the filter has ready (it holds back a window of ~50 ms),
    ``flush()`` the rest. The whole output is ``round(input length / speed)`` samples.
    """

    # silence pushed before the end: atempo keeps its last window back at the end of its input
    # (the last 17 ms of a stream slowed to 0.5x, 56 ms at 0.25x: a final consonant); with
    # silence after it the speech comes out whole, and the output is cut to its length
    TAIL_SECONDS = 0.5

    def __init__(self, speed: float, sample_rate: int) -> None:
        import av.filter

        if not 0.25 <= speed <= 4.0:
            raise ValueError("speed must be within 0.25..4.0")
        self._rate = sample_rate
        self._graph: Any = av.filter.Graph()
        node: Any = self._graph.add_abuffer(
            sample_rate=sample_rate, format="flt", layout="mono", time_base=Fraction(1, sample_rate)
        )
        factors = []
        s = speed
        while s < 0.5:
            factors.append(0.5)
            s /= 0.5
        while s > 2.0:
            factors.append(2.0)
            s /= 2.0
        factors.append(s)
        for f in factors:
            nxt = self._graph.add("atempo", f"{f:.6f}")
            node.link_to(nxt)
            node = nxt
        sink = self._graph.add("abuffersink")
        node.link_to(sink)
        self._graph.configure()
        self._speed = speed
        self._pts = 0  # input samples pushed
        self._out = 0  # output samples returned
        self._done = False

    def _pull(self) -> np.ndarray[Any, Any]:
        import av

        parts = []
        while True:
            try:
                frame = self._graph.pull()
            except (av.error.BlockingIOError, BlockingIOError, av.error.EOFError):
                break
            parts.append(frame.to_ndarray().reshape(-1).astype(np.float32, copy=False))
        if not parts:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate(parts)

    def _feed(self, chunk: np.ndarray[Any, Any]) -> None:
        import av

        x = np.ascontiguousarray(chunk, dtype=np.float32).reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(x, format="flt", layout="mono")
        frame.sample_rate = self._rate
        frame.pts = self._pts
        self._pts += x.shape[1]
        self._graph.push(frame)

    def push(self, chunk: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        if np.size(chunk) == 0:
            return np.zeros(0, dtype=np.float32)
        self._feed(chunk)
        y = self._pull()
        self._out += len(y)
        return y

    def flush(self) -> np.ndarray[Any, Any]:
        if self._done:
            return np.zeros(0, dtype=np.float32)
        self._done = True
        total = round(self._pts / self._speed)
        self._feed(np.zeros(round(self.TAIL_SECONDS * self._rate), np.float32))
        tail = self._pull()
        self._graph.push(None)
        tail = np.concatenate([tail, self._pull()])[: max(0, total - self._out)]
        self._out += len(tail)
        return tail
