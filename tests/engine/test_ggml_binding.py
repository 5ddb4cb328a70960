"""The cffi binding computes what numpy computes, through real ggml graphs."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engine.backend import BackendSet
from engine.ggml import Graph, ffi, lib, native_info, shape_of


@pytest.fixture(scope="module")
def cpu() -> BackendSet:
    return BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2"})


def test_binding_is_from_the_pinned_headers() -> None:
    assert ffi.string(lib.ggml_version()).decode() == native_info()["ggml_version"] == "0.20.2"
    # the real struct, not a hand-written one: ne/nb/data/name at the header's offsets
    assert ffi.sizeof("struct ggml_tensor") == 336
    assert ffi.offsetof("struct ggml_tensor", "data") == 248
    assert lib.GGML_MAX_DIMS == 4


def test_matmul(cpu: BackendSet) -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((37, 64)).astype(np.float32)  # [out, in]
    b = rng.standard_normal((11, 64)).astype(np.float32)  # [rows, in]
    g = Graph()
    ta, tb = g.input("a", a.shape), g.input("b", b.shape)
    g.output(lib.ggml_mul_mat(g.ctx, ta, tb), "y")
    y = cpu.execute(g, {"a": a, "b": b})["y"]
    assert y.shape == (11, 37)
    np.testing.assert_allclose(y, b @ a.T, rtol=1e-5, atol=1e-5)


def _conv1d_numpy(x: np.ndarray, w: np.ndarray, dilation: int) -> np.ndarray:
    """Causal conv: x [C, T], w [O, C, K] -> [O, T] with (K-1)*d zeros on the left."""
    _o, c, k = w.shape
    pad = (k - 1) * dilation
    xp = np.concatenate([np.zeros((c, pad), x.dtype), x], axis=1)
    t = x.shape[1]
    cols = np.stack([xp[:, i * dilation : i * dilation + t] for i in range(k)], axis=1)  # C,K,T
    return np.einsum("ock,ckt->ot", w.astype(np.float64), cols.astype(np.float64))


def test_conv1d_im2col_f32_is_exact(cpu: BackendSet) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 50)).astype(np.float32)
    w = rng.standard_normal((8, 16, 7)).astype(np.float32)
    g = Graph()
    tx, tw = g.input("x", x.shape), g.input("w", w.shape)
    xp = lib.ggml_pad_ext(g.ctx, tx, 6 * 3, 0, 0, 0, 0, 0, 0, 0)
    cols = lib.ggml_im2col(g.ctx, tw, xp, 1, 0, 0, 0, 3, 0, False, lib.GGML_TYPE_F32)
    y = lib.ggml_mul_mat(g.ctx, lib.ggml_reshape_2d(g.ctx, tw, 16 * 7, 8), cols)
    g.output(lib.ggml_cont(g.ctx, lib.ggml_transpose(g.ctx, lib.ggml_reshape_2d(
        g.ctx, y, 8, 50))), "y")
    out = cpu.execute(g, {"x": x, "w": w})["y"]
    np.testing.assert_allclose(out, _conv1d_numpy(x, w, 3), rtol=1e-5, atol=2e-5)
    # and ggml's own conv_1d agrees to its F16 im2col precision (its im2col intermediate is F16)
    g2 = Graph()
    tx, tw = g2.input("x", x.shape), g2.input("w", w.shape)
    xp = lib.ggml_pad_ext(g2.ctx, tx, 6, 0, 0, 0, 0, 0, 0, 0)
    g2.output(lib.ggml_conv_1d(g2.ctx, tw, xp, 1, 0, 1), "y")
    out2 = cpu.execute(g2, {"x": x, "w": w})["y"].reshape(8, 50)
    np.testing.assert_allclose(out2, _conv1d_numpy(x, w, 1), rtol=0, atol=2e-2)


def test_softmax(cpu: BackendSet) -> None:
    x = np.random.default_rng(2).standard_normal((5, 33)).astype(np.float32) * 4
    g = Graph()
    g.output(lib.ggml_soft_max(g.ctx, g.input("x", x.shape)), "y")
    y = cpu.execute(g, {"x": x})["y"]
    ref = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(y, ref / ref.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)


def test_shapes_are_numpy_order() -> None:
    g = Graph()
    t = g.input("x", (3, 5, 7))
    assert shape_of(t) == (3, 5, 7)
    assert tuple(t.ne[i] for i in range(3)) == (7, 5, 3)


def test_compute_releases_the_gil(cpu: BackendSet) -> None:
    """A Python thread keeps running while another thread is inside ggml compute."""
    a = np.random.default_rng(3).standard_normal((1024, 1024)).astype(np.float32)
    g = Graph()
    ta = g.input("a", a.shape)
    y = ta
    for _ in range(12):
        y = lib.ggml_mul_mat(g.ctx, ta, y)
    g.output(lib.ggml_scale(g.ctx, y, 1e-30), "y")
    ticks = 0
    done = threading.Event()

    def compute() -> None:
        cpu.execute(g, {"a": a})
        done.set()

    th = threading.Thread(target=compute)
    th.start()
    time.sleep(0.005)
    start_ticks = ticks
    while not done.is_set():
        ticks += 1
    th.join()
    # if the C call held the GIL this loop could not advance until compute finished
    assert ticks - start_ticks > 1000
