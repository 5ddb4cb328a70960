"""qtts's native ggml custom ops (native/ops) against float64 numpy and against stock ggml ops."""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
import platform
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.backend import BackendSet
from engine.errors import NativeBuildError
from engine.ggml import Graph, ffi, gemm_i8, gemv_q4, lib, native_info, ops
from engine.ggml import custom_ops as co
from engine.ggml.graph import new_tensor
from engine.ggml.ops1d import fold_weight, pad_zero
from tests.engine.test_gemm_i8 import data as gemm_data
from tests.engine.test_gemm_i8 import run_gemm
from tests.engine.test_gemv_q4 import products as gemv_q4_products
from tests.engine.test_gemv_q4 import quantised, rows

# the ops are part of the repository: a library that did not load fails these tests
needs_ops = pytest.mark.usefixtures("native_ops")
REPO = Path(__file__).resolve().parents[2]
BF16 = lib.GGML_TYPE_BF16  # BF16 inputs are uploaded as co.bf16_bits of the values


# ---------------------------------------------------------------------------------------------
# SnakeBeta


def snake_params(rng: np.random.Generator, c: int) -> tuple[np.ndarray[Any, Any], ...]:
    """exp(alpha) over e^-2..e^4 (0.14..55), 1/(exp(beta)+1e-9) over e^-2..e^2."""
    ea = np.exp(rng.uniform(-2, 4, c)).astype(np.float32)
    ib = (1 / (np.exp(rng.uniform(-2, 2, c)) + 1e-9)).astype(np.float32)
    return ea, ib


def snake_input(rng: np.random.Generator, t: int, c: int) -> np.ndarray[Any, Any]:
    """N(0, 2) plus rows of large values: |exp_alpha * x| reaches ~5e3 (and 1e6 in a few)."""
    x = (rng.standard_normal((t, c)) * 2).astype(np.float32)
    x[::7] *= 50
    x[::997] *= 300  # beyond QTTS_SNAKE_FAST_MAX: the libm lanes
    return x


