"""Chunked prefill on the tiny model: same result as one graph, bounded buffers, cancellable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.backend import BackendSet
from engine.gguf_model import open_model
from engine.talker import PromptBuilder, SamplingParams, TalkerModel, generate_frames, make_rng
from engine.talker.model import PrefillCancelled


@pytest.fixture(scope="module")
def backends() -> BackendSet:
    return BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "1"})


@pytest.fixture(scope="module")
def model(tiny_gguf: Path) -> Any:
    return open_model(tiny_gguf)


LONG = "The quick brown fox jumps over the lazy dog, again and again. " * 4


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("chunk", [7, 16, 64])
def test_chunked_prefill_equals_one_graph(model: Any, backends: BackendSet, kv_type: str,
                                          chunk: int) -> None:
    pb = PromptBuilder(model)
    p = pb.build(LONG, "ryan", "english")
    assert p.length > 2 * chunk  # several chunks, the last one partial
    whole = TalkerModel(model, backends, kv_type=kv_type, prefill_chunk=1 << 16)
    parts = TalkerModel(model, backends, kv_type=kv_type, prefill_chunk=chunk)
    for reuse in (False, True):  # cold, then with the prefix kept by the cold run
        a = whole.prefill(p, reuse_prefix=reuse)
        b = parts.prefill(p, reuse_prefix=reuse)
        # a prefix longer than one chunk is not kept: recomputed every time
        kept = reuse and p.n_prefix <= chunk
        assert parts.last_prefill_positions == p.length - (p.n_prefix if kept else 0)
        # (F16 cache: the chunk sizes change ggml's F16 matmul tiling, so its rounding)
        tol = 1e-4 if kv_type == "f32" else 2e-3
        assert np.abs(a.logits - b.logits).max() <= tol
        assert np.abs(a.hidden - b.hidden).max() <= tol
        assert np.array_equal(a.trailing, b.trailing) and np.array_equal(a.pad, b.pad)
    # the cache rows the steps read are those of the one-graph prefill: same greedy frames
    params = SamplingParams.from_defaults(model.generation_defaults).greedy()
    frames = []
    for t in (whole, parts):
        gen = generate_frames(t, p, params, 6, make_rng(0)[0])
        frames.append(np.stack([f.codes for f in gen], 1))
    assert np.array_equal(frames[0], frames[1])
    whole.close()
    parts.close()


def test_chunked_prefill_on_q4_0_with_the_int8_gemm(tiny_model_dir: Path,
                                                    tmp_path_factory: pytest.TempPathFactory,
                                                    backends: BackendSet) -> None:
    """Quantised talker (the int8 prefill GEMM where the CPU has it): the chunks' rows are
    each a row of the one-graph GEMM (row-independent), so the results match."""
    from engine.tools.convert import convert

    out = tmp_path_factory.mktemp("q4chunk") / "q4.gguf"
    convert(tiny_model_dir, out, dtype="q4_0", progress=False)
    m = open_model(out)
    p = PromptBuilder(m).build(LONG, "ryan", "english")
    whole = TalkerModel(m, backends, kv_type="f32", prefill_chunk=1 << 16)
    parts = TalkerModel(m, backends, kv_type="f32", prefill_chunk=16)
    a, b = whole.prefill(p, reuse_prefix=False), parts.prefill(p, reuse_prefix=False)
    assert np.abs(a.logits - b.logits).max() <= 1e-4
    whole.close()
    parts.close()


def test_prefill_cancel_between_chunks(model: Any, backends: BackendSet) -> None:
    pb = PromptBuilder(model)
    p = pb.build(LONG, "ryan", "english")
    t = TalkerModel(model, backends, kv_type="f32", prefill_chunk=16)
    calls = []

    def cancel() -> bool:
        calls.append(1)
        return len(calls) >= 2  # let one chunk boundary pass, stop at the second

    with pytest.raises(PrefillCancelled) as err:
        t.prefill(p, reuse_prefix=False, cancel=cancel)
    # (the prefix, kept for the next request, is a graph of its own: the first boundary)
    assert err.value.done == p.n_prefix + 16 and len(calls) == 2
    # the frame loop turns it into the "cancelled" outcome, with no frame
    params = SamplingParams.from_defaults(model.generation_defaults).greedy()
    gen = generate_frames(t, p, params, 5, make_rng(0)[0], cancel=lambda: len(calls) > 2
                          or bool(calls.append(1)))
    with pytest.raises(StopIteration) as stop:
        next(gen)
    assert stop.value.value.outcome == "cancelled"
    # and the model is usable afterwards
    out = t.prefill(p)
    assert np.isfinite(out.logits).all()
    t.close()


def test_compute_buffer_is_bounded_by_the_chunk(model: Any) -> None:
    """A prompt of 8 chunks needs a compute buffer of ``chunk x n`` scores, not ``n x n``."""
    pb = PromptBuilder(model)
    chunk = pb.build("word " * 20, "ryan", "english").length
    many = pb.build("word " * 20 * 8, "ryan", "english")
    sizes = []
    for c in (many.length, chunk):
        b = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "1"})
        t = TalkerModel(model, b, kv_type="f32", prefill_chunk=c)
        t.prefill(many, reuse_prefix=False)
        sizes.append(b.compute_buffer_bytes())
        t.close()
        b.close()
    whole, chunked = sizes
    assert chunked * 4 <= whole, sizes


def test_trim_gives_back_a_grown_compute_buffer(model: Any) -> None:
    b = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "1"})
    t = TalkerModel(model, b, kv_type="f32", prefill_chunk=1 << 16)
    pb = PromptBuilder(model)
    t.prefill(pb.build("word", "ryan", "english"), reuse_prefix=False)
    steady = b.compute_buffer_bytes()
    t.prefill(pb.build("word " * 100, "ryan", "english"), reuse_prefix=False)
    assert b.compute_buffer_bytes() > steady
    assert b.trim_compute_buffers(steady)
    assert b.compute_buffer_bytes() == 0  # a new scheduler allocates at its first graph
    out = t.prefill(pb.build("word", "ryan", "english"), reuse_prefix=False)
    assert np.isfinite(out.logits).all() and b.compute_buffer_bytes() <= steady
    assert not b.trim_compute_buffers(steady)
    t.close()
    b.close()
