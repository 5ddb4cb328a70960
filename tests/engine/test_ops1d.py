"""The cloning encoders' time-major conv building blocks against float64 numpy: folded strided
convs, causal (Mimi) padding with zeros and with edge replication, reflect padding by row
gather."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engine.backend import BackendSet
from engine.codec_encoder.seanet import ZERO_BUFFER, causal_conv, causal_padding
from engine.ggml import Graph, lib
from engine.ggml import custom_ops as co
from engine.ggml.ops1d import ConvForm, fold_weight, gather_rows, reflect_index

needs_ops = pytest.mark.usefixtures("native_ops")


def conv_ref(x: np.ndarray[Any, Any], w: np.ndarray[Any, Any], b: np.ndarray[Any, Any],
             stride: int, dilation: int) -> np.ndarray[Any, Any]:
    """Valid conv of an already padded ``x`` [L, C_in] (float64) -> [T_out, C_out]."""
    k = w.shape[2]
    span = (k - 1) * dilation + 1
    n = (x.shape[0] - span) // stride + 1
    y = np.tile(b.astype(np.float64), (n, 1))
    for j in range(k):
        rows = x[j * dilation: j * dilation + (n - 1) * stride + 1: stride].astype(np.float64)
        y += rows @ w[:, :, j].T.astype(np.float64)
    return y


def mimi_ref(x: np.ndarray[Any, Any], w: np.ndarray[Any, Any], b: np.ndarray[Any, Any],
             stride: int, dilation: int, replicate: bool) -> np.ndarray[Any, Any]:
    """``MimiConv1d`` as the reference pads it: causal left padding, extra right padding."""
    left, right = causal_padding(x.shape[0], w.shape[2], stride, dilation)
    mode = "edge" if replicate else "constant"
    return conv_ref(np.pad(x, ((left, right), (0, 0)), mode=mode), w, b, stride, dilation)


def run_causal(be: BackendSet, x: np.ndarray[Any, Any], w: np.ndarray[Any, Any],
               b: np.ndarray[Any, Any] | None, stride: int, dilation: int,
               replicate: bool, direct: bool = True, winograd: bool = False
               ) -> np.ndarray[Any, Any]:  # fmt: skip
    form = ConvForm(direct, winograd=winograd)
    store = be.weight_store()
    store.add_array("c.weight", form.pack(w, stride, dilation))
    if b is not None:
        store.add_array("c.bias", b)
    store.add_array(ZERO_BUFFER, np.zeros(w.shape[1] * w.shape[2] * dilation + w.shape[0],
                                          np.float32))  # fmt: skip
    store.allocate()
    try:
        with Graph() as g:
            tx = g.input("x", x.shape)
            y = causal_conv(g.ctx, store.__getitem__, form, "c", tx, w.shape[2], stride,
                            dilation, replicate, bias=b is not None)  # fmt: skip
            g.output(y, "y")
            return be.execute(g, {"x": x})["y"]
    finally:
        store.close()


def test_fold_weight_is_the_same_conv() -> None:
    rng = np.random.default_rng(0)
    for c_in, c_out, k, s, t in [(3, 5, 8, 4, 40), (4, 2, 10, 5, 25), (2, 3, 7, 3, 21),
                                 (6, 4, 4, 2, 12)]:  # fmt: skip
        x = rng.standard_normal((t + (-(-k // s) - 1) * s, c_in))
        w = rng.standard_normal((c_out, c_in, k)).astype(np.float32)
        b = np.zeros(c_out, np.float32)
        want = conv_ref(x, w, b, s, 1)
        folded = x.reshape(-1, s * c_in)  # s consecutive steps as one row
        got = conv_ref(folded, fold_weight(w, s), b, 1, 1)
        np.testing.assert_allclose(got[: want.shape[0]], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("t,left,right", [(10, 2, 2), (5, 4, 4), (7, 1, 3), (3, 0, 2)])
def test_reflect_index_is_torch_reflect(t: int, left: int, right: int) -> None:
    x = np.arange(t)
    assert np.array_equal(x[reflect_index(t, left, right)],
                          np.pad(x, (left, right), mode="reflect"))  # fmt: skip


def test_reflect_index_refuses_too_short() -> None:
    with pytest.raises(ValueError, match="needs more than 4 rows"):
        reflect_index(4, 4, 1)


@needs_ops
def test_gather_rows_on_a_channel_view(cpu2: BackendSet) -> None:
    from engine.ggml.ops1d import channels

    x = np.random.default_rng(1).standard_normal((9, 12)).astype(np.float32)
    idx = reflect_index(9, 3, 3)
    with Graph() as g:
        tx, ti = g.input("x", x.shape), g.input("i", idx.shape, dtype=np.int32)
        g.output(gather_rows(g.ctx, channels(g.ctx, tx, 4, 5), ti), "y")
        got = cpu2.execute(g, {"x": x, "i": idx})["y"]
    assert np.array_equal(got, np.pad(x[:, 4:9], ((3, 3), (0, 0)), mode="reflect"))


@needs_ops
@pytest.mark.parametrize("form", ["direct", "winograd", "mul_mat"])
@pytest.mark.parametrize("t", [48, 49, 50, 53])  # multiples of the stride and not
@pytest.mark.parametrize("k,s,d", [(7, 1, 1), (3, 1, 2), (3, 1, 1), (8, 4, 1), (10, 5, 1),
                                   (4, 2, 1)])  # fmt: skip
def test_causal_conv_zero_padding(cpu2: BackendSet, t: int, k: int, s: int, d: int,
                                  form: str) -> None:  # fmt: skip
    rng = np.random.default_rng(t * 100 + k)
    c_in, c_out = 6, 40
    x = rng.standard_normal((t, c_in)).astype(np.float32)
    w = (rng.standard_normal((c_out, c_in, k)) / np.sqrt(c_in * k)).astype(np.float32)
    b = rng.standard_normal(c_out).astype(np.float32)
    want = mimi_ref(x, w, b, s, d, replicate=False)
    got = run_causal(cpu2, x, w, b, s, d, replicate=False, direct=form != "mul_mat",
                     winograd=form == "winograd")  # fmt: skip
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@needs_ops
@pytest.mark.parametrize("form", ["direct", "winograd", "mul_mat"])
@pytest.mark.parametrize("t", [20, 21])
def test_causal_conv_replicate_padding_without_bias(cpu2: BackendSet, t: int,
                                                    form: str) -> None:  # fmt: skip
    """The downsampling conv: stride 2, 4 taps, edge replication both sides, no bias."""
    rng = np.random.default_rng(t)
    c = 8
    x = rng.standard_normal((t, c)).astype(np.float32)
    w = (rng.standard_normal((c, c, 4)) / np.sqrt(4 * c)).astype(np.float32)
    want = mimi_ref(x, w, np.zeros(c, np.float32), 2, 1, replicate=True)
    got = run_causal(cpu2, x, w, None, 2, 1, replicate=True, direct=form != "mul_mat",
                     winograd=form == "winograd")  # fmt: skip
    assert got.shape == want.shape == (-(-t // 2), c)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def run_conv(be: BackendSet, form: ConvForm, x: np.ndarray[Any, Any], w: np.ndarray[Any, Any],
             b: np.ndarray[Any, Any], dilation: int) -> np.ndarray[Any, Any]:
    """``form.conv`` of an already padded ``x`` [L, C_in] (valid rows only)."""
    store = be.weight_store()
    store.add_array("c.weight", form.pack(w), form.weight_type)
    store.add_array("c.bias", b)
    store.allocate()
    try:
        with Graph() as g:
            y = form.conv(g.ctx, store["c.weight"], store["c.bias"], g.input("x", x.shape),
                          dilation=dilation)
            g.output(y, "y")
            return be.execute(g, {"x": x})["y"]
    finally:
        store.close()


@needs_ops
@pytest.mark.skipif(not co.amx(), reason="split BF16 convs run where AMX does")
@pytest.mark.parametrize("c_in,c_out,k,d,t", [(96, 64, 1, 1, 40), (32, 48, 5, 1, 37),
                                              (16, 16, 3, 3, 50), (130, 33, 1, 1, 9)])
def test_split_convs_have_f32_class_error(cpu2: BackendSet, c_in: int, c_out: int, k: int,
                                          d: int, t: int) -> None:
    """The speaker encoder's convs on AMX: within F32-class error of the float64 conv (plain
    BF16 would be ~1e-3 off), and not the exact kernel's bits (the split kernel ran)."""
    rng = np.random.default_rng(k * 100 + c_in)
    x = rng.standard_normal((t + (k - 1) * d, c_in)).astype(np.float32)
    w = (rng.standard_normal((c_out, c_in, k)) / np.sqrt(c_in * k)).astype(np.float32)
    b = rng.standard_normal(c_out).astype(np.float32)
    want = conv_ref(x, w, b, 1, d)
    split = run_conv(cpu2, ConvForm(True, split=True), x, w, b, d)
    exact = run_conv(cpu2, ConvForm(True), x, w, b, d)
    scale = float(np.abs(want).max())
    assert float(np.abs(split - want).max()) < 2e-5 * scale
    assert float(np.abs(exact - want).max()) < 2e-6 * scale
    assert not np.array_equal(split, exact)


