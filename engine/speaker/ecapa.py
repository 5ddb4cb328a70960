"""The ECAPA-TDNN speaker network on ggml (``Qwen3TTSSpeakerEncoder`` of the reference).

Every conv of the reference uses ``padding="same"`` with ``padding_mode="reflect"``: a kernel
``k`` with dilation ``d`` is reflect-padded by ``d (k - 1) / 2`` on each side (all kernels are odd).
Activations are channel-major (``engine.ggml.ops1d``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.ggml import Tensor, lib
from engine.ggml.ops1d import add_channel_bias, conv1d, pad_reflect, rows
from engine.speaker.schema import SpeakerEncoderConfig

STATS_EPS = 1e-12  # AttentiveStatisticsPooling.eps (clamp of the variance)


def _same_conv(ctx: Any, w: Tensor, b: Tensor, x: Tensor, dilation: int = 1) -> Tensor:
    k = int(w.ne[0])
    total = dilation * (k - 1)
    left = total // 2
    y = conv1d(ctx, w, pad_reflect(ctx, x, left, total - left), dilation=dilation)
    return add_channel_bias(ctx, y, b)


def _tdnn(ctx: Any, W: Callable[[str], Tensor], name: str, x: Tensor, dilation: int = 1) -> Tensor:
    return lib.ggml_relu(ctx, _same_conv(ctx, W(f"{name}.weight"), W(f"{name}.bias"), x, dilation))


def _pointwise_vec(ctx: Any, W: Callable[[str], Tensor], name: str, v: Tensor) -> Tensor:
    """A 1x1 conv on a single time step ``v`` (ne ``[C_in, 1]``) -> ne ``[C_out, 1]``."""
    w = W(f"{name}.weight")
    w2 = lib.ggml_reshape_2d(ctx, w, int(w.ne[1]), int(w.ne[2]))
    y = lib.ggml_mul_mat(ctx, w2, v)
    return lib.ggml_add(ctx, y, W(f"{name}.bias"))


def _as_column(ctx: Any, per_channel: Tensor) -> Tensor:
    """ne ``[1, C]`` (a per-channel value) -> ne ``[C, 1]`` (a vector)."""
    return lib.ggml_reshape_2d(ctx, lib.ggml_cont(ctx, per_channel), int(per_channel.ne[1]), 1)


def _se_res2net(
    ctx: Any, W: Callable[[str], Tensor], c: SpeakerEncoderConfig, i: int, x: Tensor
) -> Tensor:
    g = f"spk.blk.{i}"
    h = _tdnn(ctx, W, f"{g}.tdnn1", x)
    s, width = c.enc_res2net_scale, c.enc_channels[i] // c.enc_res2net_scale
    parts = [rows(ctx, h, 0, width)]
    prev: Tensor | None = None
    for j in range(1, s):
        chunk = lib.ggml_cont(ctx, rows(ctx, h, j * width, width))
        inp = chunk if prev is None else lib.ggml_add(ctx, chunk, prev)
        prev = _tdnn(ctx, W, f"{g}.res2net.{j - 1}", inp, c.enc_dilations[i])
        parts.append(prev)
    out = lib.ggml_cont(ctx, parts[0])
    for p in parts[1:]:
        out = lib.ggml_concat(ctx, out, p, 1)
    h = _tdnn(ctx, W, f"{g}.tdnn2", out)
    # squeeze-excitation: channel gates from the time mean
    m = _as_column(ctx, lib.ggml_mean(ctx, h))
    m = lib.ggml_relu(ctx, _pointwise_vec(ctx, W, f"{g}.se1", m))
    gate = lib.ggml_sigmoid(ctx, _pointwise_vec(ctx, W, f"{g}.se2", m))
    h = lib.ggml_mul(ctx, h, lib.ggml_reshape_2d(ctx, gate, 1, int(gate.ne[0])))
    return lib.ggml_add(ctx, h, x)


def _stats(ctx: Any, x: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
    """Per-channel (weighted) mean and std over time; ``weights`` None = uniform."""
    if weights is None:
        mean = lib.ggml_mean(ctx, x)
        d = lib.ggml_sub(ctx, x, mean)
        var = lib.ggml_mean(ctx, lib.ggml_sqr(ctx, d))
    else:
        mean = lib.ggml_sum_rows(ctx, lib.ggml_mul(ctx, x, weights))
        d = lib.ggml_sub(ctx, x, mean)
        var = lib.ggml_sum_rows(ctx, lib.ggml_mul(ctx, lib.ggml_sqr(ctx, d), weights))
    std = lib.ggml_sqrt(ctx, lib.ggml_clamp(ctx, var, STATS_EPS, 3.0e38))
    return mean, std


def x_vector(ctx: Any, W: Callable[[str], Tensor], c: SpeakerEncoderConfig, mel: Tensor
             ) -> Tensor:  # fmt: skip
    """Graph: log-mel ``[mel_dim, T]`` -> x-vector ne ``[enc_dim, 1]``."""
    h = _tdnn(ctx, W, "spk.tdnn0", mel, c.enc_dilations[0])
    outs = []
    for i in range(1, len(c.enc_channels) - 1):
        h = _se_res2net(ctx, W, c, i, h)
        outs.append(h)
    cat = outs[0]
    for o in outs[1:]:
        cat = lib.ggml_concat(ctx, cat, o, 1)
    h = _tdnn(ctx, W, "spk.mfa", cat, c.enc_dilations[-1])
    # attentive statistics pooling
    t = int(h.ne[0])
    mean, std = _stats(ctx, h, None)
    ch = int(h.ne[1])
    ctxcat = lib.ggml_concat(ctx, h, lib.ggml_repeat_4d(ctx, mean, t, ch, 1, 1), 1)
    ctxcat = lib.ggml_concat(ctx, ctxcat, lib.ggml_repeat_4d(ctx, std, t, ch, 1, 1), 1)
    a = lib.ggml_tanh(ctx, _tdnn(ctx, W, "spk.asp.tdnn", ctxcat))
    a = _same_conv(ctx, W("spk.asp.conv.weight"), W("spk.asp.conv.bias"), a)
    a = lib.ggml_soft_max(ctx, a)  # over time, per channel
    mean, std = _stats(ctx, h, a)
    pooled = lib.ggml_concat(ctx, _as_column(ctx, mean), _as_column(ctx, std), 0)
    return _pointwise_vec(ctx, W, "spk.fc", pooled)
