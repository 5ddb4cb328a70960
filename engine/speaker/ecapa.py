"""The ECAPA-TDNN speaker network on ggml (``Qwen3TTSSpeakerEncoder`` of the reference).

Every conv of the reference uses ``padding="same"`` with ``padding_mode="reflect"``: a kernel
``k`` with dilation ``d`` is reflect-padded by ``d (k - 1) / 2`` on each side (all kernels are odd).
Activations are time-major (``engine.ggml.ops1d``): every conv runs on the direct conv kernel, a
reflect padding is one row gather; the pooling statistics are taken channel-major.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.ggml import Tensor, lib
from engine.ggml import custom_ops as co
from engine.ggml.ops1d import ConvForm, channels, gather_rows, reflect_index
from engine.speaker.schema import SpeakerEncoderConfig

STATS_EPS = 1e-12  # AttentiveStatisticsPooling.eps (clamp of the variance)

Pads = Callable[[int, int], Tensor]  # (left, right) -> int32 row indices of that reflect padding


def same_padding(k: int, dilation: int) -> tuple[int, int]:
    """PyTorch ``padding="same"``: ``(left, right)`` rows around the input."""
    total = dilation * (k - 1)
    return total // 2, total - total // 2


def reflect_paddings(c: SpeakerEncoderConfig) -> set[tuple[int, int]]:
    """Every ``(left, right)`` reflect padding the network uses (one index input each)."""
    out = {same_padding(c.enc_kernel_sizes[0], c.enc_dilations[0]),
           same_padding(c.enc_kernel_sizes[-1], c.enc_dilations[-1])}  # fmt: skip
    for i in range(1, len(c.enc_channels) - 1):
        out.add(same_padding(c.enc_kernel_sizes[i], c.enc_dilations[i]))
    out.discard((0, 0))
    return out


def reflect_indices(c: SpeakerEncoderConfig, frames: int
                    ) -> dict[tuple[int, int], npt.NDArray[np.int32]]:  # fmt: skip
    """The row indices of each padding in :func:`reflect_paddings` for ``frames`` mel frames."""
    return {p: reflect_index(frames, *p) for p in sorted(reflect_paddings(c))}


def packed_weights(c: SpeakerEncoderConfig, tensor: Callable[[str], npt.NDArray[np.float32]],
                   form: ConvForm) -> dict[str, tuple[npt.NDArray[np.float32], int]]:  # fmt: skip
    """Weights in the form the graph reads, each with its ggml type, from the schema's tensors
    (``tensor(name)`` with its PyTorch shape): convs with a time extent packed for ``form``'s
    kernel (stored as ``form.weight_type``); the attention TDNN split into its part on the
    frames and its part on the statistics (the reference concatenates ``[h, mean, std]`` over
    channels; the mean and std are constant in time, so their share is a per-channel bias)."""
    out: dict[str, tuple[npt.NDArray[np.float32], int]] = {}
    names = ["spk.tdnn0", "spk.mfa", "spk.asp.conv"]
    for i in range(1, len(c.enc_channels) - 1):
        g = f"spk.blk.{i}"
        names += [f"{g}.tdnn1", f"{g}.tdnn2"]
        names += [f"{g}.res2net.{j}" for j in range(c.enc_res2net_scale - 1)]
    for n in names:
        out[f"{n}.weight"] = (form.pack(tensor(f"{n}.weight")), form.weight_type)
    w = tensor("spk.asp.tdnn.weight")[:, :, 0]
    ch = c.enc_channels[-1]
    out["spk.asp.tdnn.weight"] = (form.pack(w[:, :ch, None]), form.weight_type)
    out["spk.asp.tdnn.weight_stats"] = (np.ascontiguousarray(w[:, ch:]), lib.GGML_TYPE_F32)
    return out


def _same_conv(ctx: Any, W: Callable[[str], Tensor], pads: Pads, form: ConvForm, name: str,
               x: Tensor, dilation: int = 1) -> Tensor:  # fmt: skip
    w = W(f"{name}.weight")
    left, right = same_padding(form.taps(w), dilation)
    if left or right:
        x = gather_rows(ctx, x, pads(left, right))
    return form.conv(ctx, w, W(f"{name}.bias"), x, dilation=dilation)


def _tdnn(ctx: Any, W: Callable[[str], Tensor], pads: Pads, form: ConvForm, name: str,
          x: Tensor, dilation: int = 1) -> Tensor:  # fmt: skip
    return lib.ggml_relu(ctx, _same_conv(ctx, W, pads, form, name, x, dilation))


def _pointwise_vec(ctx: Any, W: Callable[[str], Tensor], name: str, v: Tensor) -> Tensor:
    """A 1x1 conv on a single time step ``v`` (ne ``[C_in, 1]``) -> ne ``[C_out, 1]``."""
    w = W(f"{name}.weight")
    w2 = lib.ggml_reshape_2d(ctx, w, int(w.ne[1]), int(w.ne[2]))
    y = lib.ggml_mul_mat(ctx, w2, v)
    return lib.ggml_add(ctx, y, W(f"{name}.bias"))


def _as_column(ctx: Any, per_channel: Tensor) -> Tensor:
    """ne ``[1, C]`` (a per-channel value) -> ne ``[C, 1]`` (a vector)."""
    return lib.ggml_reshape_2d(ctx, lib.ggml_cont(ctx, per_channel), int(per_channel.ne[1]), 1)


def _se_res2net(ctx: Any, W: Callable[[str], Tensor], pads: Pads, form: ConvForm,
                c: SpeakerEncoderConfig, i: int, x: Tensor) -> Tensor:  # fmt: skip
    g = f"spk.blk.{i}"
    h = _tdnn(ctx, W, pads, form, f"{g}.tdnn1", x)
    s, width = c.enc_res2net_scale, c.enc_channels[i] // c.enc_res2net_scale
    parts = [channels(ctx, h, 0, width)]
    prev: Tensor | None = None
    for j in range(1, s):
        chunk = channels(ctx, h, j * width, width)
        inp = chunk if prev is None else lib.ggml_add(ctx, chunk, prev)
        prev = _tdnn(ctx, W, pads, form, f"{g}.res2net.{j - 1}", inp, c.enc_dilations[i])
        parts.append(prev)
    h = _tdnn(ctx, W, pads, form, f"{g}.tdnn2", form.join(ctx, parts))
    # squeeze-excitation: channel gates from the time mean
    m = _as_column(ctx, lib.ggml_mean(ctx, form.channel_major(ctx, h)))
    m = lib.ggml_relu(ctx, _pointwise_vec(ctx, W, f"{g}.se1", m))
    gate = lib.ggml_sigmoid(ctx, _pointwise_vec(ctx, W, f"{g}.se2", m))
    return lib.ggml_add(ctx, lib.ggml_mul(ctx, h, gate), x)


def _stats(ctx: Any, form: ConvForm, x: Tensor, weights: Tensor | None) -> Tensor:
    """``[mean | std]`` (ne ``[2 C, 1]``) per channel over time of channel-major ``x``,
    ``weights`` None = uniform."""
    if form.direct:
        mv = co.pool_stats(ctx, x, weights)
        c = int(x.ne[1])
        mean = lib.ggml_view_1d(ctx, mv, c, 0)
        var = lib.ggml_view_1d(ctx, mv, c, c * 4)
    else:
        if weights is None:
            m = lib.ggml_mean(ctx, x)
            d = lib.ggml_sub(ctx, x, m)
            v = lib.ggml_mean(ctx, lib.ggml_sqr(ctx, d))
        else:
            m = lib.ggml_sum_rows(ctx, lib.ggml_mul(ctx, x, weights))
            d = lib.ggml_sub(ctx, x, m)
            v = lib.ggml_sum_rows(ctx, lib.ggml_mul(ctx, lib.ggml_sqr(ctx, d), weights))
        mean, var = lib.ggml_cont(ctx, m), lib.ggml_cont(ctx, v)
    std = lib.ggml_sqrt(ctx, lib.ggml_clamp(ctx, var, STATS_EPS, 3.0e38))
    col = lib.ggml_concat(ctx, lib.ggml_reshape_1d(ctx, mean, int(x.ne[1])),
                          lib.ggml_reshape_1d(ctx, std, int(x.ne[1])), 0)  # fmt: skip
    return lib.ggml_reshape_2d(ctx, col, 2 * int(x.ne[1]), 1)


def x_vector(ctx: Any, W: Callable[[str], Tensor], c: SpeakerEncoderConfig, mel: Tensor,
             pads: Pads, form: ConvForm) -> Tensor:  # fmt: skip
    """Graph: time-major log-mel ``[T, mel_dim]`` -> x-vector ne ``[enc_dim, 1]``; ``pads``
    gives the graph's reflect-padding index inputs (:func:`reflect_indices`)."""
    h = _tdnn(ctx, W, pads, form, "spk.tdnn0", mel, c.enc_dilations[0])
    outs = []
    for i in range(1, len(c.enc_channels) - 1):
        h = _se_res2net(ctx, W, pads, form, c, i, h)
        outs.append(h)
    ht = _tdnn(ctx, W, pads, form, "spk.mfa", form.join(ctx, outs), c.enc_dilations[-1])
    h = form.channel_major(ctx, ht)  # ht: time-major
    # attentive statistics pooling; the TDNN's share of [mean, std] is a bias (packed_weights)
    stats = _stats(ctx, form, h, None)
    bias = lib.ggml_add(ctx, lib.ggml_mul_mat(ctx, W("spk.asp.tdnn.weight_stats"), stats),
                        lib.ggml_reshape_2d(ctx, W("spk.asp.tdnn.bias"),
                                            int(W("spk.asp.tdnn.bias").ne[0]), 1))  # fmt: skip
    bias = lib.ggml_reshape_1d(ctx, bias, int(bias.ne[0]))
    a = lib.ggml_relu(ctx, form.conv(ctx, W("spk.asp.tdnn.weight"), bias, ht))
    a = lib.ggml_tanh(ctx, a)  # time-major [T, attention]
    logits = form.conv(ctx, W("spk.asp.conv.weight"), W("spk.asp.conv.bias"), a)
    weights = lib.ggml_soft_max(ctx, form.channel_major(ctx, logits))  # over time, per channel
    pooled = _stats(ctx, form, h, weights)
    return _pointwise_vec(ctx, W, "spk.fc", pooled)