def test_the_speaker_encoder_splits_its_convs_where_amx_runs_them() -> None:
    """Only there, and the speech-tokenizer encoder never (its codes must be the reference's)."""
    assert ConvForm.split_where_fast(True).split == co.amx()
    assert not ConvForm.split_where_fast(False).split
    assert ConvForm(True).weight_type == lib.GGML_TYPE_F32


def test_winograd_where_it_pays() -> None:
    """The codec encoder's strided convs (folded to 2 taps) and its units' first convs (3 taps,
    dilation 1) run in Winograd groups; its last stage's wide strided conv, whose weights stream
    from memory, and every form that did not ask for it do not."""
    form = ConvForm(True, winograd=True)
    assert form.wino(8, 4, 64, 128) and form.wino(12, 6, 256, 512) and form.wino(4, 2, 512, 512)
    assert form.wino(3, 1, 64, 32) and form.wino(3, 1, 1024, 512)
    assert not form.wino(16, 8, 512, 1024)
    assert not form.wino(3, 1, 64, 32, dilation=2)
    assert not form.wino(7, 1, 1, 64) and not form.wino(1, 1, 32, 64)
    assert not form.wino(12, 4, 64, 128)  # folds to 3 taps
    assert not ConvForm(True).wino(8, 4, 64, 128)  # opt-in: the speaker encoder's form
    assert not ConvForm(True, split=True, winograd=True).wino(3, 1, 64, 32)
    assert not ConvForm(False, winograd=True).wino(3, 1, 64, 32)
    w = np.ones((128, 64, 8), np.float32)
    assert form.pack(w, 4).shape[1] == 4  # [blocks, K + 2, C_in, B]: two taps more
    assert ConvForm(True).pack(w, 4).shape[1] == 2
