"""The SEANet conv encoder and the downsampling conv of Mimi, channel-major on ggml.

Every ``MimiConv1d`` is causal: it pads ``k_eff - stride`` samples in front (zeros; the
downsampling conv repeats the edge sample instead) and as many at the end as make the last
window complete (``_get_extra_padding_for_conv1d``), then runs a valid conv.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from engine.codec_encoder.schema import CodecEncoderConfig
from engine.ggml import Tensor, lib
from engine.ggml.ops1d import add_channel_bias, conv1d, pad_replicate_left, pad_zero


def causal_padding(length: int, kernel: int, stride: int, dilation: int) -> tuple[int, int]:
    """``(left, right)`` padding of a causal ``MimiConv1d`` for an input of ``length``."""
    k_eff = (kernel - 1) * dilation + 1
    total = k_eff - stride
    n_frames = math.ceil((length - k_eff + total) / stride + 1) - 1
    ideal = n_frames * stride + k_eff - total
    return total, ideal - length


def _pad_replicate_right(ctx: Any, x: Tensor, n: int) -> Tensor:
    if n == 0:
        return x
    t = int(x.ne[0])
    last = lib.ggml_view_2d(ctx, x, 1, int(x.ne[1]), x.nb[1], (t - 1) * x.nb[0])
    return lib.ggml_concat(ctx, x, lib.ggml_repeat_4d(ctx, last, n, int(x.ne[1]), 1, 1), 0)


def causal_conv(ctx: Any, w: Tensor, b: Tensor | None, x: Tensor, stride: int = 1,
                dilation: int = 1, replicate: bool = False) -> Tensor:  # fmt: skip
    """A ``MimiConv1d`` (non-streaming) on ``x`` [C_in, T]."""
    left, right = causal_padding(int(x.ne[0]), int(w.ne[0]), stride, dilation)
    if replicate:
        xp = _pad_replicate_right(ctx, pad_replicate_left(ctx, x, left), right)
    else:
        xp = pad_zero(ctx, x, left, right)
    y = conv1d(ctx, w, xp, stride=stride, dilation=dilation)
    return y if b is None else add_channel_bias(ctx, y, b)


def seanet(ctx: Any, W: Callable[[str], Tensor], c: CodecEncoderConfig, wav: Tensor) -> Tensor:
    """Graph: ``wav`` [1, N] -> ``[hidden, T]`` at ``sample_rate / prod(ratios)`` frames/s."""
    convs = c.seanet_convs()

    def conv(n: int, x: Tensor) -> Tensor:
        _hf, _ci, _co, _k, stride, dil = convs[n]
        return causal_conv(ctx, W(f"cenc.conv.{n}.weight"), W(f"cenc.conv.{n}.bias"), x,
                           stride, dil)  # fmt: skip

    h = conv(0, wav)
    n = 1
    for _ratio in c.upsampling_ratios:
        for _j in range(c.num_residual_layers):
            r = conv(n, lib.ggml_elu(ctx, h))
            r = conv(n + 1, lib.ggml_elu(ctx, r))
            h = lib.ggml_add(ctx, h, r)
            n += 2
        h = conv(n, lib.ggml_elu(ctx, h))
        n += 1
    return conv(n, lib.ggml_elu(ctx, h))


def downsample(ctx: Any, W: Callable[[str], Tensor], x: Tensor) -> Tensor:
    """The stride-2 downsampling conv (no bias, replicate padding): 25 Hz -> 12.5 Hz."""
    return causal_conv(ctx, W("cenc.downsample.weight"), None, x, stride=2, replicate=True)
