"""The INT8 GEMM custom op (native/ops/gemm_i8.c) against its exact numpy model, and the talker
prefill that uses it against the plain quantised prefill."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.backend import BackendSet
from engine.ggml import Graph, lib
from engine.ggml import gemm_i8 as gi

# the ops are part of the repository: a library that did not load fails these tests
needs_ops = pytest.mark.usefixtures("native_ops")


def run_gemm(be: BackendSet, w: np.ndarray[Any, Any], x: np.ndarray[Any, Any],
             library: Any = None) -> np.ndarray[Any, Any]:
    """``gemm_i8`` of F32 ``w`` [N, K] and ``x`` [T, K] -> [T, N] (packed by ``library``)."""
    p = gi.pack(w, library=library)
    g = Graph()
    tx = g.input("x", x.shape)
    m = gi.I8Matrix(p.n, p.k, g.input("wq", p.wq.shape, np.int8),
                    g.input("ws", p.ws.shape), g.input("wc", p.wc.shape, np.int32))
    g.output(gi.gemm_i8(g.ctx, tx, m, library=library), "y")
    out = be.execute(g, {"x": x, "wq": p.wq, "ws": p.ws, "wc": p.wc})["y"]
    return np.asarray(out).reshape(x.shape[0], w.shape[0])


def data(rng: np.random.Generator, n: int, k: int, t: int
         ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    x = rng.standard_normal((t, k)).astype(np.float32)
    x[:, ::37] *= 20  # outlier channels, as LLM hidden states have
    return w, x


CASES = [  # (N, K, T): packed blocks, partial output blocks, K % 4 and K % 256, row chunks
    (64, 1024, 57), (100, 300, 13), (48, 258, 1), (17, 7, 5), (32, 512, 400), (96, 3072, 30),
]


@needs_ops
@pytest.mark.parametrize("n,k,t", CASES)
def test_gemm_i8_matches_its_numpy_model(cpu2: BackendSet, n: int, k: int, t: int) -> None:
    w, x = data(np.random.default_rng(n + k + t), n, k, t)
    y = run_gemm(cpu2, w, x)
    ref = gi.reference(w, x)
    assert y.shape == ref.shape and y.dtype == np.float32
    # integer sums are exact: what is left is F32 rounding of one scale product and FMA a block
    assert np.abs(y - ref).max() <= 1e-6 * np.abs(ref).max()
    # and W8A8 with per-256 scales is close to the F32 product
    f32 = x @ w.T
    cos = float(np.sum(y * f32) / np.linalg.norm(y) / np.linalg.norm(f32))
    assert cos >= 0.9995


@needs_ops
@pytest.mark.parametrize("n,k,t", [(64, 1024, 57), (100, 300, 13), (32, 512, 400)])
def test_gemm_i8_threads_identical(cpu1: BackendSet, cpu2: BackendSet, n: int, k: int,
                                   t: int) -> None:
    w, x = data(np.random.default_rng(7), n, k, t)
    assert np.array_equal(run_gemm(cpu1, w, x), run_gemm(cpu2, w, x))


@needs_ops
def test_gemm_i8_rows_are_independent(cpu2: BackendSet) -> None:
    """Each row is rounded on its own: a batch equals its rows one at a time (what batched
    prefix pinning relies on)."""
    w, x = data(np.random.default_rng(3), 64, 512, 20)
    y = run_gemm(cpu2, w, x)
    for r in (0, 7, 19):
        assert np.array_equal(y[r], run_gemm(cpu2, w, x[r:r + 1])[0])


@needs_ops
def test_gemm_i8_outputs_are_independent(cpu2: BackendSet) -> None:
    """Matrices packed side by side (a layer's q|k|v, gate|up) give each one the bits of its
    own GEMM: every output channel rounds and sums alone (what the talker's groups rely on)."""
    rng = np.random.default_rng(11)
    parts = [data(rng, n, 1024, 37)[0] for n in (2048, 1024, 1024)]
    x = data(rng, 32, 1024, 37)[1]
    fused = run_gemm(cpu2, np.concatenate(parts), x)
    start = 0
    for w in parts:
        np.testing.assert_array_equal(fused[:, start : start + w.shape[0]], run_gemm(cpu2, w, x))
        start += w.shape[0]


def test_gemm_i8_zero_blocks(cpu2: BackendSet) -> None:
    w, x = data(np.random.default_rng(5), 40, 600, 6)
    w[3] = 0.0
    w[:, 256:512] = 0.0
    x[2] = 0.0
    x[:, :256] = 0.0
    y = run_gemm(cpu2, w, x)
    assert np.isfinite(y).all()
    assert not y[2].any() and not y[:, 3].any()
    assert np.abs(y - gi.reference(w, x)).max() <= 1e-6 * np.abs(y).max()


@needs_ops
def test_pack_layout() -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((40, 270)).astype(np.float32)
    p = gi.pack(w)
    assert p.wq.shape == (2, 68, 128) and p.ws.shape == (2, 2, 32) and p.wc.shape == (2, 2, 32)
    # element [j, g, 4i + e] is Wq[32j + i, 4g + e]; scales per (channel, 256-block)
    s = np.abs(w[33, 256:]).max() / np.float32(127)
    assert p.ws[1, 1, 1] == np.float32(s)
    q = np.clip(np.rint(w[33, 256:] * (np.float32(1) / np.float32(s))), -127, 127)
    assert np.array_equal(p.wq[1, 64:68, 4:8].reshape(-1)[:14], q.astype(np.int8))
    assert p.wc[1, 1, 1] == -128 * int(q.sum())
    assert not p.wq[1, :, 32:].any() and not p.ws[1, :, 8:].any()  # channels past N: zero
    # K = 270 pads to 272: inputs 270 and 271 of the last group are zero weights
    assert not p.wq[:, 67, :].reshape(2, 32, 4)[:, :, 2:].any()


@needs_ops
def test_gemm_i8_rejects_what_the_kernel_cannot_take() -> None:
    w = np.zeros((64, 256), np.float32)
    p = gi.pack(w)
    with Graph() as g:
        wq = g.input("wq", p.wq.shape, np.int8)
        ws, wc = g.input("ws", p.ws.shape), g.input("wc", p.wc.shape, np.int32)
        m = gi.I8Matrix(64, 256, wq, ws, wc)
        with pytest.raises(ValueError, match="x has ne"):
            gi.gemm_i8(g.ctx, g.input("x", (5, 255)), m)
        with pytest.raises(TypeError):
            gi.gemm_i8(g.ctx, g.input("xi", (5, 256), np.int32), m)
        with pytest.raises(ValueError, match="wq must be"):
            gi.gemm_i8(g.ctx, g.input("x2", (5, 256)), gi.I8Matrix(64, 256, ws, ws, wc))
        with pytest.raises(ValueError, match="wc must be"):
            gi.gemm_i8(g.ctx, g.input("x3", (5, 256)), gi.I8Matrix(64, 256, wq, ws, ws))
        with pytest.raises(ValueError, match="rows must be contiguous"):
            xt = g.input("x4", (256, 5))
            gi.gemm_i8(g.ctx, lib.ggml_transpose(g.ctx, xt), m)
    with pytest.raises(ValueError, match="must be \\[N, K\\]"):
        gi.pack(np.zeros(5, np.float32))


# ---------------------------------------------------------------------------------------------
# The talker's prefill on the int8 copies


@needs_ops
def test_int8_prefill_is_close_to_the_plain_prefill(tiny_q4_model: Any, cpu2: BackendSet) -> None:
    from engine.talker.model import TalkerModel
    from engine.talker.prompt import PromptBuilder

    if not gi.fast_available():
        pytest.skip("no AVX512-VNNI: the talker keeps ggml's GEMM")
    plain = TalkerModel(tiny_q4_model, cpu2, kv_type="f32", int8_prefill=False)
    i8 = TalkerModel(tiny_q4_model, cpu2, kv_type="f32", int8_prefill=True)
    assert not plain.weights.int8_prefill and plain.weights.i8_nbytes == 0
    assert i8.weights.int8_prefill and i8.weights.i8_nbytes > 0
    assert all(lw.i8 is None for lw in i8.weights.cp_layers)  # one-row work: no copies
    prompt = PromptBuilder(tiny_q4_model).build("Hello there, how are you today?", "ryan",
                                                "english")
    a, b = plain.prefill(prompt), i8.prefill(prompt)
    cos = float(np.dot(a.logits, b.logits) / np.linalg.norm(a.logits) / np.linalg.norm(b.logits))
    assert cos >= 0.999
    assert not np.array_equal(a.logits, b.logits)  # it did take the other path
    plain.close()
    i8.close()


@needs_ops
def test_int8_prefill_only_for_quantised_cpu_talkers(tiny_gguf: Path, tiny_q4_model: Any,
                                                    cpu2: BackendSet,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.gguf_model import open_model
    from engine.talker.model import TalkerModel
    from engine.talker.weights import int8_prefill_possible

    m = open_model(tiny_gguf)  # F32/F16 weights: chosen for precision, keep ggml's GEMM
    assert not int8_prefill_possible(m, cpu2)
    t = TalkerModel(m, cpu2, kv_type="f32")
    assert not t.weights.int8_prefill
    t.close()
    assert int8_prefill_possible(tiny_q4_model, cpu2) == gi.fast_available()
    monkeypatch.setattr(gi, "fast_available", lambda library=None: False)
    assert not int8_prefill_possible(tiny_q4_model, cpu2)
    monkeypatch.undo()
    stock = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2",
                                 "QTTS_CUSTOM_OPS": "0"})
    assert not int8_prefill_possible(tiny_q4_model, stock)
    no_i8 = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2",
                                 "QTTS_INT8_PREFILL": "0"})
    t = TalkerModel(tiny_q4_model, no_i8, kv_type="f32")
    assert not t.weights.int8_prefill
    t.close()
