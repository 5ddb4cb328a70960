"""The Q4_0 step kernel (native/ops/gemv_q4.c) against its numpy model and ggml's own Q4_0
product, and the talker that routes its steps through it."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import pytest

from engine.backend import BackendSet
from engine.ggml import Graph, lib
from engine.ggml import gemv_q4 as gq

needs_ops = pytest.mark.usefixtures("native_ops")


def quantised(rng: np.random.Generator, n: int, k: int, scale: float = 1.0) -> np.ndarray[Any, Any]:
    """GGUF Q4_0 bytes of a random ``[N, K]`` matrix (rows of K/32 blocks)."""
    w = (rng.standard_normal((n, k)) * scale / np.sqrt(k)).astype(np.float32)
    w[:, :32] *= 8  # a block with larger weights, as real matrices have
    return np.asarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0))


def products(be: BackendSet, q4: np.ndarray[Any, Any], n: int, k: int,
             x: np.ndarray[Any, Any], library: Any = None
             ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(gemv_q4, ggml's mul_mat on the plain Q4_0 matrix) of ``x`` ``[T, K]`` -> ``[T, N]``
    (packed and run by ``library``)."""
    packed = gq.pack(q4, n, k, library=library)
    g = Graph()
    tx = g.input("x", x.shape)
    w = g.input("w", packed.shape, np.int8)
    wq = g.input("wq", (n, k), ggml_type=lib.GGML_TYPE_Q4_0)
    g.output(gq.gemv_q4(g.ctx, tx, w, library=library), "y")
    g.output(lib.ggml_mul_mat(g.ctx, wq, tx), "z")
    out = be.execute(g, {"x": x, "w": packed, "wq": q4})
    t = x.shape[0]
    return np.asarray(out["y"]).reshape(t, n), np.asarray(out["z"]).reshape(t, n)


def rows(rng: np.random.Generator, t: int, k: int) -> np.ndarray[Any, Any]:
    x = rng.standard_normal((t, k)).astype(np.float32)
    x[:, ::37] *= 20  # outlier channels, as LLM hidden states have
    return x


CASES = [(16, 32, 1), (96, 256, 1), (48, 1024, 2), (1024, 3072, 1), (3072, 1024, 3),
         (64, 2048, 5), (32, 96, 9)]  # (N, K, T): one block pair or an odd block; row groups


@needs_ops
@pytest.mark.parametrize("n,k,t", CASES)
def test_gemv_q4_matches_its_numpy_model_and_ggml(cpu2: BackendSet, n: int, k: int,
                                                  t: int) -> None:
    rng = np.random.default_rng(n + k + t)
    q4 = quantised(rng, n, k)
    x = rows(rng, t, k)
    y, z = products(cpu2, q4, n, k, x)
    ref = gq.reference(q4, n, k, x)
    assert y.dtype == np.float32
    # exact integer block sums: only the F32 rounding of each block's scale and FMA is left
    assert np.abs(y - ref).max() <= 2e-6 * np.abs(ref).max()
    # the same products as ggml's Q4_0 x Q8_0 dot, summed in another order
    assert np.abs(y - z).max() <= 2e-6 * np.abs(z).max()


@needs_ops
def test_gemv_q4_rows_and_threads_do_not_change_a_row(cpu1: BackendSet, cpu2: BackendSet) -> None:
    """A row's outputs are the same bits alone, in any batch and on any thread count (what a
    batched step equal to the unbatched one relies on)."""
    rng = np.random.default_rng(11)
    n, k = 160, 512
    q4 = quantised(rng, n, k)
    x = rows(rng, 9, k)
    alone = [products(cpu1, q4, n, k, x[r:r + 1])[0][0] for r in range(9)]
    for be in (cpu1, cpu2):
        for t in (2, 4, 5, 9):
            y = products(be, q4, n, k, x[:t])[0]
            for r in range(t):
                assert np.array_equal(y[r], alone[r]), (be.options.threads, t, r)


