"""The streaming decoder keeps constant state: memory does not grow with utterance length."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import psutil

from engine.backend import BackendSet
from engine.decoder import DecoderModel, StreamingDecoder
from engine.decoder.streaming import push_together
from engine.gguf_model import open_model


def _stream(sd: StreamingDecoder, frames: int, rng: np.random.Generator) -> None:
    for _ in range(0, frames, 8):
        sd.push(rng.integers(0, 2048, (16, 8)))


def test_a_long_stream_uses_no_more_memory_than_a_short_one(tiny_gguf: Path) -> None:
    dec = DecoderModel.load(open_model(tiny_gguf), BackendSet.from_env(
        {"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2"}), "fast")
    rng = np.random.default_rng(0)
    proc = psutil.Process()
    sd = StreamingDecoder(dec)
    _stream(sd, 128, rng)  # ~10 s: allocator and caches at their working size
    gc.collect()
    after_short = proc.memory_info().rss
    state_bytes = sum(a.nbytes for a in sd.state.values())
    _stream(sd, 1500, rng)  # + 2 minutes (1504 frames)
    gc.collect()
    grown = proc.memory_info().rss - after_short
    assert sd.frames == 128 + 1504
    assert sum(a.nbytes for a in sd.state.values()) == state_bytes  # the carried state is fixed
    assert grown < 50 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB over 2 minutes of audio"


def test_fresh_streams_own_their_state_after_their_first_push(tiny_gguf: Path) -> None:
    """A fresh stream reads its carried tensors from zeros every fresh stream shares (a join
    allocates no state of its own before it runs); its first push gives it arrays of its own:
    none shared with another stream, none the read-only zeros, which stay zeros."""
    dec = DecoderModel.load(open_model(tiny_gguf), BackendSet.from_env(
        {"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2"}), "fast")
    codes = np.random.default_rng(1).integers(0, 2048, (16, 1))
    streams = [StreamingDecoder(dec) for _ in range(3)]
    together = push_together(streams, [codes] * 3)
    arrays = [a for sd in streams for a in sd.state.values()]
    assert arrays and len({id(a) for a in arrays}) == len(arrays)
    assert all(a.flags.writeable for a in arrays)
    for _ in range(2):  # more pushes of the same streams
        push_together(streams, [codes] * 3)
    alone, _ = StreamingDecoder(dec).push(codes)  # starts from the shared zeros again
    assert np.array_equal(alone, together[0][0])