def snake_ref(x: np.ndarray[Any, Any], ea: np.ndarray[Any, Any], ib: np.ndarray[Any, Any]
              ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """float64 reference and the magnitude of its terms (|x| + ib * sin^2: the scale of the
    rounding that any float32 evaluation makes)."""
    xd = x.astype(np.float64)
    s2 = ib.astype(np.float64) * np.sin(ea.astype(np.float64) * xd) ** 2
    return xd + s2, np.abs(xd) + s2


def run_snake(be: BackendSet, x: np.ndarray[Any, Any], ea: np.ndarray[Any, Any],
              ib: np.ndarray[Any, Any], library: Any = None) -> np.ndarray[Any, Any]:
    g = Graph()
    tx, ta, tb = g.input("x", x.shape), g.input("a", ea.shape), g.input("b", ib.shape)
    g.output(co.snake_beta(g.ctx, tx, ta, tb, library=library), "y")
    # execute drops trailing size-1 ggml dims (numpy-leading ones): T = 1 comes back as [C]
    return be.execute(g, {"x": x, "a": ea, "b": ib})["y"].reshape(x.shape)


def check_snake(y: np.ndarray[Any, Any], x: np.ndarray[Any, Any], ea: np.ndarray[Any, Any],
                ib: np.ndarray[Any, Any]) -> None:
    ref, scale = snake_ref(x, ea, ib)
    assert y.shape == x.shape and y.dtype == np.float32
    err = np.abs(y - ref)
    assert np.all(err <= 2e-6 * scale), f"max err/scale {np.max(err / scale):.3g}"
    assert err.max() <= 2e-6 * np.abs(ref).max()


@needs_ops
@pytest.mark.parametrize("c", [96, 1536, 100])
@pytest.mark.parametrize("t", [1, 7, 5000])
def test_snake_matches_float64(cpu2: BackendSet, c: int, t: int) -> None:
    rng = np.random.default_rng(c * 10007 + t)
    ea, ib = snake_params(rng, c)
    x = snake_input(rng, t, c)
    check_snake(run_snake(cpu2, x, ea, ib), x, ea, ib)


@needs_ops
def test_snake_covers_large_arguments(cpu2: BackendSet) -> None:
    """|exp_alpha * x| from 0 to 1e4 on a grid (range reduction), plus zeros, tiny values and
    arguments just around multiples of pi."""
    c = 96
    ea = np.exp(np.linspace(-2, 4, c)).astype(np.float32)
    ib = np.full(c, 0.7, np.float32)
    z = np.concatenate([np.linspace(-1e4, 1e4, 40001), np.arange(-3000, 3000) * np.pi,
                        [0.0, 1e-30, -1e-20, 1e-7]])
    x = (z[:, None] / ea[None, :].astype(np.float64)).astype(np.float32)
    check_snake(run_snake(cpu2, x, ea, ib), x, ea, ib)


@needs_ops
@pytest.mark.parametrize("c,t", [(96, 5000), (1536, 33), (192, 1)])
def test_snake_threads_identical(cpu1: BackendSet, cpu2: BackendSet, c: int, t: int) -> None:
    rng = np.random.default_rng(5)
    ea, ib = snake_params(rng, c)
    x = snake_input(rng, t, c)
    assert np.array_equal(run_snake(cpu1, x, ea, ib), run_snake(cpu2, x, ea, ib))


def run_stock_snake(be: BackendSet, x: np.ndarray[Any, Any], ea: np.ndarray[Any, Any],
                    ib: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The unfused graph: ggml_mul, ggml_sin, ggml_sqr, ggml_mul, ggml_add."""
    g = Graph()
    tx, ta, tb = g.input("x", x.shape), g.input("a", ea.shape), g.input("b", ib.shape)
    s = lib.ggml_sqr(g.ctx, lib.ggml_sin(g.ctx, lib.ggml_mul(g.ctx, tx, ta)))
    g.output(lib.ggml_add(g.ctx, tx, lib.ggml_mul(g.ctx, s, tb)), "y")
    return be.execute(g, {"x": x, "a": ea, "b": ib})["y"].reshape(x.shape)


@needs_ops
@pytest.mark.parametrize("c,t", [(96, 3000), (1536, 40)])
def test_snake_matches_stock_ops(cpu2: BackendSet, c: int, t: int) -> None:
    """Equal to the stock-op composition within 1e-6 (of max|y| and of each element's scale)
    where the arguments are moderate (|exp_alpha * x| up to ~15)."""
    rng = np.random.default_rng(6)
    ea = np.exp(rng.uniform(-1, 1, c)).astype(np.float32)
    ib = (1 / (np.exp(rng.uniform(-1, 1, c)) + 1e-9)).astype(np.float32)
    x = rng.standard_normal((t, c)).astype(np.float32)
    stock = run_stock_snake(cpu2, x, ea, ib)
    fused = run_snake(cpu2, x, ea, ib)
    _, scale = snake_ref(x, ea, ib)
    assert np.abs(fused - stock).max() <= 1e-6 * np.abs(stock).max()
    assert np.all(np.abs(fused - stock) <= 1e-6 * np.maximum(scale, 1.0))


@needs_ops
def test_snake_vs_stock_ops_on_large_arguments(cpu2: BackendSet) -> None:
    """With large arguments the stock graph's sin(fl(ea * x)) carries the product's rounding
    (|z| * 6e-8); the fused op does not. Any gap beyond 1e-6 is the stock graph's own error."""
    rng = np.random.default_rng(8)
    c = 96
    ea, ib = snake_params(rng, c)
    x = (rng.standard_normal((2000, c)) * 20).astype(np.float32)
    stock = run_stock_snake(cpu2, x, ea, ib)
    fused = run_snake(cpu2, x, ea, ib)
    ref, scale = snake_ref(x, ea, ib)
    gap = np.abs(fused.astype(np.float64) - stock)
    assert np.all(gap <= 1e-6 * scale + np.abs(stock - ref))
    assert np.abs(fused - ref).max() < np.abs(stock - ref).max()


@needs_ops
def test_snake_in_a_graph_with_other_ops(cpu2: BackendSet) -> None:
    """A 3-D input (rows = every trailing index) and a snake feeding a stock op."""
    rng = np.random.default_rng(7)
    c = 48
    ea, ib = snake_params(rng, c)
    x = rng.standard_normal((3, 5, c)).astype(np.float32)
    g = Graph()
    tx, ta, tb = g.input("x", x.shape), g.input("a", (c,)), g.input("b", (c,))
    g.output(lib.ggml_scale(g.ctx, co.snake_beta(g.ctx, tx, ta, tb), 2.0), "y")
    y = cpu2.execute(g, {"x": x, "a": ea, "b": ib})["y"]
    ref, scale = snake_ref(x, ea, ib)
    assert np.all(np.abs(y - 2 * ref) <= 4e-6 * scale)


@needs_ops
def test_snake_rejects_what_the_kernel_cannot_take() -> None:
    with Graph() as g:
        x = g.input("x", (10, 96))
        a, b = g.input("a", (96,)), g.input("b", (96,))
        with pytest.raises(ValueError, match="contiguous"):
            co.snake_beta(g.ctx, lib.ggml_transpose(g.ctx, x), a, b)
        with pytest.raises(ValueError, match="exp_alpha"):
            co.snake_beta(g.ctx, x, g.input("a2", (95,)), b)
        with pytest.raises(TypeError, match="F32"):
            co.snake_beta(g.ctx, g.input("h", (10, 96), np.float16), a, b)


def test_missing_library_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(co, "ops", None)
    with Graph() as g:
        x = g.input("x", (4, 8))
        a, b = g.input("a", (8,)), g.input("b", (8,))
        with pytest.raises(NativeBuildError, match="libqtts_ops"):
            co.snake_beta(g.ctx, x, a, b)
        w, bias = g.input("w", (1, 8, 8)), g.input("bias", (8,))
        with pytest.raises(NativeBuildError, match="libqtts_ops"):
            co.conv1d_tm(g.ctx, x, w, bias)
        with pytest.raises(NativeBuildError, match="libqtts_ops"):
            co.conv1d_tm_bf16(g.ctx, x, g.input("wb", (1, 1, 4, 64), ggml_type=BF16), bias)
    assert not co.bf16_available()


# ---------------------------------------------------------------------------------------------
# Causal dilated conv1d, time-major


def conv_ref(xp: np.ndarray[Any, Any], w_oik: np.ndarray[Any, Any], b: np.ndarray[Any, Any],
             d: int) -> np.ndarray[Any, Any]:
    """float64: y[t, o] = b[o] + sum_k sum_c W[o, c, k] xp[t + k d, c]."""
    k = w_oik.shape[2]
    t = xp.shape[0] - (k - 1) * d
    xd, wd = xp.astype(np.float64), w_oik.astype(np.float64)
    y = np.broadcast_to(b.astype(np.float64), (t, w_oik.shape[0])).copy()
    for i in range(k):
        y += xd[i * d : i * d + t] @ wd[:, :, i].T
    return y


def conv_data(rng: np.random.Generator, c_in: int, c_out: int, t: int, k: int, d: int
              ) -> tuple[np.ndarray[Any, Any], ...]:
    xp = rng.standard_normal((t + (k - 1) * d, c_in)).astype(np.float32)
    w = (rng.standard_normal((c_out, c_in, k)) / np.sqrt(c_in * k)).astype(np.float32)
    b = rng.standard_normal(c_out).astype(np.float32)
    return xp, w, b


def run_conv(be: BackendSet, xp: np.ndarray[Any, Any], w_oik: np.ndarray[Any, Any],
             b: np.ndarray[Any, Any], d: int, library: Any = None) -> np.ndarray[Any, Any]:
    wp = co.pack_conv_weight(w_oik, library=library)
    g = Graph()
    tx, tw, tb = g.input("x", xp.shape), g.input("w", wp.shape), g.input("b", b.shape)
    g.output(co.conv1d_tm(g.ctx, tx, tw, tb, d, library=library), "y")
    t = xp.shape[0] - (w_oik.shape[2] - 1) * d
    return be.execute(g, {"x": xp, "w": wp, "b": b})["y"].reshape(t, w_oik.shape[0])


def check_conv(y: np.ndarray[Any, Any], ref: np.ndarray[Any, Any]) -> None:
    assert y.shape == ref.shape and y.dtype == np.float32
    rel = np.abs(y - ref).max() / np.abs(ref).max()
    assert rel <= 1e-5, f"max|d|/max|y| = {rel:.3g}"


CONV_CASES = [  # (C_in, C_out, T, K, d)
    (96, 96, 1, 7, 1),
    (96, 96, 13, 7, 3),
    (96, 96, 5000, 7, 9),
    (192, 192, 700, 7, 1),
    (384, 384, 257, 7, 3),
    (768, 768, 40, 7, 9),
    (96, 96, 999, 1, 1),  # the 1x1 conv
    (384, 384, 31, 1, 1),
    (96, 1, 500, 7, 1),  # decoder.6: 96 -> 1 (masked output block)
    (40, 100, 77, 3, 2),  # odd channel counts: one full block + a masked one
    (1536, 768, 9, 7, 1),
]


@needs_ops
@pytest.mark.parametrize("c_in,c_out,t,k,d", CONV_CASES)
def test_conv_matches_float64(cpu2: BackendSet, c_in: int, c_out: int, t: int, k: int,
                              d: int) -> None:
    rng = np.random.default_rng(c_in + 7 * c_out + 13 * t + d)
    xp, w, b = conv_data(rng, c_in, c_out, t, k, d)
    check_conv(run_conv(cpu2, xp, w, b, d), conv_ref(xp, w, b, d))


@needs_ops
@pytest.mark.parametrize("c,t,d", [(96, 3001, 3), (768, 5, 1), (384, 1, 9), (64, 250, 1),
                                   (32, 7297, 2)])  # fmt: skip
def test_conv_threads_identical(cpu1: BackendSet, cpu2: BackendSet, c: int, t: int,
                                d: int) -> None:
    rng = np.random.default_rng(11)
    xp, w, b = conv_data(rng, c, c, t, 7, d)
    assert np.array_equal(run_conv(cpu1, xp, w, b, d), run_conv(cpu2, xp, w, b, d))


@needs_ops
def test_conv_on_a_strided_view(cpu2: BackendSet) -> None:
    """xp may be a row view of a wider buffer (e.g. [history | other channels])."""
    rng = np.random.default_rng(12)
    c, t, d = 96, 200, 3
    wide = rng.standard_normal((t + 6 * d, 2 * c)).astype(np.float32)
    _, w, b = conv_data(rng, c, c, t, 7, d)
    wp = co.pack_conv_weight(w)
    g = Graph()
    tx, tw, tb = g.input("x", wide.shape), g.input("w", wp.shape), g.input("b", b.shape)
    view = lib.ggml_view_2d(g.ctx, tx, c, t + 6 * d, tx.nb[1], 4 * c)  # the right half
    g.output(co.conv1d_tm(g.ctx, view, tw, tb, d), "y")
    y = cpu2.execute(g, {"x": wide, "w": wp, "b": b})["y"]
    check_conv(y, conv_ref(wide[:, c:], w, b, d))


@needs_ops
def test_conv_matches_the_mul_mat_formulation(cpu2: BackendSet) -> None:
    """Same as the K x ggml_mul_mat over shifted views (what it replaces), to F32 rounding."""
    rng = np.random.default_rng(13)
    c, t, d, k = 192, 300, 9, 7
    xp, w, b = conv_data(rng, c, c, t, k, d)
    g = Graph()
    tx, tw, tb = g.input("x", xp.shape), g.input("w", (k, c, c)), g.input("b", (c,))
    y = tb
    for i in range(k):
        wk = lib.ggml_view_2d(g.ctx, tw, c, c, tw.nb[1], i * tw.nb[2])
        xk = lib.ggml_view_2d(g.ctx, tx, c, t, tx.nb[1], i * d * tx.nb[1])
        y = lib.ggml_add(g.ctx, lib.ggml_mul_mat(g.ctx, wk, xk), y)
    g.output(y, "y")
    mm = cpu2.execute(g, {"x": xp, "w": np.ascontiguousarray(w.transpose(2, 0, 1)), "b": b})
    ours = run_conv(cpu2, xp, w, b, d)
    assert np.abs(ours - mm["y"]).max() <= 1e-5 * np.abs(mm["y"]).max()


# Convs of 2 and 3 taps in Winograd groups, F(3, 2) and F(2, 3) (the codec encoder's folded
# strided convs and its residual units' first convs)

WINOGRAD_CASES = [  # (C_in, C_out, T): T % 3 and T % 2 of every value, shorter than a group,
    (256, 128, 999),  # masked output blocks, several time chunks, a wide reduction
    (96, 40, 1),
    (96, 40, 2),
    (64, 33, 4),
    (640, 256, 1301),
    (4096, 64, 25),
]


def run_conv_winograd(be: BackendSet, xp: np.ndarray[Any, Any], w: np.ndarray[Any, Any],
                      b: np.ndarray[Any, Any], library: Any = None, hist_apart: bool = False
                      ) -> np.ndarray[Any, Any]:  # fmt: skip
    """``conv1d_tm`` with ``wino``: the K - 1 history rows in front of ``xp``, or
    (``hist_apart``) a tensor of their own."""
    wp = co.pack_conv_weight_winograd(w, library=library)
    p = w.shape[2] - 1
    g = Graph()
    feed = {"w": wp, "b": b}
    tw, tb = g.input("w", wp.shape), g.input("b", b.shape)
    if hist_apart:
        feed["h"], feed["x"] = xp[:p], xp[p:]
        hist, tx = g.input("h", (p, xp.shape[1])), g.input("x", xp[p:].shape)
    else:
        feed["x"], hist, tx = xp, None, g.input("x", xp.shape)
    g.output(co.conv1d_tm(g.ctx, tx, tw, tb, hist=hist, wino=True, library=library), "y")
    return be.execute(g, feed)["y"].reshape(xp.shape[0] - p, w.shape[0])


@needs_ops
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize(("c_in", "c_out", "t"), WINOGRAD_CASES)
def test_conv_winograd_matches_float64(cpu1: BackendSet, cpu2: BackendSet, c_in: int,
                                       c_out: int, t: int, k: int) -> None:
    rng = np.random.default_rng(c_in + 3 * t + k)
    xp, w, b = conv_data(rng, c_in, c_out, t, k, 1)
    y = run_conv_winograd(cpu2, xp, w, b)
    ref = conv_ref(xp, w, b, 1)
    check_conv(y, ref)
    assert np.array_equal(y, run_conv_winograd(cpu1, xp, w, b))
    assert np.array_equal(y, run_conv_winograd(cpu2, xp, w, b, hist_apart=True))
    direct = run_conv(cpu2, xp, w, b, 1)
    # the rows past the last whole group are the direct sums, bit for bit
    whole = t - t % (3 if k == 2 else 2)
    assert np.array_equal(y[whole:], direct[whole:])
    # and the groups' error is of the direct sums' order (RMS against float64)
    err, err_direct = (float(np.sqrt(np.mean((a - ref) ** 2))) for a in (y, direct))
    assert err <= 2 * err_direct + 1e-9 * float(np.abs(ref).max())


@needs_ops
def test_conv_winograd_rejects_what_the_kernel_cannot_take() -> None:
    blk = co.conv_block()
    with Graph() as g:
        x = g.input("x", (20, 96))
        b = g.input("b", (96,))
        w4 = g.input("w4", (-(-96 // blk), 4, 96, blk))
        assert int(co.conv1d_tm(g.ctx, x, w4, b, wino=True).ne[1]) == 19
        w5 = g.input("w5", (-(-96 // blk), 5, 96, blk))
        assert int(co.conv1d_tm(g.ctx, x, w5, b, wino=True).ne[1]) == 18
        with pytest.raises(ValueError, match="wino takes 2 or 3 taps of dilation 1"):
            co.conv1d_tm(g.ctx, x, g.input("w2", (-(-96 // blk), 2, 96, blk)), b, wino=True)
        with pytest.raises(ValueError, match="wino takes 2 or 3 taps of dilation 1"):
            co.conv1d_tm(g.ctx, x, w4, b, 2, wino=True)
        with pytest.raises(ValueError, match="needs more than the 2 of history"):
            co.conv1d_tm(g.ctx, g.input("x1", (1, 96)), w5, b, wino=True)
        h, b3 = g.input("h", (10, 64)), g.input("b3", (32,))
        w1, b1 = g.input("w1", (-(-64 // blk), 1, 32, blk)), g.input("b1", (64,))
        w3 = g.input("w3", (1, 3, 64, blk))
        with pytest.raises(ValueError, match="w3 has ne"):  # 3 taps packed, not 5
            co.seanet_unit(g.ctx, h, w3, b3, w1, b1, wino=True)
        with pytest.raises(ValueError, match="dilation 1"):
            co.seanet_unit(g.ctx, h, g.input("w35", (1, 5, 64, blk)), b3, w1, b1, 2, wino=True)
    with pytest.raises(ValueError, match="2- or 3-tap weight"):
        co.pack_conv_weight_winograd(np.zeros((8, 8, 4), np.float32))


@needs_ops
def test_conv_rejects_what_the_kernel_cannot_take() -> None:
    blk = co.conv_block()
    with Graph() as g:
        x = g.input("x", (20, 96))
        w, b = g.input("w", (-(-96 // blk), 7, 96, blk)), g.input("b", (96,))
        with pytest.raises(ValueError, match="history"):
            co.conv1d_tm(g.ctx, x, w, b, 9)  # 20 rows < 6*9 + 1
        with pytest.raises(ValueError, match="channels"):
            co.conv1d_tm(g.ctx, g.input("x2", (20, 48)), w, b, 1)
        with pytest.raises(ValueError, match="pack_conv_weight"):
            co.conv1d_tm(g.ctx, x, w, g.input("b2", (48 + 2 * blk,)), 1)
        with pytest.raises(ValueError, match="pack_conv_weight"):
            co.conv1d_tm(g.ctx, x, g.input("w_torch_layout", (96, 96, 7)), b, 1)
        with pytest.raises(ValueError, match="dilation"):
            co.conv1d_tm(g.ctx, x, w, b, 0)
        with pytest.raises(ValueError, match="contiguous"):
            co.conv1d_tm(g.ctx, lib.ggml_transpose(g.ctx, g.input("x3", (96, 20))), w, b, 1)


@needs_ops
def test_pack_conv_weight() -> None:
    blk = co.conv_block()
    c_out = blk + 3
    w = np.arange(c_out * 5 * 4, dtype=np.float32).reshape(c_out, 5, 4)  # [O, I, K]
    p = co.pack_conv_weight(w)
    assert p.shape == (2, 4, 5, blk) and p.flags.c_contiguous and p.dtype == np.float32
    assert p[0, 3, 1, 2] == w[2, 1, 3]
    assert p[1, 2, 4, 1] == w[blk + 1, 4, 2]
    assert not p[1, :, :, 3:].any()  # zero past C_out


# ---------------------------------------------------------------------------------------------
# BF16 causal dilated conv1d, time-major (fast mode)



def run_conv_bf16(be: BackendSet, xp: np.ndarray[Any, Any], w_oik: np.ndarray[Any, Any],
                  b: np.ndarray[Any, Any], d: int, library: Any = None, wino: bool = False
                  ) -> np.ndarray[Any, Any]:
    """The direct BF16 conv, or with ``wino`` its Winograd twin, of xp (history in front)."""
    pack = co.pack_conv_weight_wino_bf16 if wino else co.pack_conv_weight_bf16
    conv = co.conv1d_wino_bf16 if wino else co.conv1d_tm_bf16
    wp = co.bf16_bits(pack(w_oik))
    g = Graph()
    tx, tb = g.input("x", xp.shape), g.input("b", b.shape)
    tw = g.input("w", wp.shape, ggml_type=BF16)
    g.output(conv(g.ctx, tx, tw, tb, d, library=library), "y")
    t = xp.shape[0] - (w_oik.shape[2] - 1) * d
    return be.execute(g, {"x": xp, "w": wp, "b": b})["y"].reshape(t, w_oik.shape[0])


def conv_ref_bf16(xp: np.ndarray[Any, Any], w_oik: np.ndarray[Any, Any],
                  b: np.ndarray[Any, Any], d: int) -> np.ndarray[Any, Any]:
    """float64 conv of the BF16-rounded input and weights: all the op may add is F32 sums."""
    return conv_ref(co.round_bf16(xp), co.round_bf16(w_oik), b, d)


BF16_CASES = [  # (C_in, C_out, T, K, d)
    (96, 96, 1, 7, 1),
    (96, 96, 5000, 7, 1),
    (96, 96, 5000, 7, 3),
    (96, 96, 5000, 7, 9),
    (96, 96, 5000, 1, 1),
    (192, 192, 1, 7, 3),
    (192, 192, 5000, 7, 9),
    (192, 192, 5000, 1, 1),
    (384, 384, 1, 7, 9),
    (384, 384, 700, 7, 1),
    (384, 384, 999, 1, 1),
    (768, 768, 1, 7, 1),
    (768, 768, 40, 7, 3),
    (768, 768, 77, 1, 1),
    (95, 100, 333, 7, 3),  # odd C_in (a zero pad channel), C_out = 3 blocks + 4
    (95, 40, 1, 7, 9),  # C_out = 32 + 8: a half-width (<= 16) last block
    (96, 1, 500, 7, 1),  # decoder.6: 96 -> 1
    (1, 3, 20, 3, 2),  # one input channel (half a pair)
    (1536, 768, 9, 7, 1),  # several input-pair chunks
]


@needs_ops
@pytest.mark.parametrize("c_in,c_out,t,k,d", BF16_CASES)
def test_conv_bf16_matches_float64(cpu2: BackendSet, c_in: int, c_out: int, t: int, k: int,
                                   d: int) -> None:
    rng = np.random.default_rng(c_in + 7 * c_out + 13 * t + d + 3 * k)
    xp, w, b = conv_data(rng, c_in, c_out, t, k, d)
    y = run_conv_bf16(cpu2, xp, w, b, d)
    check_conv(y, conv_ref_bf16(xp, w, b, d))


# Typical max|d|/max|y| of BF16 against the F32 op on these data: 1.5e-3 .. 3e-3 (the rounding
# of the input and the weights, ~2^-9 relative each, averaged over C_in * K products).
@needs_ops
@pytest.mark.parametrize("c,t,k,d", [(96, 5000, 7, 9), (192, 1, 7, 1), (384, 300, 7, 3),
                                     (768, 40, 1, 1), (95, 200, 7, 1)])
def test_conv_bf16_close_to_f32_op(cpu2: BackendSet, c: int, t: int, k: int, d: int) -> None:
    rng = np.random.default_rng(31 + c + t)
    xp, w, b = conv_data(rng, c, c, t, k, d)
    ref = run_conv(cpu2, xp, w, b, d)
    rel = np.abs(run_conv_bf16(cpu2, xp, w, b, d) - ref).max() / np.abs(ref).max()
    assert 1e-5 < rel <= 1e-2, f"max|d|/max|y| = {rel:.3g}"


@needs_ops
@pytest.mark.parametrize("c_in,c_out,t,k,d", [(96, 96, 5000, 7, 3), (768, 768, 5, 7, 1),
                                              (384, 384, 1, 7, 9), (95, 100, 777, 1, 1),
                                              (1536, 40, 30, 7, 1), (96, 96, 300, 7, 9)])
def test_conv_bf16_threads_identical(cpu1: BackendSet, cpu2: BackendSet, c_in: int, c_out: int,
                                     t: int, k: int, d: int) -> None:
    rng = np.random.default_rng(17)
    xp, w, b = conv_data(rng, c_in, c_out, t, k, d)
    assert np.array_equal(run_conv_bf16(cpu1, xp, w, b, d), run_conv_bf16(cpu2, xp, w, b, d))


@needs_ops
def test_conv_bf16_on_a_strided_view(cpu2: BackendSet) -> None:
    rng = np.random.default_rng(18)
    c, t, d = 96, 200, 3
    wide = rng.standard_normal((t + 6 * d, 2 * c)).astype(np.float32)
    _, w, b = conv_data(rng, c, c, t, 7, d)
    wp = co.bf16_bits(co.pack_conv_weight_bf16(w))
    g = Graph()
    tx, tb = g.input("x", wide.shape), g.input("b", b.shape)
    tw = g.input("w", wp.shape, ggml_type=BF16)
    view = lib.ggml_view_2d(g.ctx, tx, c, t + 6 * d, tx.nb[1], 4 * c)  # the right half
    g.output(co.conv1d_tm_bf16(g.ctx, view, tw, tb, d), "y")
    y = cpu2.execute(g, {"x": wide, "w": wp, "b": b})["y"]
    check_conv(y, conv_ref_bf16(wide[:, c:], w, b, d))


@needs_ops
def test_conv_bf16_weight_through_the_weight_store(cpu2: BackendSet) -> None:
    """The decoder's path: ``add_array(name, packed, GGML_TYPE_BF16)`` stores the packed values
    losslessly (they are BF16 already), giving the same result as the raw bits."""
    rng = np.random.default_rng(19)
    c, t, d = 192, 100, 9
    xp, w, b = conv_data(rng, c, c, t, 7, d)
    store = cpu2.weight_store()
    tw = store.add_array("w", co.pack_conv_weight_bf16(w), lib.GGML_TYPE_BF16)
    tb = store.add_array("b", b)
    store.allocate()
    try:
        g = Graph()
        tx = g.input("x", xp.shape)
        g.output(co.conv1d_tm_bf16(g.ctx, tx, tw, tb, d), "y")
        y = cpu2.execute(g, {"x": xp})["y"]
    finally:
        store.close()
    assert np.array_equal(y, run_conv_bf16(cpu2, xp, w, b, d))


@needs_ops
def test_conv_bf16_rejects_what_the_kernel_cannot_take() -> None:
    with Graph() as g:
        x = g.input("x", (20, 96))
        w, b = g.input("w", (3, 7, 48, 64), ggml_type=BF16), g.input("b", (96,))
        with pytest.raises(ValueError, match="history"):
            co.conv1d_tm_bf16(g.ctx, x, w, b, 9)  # 20 rows < 6*9 + 1
        with pytest.raises(ValueError, match="channels"):
            co.conv1d_tm_bf16(g.ctx, g.input("x2", (20, 48)), w, b, 1)
        with pytest.raises(ValueError, match="channels"):
            co.conv1d_tm_bf16(g.ctx, g.input("x2b", (20, 98)), w, b, 1)
        with pytest.raises(ValueError, match="pack_conv_weight_bf16"):
            co.conv1d_tm_bf16(g.ctx, x, w, g.input("b2", (97,)), 1)
        with pytest.raises(ValueError, match="pack_conv_weight_bf16"):
            co.conv1d_tm_bf16(g.ctx, x, g.input("w_torch", (96, 96, 7), ggml_type=BF16), b, 1)
        with pytest.raises(TypeError, match="BF16"):  # the F32 op's packing
            co.conv1d_tm_bf16(g.ctx, x, g.input("w32", (3, 7, 48, 64)), b, 1)
        with pytest.raises(TypeError, match="F32"):
            co.conv1d_tm_bf16(g.ctx, g.input("xb", (20, 96), ggml_type=BF16), w, b, 1)
        with pytest.raises(ValueError, match="dilation"):
            co.conv1d_tm_bf16(g.ctx, x, w, b, 0)
        with pytest.raises(ValueError, match="contiguous"):
            co.conv1d_tm_bf16(g.ctx, lib.ggml_transpose(g.ctx, g.input("x3", (96, 20))), w, b,
                              1)
        with pytest.raises(ValueError, match="2-D"):
            co.conv1d_tm_bf16(g.ctx, g.input("x4", (2, 20, 96)), w, b, 1)
        # split: 2K taps (hi then lo); 7 cannot be
        with pytest.raises(ValueError, match="pack_conv_weight_bf16_split"):
            co.conv1d_tm_bf16(g.ctx, x, w, b, 1, split=True)
        w6 = g.input("w6", (3, 6, 48, 64), ggml_type=BF16)
        co.conv1d_tm_bf16(g.ctx, x, w6, b, 3, split=True)  # K = 3: fine
        with pytest.raises(ValueError, match="history"):
            co.conv1d_tm_bf16(g.ctx, x, w6, b, 10, split=True)  # 20 rows < 2*10 + 1


def test_pack_conv_weight_bf16() -> None:
    blk = co.CONV_BF16_BLOCK
    c_out, c_in, k = blk + 3, 5, 4
    w = np.random.default_rng(0).standard_normal((c_out, c_in, k)).astype(np.float32)
    p = co.pack_conv_weight_bf16(w)
    assert p.shape == (2, k, 3, 2 * blk) and p.flags.c_contiguous and p.dtype == np.float32
    want = np.zeros((2, k, 3, blk, 2), np.float32)
    for o in range(c_out):
        for c in range(c_in):
            for j in range(k):
                want[o // blk, j, c // 2, o % blk, c % 2] = co.round_bf16(w[o, c, j])
    assert np.array_equal(p, want.reshape(p.shape))  # zero past C_out and past C_in
    assert p[1, 2, 0, 2 * 1 + 1] == co.round_bf16(w[blk + 1, 1, 2])
    assert np.array_equal(p, co.round_bf16(p))  # BF16 values


def test_round_bf16() -> None:
    bits = np.array([0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0xBF80FFFF, 0x7F7FFFFF,
                     0x00400000, 0x80000001, 0x7F800000, 0xFF800000, 0x7F800001, 0x00800000],
                    np.uint32)
    want = np.array([0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xBF81, 0x7F80,
                     0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x0080], np.uint16)
    # 1.0; ties to even down and up; above a tie; carry; overflow to inf; subnormals to signed
    # zero; infinities; NaN quieted; the smallest normal kept
    assert np.array_equal(co.bf16_bits(bits.view(np.float32)), want)
    r = co.round_bf16(bits.view(np.float32)).view(np.uint32)
    assert np.array_equal(r >> 16, want.astype(np.uint32)) and not (r & 0xFFFF).any()


@needs_ops
def test_bf16_available() -> None:
    assert ops is not None
    assert co.bf16_available() == (int(ops.qtts_conv1d_tm_bf16_fast()) == 1)
    if co.simd_isa() == "avx512" and "avx512_bf16" in _cpu_flags():
        assert co.bf16_available()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# ---------------------------------------------------------------------------------------------
# Both convs with the history in a tensor of its own (``hist=``): no concat in front


def _conv_op_inputs(g: Graph, op: str, w_oik: np.ndarray[Any, Any], library: Any = None
                    ) -> tuple[Any, Any, dict[str, np.ndarray[Any, Any]]]:
    """The packed weight (as the op wants it) and the bias as graph inputs, with their data."""
    b = np.random.default_rng(w_oik.shape[0]).standard_normal(w_oik.shape[0]).astype(np.float32)
    if op in ("bf16", "wino", "split"):
        pack = {"bf16": co.pack_conv_weight_bf16, "wino": co.pack_conv_weight_wino_bf16,
                "split": co.pack_conv_weight_bf16_split}[op]
        wp = co.bf16_bits(pack(w_oik))
        tw = g.input("w", wp.shape, ggml_type=BF16)
    elif op == "wino_f32":
        wp = co.pack_conv_weight_wino_f32(w_oik)
        tw = g.input("w", wp.shape)
    else:
        wp = co.pack_conv_weight(w_oik, library=library)
        tw = g.input("w", wp.shape)
    return tw, g.input("b", b.shape), {"w": wp, "b": b}


def _conv_op(op: str) -> Any:
    return {"bf16": co.conv1d_tm_bf16, "wino": co.conv1d_wino_bf16, "f32": co.conv1d_tm,
            "wino_f32": co.conv1d_wino_f32,
            "split": functools.partial(co.conv1d_tm_bf16, split=True)}[op]


def run_conv_two_ways(bes: list[BackendSet], op: str, hist: np.ndarray[Any, Any],
                      x: np.ndarray[Any, Any], w_oik: np.ndarray[Any, Any], d: int,
                      library: Any = None) -> list[np.ndarray[Any, Any]]:
    """One graph with the conv on ggml_concat(hist, x) (the decoder's way until now) and the
    conv on (x, hist=hist), run on each backend: [concat, two-source] per backend."""
    fn = _conv_op(op)
    g = Graph()
    tw, tb, data = _conv_op_inputs(g, op, w_oik, library)
    tx = g.input("x", x.shape)
    if hist.shape[0]:
        th = g.input("h", hist.shape)
        xp = lib.ggml_concat(g.ctx, th, tx, 1)
        data["h"] = hist
    else:  # K = 1: no history; a 0-row hist is accepted and dropped
        th = new_tensor(g.ctx, lib.GGML_TYPE_F32, (0, x.shape[1]))
        xp = tx
    g.output(fn(g.ctx, xp, tw, tb, d, library=library), "concat")
    g.output(fn(g.ctx, tx, tw, tb, d, hist=th, library=library), "two")
    data["x"] = x
    shape = (x.shape[0], w_oik.shape[0])
    outs = []
    for be in bes:
        r = be.execute(g, data)
        outs += [r["concat"].reshape(shape), r["two"].reshape(shape)]
    g.close()
    return outs


@needs_ops
@pytest.mark.parametrize("op", ["f32", "bf16", "split"])
@pytest.mark.parametrize("t", [1, 2, 17, 5000])
@pytest.mark.parametrize("c", [96, 95, 384])
@pytest.mark.parametrize("k,d", [(1, 1), (3, 1), (3, 3), (3, 9), (7, 1), (7, 3), (7, 9)])
def test_conv_hist_apart_equals_concat(cpu1: BackendSet, cpu2: BackendSet, op: str, t: int,
                                       c: int, k: int, d: int) -> None:
    """Bit for bit the conv of the concatenation, with 1 and 2 threads, T below and above the
    history length (K = 1 takes no d: one case)."""
    rng = np.random.default_rng(1000 * k + 100 * d + c + t)
    p = (k - 1) * d
    hist = rng.standard_normal((p, c)).astype(np.float32)
    x = rng.standard_normal((t, c)).astype(np.float32)
    w = (rng.standard_normal((c, c, k)) / np.sqrt(c * k)).astype(np.float32)
    cat1, two1, cat2, two2 = run_conv_two_ways([cpu1, cpu2], op, hist, x, w, d)
    assert np.array_equal(two2, cat2)
    assert np.array_equal(two1, cat1)
    assert np.array_equal(two1, two2)
    if t <= 17:  # and the concat path is right (the other tests cover it at length)
        xp = np.concatenate([hist, x])
        b = np.random.default_rng(c).standard_normal(c).astype(np.float32)
        ref = conv_ref_bf16(xp, w, b, d) if op == "bf16" else conv_ref(xp, w, b, d)
        check_conv(two2, ref)


@needs_ops
@pytest.mark.parametrize("t", [1, 2, 17, 5000])
@pytest.mark.parametrize("c", [96, 95, 384])
@pytest.mark.parametrize("k,d", [(7, 1), (7, 3), (7, 9), (2, 1), (2, 3)])
def test_conv_wino_hist_apart_equals_concat(cpu1: BackendSet, cpu2: BackendSet, t: int, c: int,
                                            k: int, d: int) -> None:
    rng = np.random.default_rng(300 * d + c + t + k)
    hist = rng.standard_normal(((k - 1) * d, c)).astype(np.float32)
    x = rng.standard_normal((t, c)).astype(np.float32)
    w = (rng.standard_normal((c, c, k)) / np.sqrt(c * k)).astype(np.float32)
    cat1, two1, cat2, two2 = run_conv_two_ways([cpu1, cpu2], "wino", hist, x, w, d)
    assert np.array_equal(two2, cat2) and np.array_equal(two1, cat1)
    assert np.array_equal(two1, two2)


@needs_ops
@pytest.mark.parametrize("op", ["f32", "bf16", "wino", "split"])
@pytest.mark.parametrize("t", [3, 300])
def test_conv_hist_apart_on_strided_views(cpu1: BackendSet, cpu2: BackendSet, op: str,
                                          t: int) -> None:
    """x and hist may each be a row view of a wider buffer, at an offset."""
    rng = np.random.default_rng(40 + t)
    c, k, d = 96, 7, 3
    p = (k - 1) * d
    wide_h = rng.standard_normal((p + 2, 3 * c)).astype(np.float32)
    wide_x = rng.standard_normal((t + 1, 2 * c + 5)).astype(np.float32)
    w = (rng.standard_normal((c, c, k)) / np.sqrt(c * k)).astype(np.float32)
    fn = _conv_op(op)
    g = Graph()
    tw, tb, data = _conv_op_inputs(g, op, w)
    th, tx = g.input("h", wide_h.shape), g.input("x", wide_x.shape)
    vh = lib.ggml_view_2d(g.ctx, th, c, p, th.nb[1], 2 * th.nb[1] + 4 * c)  # rows 2.., mid
    vx = lib.ggml_view_2d(g.ctx, tx, c, t, tx.nb[1], tx.nb[1] + 4 * (c + 5))  # rows 1.., right
    g.output(fn(g.ctx, vx, tw, tb, d, hist=vh), "y")
    data.update(h=wide_h, x=wide_x)
    y1, y2 = (be.execute(g, data)["y"].reshape(t, c) for be in (cpu1, cpu2))
    g.close()
    h, x = wide_h[2:, c:2 * c], wide_x[1:, c + 5:]
    cat = run_conv_two_ways([cpu2], op, np.ascontiguousarray(h), np.ascontiguousarray(x), w, d)
    assert np.array_equal(y2, cat[0]) and np.array_equal(y1, y2)



@needs_ops
def test_a_graph_after_another_of_the_same_counts() -> None:
    """ggml's allocator reuses the previous graph's placement when the node and leaf counts
    match and every node fits, without checking the leaves: the strided-view graph after a
    bigger concat graph got its inputs overlapping other tensors (garbage that depended on
    the test order). BackendSet reserves every graph it runs (engine/backend.py)."""
    cpu1 = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "1"})
    cpu2 = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2"})
    rng = np.random.default_rng(0)
    c, k, d = 384, 7, 9
    p = (k - 1) * d
    w = (rng.standard_normal((c, c, k)) / np.sqrt(c * k)).astype(np.float32)
    hist = rng.standard_normal((p, c)).astype(np.float32)
    run_conv_two_ways([cpu1, cpu2], "f32", hist, rng.standard_normal((1, c)).astype(np.float32),
                      w, d)
    for op in ("f32", "bf16", "wino"):
        test_conv_hist_apart_on_strided_views(cpu1, cpu2, op, 3)

@needs_ops
@pytest.mark.parametrize("op", ["f32", "bf16"])
def test_conv_hist_rejects_what_the_kernel_cannot_take(op: str) -> None:
    fn = _conv_op(op)
    c, k, d = 96, 7, 3
    w_oik = np.zeros((c, c, k), np.float32)
    with Graph() as g:
        tw, tb, _ = _conv_op_inputs(g, op, w_oik)
        x, h = g.input("x", (20, c)), g.input("h", ((k - 1) * d, c))
        fn(g.ctx, x, tw, tb, d, hist=h)  # fine
        with pytest.raises(ValueError, match="hist has 17 rows"):
            fn(g.ctx, x, tw, tb, d, hist=g.input("h_short", (17, c)))
        with pytest.raises(ValueError, match="hist has 18 rows"):
            fn(g.ctx, x, tw, tb, 1, hist=h)  # the history of d = 3, not of d = 1
        with pytest.raises(ValueError, match="hist has 48 channels"):
            fn(g.ctx, x, tw, tb, d, hist=g.input("h_narrow", (18, 48)))
        with pytest.raises(ValueError, match="x has 48 channels"):
            fn(g.ctx, g.input("x_narrow", (20, 48)), tw, tb, d, hist=h)
        with pytest.raises(TypeError, match="hist must be F32"):
            fn(g.ctx, x, tw, tb, d, hist=g.input("h16", (18, c), np.float16))
        with pytest.raises(ValueError, match="hist must be 2-D"):
            fn(g.ctx, x, tw, tb, d, hist=g.input("h3", (2, 18, c)))
        with pytest.raises(ValueError, match="hist rows must be contiguous"):
            fn(g.ctx, x, tw, tb, d,
               hist=lib.ggml_transpose(g.ctx, g.input("h_t", (c, 18))))
        with pytest.raises(ValueError, match="x must be 2-D"):
            fn(g.ctx, g.input("x3", (2, 20, c)), tw, tb, d, hist=h)
        with pytest.raises(ValueError, match="x has no rows"):
            fn(g.ctx, new_tensor(g.ctx, lib.GGML_TYPE_F32, (0, c)), tw, tb, d, hist=h)
        tw1, tb1, _ = _conv_op_inputs(g, op, np.zeros((c, c, 1), np.float32))
        with pytest.raises(ValueError, match="K = 1 has no history"):
            fn(g.ctx, x, tw1, tb1, 1, hist=g.input("h1", (1, c)))


# ---------------------------------------------------------------------------------------------
# ELU


def elu_input() -> np.ndarray[Any, Any]:
    """Every scale from 1e-7 to 30 on both sides, the -1 saturation edge and the specials."""
    rng = np.random.default_rng(5)
    parts = [rng.standard_normal(4001) * s for s in (1e-7, 1e-3, 0.1, 0.35, 1, 3, 10, 30)]
    edge = [0.0, -0.0, 1e-40, -1e-40, -16.4, -16.5, -16.6, -17.3, -17.33, -17.4, -88.0,
            -1e30, 1e30, np.inf, -np.inf, np.nan]  # fmt: skip
    return np.concatenate([*parts, edge]).astype(np.float32)


def run_elu(be: BackendSet, x: np.ndarray[Any, Any], library: Any = None) -> np.ndarray[Any, Any]:
    g = Graph()
    tx = g.input("x", x.shape)
    g.output(co.elu(g.ctx, tx, library=library), "y")
    return be.execute(g, {"x": x})["y"].reshape(x.shape)


def check_elu(y: np.ndarray[Any, Any], x: np.ndarray[Any, Any]) -> None:
    """Within 1 ulp of float64 expm1 (positive values exact); NaN stays NaN."""
    ref = np.where(x > 0, x.astype(np.float64), np.expm1(x.astype(np.float64)))
    assert y.dtype == np.float32
    assert np.array_equal(np.isnan(y), np.isnan(x))
    ok = ~np.isnan(x)
    assert np.array_equal(y[ok & (x > 0)], x[ok & (x > 0)])
    assert np.array_equal(y[np.isinf(x)], np.where(x[np.isinf(x)] > 0, np.inf, -1.0))
    ok &= np.isfinite(x)
    ulp = np.spacing(np.abs(ref[ok]).astype(np.float32)).astype(np.float64)
    err = np.abs(y[ok].astype(np.float64) - ref[ok])
    assert np.all(err <= ulp), f"max error {np.max(err / ulp):.2f} ulp"


def check_elementwise(cpu1: BackendSet, cpu2: BackendSet, x: np.ndarray[Any, Any],
                      run: Any, check: Any) -> None:
    """An element-wise op: ``check(y, x)`` on 2 threads, the same bits on 1, and the masked
    tails of short inputs."""
    y = run(cpu2, x)
    check(y, x)
    assert np.array_equal(y, run(cpu1, x), equal_nan=True)
    for n in (1, 15, 17, 33):
        check(run(cpu2, x[-n:]), x[-n:])


@needs_ops
def test_elu_matches_float64(cpu1: BackendSet, cpu2: BackendSet) -> None:
    check_elementwise(cpu1, cpu2, elu_input(), run_elu, check_elu)


@needs_ops
@pytest.mark.parametrize("op", [co.elu, co.gelu_erf])
def test_elementwise_ops_reject_what_the_kernel_cannot_take(op: Any) -> None:
    g = Graph()
    x = g.input("x", (4, 6))
    with pytest.raises(ValueError, match="contiguous"):
        op(g.ctx, lib.ggml_transpose(g.ctx, x))
    with pytest.raises(TypeError, match="F32"):
        op(g.ctx, g.input("i", (4,), dtype=np.int32))


# ---------------------------------------------------------------------------------------------
# GELU (exact erf)


def gelu_input() -> np.ndarray[Any, Any]:
    """Every scale from 1e-6 to 8 on both sides, a fine sweep of -16..16 and the specials."""
    rng = np.random.default_rng(6)
    parts = [rng.standard_normal(20001) * s for s in (1e-6, 0.01, 0.3, 1, 2, 4, 8)]
    edge = [0.0, -0.0, 1e-40, -1e-40, 0.7071, -0.7071, -14.1, -14.2, -30.0, 1e30, -1e30,
            np.inf, -np.inf, np.nan]  # fmt: skip
    return np.concatenate([*parts, np.linspace(-16, 16, 64001), edge]).astype(np.float32)


def run_gelu(be: BackendSet, x: np.ndarray[Any, Any], library: Any = None, native: bool = True
             ) -> np.ndarray[Any, Any]:  # fmt: skip
    g = Graph()
    tx = g.input("x", x.shape)
    g.output(co.gelu_erf(g.ctx, tx, library=library) if native else lib.ggml_gelu_erf(g.ctx, tx),
             "y")
    return be.execute(g, {"x": x})["y"].reshape(x.shape)


def gelu_errors(y: np.ndarray[Any, Any], x: np.ndarray[Any, Any]
                ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:  # fmt: skip
    """Finite x: (x, error in ulp of the float64 GELU); NaN and infinities checked here."""
    assert y.dtype == np.float32
    assert np.array_equal(np.isnan(y), np.isnan(x) | (x == -np.inf))  # -inf * 0, as ggml
    assert np.all(y[x == np.inf] == np.inf)
    ok = np.isfinite(x)
    xd = x[ok].astype(np.float64)
    ref = np.array([0.5 * v * math.erfc(-v / math.sqrt(2)) for v in xd])
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    # below the normal range (x < -13) in units of the smallest normal: AVX2 flushes there
    ulp = np.maximum(ulp, float(np.finfo(np.float32).tiny))
    return xd, np.abs(y[ok].astype(np.float64) - ref) / ulp


def check_gelu(y: np.ndarray[Any, Any], x: np.ndarray[Any, Any]) -> None:
    """The vector paths: within 6 ulp of float64 from x = -5 up, 11 below."""
    xd, err = gelu_errors(y, x)
    assert err[xd >= -5].max(initial=0.0) <= 6.0, f"{err[xd >= -5].max():.2f} ulp"
    assert err.max(initial=0.0) <= 11.0, f"{err.max():.2f} ulp"


@needs_ops
def test_gelu_erf_matches_float64(cpu1: BackendSet, cpu2: BackendSet) -> None:
    x = gelu_input()
    check_elementwise(cpu1, cpu2, x, run_gelu, check_gelu)
    # ggml's (libm erff per element) loses every digit where 1 + erf cancels; ours does not
    xd, err = gelu_errors(run_gelu(cpu2, x, native=False), x)
    assert err[xd < -5].max() > 1e6


def test_gelu_erf_coefficients_are_the_fit() -> None:
    """native/ops/gelu.c's g is what native/fit_gelu.py fits: the same polynomial to well below
    its fit error (the least squares move the last printed digits with the BLAS's threads)."""
    spec = importlib.util.spec_from_file_location("qtts_fit_gelu", REPO / "native" / "fit_gelu.py")
    assert spec is not None and spec.loader is not None
    fit_gelu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit_gelu)
    coef, err = fit_gelu.fit()
    source = (REPO / "native" / "ops" / "gelu.c").read_text()
    in_c = [float(v) for v in re.findall(r"#define GELU_G\d+ (\S+)f", source)]
    assert len(in_c) == len(coef) and err < 5e-8
    u = np.linspace(-1.0, 1.0, 2001)
    gap = np.polynomial.polynomial.polyval(u, in_c) - np.polynomial.polynomial.polyval(u, coef)
    assert np.abs(gap).max() < 1e-9


# ---------------------------------------------------------------------------------------------
# Row argmax


def argmax_input() -> np.ndarray[Any, Any]:
    """Rows of 2048 (a codebook), 37 and 5 values: random, with ties, NaN, +-0, -inf."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((9, 2048)).astype(np.float32)
    x[1, [5, 700, 2047]] = 9.0  # ties: the first
    x[2, :] = np.nan
    x[2, 1000] = 1.0  # NaN never taken
    x[3, :] = -np.inf  # nothing exceeds -inf: 0
    x[4, :] = np.nan  # 0
    x[5, :] = 0.0
    x[5, 3] = -0.0
    x[6, 2047] = 50.0  # the last element, in the scalar tail of no row
    x[7, :17] = np.nan
    return x


def run_argmax(be: BackendSet, x: np.ndarray[Any, Any], library: Any = None
               ) -> np.ndarray[Any, Any]:  # fmt: skip
    g = Graph()
    tx = g.input("x", x.shape)
    g.output(co.argmax(g.ctx, tx, library=library), "i")
    return be.execute(g, {"x": x})["i"].reshape(x.shape[0])


def argmax_ref(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The first index of the largest non-NaN value; 0 where none exceeds -inf."""
    xm = np.where(np.isnan(x), -np.inf, x)
    return np.where(xm.max(axis=1) > -np.inf, xm.argmax(axis=1), 0)


@needs_ops
def test_argmax_first_of_the_largest(cpu1: BackendSet, cpu2: BackendSet) -> None:
    x = argmax_input()
    for n in (2048, 37, 5):
        xs = np.ascontiguousarray(x[:, -n:])
        got = run_argmax(cpu2, xs)
        assert np.array_equal(got, argmax_ref(xs))
        assert np.array_equal(got, run_argmax(cpu1, xs))
    assert list(run_argmax(cpu2, x)[1:7]) == [5, 1000, 0, 0, 0, 2047]
    # where values are distinct, ggml's ARGMAX (the graph without the native ops) agrees
    g = Graph()
    tx = g.input("x", x[8:].shape)
    g.output(lib.ggml_argmax(g.ctx, tx), "i")
    assert np.array_equal(cpu2.execute(g, {"x": x[8:]})["i"].reshape(-1), argmax_ref(x[8:]))


@needs_ops
def test_argmax_rejects_what_the_kernel_cannot_take() -> None:
    g = Graph()
    with pytest.raises(TypeError, match="F32"):
        co.argmax(g.ctx, g.input("i", (4, 3), dtype=np.int32))
    with pytest.raises(ValueError, match="2-D"):
        co.argmax(g.ctx, g.input("x3", (2, 4, 3)))


# ---------------------------------------------------------------------------------------------
# SEANet residual unit (the codec encoder's, fused)


def seanet_unit_data(rng: np.random.Generator, c: int, t: int, k: int
                     ) -> tuple[np.ndarray[Any, Any], ...]:
    """h ~ N(0, 2) and the two convs of a unit (C -> C/2, K taps; C/2 -> C, 1 tap)."""
    r = c // 2
    h = (rng.standard_normal((t, c)) * 2).astype(np.float32)
    w3 = (rng.standard_normal((r, c, k)) * 2 / np.sqrt(c * k)).astype(np.float32)
    w1 = (rng.standard_normal((c, r, 1)) / np.sqrt(r)).astype(np.float32)
    b3, b1 = (rng.standard_normal(n).astype(np.float32) for n in (r, c))
    return h, w3, b3, w1, b1


def run_seanet_unit(be: BackendSet, data: tuple[np.ndarray[Any, Any], ...], d: int,
                    elu_out: bool, fused: bool, library: Any = None, wino: bool = False
                    ) -> np.ndarray[Any, Any]:  # fmt: skip
    """The unit as one ``seanet_unit`` node, or as the separate ELU, conv and add nodes
    (``wino``: its first conv in Winograd groups)."""
    h, w3, b3, w1, b1 = data
    t, c = h.shape
    p = (w3.shape[2] - 1) * d
    g = Graph()
    th, tb3, tb1 = g.input("h", h.shape), g.input("b3", b3.shape), g.input("b1", b1.shape)
    p3 = (co.pack_conv_weight_winograd if wino else co.pack_conv_weight)(w3, library=library)
    p1 = co.pack_conv_weight(w1, library=library)
    tw3, tw1 = g.input("w3", p3.shape), g.input("w1", p1.shape)
    if fused:
        y = co.seanet_unit(g.ctx, th, tw3, tb3, tw1, tb1, d, elu_out=elu_out, wino=wino,
                           library=library)
    else:
        hist = g.input("zeros", (p, c))
        r = co.conv1d_tm(g.ctx, co.elu(g.ctx, th, library=library), tw3, tb3, d, hist=hist,
                         wino=wino, library=library)
        r = co.conv1d_tm(g.ctx, co.elu(g.ctx, r, library=library), tw1, tb1, library=library)
        y = lib.ggml_add(g.ctx, th, r)
        y = co.elu(g.ctx, y, library=library) if elu_out else y
    g.output(y, "y")
    feed = {"h": h, "w3": p3, "b3": b3, "w1": p1, "b1": b1}
    if not fused:
        feed["zeros"] = np.zeros((p, c), np.float32)
    return be.execute(g, feed)["y"].reshape(t, c)


def seanet_unit_ref(data: tuple[np.ndarray[Any, Any], ...], d: int, elu_out: bool
                    ) -> np.ndarray[Any, Any]:
    """float64."""
    h, w3, b3, w1, b1 = (a.astype(np.float64) for a in data)

    def elu(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return np.where(x > 0, x, np.expm1(np.minimum(x, 0)))

    p = (w3.shape[2] - 1) * d
    e = np.concatenate([np.zeros((p, h.shape[1])), elu(h)])
    r = conv_ref(e, w3, b3, d)
    s = h + conv_ref(elu(r), w1, b1, 1)
    return elu(s) if elu_out else s


SEANET_CASES = [  # (C, T, K, d, elu_out): one and two input-channel chunks, masked blocks,
    (64, 5000, 3, 1, True),  # fewer rows than the history, several slices per thread
    (128, 2001, 3, 1, False),
    (512, 300, 3, 1, True),
    (40, 37, 3, 2, False),
    (96, 2, 3, 2, True),
    (64, 1, 1, 1, True),
]


# with the first conv in Winograd F(2, 3) groups (K = 3, dilation 1): odd and even lengths,
# one row, slices and thread ranges that start at odd time steps
SEANET_WINO_CASES = [(c, t, 3, 1, e) for c, t, e in [(64, 5000, True), (128, 2001, False),
                                                      (512, 300, True), (40, 37, False),
                                                      (96, 2, True), (33, 1, True)]]


@needs_ops
@pytest.mark.parametrize(("c", "t", "k", "d", "elu_out", "wino"),
                         [(*case, False) for case in SEANET_CASES]
                         + [(*case, True) for case in SEANET_WINO_CASES])  # fmt: skip
def test_seanet_unit_equals_separate_nodes(cpu1: BackendSet, cpu2: BackendSet, c: int, t: int,
                                           k: int, d: int, elu_out: bool, wino: bool) -> None:
    data = seanet_unit_data(np.random.default_rng(c + t), c, t, k)
    y = run_seanet_unit(cpu2, data, d, elu_out, fused=True, wino=wino)
    assert np.array_equal(y, run_seanet_unit(cpu2, data, d, elu_out, fused=False, wino=wino))
    assert np.array_equal(y, run_seanet_unit(cpu1, data, d, elu_out, fused=True, wino=wino))
    ref = seanet_unit_ref(data, d, elu_out)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()


def run_seanet_stage(be: BackendSet, data: tuple[np.ndarray[Any, Any], ...],
                     strided: tuple[np.ndarray[Any, Any], ...], stride: int, d: int, fused: bool,
                     library: Any = None,
                     pre: tuple[np.ndarray[Any, Any], ...] | None = None, wino: bool = False,
                     unit_wino: bool = False) -> np.ndarray[Any, Any]:  # fmt: skip
    """A unit and the strided conv after it: one ``seanet_stage`` node, or ``seanet_unit``
    (``elu_out``) then ``conv1d_tm`` on the folded rows, with the zero rows in front and at
    the end as the graph builds them. ``pre``: (x [T, 1], w0, b0): h is that conv of x;
    ``wino``, ``unit_wino``: the strided conv, the unit's first conv in Winograd groups."""
    h, w3, b3, w1, b1 = data
    ws, bs = strided
    t, c = h.shape
    t_out = -(-t // stride)
    g = Graph()
    src = h if pre is None else pre[0]
    th, tb3, tb1, tbs = (g.input(n, a.shape) for n, a in (("h", src), ("b3", b3), ("b1", b1),
                                                          ("bs", bs)))
    p3 = (co.pack_conv_weight_winograd if unit_wino else co.pack_conv_weight)(w3, library=library)
    p1 = co.pack_conv_weight(w1, library=library)
    pack = co.pack_conv_weight_winograd if wino else co.pack_conv_weight
    ps = pack(fold_weight(ws, stride), library=library)
    tw3, tw1, tws = g.input("w3", p3.shape), g.input("w1", p1.shape), g.input("ws", ps.shape)
    feed = {"h": src, "w3": p3, "b3": b3, "w1": p1, "b1": b1, "ws": ps, "bs": bs}
    tpre = None
    if pre is not None:
        p0 = co.pack_conv_weight(pre[1], library=library)
        tpre = (g.input("w0", p0.shape), g.input("b0", pre[2].shape))
        feed["w0"], feed["b0"] = p0, pre[2]
    if fused:
        y = co.seanet_stage(g.ctx, th, tw3, tb3, tw1, tb1, tws, tbs, stride, d, wino=wino,
                            unit_wino=unit_wino, pre=tpre, library=library)
    else:
        if tpre is not None:
            k0 = pre[1].shape[2] if pre is not None else 1
            th = co.conv1d_tm(g.ctx, th, tpre[0], tpre[1], hist=g.input("z0", (k0 - 1, 1)),
                              library=library)
            feed["z0"] = np.zeros((k0 - 1, 1), np.float32)
        u = co.seanet_unit(g.ctx, th, tw3, tb3, tw1, tb1, d, elu_out=True, wino=unit_wino,
                           library=library)
        u = pad_zero(g.ctx, u, 0, t_out * stride - t)
        folded = lib.ggml_reshape_2d(g.ctx, u, stride * c, t_out)
        y = co.conv1d_tm(g.ctx, folded, tws, tbs, hist=g.input("zeros", (1, stride * c)),
                         wino=wino, library=library)
        feed["zeros"] = np.zeros((1, stride * c), np.float32)
    g.output(y, "y")
    return be.execute(g, feed)["y"].reshape(t_out, bs.shape[0])


SEANET_STAGE_CASES = [  # (C, T, d, stride, pre): a length not a multiple of the stride,
    (64, 4000, 1, 4, True),  # shorter than one, masked blocks, the
    (64, 4000, 1, 4, False),  # first conv inside; several slices a thread
    (32, 12000, 1, 2, True),
    (128, 1001, 1, 5, False),
    (40, 37, 2, 6, True),
    (32, 3, 1, 8, True),
    (256, 300, 1, 2, False),
]


def seanet_stage_data(c: int, t: int, stride: int, pre: bool
                      ) -> tuple[tuple[np.ndarray[Any, Any], ...], tuple[np.ndarray[Any, Any], ...],
                                 tuple[np.ndarray[Any, Any], ...] | None]:  # fmt: skip
    """A unit's data, the strided conv and (``pre``) a 7-tap conv of one channel making h."""
    rng = np.random.default_rng(c * t)
    data = seanet_unit_data(rng, c, t, 3)
    ws = (rng.standard_normal((2 * c, c, 2 * stride)) / np.sqrt(2 * c * stride)).astype(
        np.float32)
    strided = (ws, rng.standard_normal(2 * c).astype(np.float32))
    if not pre:
        return data, strided, None
    x = (rng.standard_normal((t, 1)) * 0.5).astype(np.float32)
    w0 = rng.standard_normal((c, 1, 7)).astype(np.float32)
    b0 = rng.standard_normal(c).astype(np.float32)
    xp = np.concatenate([np.zeros((6, 1), np.float32), x])
    h = conv_ref(xp, w0, b0, 1).astype(np.float32)  # for the float64 check only
    return (h, *data[1:]), strided, (x, w0, b0)


# (case, strided conv in Winograd groups, the unit's first conv too): the unit's only where
# its dilation is 1
SEANET_STAGE_WINO = [(case, wino, unit) for case in SEANET_STAGE_CASES
                     for wino, unit in itertools.product((False, True), repeat=2)
                     if case[2] == 1 or not unit]  # fmt: skip


@needs_ops
@pytest.mark.parametrize(("case", "wino", "unit_wino"), SEANET_STAGE_WINO)
def test_seanet_stage_equals_separate_nodes(cpu1: BackendSet, cpu2: BackendSet,
                                            case: tuple[int, int, int, int, bool], wino: bool,
                                            unit_wino: bool) -> None:  # fmt: skip
    c, t, d, stride, pre = case
    data, strided, pre_data = seanet_stage_data(c, t, stride, pre)
    kw = {"pre": pre_data, "wino": wino, "unit_wino": unit_wino}
    y = run_seanet_stage(cpu2, data, strided, stride, d, True, **kw)
    assert np.array_equal(y, run_seanet_stage(cpu2, data, strided, stride, d, False, **kw))
    assert np.array_equal(y, run_seanet_stage(cpu1, data, strided, stride, d, True, **kw))
    ws = strided[0]
    u = seanet_unit_ref(data, d, True)  # float64: zero rows, folded, conv
    u = np.concatenate([np.zeros((stride, c)), u, np.zeros((-t % stride, c))])
    ref = conv_ref(u.reshape(-1, stride * c), fold_weight(ws, stride).astype(np.float64),
                   strided[1], 1)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()


@needs_ops
def test_seanet_unit_rejects_what_the_kernel_cannot_take() -> None:
    blk = co.conv_block()
    g = Graph()
    h = g.input("h", (10, 64))
    w3, b3 = g.input("w3", (1, 3, 64, blk)), g.input("b3", (32,))
    w1, b1 = g.input("w1", (-(-64 // blk), 1, 32, blk)), g.input("b1", (64,))
    assert int(co.seanet_unit(g.ctx, h, w3, b3, w1, b1).ne[1]) == 10
    with pytest.raises(ValueError, match="contiguous 2-D"):
        co.seanet_unit(g.ctx, lib.ggml_transpose(g.ctx, h), w3, b3, w1, b1)
    with pytest.raises(ValueError, match="w3 has ne"):
        co.seanet_unit(g.ctx, h, g.input("w3b", (1, 3, 48, blk)), b3, w1, b1)
    with pytest.raises(ValueError, match="w1 has ne"):
        co.seanet_unit(g.ctx, h, w3, b3, g.input("w1b", (1, 2, 32, blk)), b1)
    with pytest.raises(ValueError, match="h has 64 channels, expected 63"):
        co.seanet_unit(g.ctx, h, w3, b3, w1, g.input("b1b", (63,)))
    with pytest.raises(ValueError, match="dilation"):
        co.seanet_unit(g.ctx, h, w3, b3, w1, b1, 0)
    ws, bs = g.input("ws", (-(-128 // blk), 2, 256, blk)), g.input("bs", (128,))
    assert int(co.seanet_stage(g.ctx, h, w3, b3, w1, b1, ws, bs, 4).ne[1]) == 3
    with pytest.raises(ValueError, match="ws has ne"):
        co.seanet_stage(g.ctx, h, w3, b3, w1, b1, ws, bs, 2)
    with pytest.raises(ValueError, match="ws has ne"):  # two taps packed, not four
        co.seanet_stage(g.ctx, h, w3, b3, w1, b1, ws, bs, 4, wino=True)
    with pytest.raises(ValueError, match="stride"):
        co.seanet_stage(g.ctx, h, w3, b3, w1, b1, ws, bs, 0)
    with pytest.raises(ValueError, match="h has 64 channels, expected 1"):
        co.seanet_stage(g.ctx, h, w3, b3, w1, b1, ws, bs, 4, pre=(g.input("w0", (2, 7, 1, blk)),
                                                                  b1))
    x = g.input("x", (10, 1))
    with pytest.raises(ValueError, match="pre weight has ne"):
        co.seanet_stage(g.ctx, x, w3, b3, w1, b1, ws, bs, 4, pre=(g.input("w0b", (1, 7, 1, blk)),
                                                                  b1))
    with pytest.raises(TypeError, match="bs"):
        co.seanet_stage(g.ctx, h, w3, b3, w1, b1, ws, g.input("bs2", (128,), dtype=np.int32), 4)


# ---------------------------------------------------------------------------------------------
# The other ISA paths (AVX2 and scalar), compiled here from the same sources


def _build_variant(tmp: Path, name: str) -> Any:
    """libqtts_ops with the one ISA variant ``name``, built as native/build.py builds it."""
    spec = importlib.util.spec_from_file_location("qtts_native_build",
                                                  REPO / "native" / "build.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    out = tmp / f"libqtts_ops_{name}.so"
    build.compile_ops(Path(native_info()["prefix"]), [(name, dict(build.X86_OPS_VARIANTS)[name])],
                      out)
    return ffi.dlopen(str(out))


VARIANTS = {"avx2": "avx2", "scalar": "scalar"}  # variant -> its SIMD path


@needs_ops
@pytest.mark.skipif(shutil.which("cc") is None or platform.machine() != "x86_64",
                    reason="needs cc on x86-64")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_other_isa_paths(cpu1: BackendSet, cpu2: BackendSet, tmp_path: Path,
                         variant: str) -> None:
    isa = VARIANTS[variant]
    library = _build_variant(tmp_path, variant)
    assert co.variant(library) == variant and co.variants(library) == [variant]
    assert co.simd_isa(library) == isa
    assert co.conv_block(library) == {"avx2": 16, "scalar": 64}[isa]
    x = elu_input()
    check_elu(run_elu(cpu2, x, library), x)
    for d, h, hkv, t, scale in ATTN_FULL_CASES:
        q, k, v = _attn_full_data(d, h, hkv, t, scale)
        want, mag = _window_reference(q, k, v, 0, t)
        got = _attn_full(cpu2, q, k, v, library)
        assert np.all(np.abs(got - want) <= 1e-6 * mag + 1e-30), np.abs(got - want).max()
        assert np.array_equal(got, _attn_full(cpu1, q, k, v, library))
    x = gelu_input()
    if isa == "avx2":
        check_gelu(run_gelu(cpu2, x, library), x)
    else:  # erff per element, as ggml: its digits where 1 + erf does not cancel
        xd, err = gelu_errors(run_gelu(cpu2, x, library), x)
        assert err[xd >= -1].max() <= 3.0
    x = argmax_input()
    assert np.array_equal(run_argmax(cpu2, x, library), argmax_ref(x))
    for (c, t, k, d, elu_out), wino in ([(case, False) for case in SEANET_CASES]
                                        + [(case, True) for case in SEANET_WINO_CASES]):
        data = seanet_unit_data(np.random.default_rng(c), c, t, k)
        y = run_seanet_unit(cpu2, data, d, elu_out, True, library, wino)
        assert np.array_equal(y, run_seanet_unit(cpu2, data, d, elu_out, False, library, wino))
        assert np.array_equal(y, run_seanet_unit(cpu1, data, d, elu_out, True, library, wino))
    for (c, t, d, stride, pre), wino, unit_wino in SEANET_STAGE_WINO:
        data, strided, pre_data = seanet_stage_data(c, t, stride, pre)
        y = run_seanet_stage(cpu2, data, strided, stride, d, True, library, pre_data, wino,
                             unit_wino)  # fmt: skip
        for be, fused in ((cpu2, False), (cpu1, True)):
            z = run_seanet_stage(be, data, strided, stride, d, fused, library, pre_data, wino,
                                 unit_wino)  # fmt: skip
            assert np.array_equal(y, z)
    for (c_in, c_out, t), k in itertools.product(WINOGRAD_CASES, (2, 3)):
        xp, w, b = conv_data(np.random.default_rng(c_in + t), c_in, c_out, t, k, 1)
        y = run_conv_winograd(cpu2, xp, w, b, library)
        assert np.array_equal(y, run_conv_winograd(cpu1, xp, w, b, library))
        check_conv(y, conv_ref(xp, w, b, 1))
    rng = np.random.default_rng(21)
    for c, t in [(96, 300), (100, 3)]:
        ea, ib = snake_params(rng, c)
        x = snake_input(rng, t, c)
        y = run_snake(cpu2, x, ea, ib, library)
        check_snake(y, x, ea, ib)
        assert np.array_equal(y, run_snake(cpu1, x, ea, ib, library))
    for c_in, c_out, t, k, d in [(96, 96, 301, 7, 3), (40, 100, 17, 3, 2), (96, 1, 50, 7, 1),
                                 (384, 384, 20, 1, 1)]:
        xp, w, b = conv_data(rng, c_in, c_out, t, k, d)
        y = run_conv(cpu2, xp, w, b, d, library)
        check_conv(y, conv_ref(xp, w, b, d))
        assert np.array_equal(y, run_conv(cpu1, xp, w, b, d, library))
    assert not co.bf16_available(library)  # the portable BF16 conv: correct, not fast
    for c_in, c_out, t, k, d in [(96, 96, 301, 7, 3), (95, 40, 17, 3, 2), (96, 1, 50, 7, 1),
                                 (384, 384, 20, 1, 1)]:
        xp, w, b = conv_data(rng, c_in, c_out, t, k, d)
        y = run_conv_bf16(cpu2, xp, w, b, d, library)
        check_conv(y, conv_ref_bf16(xp, w, b, d))
        assert np.array_equal(y, run_conv_bf16(cpu1, xp, w, b, d, library))
        if co.bf16_available():
            # the same sums as VDPBF16PS (odd product, then even; F32 RNE) without subnormals
            # (the AVX512 kernel: AMX tiles sum in another order)
            amx = co.amx()
            co.set_amx(False)
            try:
                assert np.array_equal(y, run_conv_bf16(cpu2, xp, w, b, d))
            finally:
                co.set_amx(amx)
    for c_in, c_out, t, k, d in [(96, 96, 301, 7, 3), (95, 40, 17, 7, 2), (96, 1, 50, 7, 1),
                                 (95, 100, 33, 2, 1)]:
        xp, w, b = conv_data(rng, c_in, c_out, t, k, d)
        y = run_conv_wino(cpu2, xp, w, b, d, library)
        assert snr_db(y, conv_ref(xp, w, b, d)) >= 50.0
        assert np.array_equal(y, run_conv_wino(cpu1, xp, w, b, d, library))
        if co.bf16_available():  # the same sums as the VDPBF16PS kernel
            assert np.array_equal(y, run_conv_wino(cpu2, xp, w, b, d))
    # the F32 Winograd conv: AVX2/FMA, portable C below; the same bits as the native build's
    # where both run the AVX2 path
    assert co.wino_f32_available(library) == (isa == "avx2")
    for c_in, c_out, t, k, d in [(96, 96, 301, 7, 3), (95, 40, 17, 7, 2), (96, 1, 50, 7, 1),
                                 (95, 100, 33, 2, 1)]:
        xp, w, b = conv_data(rng, c_in, c_out, t, k, d)
        y = run_conv_wino_f32(cpu2, xp, w, b, d, library)
        assert snr_db(y, conv_ref(xp, w, b, d)) >= 90.0
        assert np.array_equal(y, run_conv_wino_f32(cpu1, xp, w, b, d, library))
        if co.wino_f32_available() and isa == "avx2":
            assert np.array_equal(y, run_conv_wino_f32(cpu2, xp, w, b, d))
    assert not gemm_i8.fast_available(library)  # the portable int8 GEMM: exact integer sums
    for n, k, t in [(100, 300, 13), (64, 1024, 20)]:
        w, x = gemm_data(rng, n, k, t)
        y = run_gemm(cpu2, w, x, library)
        assert np.abs(y - gemm_i8.reference(w, x)).max() <= 1e-6 * np.abs(y).max()
        if gemm_i8.fast_available():  # VPDPBUSD + FMA give the same sums, rounded the same
            assert np.array_equal(y, run_gemm(cpu2, w, x))
    # the Q4_0 step kernel: VPMADDUBSW on AVX2, portable C below; the same bits everywhere
    assert gemv_q4.fast_available(library) == (isa == "avx2")
    for n, k, t in [(96, 256, 1), (48, 1024, 5)]:
        q4, x = quantised(rng, n, k), rows(rng, t, k)
        y, z = gemv_q4_products(cpu2, q4, n, k, x, library)
        assert np.abs(y - z).max() <= 2e-6 * np.abs(z).max()
        if gemv_q4.fast_available():  # VPDPBUSD / VPMADDUBSW sums and the FMA chain
            assert np.array_equal(y, gemv_q4_products(cpu2, q4, n, k, x)[0])
    assert co.attn_causal_fast(library) == (isa == "avx2")
    for d, h, hkv, t, pos0 in [(128, 16, 8, 37, 20), (24, 8, 2, 9, 3)]:
        q = rng.standard_normal((t, h, d)).astype(np.float32)
        k = rng.standard_normal((pos0 + t + 16, hkv * d)).astype(np.float16)
        vt = rng.standard_normal((hkv * d, pos0 + t + 16)).astype(np.float16)
        pos = np.arange(pos0, pos0 + t, dtype=np.int32)
        want, mag = _attn_reference(q, k, vt, pos)
        got = _attn_causal(cpu2, q, k, vt, pos, pos0 + t, library)
        assert np.all(np.abs(got - want) <= 1e-6 * mag + 1e-30)
    # the fused step attention (AVX2 intrinsics, portable C below): two sessions' caches; AVX2
    # gives the same bits as this machine's own path (AVX-512's eight sums at once add in the
    # same order and take the same exponential; the portable one is libm's expf)
    for d, h, hkv in [(128, 16, 8), (32, 6, 2), (32, 4, 4), (48, 8, 2)]:
        positions = np.asarray([37, 5], dtype=np.int32)
        q = rng.standard_normal((2, h, d)).astype(np.float32)
        k, v = (rng.standard_normal((2, hkv * d)).astype(np.float32) for _ in range(2))
        caches = _step_caches(cpu2, rng, [64, 64], hkv * d, np.float16)
        got = _attn_step(cpu2, q, k, v, positions, [(c, 0, 64) for c in caches], library)
        if isa == "avx2" and co.attn_causal_fast():
            assert np.array_equal(got, _attn_step(cpu2, q, k, v, positions,
                                                  [(c, 0, 64) for c in caches]))
        for i, c in enumerate(caches):
            kr, vr = _cache_rows(c, np.float16)
            want, mag = _attn_reference(q[i:i + 1], kr, vr, positions[i:i + 1])
            assert np.all(np.abs(got[i:i + 1] - want) <= 1e-6 * mag + 1e-30)
            c.close()
    # the window attention (AVX2 intrinsics, portable C below), in two chunkings: the same bits
    d, h, window, total = 24, 8, 9, 20
    q = rng.standard_normal((total, h, d)).astype(np.float32)
    k, v = (np.concatenate([np.zeros((window - 1, 4, d), np.float32),
                            rng.standard_normal((total, 4, d)).astype(np.float32)])
            for _ in range(2))
    whole = _attn_window(cpu2, q, k, v, 0, window, library)
    want, mag = _window_reference(q, k, v, 0, window)
    assert np.all(np.abs(whole - want) <= 1e-6 * mag + 1e-30)
    parts, p0 = [], 0
    for n in (1, 3, 16):
        rows_ = slice(p0, p0 + window - 1 + n)
        parts.append(_attn_window(cpu1, q[p0:p0 + n], k[rows_], v[rows_], p0, window, library))
        p0 += n
    assert np.array_equal(np.concatenate(parts), whole)
    for op in ("f32", "bf16"):  # the history apart (hist=): bit for bit the concat
        for c, t, k, d in [(96, 2, 7, 3), (95, 50, 7, 9), (40, 300, 3, 1)]:
            p = (k - 1) * d
            hist = rng.standard_normal((p, c)).astype(np.float32)
            x = rng.standard_normal((t, c)).astype(np.float32)
            w = (rng.standard_normal((c, c, k)) / np.sqrt(c * k)).astype(np.float32)
            cat1, two1, cat2, two2 = run_conv_two_ways([cpu1, cpu2], op, hist, x, w, d, library)
            assert np.array_equal(two1, cat1) and np.array_equal(two2, cat2)
            assert np.array_equal(two1, two2)


# ---------------------------------------------------------------------------------------------
# The BF16 conv with SnakeBeta fused into its input conversion and the residual add into its
# output: bit for bit snake_beta -> conv1d_tm_bf16 -> ggml_add.


def run_conv_fused_and_apart(be: BackendSet, hist: np.ndarray[Any, Any], x: np.ndarray[Any, Any],
                             w_oik: np.ndarray[Any, Any], d: int, with_res: bool,
                             op: str = "bf16"
                             ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(fused, separate ops) results of ``res + conv(snake([hist | x]))``."""
    rng = np.random.default_rng(x.shape[1] + 3 * x.shape[0])
    c, t, c_out = x.shape[1], x.shape[0], w_oik.shape[0]
    ea = np.exp(0.5 * rng.standard_normal(c)).astype(np.float32)
    ib = (1.0 / (np.exp(0.5 * rng.standard_normal(c)) + 1e-9)).astype(np.float32)
    res = rng.standard_normal((t, c_out)).astype(np.float32)
    g = Graph()
    tw, tb, data = _conv_op_inputs(g, op, w_oik)
    fn = _conv_op(op)
    tx, tea, tib = g.input("x", x.shape), g.input("ea", (c,)), g.input("ib", (c,))
    data.update(x=x, ea=ea, ib=ib)
    th = None
    if hist.shape[0]:
        th = g.input("h", hist.shape)
        data["h"] = hist
    tres = None
    if with_res:
        tres = g.input("res", res.shape)
        data["res"] = res
    fused = fn(g.ctx, tx, tw, tb, d, hist=th, snake=(tea, tib), residual=tres)
    g.output(fused, "fused")
    sx = co.snake_beta(g.ctx, tx, tea, tib)
    sh = co.snake_beta(g.ctx, th, tea, tib) if th is not None else None
    apart = fn(g.ctx, sx, tw, tb, d, hist=sh)
    if tres is not None:
        apart = lib.ggml_add(g.ctx, tres, apart)
    g.output(apart, "apart")
    out = be.execute(g, data)
    g.close()
    return out["fused"].reshape(t, c_out), out["apart"].reshape(t, c_out)


def check_fused_equals_apart(cpu1: BackendSet, cpu2: BackendSet, seed: int, t: int, c_in: int,
                             c_out: int, k: int, d: int, with_res: bool, op: str) -> None:
    """``op`` with its snake and residual fused is bit for bit the separate ops, and neither
    depends on the thread count (random history, input x 3 and weights from ``seed``)."""
    rng = np.random.default_rng(seed)
    hist = rng.standard_normal(((k - 1) * d, c_in)).astype(np.float32)
    x = (3 * rng.standard_normal((t, c_in))).astype(np.float32)
    w = (rng.standard_normal((c_out, c_in, k)) / np.sqrt(c_in * k)).astype(np.float32)
    f2, a2 = run_conv_fused_and_apart(cpu2, hist, x, w, d, with_res, op)
    f1, a1 = run_conv_fused_and_apart(cpu1, hist, x, w, d, with_res, op)
    assert np.array_equal(f2, a2)
    assert np.array_equal(f1, f2) and np.array_equal(a1, a2)


@needs_ops
@pytest.mark.parametrize("t", [1, 17, 5000])
@pytest.mark.parametrize("c_in,c_out", [(96, 96), (95, 100), (384, 192), (1536, 40)])
@pytest.mark.parametrize("k,d,with_res", [(1, 1, True), (1, 1, False), (7, 9, False),
                                          (7, 1, True), (2, 1, False)])
def test_conv_bf16_fused_snake_and_residual(cpu1: BackendSet, cpu2: BackendSet, t: int,
                                            c_in: int, c_out: int, k: int, d: int,
                                            with_res: bool) -> None:
    check_fused_equals_apart(cpu1, cpu2, c_in + t + 10 * k + d, t, c_in, c_out, k, d,
                             with_res, "bf16")


@needs_ops
@pytest.mark.parametrize("t", [1, 17, 600])
@pytest.mark.parametrize("c_in,c_out", [(95, 100), (384, 192)])
@pytest.mark.parametrize("k,d,with_res", [(1, 1, True), (7, 3, False), (2, 1, True)])
def test_conv_split_fused_snake_and_residual(cpu1: BackendSet, cpu2: BackendSet, t: int,
                                             c_in: int, c_out: int, k: int, d: int,
                                             with_res: bool) -> None:
    check_fused_equals_apart(cpu1, cpu2, c_in + t + 10 * k + d, t, c_in, c_out, k, d,
                             with_res, "split")


SPLIT_CASES = [  # (C_in, C_out, T, K, d): the decoder's kept layers (conv_in, the transposed
    # convs' phases, the upsampler's pointwise layers) and odd shapes
    (1024, 1536, 37, 7, 1), (1536, 6144, 9, 2, 1), (768, 1920, 70, 2, 1), (192, 288, 500, 2, 1),
    (1024, 4096, 33, 1, 1), (95, 100, 333, 7, 3), (257, 40, 17, 2, 1), (1, 3, 20, 3, 2),
]


@needs_ops
@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("c_in,c_out,t,k,d", SPLIT_CASES)
def test_conv_split_is_f32_class(cpu1: BackendSet, cpu2: BackendSet, amx: bool, c_in: int,
                                 c_out: int, t: int, k: int, d: int) -> None:
    """Split products (hi(W) hi(x) + hi(W) lo(x) + lo(W) hi(x)) are within a few F32 roundings
    of float64 (the F32 op: ~1e-6 here; BF16 ~2e-3), on AMX tiles and on the AVX512-BF16
    path (whose instruction rounds more: ~2e-5), the same for any thread count."""
    rng = np.random.default_rng(c_in + 7 * c_out + 13 * t + d + 3 * k)
    xp, w, b = conv_data(rng, c_in, c_out, t, k, d)
    ref = conv_ref(xp, w, b, d)
    was = co.amx()
    co.set_amx(amx)
    try:
        y = run_conv_split(cpu2, xp, w, b, d)
        assert np.array_equal(y, run_conv_split(cpu1, xp, w, b, d))
    finally:
        co.set_amx(was)
    rel = np.abs(y - ref).max() / np.abs(ref).max()
    assert rel <= (1e-5 if co.amx() and amx else 6e-5), f"max|d|/max|y| = {rel:.3g}"
    bf16 = np.abs(run_conv_bf16(cpu2, xp, w, b, d) - ref).max() / np.abs(ref).max()
    assert rel < bf16 / 30


def run_conv_split(be: BackendSet, xp: np.ndarray[Any, Any], w_oik: np.ndarray[Any, Any],
                   b: np.ndarray[Any, Any], d: int) -> np.ndarray[Any, Any]:
    wp = co.bf16_bits(co.pack_conv_weight_bf16_split(w_oik))
    g = Graph()
    tx, tb = g.input("x", xp.shape), g.input("b", b.shape)
    tw = g.input("w", wp.shape, ggml_type=BF16)
    g.output(co.conv1d_tm_bf16(g.ctx, tx, tw, tb, d, split=True), "y")
    t = xp.shape[0] - (w_oik.shape[2] - 1) * d
    return be.execute(g, {"x": xp, "w": wp, "b": b})["y"].reshape(t, w_oik.shape[0])


@needs_ops
def test_pack_conv_weight_bf16_split() -> None:
    """hi(W) then lo(W) along the taps, each packed as pack_conv_weight_bf16 packs; their sum
    holds W to ~2^-17 relative."""
    w = (np.random.default_rng(3).standard_normal((40, 7, 3)) * 10.0 ** np.arange(-3, 4)[:, None]
         ).astype(np.float32)
    p = co.pack_conv_weight_bf16_split(w)
    hi = co.round_bf16(w)
    assert p.shape == (2, 6, 4, 64) and p.dtype == np.float32 and p.flags.c_contiguous
    assert np.array_equal(p[:, :3], co.pack_conv_weight_bf16(hi))
    assert np.array_equal(p[:, 3:], co.pack_conv_weight_bf16(w - hi))
    assert np.array_equal(co.round_bf16(p), p)
    whole = hi.astype(np.float64) + co.round_bf16(w - hi)
    assert np.all(np.abs(whole - w) <= 2.0 ** -16 * np.abs(w))
    # a weight whose layout is itself (32 outputs, one pair of inputs, one tap) is left as it was
    w = np.random.default_rng(4).standard_normal((64, 2, 1)).astype(np.float32)
    kept = w.copy()
    p = co.pack_conv_weight_bf16_split(w)
    assert np.array_equal(w, kept)
    assert np.array_equal(p[:, 1:], co.pack_conv_weight_bf16(w - co.round_bf16(w)))


@needs_ops
@pytest.mark.parametrize("t", [1, 17, 5000])
@pytest.mark.parametrize("c_in,c_out", [(96, 96), (95, 100), (384, 192), (768, 40)])
@pytest.mark.parametrize("k,d,with_res", [(7, 1, True), (7, 3, False), (7, 9, True),
                                          (2, 1, False), (2, 2, True)])
def test_conv_wino_fused_snake_and_residual(cpu1: BackendSet, cpu2: BackendSet, t: int,
                                            c_in: int, c_out: int, k: int, d: int,
                                            with_res: bool) -> None:
    check_fused_equals_apart(cpu1, cpu2, c_in + t + d + k, t, c_in, c_out, k, d,
                             with_res, "wino")


def run_conv_wino(be: BackendSet, xp: np.ndarray[Any, Any], w_oik: np.ndarray[Any, Any],
                  b: np.ndarray[Any, Any], d: int, library: Any = None) -> np.ndarray[Any, Any]:
    return run_conv_bf16(be, xp, w_oik, b, d, library, wino=True)


def snr_db(y: np.ndarray[Any, Any], ref: np.ndarray[Any, Any]) -> float:
    return float(10 * np.log10(np.sum(ref ** 2) / np.sum((y - ref) ** 2)))


WINO_CASES = [  # (C_in, C_out, T, K, d): T odd, below/above 2d, several chunks, wide inputs;
    # odd C_in, partial C_out blocks; K = 2 as the transposed convs use it
    (96, 96, 1, 7, 1), (96, 96, 2, 7, 3), (96, 96, 7, 7, 3), (96, 96, 5000, 7, 1),
    (96, 96, 5000, 7, 9), (192, 192, 777, 7, 9), (384, 384, 700, 7, 1), (95, 100, 333, 7, 3),
    (95, 40, 1, 7, 9), (96, 1, 500, 7, 1), (768, 768, 40, 7, 3), (768, 768, 1100, 7, 9),
    (1024, 1536, 124, 7, 1), (40, 33, 37, 7, 2),
    (96, 96, 1, 2, 1), (96, 96, 2, 2, 1), (95, 100, 333, 2, 3), (40, 33, 37, 2, 2),
    (192, 288, 5000, 2, 1), (1536, 6144, 20, 2, 1), (768, 1920, 300, 2, 1),
]


@needs_ops
@pytest.mark.parametrize("c_in,c_out,t,k,d", WINO_CASES)
def test_conv_wino_matches_float64(cpu1: BackendSet, cpu2: BackendSet, c_in: int, c_out: int,
                                   t: int, k: int, d: int) -> None:
    """The F(2,3) / F(2,2) conv is the K = 7 / K = 2 conv up to BF16 rounding of its
    transformed operands: within ~2.5 dB of the direct BF16 kernel's SNR against float64, the
    same for any thread count."""
    rng = np.random.default_rng(c_in + 7 * c_out + 13 * t + d + k)
    xp, w, b = conv_data(rng, c_in, c_out, t, k, d)
    ref = conv_ref(xp, w, b, d)
    y = run_conv_wino(cpu2, xp, w, b, d)
    assert y.shape == ref.shape and np.isfinite(y).all()
    direct = snr_db(run_conv_bf16(cpu2, xp, w, b, d), ref)
    assert snr_db(y, ref) >= min(50.0, direct - 2.5)
    assert np.abs(y - ref).max() <= 0.02 * np.abs(ref).max()
    assert np.array_equal(y, run_conv_wino(cpu1, xp, w, b, d))


@needs_ops
def test_pack_conv_weight_wino_bf16() -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 5, 7)).astype(np.float32)
    p = co.pack_conv_weight_wino_bf16(w)
    assert p.shape == (2, 3, 10, 64) and p.dtype == np.float32
    assert np.array_equal(p, co.round_bf16(p))
    g = w.astype(np.float64)
    o, c = 33, 3  # block 1, lane 1; input pair 1, element 1
    want = [g[o, c, 0], (g[o, c, 0] + g[o, c, 1] + g[o, c, 2]) / 2,
            (g[o, c, 0] - g[o, c, 1] + g[o, c, 2]) / 2, g[o, c, 2],
            g[o, c, 3], (g[o, c, 3] + g[o, c, 4] + g[o, c, 5]) / 2,
            (g[o, c, 3] - g[o, c, 4] + g[o, c, 5]) / 2, g[o, c, 5], g[o, c, 6], -g[o, c, 6]]
    got = p[1, 1, :, 2 * 1 + 1]
    assert np.array_equal(got, co.round_bf16(np.array(want, np.float32)))
    assert not p[1, :, :, 2 * 8:].any()  # outputs past 40: zero
    assert not p[:, 2, :, 1::2].any()  # input 5 (odd C_in's pad): zero
    p2 = co.pack_conv_weight_wino_bf16(w[:, :, :2])
    assert p2.shape == (2, 3, 3, 64)
    want2 = [g[o, c, 0] + g[o, c, 1] / 2, g[o, c, 1] / 2 - g[o, c, 0], g[o, c, 1]]
    assert np.array_equal(p2[1, 1, :, 3], co.round_bf16(np.array(want2, np.float32)))
    with pytest.raises(ValueError, match="must be \\[C_out, C_in, 7 or 2\\]"):
        co.pack_conv_weight_wino_bf16(np.zeros((4, 4, 3), np.float32))


@needs_ops
def test_conv_wino_rejects_a_direct_layout() -> None:
    c = 96
    with Graph() as g:
        tw, tb, _ = _conv_op_inputs(g, "bf16", np.zeros((c, c, 7), np.float32))
        with pytest.raises(ValueError, match="pack_conv_weight_wino_bf16"):
            co.conv1d_wino_bf16(g.ctx, g.input("x", (20 + 18, c)), tw, tb, 3)
        tw2, tb2, _ = _conv_op_inputs(g, "wino", np.zeros((c, c, 7), np.float32))
        co.conv1d_wino_bf16(g.ctx, g.input("x1", (19, c)), tw2, tb2, 3)  # fine: T = 1
        with pytest.raises(ValueError, match="xp"):
            co.conv1d_wino_bf16(g.ctx, g.input("x2", (18, c)), tw2, tb2, 3)


@needs_ops
def test_conv_bf16_fusions_reject_bad_sources() -> None:
    c, k = 96, 7
    with Graph() as g:
        tw, tb, _ = _conv_op_inputs(g, "bf16", np.zeros((c, c, k), np.float32))
        x = g.input("x", (20, c))
        ea, ib = g.input("ea", (c,)), g.input("ib", (c,))
        with pytest.raises(ValueError, match="snake exp_alpha"):
            co.conv1d_tm_bf16(g.ctx, x, tw, tb, 1, snake=(g.input("ea2", (c - 1,)), ib))
        with pytest.raises(ValueError, match="residual has"):
            co.conv1d_tm_bf16(g.ctx, x, tw, tb, 1, snake=(ea, ib),
                              residual=g.input("r", (13, c)))
        with pytest.raises(TypeError, match="residual"):
            co.conv1d_tm_bf16(g.ctx, x, tw, tb, 1, residual=g.input("rb", (14, c), ggml_type=BF16))


# ---------------------------------------------------------------------------------------------
# The transposed V write of a prefill


def _v_written(be: BackendSet, v: np.ndarray[Any, Any], ggml_type: int, row0: int,
               ours: bool) -> np.ndarray[Any, Any]:
    """The channel-major cache V (bytes) after writing ``v`` ([n, C]) at positions row0..."""
    from engine.talker.qwen3 import KVCache

    n, c = v.shape
    cache = KVCache(be, 1, c, 64, ggml_type, "t")
    try:
        g = Graph()
        tv = g.input("v", v.shape)
        cv = cache.v[0]
        es = int(lib.ggml_type_size(ggml_type))
        dst = lib.ggml_view_2d(g.ctx, cv, n, c, cv.nb[1], row0 * es)
        g.expand(co.kv_write_transposed(g.ctx, dst, tv) if ours else
                 lib.ggml_cpy(g.ctx, lib.ggml_transpose(g.ctx, tv), dst))
        be.execute(g, {"v": v})
        out = np.empty(c * 64 * es, dtype=np.uint8)
        lib.ggml_backend_tensor_get(cv, ffi.from_buffer(out), 0, out.nbytes)
        return out
    finally:
        cache.close()


@needs_ops
@pytest.mark.parametrize("ggml_type", [lib.GGML_TYPE_F16, lib.GGML_TYPE_F32])
@pytest.mark.parametrize("n,c,row0", [(23, 40, 0), (7, 16, 5), (64, 33, 0), (1, 128, 63)])
def test_kv_write_transposed_is_ggmls_cpy_bit_for_bit(cpu1: BackendSet, cpu2: BackendSet,
                                                      ggml_type: int, n: int, c: int,
                                                      row0: int) -> None:
    """The channel-major cache after the op holds exactly what ggml's CPY through a transposed
    view writes: every rounding to F16 (ties to even, subnormals, overflow to inf), channel
    counts with and without a tail of 16, on 1 and 2 threads; nothing outside the block."""
    rng = np.random.default_rng(n * c + row0)
    v = (rng.standard_normal((n, c)) * 10.0 ** rng.uniform(-7, 5.5, (n, c))).astype(np.float32)
    v.flat[::7] = np.float32(1 + 2.0 ** -11)  # a tie: F16 rounds it to 1.0 (even)
    v.flat[3::11] = np.float32(1 + 3 * 2.0 ** -11)  # the other tie: up to 1 + 2^-9
    want = _v_written(cpu2, v, ggml_type, row0, ours=False)
    assert np.array_equal(_v_written(cpu2, v, ggml_type, row0, ours=True), want)
    assert np.array_equal(_v_written(cpu1, v, ggml_type, row0, ours=True), want)


@needs_ops
def test_kv_write_transposed_rejects_what_the_kernel_cannot_take() -> None:
    g = Graph()
    v = g.input("v", (5, 8))  # ne [8, 5]
    good = new_tensor(g.ctx, lib.GGML_TYPE_F16, (8, 5))  # ne [5, 8]
    with pytest.raises(ValueError, match="transposed"):
        co.kv_write_transposed(g.ctx, new_tensor(g.ctx, lib.GGML_TYPE_F16, (5, 8)), v)
    with pytest.raises(TypeError, match="F16 or F32"):
        co.kv_write_transposed(g.ctx, new_tensor(g.ctx, lib.GGML_TYPE_Q8_0, (8, 32)), v)
    with pytest.raises(ValueError, match="contiguous"):
        co.kv_write_transposed(g.ctx, good, lib.ggml_transpose(g.ctx, g.input("w", (8, 5))))


# ---------------------------------------------------------------------------------------------
# The fused causal attention of a prefill


def _attn_causal(be: BackendSet, q: np.ndarray[Any, Any], k: np.ndarray[Any, Any],
                 vt: np.ndarray[Any, Any], pos: np.ndarray[Any, Any], n_kv: int,
                 library: Any | None = None) -> np.ndarray[Any, Any]:
    """The op on q [T, H, d], a position-major K [n_ctx, kv] and a channel-major V [kv, n_ctx]
    (of k's dtype; both read through views of n_kv rows, V's rows n_ctx apart)."""
    t, h, d = q.shape
    kv = k.shape[1]
    g = Graph()
    tq = g.input("q", q.shape)
    tk = g.input("k", k.shape, k.dtype)
    tv = g.input("v", vt.shape, vt.dtype)
    tp = g.input("pos", pos.shape, np.int32)
    kk = lib.ggml_view_2d(g.ctx, tk, kv, n_kv, tk.nb[1], 0)
    vv = lib.ggml_view_2d(g.ctx, tv, n_kv, kv, tv.nb[1], 0)
    g.output(co.attn_causal(g.ctx, tq, kk, vv, tp, library=library), "out")
    return be.execute(g, {"q": q, "k": k, "v": vt, "pos": pos})["out"].reshape(t, h * d)


def _attn_reference(q: np.ndarray[Any, Any], k: np.ndarray[Any, Any], vt: np.ndarray[Any, Any],
                    pos: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """float64 causal GQA attention, and the scale of each output's float32 rounding: sum of
    |p v|, times the largest sum of |q k| / sqrt(d) over its keys (a score's rounding error
    scales with that sum and moves the probabilities by as much)."""
    t, h, d = q.shape
    hkv = k.shape[1] // d
    out = np.zeros((t, h * d))
    mag = np.zeros((t, h * d))
    kd, vd = k.astype(np.float64), vt.astype(np.float64)
    for i in range(t):
        for hh in range(h):
            hk = hh // (h // hkv)
            keys = kd[: pos[i] + 1, hk * d:(hk + 1) * d]
            s = keys @ q[i, hh].astype(np.float64) / np.sqrt(d)
            p = np.exp(s - s.max())
            p /= p.sum()
            vals = vd[hk * d:(hk + 1) * d, : pos[i] + 1]
            out[i, hh * d:(hh + 1) * d] = vals @ p
            terms = np.abs(keys) @ np.abs(q[i, hh].astype(np.float64)) / np.sqrt(d)
            mag[i, hh * d:(hh + 1) * d] = (np.abs(vals) @ p) * (1 + terms.max())
    return out, mag


@needs_ops
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("d,h,hkv,t,pos0,n_kv,scale", [
    (128, 16, 8, 134, 9, 144, 1.0),  # a cloned voice's prefill after its pinned prefix
    (128, 16, 8, 1, 250, 256, 1.0),  # the last layer: the last position only
    (128, 16, 2, 33, 300, 352, 3.0),  # 8 query heads per KV head, keys in three blocks
    (64, 4, 4, 5, 0, 16, 1.0),  # no GQA, a block of queries mostly spare
    (24, 8, 2, 20, 3, 32, 8.0),  # head size not a multiple of 8: the tails; peaked softmax
    # query heads per KV head that do not divide the 16 lanes: the lanes past G x (16 // G)
    # are spare (they once took the next group's heads and wrote past the last query)
    (16, 6, 2, 20, 3, 32, 1.0),  # G = 3
    (16, 5, 1, 7, 0, 16, 1.0),  # G = 5
    (32, 12, 2, 9, 4, 16, 1.0),  # G = 6, the last block's queries at the output's end
    (16, 15, 1, 1, 10, 16, 1.0),  # G = 15, one query
])
def test_attn_causal_matches_float64(cpu1: BackendSet, cpu2: BackendSet, dtype: Any, d: int,
                                     h: int, hkv: int, t: int, pos0: int, n_kv: int,
                                     scale: float) -> None:
    """Every query head attends to its KV head's rows 0..position and nothing past them, on
    1 and 2 threads, F16 and F32 caches: within float32 rounding of float64 (the F16 values
    taken as they are stored)."""
    rng = np.random.default_rng(d * t + pos0)
    n_ctx = n_kv + 64
    q = (rng.standard_normal((t, h, d)) * scale).astype(np.float32)
    k = (rng.standard_normal((n_ctx, hkv * d)) * scale).astype(dtype)
    vt = (rng.standard_normal((hkv * d, n_ctx)) * 10.0 ** rng.uniform(-2, 2, (hkv * d, 1))
          ).astype(dtype)
    k[pos0 + t:] = 1e4  # rows past every position: scored, they would dominate
    vt[:, pos0 + t:] = np.nan
    pos = np.arange(pos0, pos0 + t, dtype=np.int32)
    want, mag = _attn_reference(q, k, vt, pos)
    for be in (cpu1, cpu2):
        got = _attn_causal(be, q, k, vt, pos, n_kv)
        assert np.all(np.abs(got - want) <= 1e-6 * mag + 1e-30), np.abs(got - want).max()


@needs_ops
@pytest.mark.parametrize("hkv", [8, 2])
def test_attn_causal_a_query_does_not_depend_on_the_others(cpu2: BackendSet, hkv: int) -> None:
    """A query's output is the same bits whichever later queries share the graph: with them,
    its block of queries reads more keys, so keys move between the kernel's vector loop and
    its remainder loop (a prepared voice's prefix equals the rows a longer prefill keeps)."""
    rng = np.random.default_rng(hkv)
    d, h, t, n_ctx = 64, 16, 61, 128
    q = rng.standard_normal((t, h, d)).astype(np.float32)
    k = rng.standard_normal((n_ctx, hkv * d)).astype(np.float16)
    vt = rng.standard_normal((hkv * d, n_ctx)).astype(np.float16)
    pos = np.arange(t, dtype=np.int32)
    every = _attn_causal(cpu2, q, k, vt, pos, 64)
    for n in (13, 22, 35, 38, 47, 57, 60):  # remainders of every size under 4 and 8 keys
        part = _attn_causal(cpu2, q[:n], k, vt, pos[:n], 64)
        assert np.array_equal(part, every[:n]), n


# ---------------------------------------------------------------------------------------------
# The fused attention of decoding steps (K/V writes included), several sessions in one node


def _step_caches(be: BackendSet, rng: np.random.Generator, n_ctxs: list[int], kv: int,
                 dtype: Any) -> list[Any]:
    """One-layer caches of random rows (position-major K, channel-major V), in host memory."""
    from engine.talker.qwen3 import KVCache
    ggml_type = lib.GGML_TYPE_F16 if dtype == np.float16 else lib.GGML_TYPE_F32
    caches = []
    for n_ctx in n_ctxs:
        c = KVCache(be, 1, kv, n_ctx, ggml_type, "test")
        k = rng.standard_normal((n_ctx, kv)).astype(dtype)
        vt = (rng.standard_normal((kv, n_ctx)) * 10.0 ** rng.uniform(-2, 2, (kv, 1))).astype(dtype)
        lib.ggml_backend_tensor_set(c.k[0], ffi.from_buffer(k), 0, k.nbytes)
        lib.ggml_backend_tensor_set(c.v[0], ffi.from_buffer(vt), 0, vt.nbytes)
        caches.append(c)
    return caches


def _cache_rows(c: Any, dtype: Any) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    k = np.empty((c.n_ctx, c.kv_dim), dtype)
    vt = np.empty((c.kv_dim, c.n_ctx), dtype)
    lib.ggml_backend_tensor_get(c.k[0], ffi.from_buffer(k), 0, k.nbytes)
    lib.ggml_backend_tensor_get(c.v[0], ffi.from_buffer(vt), 0, vt.nbytes)
    return k, vt


def _attn_step(be: BackendSet, q: np.ndarray[Any, Any], k: np.ndarray[Any, Any],
               v: np.ndarray[Any, Any], pos: np.ndarray[Any, Any],
               slots: list[Any], library: Any | None = None) -> np.ndarray[Any, Any]:
    """The op on q [T, H, d] and new rows k, v [T, kv] at ``pos``, over ``slots``: (cache,
    first position, n_ctx) per session."""
    t, h, d = q.shape
    g = Graph()
    tq = g.input("q", q.shape)
    tk = g.input("k", k.shape)
    tv = g.input("v", v.shape)
    tp = g.input("pos", pos.shape, np.int32)
    caches = [co.StepCache(c.k[0], c.v[0], first, n) for c, first, n in slots]
    g.output(co.attn_step(g.ctx, tq, tk, tv, tp, caches, g.keep, library=library), "out")
    return be.execute(g, {"q": q, "k": k, "v": v, "pos": pos})["out"].reshape(t, h * d)


@needs_ops
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("d,h,hkv,positions,per,scale", [
    (128, 16, 8, [200, 0, 63, 64], 1, 1.0),  # a talker step of four sessions
    (128, 16, 8, [0, 1, 0, 1, 0, 1], 2, 1.0),  # the code predictor's first pass, three slots
    (64, 8, 2, [15, 7], 1, 3.0),  # 4 query heads per KV head
    (32, 6, 2, [70, 3, 16], 1, 2.0),  # 3 query heads per KV head
    (32, 4, 4, [9, 100], 1, 1.0),  # one query head per KV head
    (24, 8, 8, [40, 2, 17], 1, 8.0),  # head size not a multiple of 16; a peaked softmax
])
def test_attn_step_writes_the_rows_and_matches_float64(cpu1: BackendSet, cpu2: BackendSet,
                                                       dtype: Any, d: int, h: int, hkv: int,
                                                       positions: list[int], per: int,
                                                       scale: float) -> None:
    """Each session's new K/V rows land in its own cache at its position (rounded as ggml
    stores them) and nowhere else; its query heads attend to rows 0..position of its own cache
    only: within float32 rounding of float64. Sessions may be caches of their own or slots of
    one cache (the code predictor's layout)."""
    kv = hkv * d
    n_sess = len(positions) // per
    pos = np.asarray(positions, dtype=np.int32)
    for be in (cpu1, cpu2):
        rng = np.random.default_rng(d + len(positions))
        q = (rng.standard_normal((len(pos), h, d)) * scale).astype(np.float32)
        k = (rng.standard_normal((len(pos), kv)) * scale).astype(np.float32)
        v = rng.standard_normal((len(pos), kv)).astype(np.float32)
        if per == 1:  # caches of their own, of different lengths
            caches = _step_caches(be, rng, [64 * (2 + i) + 64 * (p // 64) for i, p in
                                            enumerate(positions)], kv, dtype)
            slots = [(c, 0, c.n_ctx) for c in caches]
        else:  # slots of 16 positions in one cache
            caches = _step_caches(be, rng, [16 * n_sess], kv, dtype)
            slots = [(caches[0], 16 * i, 16) for i in range(n_sess)]
        before = [_cache_rows(c, dtype) for c in caches]
        for i, (c, first, _n) in enumerate(slots):  # keys past a position: they would dominate
            kr, vr = before[caches.index(c)]
            top = first + int(pos[i * per:(i + 1) * per].max()) + 1
            kr[top:first + _n] = 1e4 if dtype == np.float16 else 1e30
        for c, (kr, _vr) in zip(caches, before, strict=True):
            lib.ggml_backend_tensor_set(c.k[0], ffi.from_buffer(kr), 0, kr.nbytes)
        got = _attn_step(be, q, k, v, pos, slots)
        for i, (c, first, _n) in enumerate(slots):
            ci = caches.index(c)
            kr, vr = before[ci]
            for j in range(per):
                t = i * per + j
                kr[first + pos[t]] = k[t].astype(dtype)
                vr[:, first + pos[t]] = v[t].astype(dtype)
        for c, (kr, vr) in zip(caches, before, strict=True):
            ka, va = _cache_rows(c, dtype)
            assert np.array_equal(ka, kr) and np.array_equal(va, vr)
        for i, (c, first, n) in enumerate(slots):
            kr, vr = before[caches.index(c)]
            cols = slice(i * per, (i + 1) * per)
            want, mag = _attn_reference(q[cols], kr[first:first + n], vr[:, first:first + n],
                                        pos[cols])
            assert np.all(np.abs(got[cols] - want) <= 1e-6 * mag + 1e-30), \
                np.abs(got[cols] - want).max()
        for c in caches:
            c.close()


@needs_ops
def test_attn_step_a_session_does_not_depend_on_the_others(cpu1: BackendSet,
                                                           cpu2: BackendSet) -> None:
    """A session's output is the same bits alone as beside others, on 1 and 2 threads: a
    batched step gives each session what it gets alone."""
    d, h, hkv = 128, 16, 8
    kv = hkv * d
    positions = [37, 130, 5]
    rng = np.random.default_rng(3)
    q = rng.standard_normal((3, h, d)).astype(np.float32)
    k = rng.standard_normal((3, kv)).astype(np.float32)
    v = rng.standard_normal((3, kv)).astype(np.float32)
    pos = np.asarray(positions, dtype=np.int32)
    outs = []
    for be in (cpu2, cpu1):
        caches = _step_caches(be, np.random.default_rng(4), [192, 192, 192], kv, np.float16)
        together = _attn_step(be, q, k, v, pos, [(c, 0, c.n_ctx) for c in caches])
        for c in caches:
            c.close()
        caches = _step_caches(be, np.random.default_rng(4), [192, 192, 192], kv, np.float16)
        for i, c in enumerate(caches):
            alone = _attn_step(be, q[i:i + 1], k[i:i + 1], v[i:i + 1], pos[i:i + 1],
                               [(c, 0, c.n_ctx)])
            assert np.array_equal(alone[0], together[i]), i
            c.close()
        outs.append(together)
    assert np.array_equal(outs[0], outs[1])


@needs_ops
def test_attn_step_rejects_what_the_kernel_cannot_take(cpu1: BackendSet) -> None:
    from engine.talker.qwen3 import KVCache
    c = KVCache(cpu1, 1, 16, 64, lib.GGML_TYPE_F16, "test")
    c32 = KVCache(cpu1, 1, 16, 64, lib.GGML_TYPE_F32, "test")
    g = Graph()
    q = g.input("q", (2, 4, 8))  # d 8, 4 heads, 2 columns
    k = g.input("k", (2, 16))
    pos = g.input("pos", (2,), np.int32)
    one = [co.StepCache(c.k[0], c.v[0], 0, 64)]
    with pytest.raises(ValueError, match="do not split"):
        co.attn_step(g.ctx, q, k, k, pos, one * 3, g.keep)
    with pytest.raises(TypeError, match="every cache"):
        co.attn_step(g.ctx, q, k, k, pos, [*one, co.StepCache(c32.k[0], c32.v[0], 0, 64)],
                     g.keep)
    with pytest.raises(ValueError, match="does not hold"):
        co.attn_step(g.ctx, q, k, k, pos, [co.StepCache(c.k[0], c.v[0], 32, 64)], g.keep)
    with pytest.raises(ValueError, match="pos must be"):
        co.attn_step(g.ctx, q, k, k, g.input("p3", (3,), np.int32), one, g.keep)
    with pytest.raises(ValueError, match="k must be"):
        co.attn_step(g.ctx, q, g.input("k3", (3, 16)), k, pos, one, g.keep)
    c.close()
    c32.close()


@needs_ops
def test_attn_causal_rejects_what_the_kernel_cannot_take() -> None:
    g = Graph()
    q = g.input("q", (3, 4, 8))  # ne [8, 4, 3]: d 8, 4 heads, 3 positions
    pos = g.input("pos", (3,), np.int32)
    k = g.input("k", (10, 16), np.float16)  # ne [16, 10]: 2 KV heads
    v = g.input("v", (16, 10), np.float16)  # ne [10, 16]
    co.attn_causal(g.ctx, q, k, v, pos)
    with pytest.raises(ValueError, match="transposed"):
        co.attn_causal(g.ctx, q, k, g.input("v2", (10, 16), np.float16), pos)
    with pytest.raises(ValueError, match="query heads"):
        co.attn_causal(g.ctx, q, g.input("k3", (10, 24), np.float16), v, pos)
    with pytest.raises(TypeError, match="F16 or F32"):
        co.attn_causal(g.ctx, q, g.input("k4", (10, 16), np.int32), v, pos)
    with pytest.raises(ValueError, match="pos"):
        co.attn_causal(g.ctx, q, k, v, g.input("p2", (4,), np.int32))


# ---------------------------------------------------------------------------------------------
# The sliding-window attention of the decoder's pre-transformer


def _attn_window(be: BackendSet, q: np.ndarray[Any, Any], k: np.ndarray[Any, Any],
                 v: np.ndarray[Any, Any], pos0: int, window: int,
                 library: Any | None = None) -> np.ndarray[Any, Any]:
    """The op on q [T, H, d] and k, v [Tk, H_kv, d] (carried rows, then the chunk's)."""
    t, h, d = q.shape
    g = Graph()
    tq, tk, tv = g.input("q", q.shape), g.input("k", k.shape), g.input("v", v.shape)
    tp = g.input("pos", (t,), np.int32)
    g.output(co.attn_window(g.ctx, tq, tk, tv, tp, window, library=library), "out")
    pos = np.arange(pos0, pos0 + t, dtype=np.int32)
    return be.execute(g, {"q": q, "k": k, "v": v, "pos": pos})["out"].reshape(t, h * d)


def _window_reference(q: np.ndarray[Any, Any], k: np.ndarray[Any, Any], v: np.ndarray[Any, Any],
                      pos0: int, window: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """float64 sliding-window attention and the scale of each output's float32 rounding (as
    ``_attn_reference``)."""
    t, h, d = q.shape
    n_cache, hkv = k.shape[0] - t, k.shape[1]
    out, mag = np.zeros((t, h * d)), np.zeros((t, h * d))
    kpos = pos0 - n_cache + np.arange(k.shape[0])
    for i in range(t):
        p = pos0 + i
        seen = (kpos <= p) & (kpos > p - window) & (kpos >= 0)
        for hh in range(h):
            hk = hh // (h // hkv)
            keys = k[seen, hk].astype(np.float64)
            s = keys @ q[i, hh].astype(np.float64) / np.sqrt(d)
            pr = np.exp(s - s.max())
            pr /= pr.sum()
            vals = v[seen, hk].astype(np.float64)
            out[i, hh * d:(hh + 1) * d] = pr @ vals
            terms = np.abs(keys) @ np.abs(q[i, hh].astype(np.float64)) / np.sqrt(d)
            mag[i, hh * d:(hh + 1) * d] = (pr @ np.abs(vals)) * (1 + terms.max())
    return out, mag


@needs_ops
@pytest.mark.parametrize("d,h,hkv,t,pos0,window,scale", [
    (64, 16, 16, 16, 200, 72, 1.0),  # the decoder: a 16-frame chunk well into a stream
    (64, 16, 16, 1, 0, 72, 1.0),  # its first frame: one key
    (64, 16, 16, 5, 3, 72, 4.0),  # early: the carried rows before position 0 are not seen
    (64, 4, 2, 90, 10, 72, 1.0),  # a chunk longer than the window; 2 query heads per KV head
    (24, 8, 4, 7, 40, 9, 8.0),  # head size not a multiple of 8 or 16; a peaked softmax
])
def test_attn_window_matches_float64(cpu1: BackendSet, cpu2: BackendSet, d: int, h: int,
                                     hkv: int, t: int, pos0: int, window: int,
                                     scale: float) -> None:
    """A query sees the keys of the last ``window`` positions up to its own, none before
    position 0 (those carried rows hold NaN here), on 1 and 2 threads: within float32 rounding
    of float64."""
    rng = np.random.default_rng(d * t + pos0)
    n_cache = window - 1
    q = (rng.standard_normal((t, h, d)) * scale).astype(np.float32)
    k = (rng.standard_normal((n_cache + t, hkv, d)) * scale).astype(np.float32)
    v = (rng.standard_normal((n_cache + t, hkv, d)) * 10.0 ** rng.uniform(-2, 2, (1, hkv, d))
         ).astype(np.float32)
    unseen = max(0, n_cache - pos0)  # rows of positions below 0
    k[:unseen], v[:unseen] = np.nan, np.nan
    want, mag = _window_reference(q, k, v, pos0, window)
    for be in (cpu1, cpu2):
        got = _attn_window(be, q, k, v, pos0, window)
        assert np.all(np.abs(got - want) <= 1e-6 * mag + 1e-30), np.abs(got - want).max()


def _attn_full(be: BackendSet, q: np.ndarray[Any, Any], k: np.ndarray[Any, Any],
               v: np.ndarray[Any, Any], library: Any | None = None) -> np.ndarray[Any, Any]:
    """The op on q [T, H, d] and k, v [T, H_kv, d]."""
    t, h, d = q.shape
    g = Graph()
    tq, tk, tv = g.input("q", q.shape), g.input("k", k.shape), g.input("v", v.shape)
    g.output(co.attn_full(g.ctx, tq, tk, tv, library=library), "out")
    return be.execute(g, {"q": q, "k": k, "v": v})["out"].reshape(t, h * d)


ATTN_FULL_CASES = [  # (d, H, H_kv, T, scale)
    (64, 8, 8, 256, 1.0),  # the codec encoder's transformer (10 s: 250 frames, padded)
    (64, 8, 8, 1, 1.0),  # one query
    (64, 4, 2, 97, 4.0),  # 2 query heads per KV head; not a whole number of query blocks
    (24, 8, 4, 50, 8.0),  # head size not a multiple of the conv block; a peaked softmax
    (100, 2, 1, 130, 0.5),
]


def _attn_full_data(d: int, h: int, hkv: int, t: int, scale: float
                    ) -> tuple[np.ndarray[Any, Any], ...]:  # fmt: skip
    rng = np.random.default_rng(d * t + h)
    q = (rng.standard_normal((t, h, d)) * scale).astype(np.float32)
    k = (rng.standard_normal((t, hkv, d)) * scale).astype(np.float32)
    v = (rng.standard_normal((t, hkv, d)) * 10.0 ** rng.uniform(-2, 2, (1, hkv, d))
         ).astype(np.float32)
    return q, k, v


@needs_ops
@pytest.mark.parametrize("d,h,hkv,t,scale", ATTN_FULL_CASES)
def test_attn_full_matches_float64(cpu1: BackendSet, cpu2: BackendSet, d: int, h: int,
                                   hkv: int, t: int, scale: float) -> None:
    """Causal attention over the whole input (a window as long as it): within float32
    rounding of float64, the same bits on 1 and 2 threads."""
    q, k, v = _attn_full_data(d, h, hkv, t, scale)
    want, mag = _window_reference(q, k, v, 0, t)
    got = _attn_full(cpu2, q, k, v)
    assert np.all(np.abs(got - want) <= 1e-6 * mag + 1e-30), np.abs(got - want).max()
    assert np.array_equal(got, _attn_full(cpu1, q, k, v))


@needs_ops
def test_attn_full_rejects_what_the_kernel_cannot_take() -> None:
    g = Graph()
    q, k = g.input("q", (10, 8, 64)), g.input("k", (10, 4, 64))
    assert int(co.attn_full(g.ctx, q, k, k).ne[0]) == 512
    with pytest.raises(ValueError, match="heads contiguously"):
        co.attn_full(g.ctx, lib.ggml_permute(g.ctx, g.input("p", (8, 10, 64)), 0, 2, 1, 3), k, k)
    with pytest.raises(ValueError, match="k and v"):
        co.attn_full(g.ctx, q, k, g.input("v", (9, 4, 64)))
    with pytest.raises(ValueError, match="8 query heads over 3"):
        k3 = g.input("k3", (10, 3, 64))
        co.attn_full(g.ctx, q, k3, k3)
    with pytest.raises(TypeError, match="F32"):
        co.attn_full(g.ctx, q, k, g.input("vi", (10, 4, 64), dtype=np.int32))


@needs_ops
def test_attn_window_bits_do_not_depend_on_the_chunking(cpu1: BackendSet,
                                                        cpu2: BackendSet) -> None:
    """A stream's queries give the same bits whichever chunks they come in (each chunk with the
    window's last rows carried in front, as the decoder does), on 1 or 2 threads: its keys
    sit at other offsets, but every sum runs in position order."""
    rng = np.random.default_rng(7)
    d, h, window, total = 64, 16, 72, 150
    n_cache = window - 1
    q = rng.standard_normal((total, h, d)).astype(np.float32)
    k = np.concatenate([np.zeros((n_cache, h, d), np.float32),
                        rng.standard_normal((total, h, d)).astype(np.float32)])
    v = np.concatenate([np.zeros((n_cache, h, d), np.float32),
                        rng.standard_normal((total, h, d)).astype(np.float32)])

    def stream(sizes: list[int], be: BackendSet) -> np.ndarray[Any, Any]:
        out, p = [], 0
        for n in sizes:
            rows = slice(p, p + n_cache + n)  # the carried window, then the chunk
            out.append(_attn_window(be, q[p:p + n], k[rows], v[rows], p, window))
            p += n
        assert p == total
        return np.concatenate(out)

    whole = stream([total], cpu2)
    assert np.array_equal(stream([1] * 3 + [2, 2, 3, 4, 6, 8, 12, 16, 16, 16, 16, 16, 16, 14],
                                 cpu1), whole)
    assert np.array_equal(stream([1, 2, 4, 8, 16, 16, 16, 16, 16, 16, 16, 16, 7], cpu2), whole)


def test_attn_window_rejects_what_the_kernel_cannot_take() -> None:
    g = Graph()
    q = g.input("q", (3, 4, 8))  # ne [8, 4, 3]: d 8, 4 heads, 3 positions
    pos = g.input("pos", (3,), np.int32)
    k = g.input("k", (10, 2, 8))  # ne [8, 2, 10]: 2 KV heads, 7 carried rows
    v = g.input("v", (10, 2, 8))
    co.attn_window(g.ctx, q, k, v, pos, 8)
    with pytest.raises(ValueError, match="k and v"):
        co.attn_window(g.ctx, q, k, g.input("v2", (10, 2, 4)), pos, 8)
    with pytest.raises(ValueError, match="KV heads"):
        co.attn_window(g.ctx, q, g.input("k3", (10, 3, 8)), g.input("v3", (10, 3, 8)), pos, 8)
    with pytest.raises(TypeError, match="F32"):
        co.attn_window(g.ctx, q, g.input("k4", (10, 2, 8), np.float16), v, pos, 8)
    with pytest.raises(ValueError, match="pos"):
        co.attn_window(g.ctx, q, k, v, g.input("p2", (4,), np.int32), 8)
    with pytest.raises(ValueError, match="window"):
        co.attn_window(g.ctx, q, k, v, pos, 0)


# ---------------------------------------------------------------------------------------------
# The channel join of time-major parts


@needs_ops
@pytest.mark.parametrize("widths", [[64] * 9, [512, 512, 512], [3, 1, 17], [40]])
def test_channel_join_is_numpys_concatenate(cpu1: BackendSet, cpu2: BackendSet,
                                            widths: list[int]) -> None:
    """Parts side by side in every row, the first one a channel-range view of a wider tensor
    (rows strided), on 1 and 2 threads; as many parts as ggml allows a node."""
    rng = np.random.default_rng(sum(widths))
    t = 37
    wide = rng.standard_normal((t, widths[0] + 5)).astype(np.float32)
    rest = [rng.standard_normal((t, w)).astype(np.float32) for w in widths[1:]]
    for be in (cpu1, cpu2):
        g = Graph()
        tw = g.input("wide", wide.shape)
        parts = [lib.ggml_view_2d(g.ctx, tw, widths[0], t, tw.nb[1], 2 * 4)]
        parts += [g.input(f"p{i}", r.shape) for i, r in enumerate(rest)]
        g.output(co.channel_join(g.ctx, parts), "out")
        got = be.execute(g, {"wide": wide, **{f"p{i}": r for i, r in enumerate(rest)}})["out"]
        want = np.concatenate([wide[:, 2:2 + widths[0]], *rest], axis=1)
        assert np.array_equal(got.reshape(want.shape), want)


@needs_ops
def test_channel_join_rejects_what_the_kernel_cannot_take() -> None:
    g = Graph()
    a, b = g.input("a", (5, 8)), g.input("b", (6, 8))
    with pytest.raises(ValueError, match="part 1"):
        co.channel_join(g.ctx, [a, b])
    with pytest.raises(ValueError, match="1 to 9 parts"):  # ggml's custom node takes 9
        co.channel_join(g.ctx, [a] * 10)
    with pytest.raises(ValueError, match="contiguous rows"):
        co.channel_join(g.ctx, [a, lib.ggml_transpose(g.ctx, g.input("c", (8, 5)))])


@needs_ops
@pytest.mark.parametrize("lengths", [[3] * 9, [1, 200, 7], [5, 1, 1, 2], [40]])
def test_time_join_is_numpys_concatenate(cpu1: BackendSet, cpu2: BackendSet,
                                         lengths: list[int]) -> None:
    """Parts one after another in time, the first a row-range view of a longer tensor, on 1
    and 2 threads (rows split across them, some threads' rows in one part, some across
    several); as many parts as ggml allows a node."""
    rng = np.random.default_rng(sum(lengths))
    c = 24
    long = rng.standard_normal((lengths[0] + 6, c)).astype(np.float32)
    rest = [rng.standard_normal((n, c)).astype(np.float32) for n in lengths[1:]]
    for be in (cpu1, cpu2):
        g = Graph()
        tl = g.input("long", long.shape)
        parts = [lib.ggml_view_2d(g.ctx, tl, c, lengths[0], tl.nb[1], 4 * tl.nb[1])]
        parts += [g.input(f"p{i}", r.shape) for i, r in enumerate(rest)]
        g.output(co.time_join(g.ctx, parts), "out")
        got = be.execute(g, {"long": long, **{f"p{i}": r for i, r in enumerate(rest)}})["out"]
        want = np.concatenate([long[4 : 4 + lengths[0]], *rest], axis=0)
        assert np.array_equal(got.reshape(want.shape), want)


@needs_ops
def test_time_join_rejects_what_the_kernel_cannot_take() -> None:
    g = Graph()
    a, b = g.input("a", (5, 8)), g.input("b", (5, 6))
    with pytest.raises(ValueError, match="part 1"):
        co.time_join(g.ctx, [a, b])
    with pytest.raises(ValueError, match="1 to 9 parts"):
        co.time_join(g.ctx, [a] * 10)
    with pytest.raises(ValueError, match="contiguous rows"):
        co.time_join(g.ctx, [a, lib.ggml_transpose(g.ctx, g.input("c", (8, 5)))])
    with pytest.raises(ValueError, match="part 1 must be"):
        co.time_join(g.ctx, [a, lib.ggml_view_2d(g.ctx, a, 8, 0, a.nb[1], 0)])


@needs_ops
@pytest.mark.parametrize("weighted", [False, True], ids=["uniform", "weighted"])
@pytest.mark.parametrize(("t", "c", "offset"), [(937, 48, 0.0), (3, 5, 0.0), (1, 1, 0.0),
                                                (250, 17, 1000.0)])
def test_pool_stats_is_the_float64_mean_and_variance(cpu1: BackendSet, cpu2: BackendSet,
                                                     weighted: bool, t: int, c: int,
                                                     offset: float) -> None:
    """Per-channel mean and variance over time, uniform and softmax-weighted, from rows of a
    wider tensor (strided); a large common offset (mean >> std) keeps the variance exact."""
    rng = np.random.default_rng(t * c)
    wide = (rng.standard_normal((c, t + 3)) * 2.0 + offset).astype(np.float32)
    logits = rng.standard_normal((c, t)) * 3.0
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    w = (w / w.sum(axis=1, keepdims=True)).astype(np.float32)
    x64 = wide[:, 1:1 + t].astype(np.float64)
    w64 = w.astype(np.float64) if weighted else np.full((c, t), 1.0 / t)
    mean = (w64 * x64).sum(axis=1)
    var = (w64 * (x64 - mean[:, None]) ** 2).sum(axis=1)
    for be in (cpu1, cpu2):
        g = Graph()
        tw = g.input("wide", wide.shape)
        x = lib.ggml_view_2d(g.ctx, tw, t, c, tw.nb[1], 4)
        g.output(co.pool_stats(g.ctx, x, g.input("w", w.shape) if weighted else None), "out")
        got = be.execute(g, {"wide": wide, "w": w} if weighted else {"wide": wide})["out"]
        g.close()
        got = got.reshape(2, c)
        np.testing.assert_allclose(got[0], mean, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got[1], var, rtol=1e-5, atol=1e-12)


@needs_ops
def test_pool_stats_rejects_what_the_kernel_cannot_take() -> None:
    g = Graph()
    x = g.input("x", (4, 9))
    with pytest.raises(ValueError, match="weights must be shaped like x"):
        co.pool_stats(g.ctx, x, g.input("w", (4, 8)))
    with pytest.raises(ValueError, match="x must be 2-D with contiguous rows"):
        co.pool_stats(g.ctx, lib.ggml_transpose(g.ctx, x))
    with pytest.raises(TypeError):
        co.pool_stats(g.ctx, g.input("i", (4, 9), dtype=np.int32))
    g.close()


# ---------------------------------------------------------------------------------------------
# F32 Winograd F(6,7) conv (fast mode without the BF16 kernels)


def run_conv_wino_f32(be: BackendSet, xp: np.ndarray[Any, Any], w_oik: np.ndarray[Any, Any],
                      b: np.ndarray[Any, Any], d: int, library: Any = None
                      ) -> np.ndarray[Any, Any]:
    """conv1d_wino_f32 of xp (history in front)."""
    wp = co.pack_conv_weight_wino_f32(w_oik)
    g = Graph()
    tx, tb, tw = g.input("x", xp.shape), g.input("b", b.shape), g.input("w", wp.shape)
    g.output(co.conv1d_wino_f32(g.ctx, tx, tw, tb, d, library=library), "y")
    t = xp.shape[0] - (w_oik.shape[2] - 1) * d
    y = be.execute(g, {"x": xp, "w": wp, "b": b})["y"].reshape(t, w_oik.shape[0])
    g.close()
    return y


WINO_F32_CASES = [  # (C_in, C_out, T, K, d): T below, at and past a tile (6d) and a stretch
    # of d tiles, several chunks; small weights (tiles shared out) and large ones (output
    # blocks shared out); odd channels, partial output blocks, one output channel; K = 2 as the
    # transposed convs use it
    (96, 96, 1, 7, 1), (96, 96, 2, 7, 3), (96, 96, 7, 7, 3), (96, 96, 6, 7, 1),
    (96, 96, 54, 7, 9), (96, 96, 55, 7, 9), (96, 96, 5000, 7, 1), (96, 96, 5000, 7, 9),
    (192, 192, 777, 7, 9), (384, 384, 700, 7, 1), (95, 100, 333, 7, 3), (95, 40, 1, 7, 9),
    (96, 1, 500, 7, 1), (7, 3, 100, 7, 2), (768, 768, 32, 7, 9), (768, 768, 1100, 7, 3),
    (1024, 1536, 124, 7, 1), (40, 33, 37, 7, 2),
    (96, 96, 1, 2, 1), (96, 96, 7, 2, 1), (95, 100, 333, 2, 3), (40, 33, 37, 2, 2),
    (192, 288, 5000, 2, 1), (384, 768, 700, 2, 1), (768, 1920, 40, 2, 1), (1536, 6144, 9, 2, 1),
]


@needs_ops
@pytest.mark.parametrize("c_in,c_out,t,k,d", WINO_F32_CASES)
def test_conv_wino_f32_matches_float64(cpu1: BackendSet, cpu2: BackendSet, c_in: int,
                                       c_out: int, t: int, k: int, d: int) -> None:
    """F(6,7) / F(6,2) in F32 are the K = 7 / K = 2 convs up to rounding: >= 85 dB SNR against
    float64 (the BF16 kernels: ~51 dB), the same for any thread count."""
    rng = np.random.default_rng(c_in + 7 * c_out + 13 * t + d + k)
    xp, w, b = conv_data(rng, c_in, c_out, t, k, d)
    ref = conv_ref(xp, w, b, d)
    y = run_conv_wino_f32(cpu2, xp, w, b, d)
    assert y.shape == ref.shape and np.isfinite(y).all()
    assert snr_db(y, ref) >= 85.0
    assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max()
    assert np.array_equal(y, run_conv_wino_f32(cpu1, xp, w, b, d))


@needs_ops
@pytest.mark.parametrize("c_in,c_out,t,k,d", [(96, 96, 777, 7, 9), (768, 768, 100, 7, 3),
                                              (384, 768, 200, 2, 1), (40, 33, 5, 7, 1)])
def test_conv_wino_f32_any_thread_count(cpu1: BackendSet, c_in: int, c_out: int, t: int, k: int,
                                        d: int) -> None:
    """Tiles (small weights) or output blocks (large ones) shared out over 3 and 5 threads,
    some of them idle when there are fewer tiles or blocks: the same bits as one thread."""
    rng = np.random.default_rng(c_in + t + k + d)
    xp, w, b = conv_data(rng, c_in, c_out, t, k, d)
    one = run_conv_wino_f32(cpu1, xp, w, b, d)
    for n in (3, 5):
        be = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": str(n)})
        try:
            assert np.array_equal(run_conv_wino_f32(be, xp, w, b, d), one)
        finally:
            be.close()


@needs_ops
def test_conv_wino_f32_on_o1_weights_and_large_inputs(cpu2: BackendSet) -> None:
    """Stress statistics: weights O(1) per tap (not 1/sqrt(fan-in)) and inputs of +-100, where
    a transform with large constants would lose digits first."""
    rng = np.random.default_rng(11)
    c, t, d = 96, 400, 3
    for k in (7, 2):
        xp = (100 * rng.standard_normal((t + (k - 1) * d, c))).astype(np.float32)
        w = rng.standard_normal((c, c, k)).astype(np.float32)
        b = rng.standard_normal(c).astype(np.float32)
        ref = conv_ref(xp, w, b, d)
        assert snr_db(run_conv_wino_f32(cpu2, xp, w, b, d), ref) >= 90.0


@needs_ops
@pytest.mark.parametrize("t", [1, 2, 17, 500])
@pytest.mark.parametrize("c", [96, 95, 768])
@pytest.mark.parametrize("k,d", [(7, 1), (7, 3), (7, 9), (2, 1), (2, 3)])
def test_conv_wino_f32_hist_apart_equals_concat(cpu1: BackendSet, cpu2: BackendSet, t: int,
                                                c: int, k: int, d: int) -> None:
    rng = np.random.default_rng(300 * d + c + t + k)
    hist = rng.standard_normal(((k - 1) * d, c)).astype(np.float32)
    x = rng.standard_normal((t, c)).astype(np.float32)
    w = (rng.standard_normal((c, c, k)) / np.sqrt(c * k)).astype(np.float32)
    cat1, two1, cat2, two2 = run_conv_two_ways([cpu1, cpu2], "wino_f32", hist, x, w, d)
    assert np.array_equal(two2, cat2) and np.array_equal(two1, cat1)
    assert np.array_equal(two1, two2)


@needs_ops
@pytest.mark.parametrize("t", [1, 17, 3000])
@pytest.mark.parametrize("c_in,c_out", [(96, 96), (95, 100), (768, 40)])
@pytest.mark.parametrize("k,d,with_res", [(7, 1, True), (7, 3, False), (7, 9, True),
                                          (2, 1, False), (2, 2, True)])
def test_conv_wino_f32_fused_snake_and_residual(cpu1: BackendSet, cpu2: BackendSet, t: int,
                                                c_in: int, c_out: int, k: int, d: int,
                                                with_res: bool) -> None:
    check_fused_equals_apart(cpu1, cpu2, c_in + t + d + k, t, c_in, c_out, k, d,
                             with_res, "wino_f32")


@pytest.mark.parametrize("k", [7, 2])
def test_wino_f32_transforms_compute_the_conv(k: int) -> None:
    """The filter transform of the packer and the C file's input and output transforms (taken
    here from the C source) are one algorithm: A^T [(G g) * (B^T x)] is the k-tap correlation
    of six outputs, exactly, for every filter and input."""
    src = (Path(__file__).parents[2] / "native" / "ops" / "conv1d_wino_f32.c").read_text()
    al = k + 5

    def table(name: str, rows: int) -> np.ndarray[Any, Any]:
        body = src.split(f"static const float {name}[")[1].split("};")[0]
        vals = [float(v) for v in re.findall(r"-?\d+\.\d+(?:e-?\d+)?", body.split("=", 1)[1])]
        return np.array(vals).reshape(rows, -1)

    bt, at, g = table(f"BT{k}", al), table(f"AT{k}", 6), co.wino_f32_filter(k)
    assert bt.shape == (al, al) and at.shape == (6, al) and g.shape == (al, k)
    # sum_p AT[i, p] G[p, j] BT[p, l] = [l == i + j]
    got = np.einsum("ip,pj,pl->ijl", at, g, bt)
    want = np.zeros((6, k, al))
    for i in range(6):
        for j in range(k):
            want[i, j, i + j] = 1.0
    assert np.abs(got - want).max() < 1e-12


@needs_ops
def test_pack_conv_weight_wino_f32() -> None:
    rng = np.random.default_rng(4)
    w = rng.standard_normal((40, 5, 7)).astype(np.float32)
    p = co.pack_conv_weight_wino_f32(w)
    assert p.shape == (3, 12, 5, 16) and p.dtype == np.float32
    g = co.wino_f32_filter(7)
    o, c = 33, 3  # block 2, lane 1
    want = (g @ w[o, c].astype(np.float64)).astype(np.float32)
    assert np.array_equal(p[2, :, c, 1], want)
    assert np.array_equal(p[0, :, 2, 0], (g @ w[0, 2].astype(np.float64)).astype(np.float32))
    assert not p[2, :, :, 8:].any()  # outputs past 40: zero
    p2 = co.pack_conv_weight_wino_f32(w[:, :, :2])
    assert p2.shape == (3, 7, 5, 16)
    want2 = (co.wino_f32_filter(2) @ w[o, c, :2].astype(np.float64)).astype(np.float32)
    assert np.array_equal(p2[2, :, c, 1], want2)
    with pytest.raises(ValueError, match="must be \\[C_out, C_in, 7 or 2\\]"):
        co.pack_conv_weight_wino_f32(np.zeros((4, 4, 3), np.float32))


@needs_ops
def test_conv_wino_f32_rejects_what_the_kernel_cannot_take() -> None:
    c = 96
    with Graph() as g:
        # a direct conv's packing (its K = 7 one has the shape of a K = 2 Winograd weight)
        tw, tb, _ = _conv_op_inputs(g, "f32", np.zeros((c, c, 3), np.float32))
        with pytest.raises(ValueError, match="pack_conv_weight_wino_f32"):
            co.conv1d_wino_f32(g.ctx, g.input("x", (20 + 18, c)), tw, tb, 3)
        tw2, tb2, _ = _conv_op_inputs(g, "wino_f32", np.zeros((c, c, 7), np.float32))
        co.conv1d_wino_f32(g.ctx, g.input("x1", (19, c)), tw2, tb2, 3)  # fine: T = 1
        with pytest.raises(ValueError, match="xp"):
            co.conv1d_wino_f32(g.ctx, g.input("x2", (18, c)), tw2, tb2, 3)
        with pytest.raises(ValueError, match="pack_conv_weight_wino_f32"):
            co.conv1d_wino_f32(g.ctx, g.input("x3", (40, c + 1)), tw2, tb2, 3)
        with pytest.raises(ValueError, match="dilation"):
            co.conv1d_wino_f32(g.ctx, g.input("x4", (40, c)), tw2, tb2, 0)
        tb3 = g.input("b3", (c,), ggml_type=BF16)
        with pytest.raises(TypeError, match="bias"):
            co.conv1d_wino_f32(g.ctx, g.input("x5", (40, c)), tw2, tb3, 3)