def unit_matrix(n: int) -> np.ndarray[Any, Any]:
    """GGUF Q4_0 bytes of the ``[N, N]`` identity: scale 1, nibble 9 on the diagonal, 8 off it."""
    u = np.full((n, n), 8, np.uint8)
    u[np.arange(n), np.arange(n)] = 9
    blocks = u.reshape(n, n // 32, 32)
    out = np.empty((n, n // 32, 18), np.uint8)
    out[:, :, :2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    out[:, :, 2:] = blocks[:, :, :16] | blocks[:, :, 16:] << 4
    return out.reshape(-1)


@needs_ops
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_q4_rounds_its_input_as_ggml_q8_0(cpu1: BackendSet, cpu2: BackendSet,
                                               threads: int) -> None:
    """Through the identity each output is one product, q * d exactly: the kernel's int8
    values and F16 scales are ggml's Q8_0 rounding bit for bit (ties, outliers, zero blocks,
    values at the clamp)."""
    rng = np.random.default_rng(3)
    n = 256
    x = rows(rng, 5, n)
    x[1, :32] = 0.0
    x[2, 32:64] = np.arange(32, dtype=np.float32) - 15.5  # halves at scale 1: ties to even
    x[2, 32] = 127.0
    x[3, 64:96] = 127.0  # every value at the scale's clamp
    x[4] *= 1e-30  # tiny scales
    y = products(cpu1 if threads == 1 else cpu2, unit_matrix(n), n, n, x)[0]
    q, d = gq._q8_rows(x)
    want = q.reshape(5, n).astype(np.float32) * np.repeat(d, 32, axis=1)
    assert np.array_equal(y, want)


@needs_ops
def test_gemv_q4_zero_rows_and_blocks(cpu2: BackendSet) -> None:
    rng = np.random.default_rng(5)
    n, k = 48, 128
    q4 = quantised(rng, n, k)
    x = rows(rng, 3, k)
    x[1] = 0.0
    x[:, 32:64] = 0.0
    y, z = products(cpu2, q4, n, k, x)
    assert np.isfinite(y).all() and not y[1].any()
    assert np.abs(y - z).max() <= 2e-6 * np.abs(z).max()


@needs_ops
def test_gemv_q4_takes_strided_rows(cpu2: BackendSet) -> None:
    """x as a view (the last row of a prefill, or rows of a 3-D batch) multiplies like its copy."""
    rng = np.random.default_rng(2)
    n, k = 64, 256
    q4 = quantised(rng, n, k)
    packed = gq.pack(q4, n, k)
    x = rows(rng, 6, k)
    g = Graph()
    tx = g.input("x", x.shape)
    w = g.input("w", packed.shape, np.int8)
    last = lib.ggml_view_2d(g.ctx, tx, k, 1, int(tx.nb[1]), 5 * int(tx.nb[1]))
    every_other = lib.ggml_view_3d(g.ctx, tx, k, 1, 3, int(tx.nb[1]), 2 * int(tx.nb[1]), 0)
    g.output(gq.gemv_q4(g.ctx, last, w), "last")
    g.output(gq.gemv_q4(g.ctx, every_other, w), "odd")
    out = cpu2.execute(g, {"x": x, "w": packed})
    ref = products(cpu2, q4, n, k, x)[0]
    assert np.array_equal(np.asarray(out["last"]).reshape(n), ref[5])
    assert np.array_equal(np.asarray(out["odd"]).reshape(3, n), ref[[0, 2, 4]])


@needs_ops
def test_pack_layout() -> None:
    rng = np.random.default_rng(1)
    n, k = 32, 64
    q4 = quantised(rng, n, k)
    p = gq.pack(q4, n, k)
    assert p.shape == (2, 2, gq.BYTES) and p.dtype == np.int8
    raw = q4.reshape(n, 2, 18)
    u = np.concatenate([raw[:, :, 2:] & 0x0F, raw[:, :, 2:] >> 4], axis=2)  # [N, block, 32]
    b = p.view(np.uint8)
    # block (j=1, b=1), group g=2: byte 4r + e = u[16 + r, 32 + 16 + e] | u[.., +4] << 4
    for r, e in ((0, 0), (5, 3), (15, 1)):
        byte = int(b[1, 1, 2 * 64 + 4 * r + e])
        assert byte & 0x0F == u[16 + r, 1, 16 + e] and byte >> 4 == u[16 + r, 1, 20 + e]
    # then the 16 rows' F16 scales, as stored in the GGUF
    assert bytes(b[1, 1, 256:258]) == bytes(raw[16, 1, :2])
    assert bytes(b[0, 0, 256 + 30:258 + 30]) == bytes(raw[15, 0, :2])


@needs_ops
def test_gemv_q4_rejects_what_the_kernel_cannot_take() -> None:
    rng = np.random.default_rng(3)
    q4 = quantised(rng, 32, 64)
    with pytest.raises(ValueError, match="N % 16"):
        gq.pack(quantised(rng, 24, 64), 24, 64)
    with pytest.raises(ValueError, match="not a Q4_0"):
        gq.pack(q4[:10], 32, 64)
    packed = gq.pack(q4, 32, 64)
    with Graph() as g:
        w = g.input("w", packed.shape, np.int8)
        with pytest.raises(ValueError, match="packed I8 tensor"):
            gq.gemv_q4(g.ctx, g.input("x", (1, 96)), w)
        with pytest.raises(ValueError, match="packed I8 tensor"):
            gq.gemv_q4(g.ctx, g.input("x2", (1, 64)), g.input("wf", packed.shape))
        with pytest.raises(ValueError, match="rows must be contiguous"):
            gq.gemv_q4(g.ctx, lib.ggml_transpose(g.ctx, g.input("x3", (64, 2))), w)
    assert gq.packable(32, 64) and not gq.packable(24, 64) and not gq.packable(32, 48)


# ---------------------------------------------------------------------------------------------
# The talker's steps on it


@needs_ops
def test_the_talker_steps_through_gemv_q4_where_it_can(tiny_q4_model: Any,
                                                       cpu2: BackendSet) -> None:
    from engine.talker.model import TalkerModel
    from engine.talker.weights import gemv_q4_possible

    assert gemv_q4_possible(cpu2) == gq.fast_available()
    t = TalkerModel(tiny_q4_model, cpu2, kv_type="f32")
    if gq.fast_available():
        # every Q4_0 matrix of the talker and code predictor (the tiny model has no other Q4_0
        # tensor), the code predictor's heads included: no ggml repack copy
        n_q4 = sum(ty == lib.GGML_TYPE_Q4_0 for ty in t.weights.types.values())
        assert t.weights.q4_matrices == n_q4 > 0 and t.weights.repacked is None
    else:
        assert t.weights.q4_matrices == 0
    t.close()
    stock = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2",
                                 "QTTS_CUSTOM_OPS": "0"})
    assert not gemv_q4_possible(stock)
    t = TalkerModel(tiny_q4_model, stock, kv_type="f32")
    assert t.weights.q4_matrices == 0
    t.close()
