"""The SEANet conv encoder and the downsampling conv of Mimi, time-major on ggml.

Every ``MimiConv1d`` is causal: it pads ``k_eff - stride`` samples in front (zeros; the
downsampling conv repeats the edge sample instead) and as many at the end as make the last
window complete (``_get_extra_padding_for_conv1d``), then runs a valid conv. Here the front
padding is the conv kernel's separate history (a view of a zero buffer, or the first row
repeated) and the strided convs are folded (``engine.ggml.ops1d``), so nothing is unfolded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from engine.codec_encoder.schema import CodecEncoderConfig
from engine.ggml import Tensor, lib
from engine.ggml import custom_ops as co
from engine.ggml.ops1d import ConvForm, pad_zero, repeat_row, row, zeros

ZERO_BUFFER = "cenc.zeros"  # the store's zero buffer (left padding of every causal conv)


def causal_padding(length: int, kernel: int, stride: int, dilation: int) -> tuple[int, int]:
    """``(left, right)`` padding of a causal ``MimiConv1d`` for an input of ``length``."""
    k_eff = (kernel - 1) * dilation + 1
    total = k_eff - stride
    n_frames = math.ceil((length - k_eff + total) / stride + 1) - 1
    ideal = n_frames * stride + k_eff - total
    return total, ideal - length


def zero_buffer_size(c: CodecEncoderConfig) -> int:
    """Values the zero buffer needs: the largest left padding of any conv, or the widest
    bias-free output (its zero bias), in floats."""
    need = [c.hidden_size, c.intermediate_size, c.codebook_dim, c.codebook_size]
    for _hf, c_in, _co, k, _stride, dil in c.seanet_convs():
        need.append(c_in * ((k - 1) * dil + 1))
    return max(need)


def _pad_right(ctx: Any, x: Tensor, right: int, replicate: bool) -> Tensor:
    """The reference's extra padding at the end: zeros, or the last row repeated."""
    if right == 0:
        return x
    if not replicate:
        return pad_zero(ctx, x, 0, right)
    return lib.ggml_concat(ctx, x, repeat_row(ctx, row(ctx, x, int(x.ne[1]) - 1), right), 1)


def causal_conv(ctx: Any, W: Callable[[str], Tensor], form: ConvForm, name: str, x: Tensor,
                kernel: int,
                stride: int = 1, dilation: int = 1, replicate: bool = False,
                bias: bool = True) -> Tensor:  # fmt: skip
    """A ``MimiConv1d`` (non-streaming) on ``x`` [T, C_in] -> ``[T_out, C_out]``; its weight is
    packed by ``ConvForm.pack`` (folded when strided). Without a bias (only the
    downsampling conv, whose C_out = C_in) the bias is a view of the zero buffer."""
    w = W(f"{name}.weight")
    b = W(f"{name}.bias") if bias else lib.ggml_view_1d(ctx, W(ZERO_BUFFER), int(x.ne[0]), 0)
    c_in, t = int(x.ne[0]), int(x.ne[1])
    left, right = causal_padding(t, kernel, stride, dilation)
    wino = form.wino(kernel, stride, c_in, int(b.ne[0]), dilation)
    if stride == 1:
        hist = zeros(ctx, W(ZERO_BUFFER), c_in, left) if left else None
        return form.conv(ctx, w, b, x, dilation=dilation, hist=hist, wino=wino)
    # left = kernel - stride: whole folded rows (the history) when the kernel spans whole
    # strides, as in every Mimi conv; then the input plus ``right`` is a whole number of rows
    if kernel % stride or left // stride != form.taps(w, wino) - 1:
        raise ValueError(f"{name}: a causal stride-{stride} conv of {kernel} taps does not fold")
    n_out = (left + t + right - kernel) // stride + 1
    xp = _pad_right(ctx, x, right, replicate)
    if replicate:
        hist = repeat_row(ctx, row(ctx, x, 0), left)  # [left, C]: whole folded rows
        hist = lib.ggml_reshape_2d(ctx, hist, c_in * stride, left // stride)
    else:
        hist = zeros(ctx, W(ZERO_BUFFER), c_in * stride, left // stride) if left else None
    y = form.conv_strided(ctx, w, b, xp, stride, hist, wino)
    if int(y.ne[1]) != n_out:
        raise AssertionError(f"{name}: {int(y.ne[1])} frames, expected {n_out}")
    return y


def seanet(ctx: Any, W: Callable[[str], Tensor], form: ConvForm, c: CodecEncoderConfig,
           wav: Tensor) -> Tensor:  # fmt: skip
    """Graph: ``wav`` [N, 1] (time-major) -> ``[T, hidden]`` at ``sample_rate / prod(ratios)``
    frames per second."""
    convs = c.seanet_convs()

    def unit_wino(n: int) -> bool:
        """Whether unit ``n``'s first conv runs in Winograd groups."""
        _hf, c_in, c_out, k, stride, dil = convs[n]
        return form.wino(k, stride, c_in, c_out, dil)

    def cv(n: int, x: Tensor) -> Tensor:
        _hf, _ci, _co, k, stride, dil = convs[n]
        return causal_conv(ctx, W, form, f"cenc.conv.{n}", x, k, stride, dil)

    def unit(n: int, h: Tensor, last: bool) -> Tensor:
        """A residual unit; with ``last``, the ELU of its sum (what the strided conv reads)."""
        if form.direct:  # one node, its intermediates never leave the cache
            p, q = f"cenc.conv.{n}", f"cenc.conv.{n + 1}"
            return co.seanet_unit(ctx, h, W(f"{p}.weight"), W(f"{p}.bias"), W(f"{q}.weight"),
                                  W(f"{q}.bias"), convs[n][5], elu_out=last,
                                  wino=unit_wino(n))  # fmt: skip
        r = cv(n, form.elu(ctx, h))
        s = lib.ggml_add(ctx, h, cv(n + 1, form.elu(ctx, r)))
        return form.elu(ctx, s) if last else s

    def stage(n: int, h: Tensor, pre: int | None = None) -> Tensor:
        """The last unit of a stage and the strided conv after it, in one node where the
        conv's kernel spans two strides (every Mimi stage) and its weights are not larger than
        the stage's input: the node reads them once per time slice, the separate nodes write
        the unit's output (the size of the input) out and read it back. ``pre``: the conv
        that makes ``h`` from the one-channel ``h`` given (the first conv), in the node too."""
        _hf, c_in, c_out, k, stride, _dil = convs[n + 2]
        size = int(h.ne[1]) * c_in  # the stage's input [T, C], in floats
        if not form.direct or k != 2 * stride or c_in * c_out * k > size:
            return cv(n + 2, unit(n, h if pre is None else cv(pre, h), last=True))
        p, q, s = (f"cenc.conv.{i}" for i in (n, n + 1, n + 2))
        pw = None if pre is None else (W(f"cenc.conv.{pre}.weight"), W(f"cenc.conv.{pre}.bias"))
        wino = form.wino(k, stride, c_in, c_out)
        return co.seanet_stage(ctx, h, W(f"{p}.weight"), W(f"{p}.bias"), W(f"{q}.weight"),
                               W(f"{q}.bias"), W(f"{s}.weight"), W(f"{s}.bias"), stride,
                               convs[n][5], wino=wino, unit_wino=unit_wino(n),
                               pre=pw)  # fmt: skip

    # the first conv (one input channel, stride and dilation 1) runs inside the first stage's
    # node where that stage is one unit
    one_unit = (c.num_residual_layers == 1 and bool(c.upsampling_ratios)
                and convs[0][1] == 1 and convs[0][4:] == (1, 1))
    h = wav if one_unit else cv(0, wav)
    n = 1
    for _ratio in c.upsampling_ratios:
        if not c.num_residual_layers:
            h = cv(n, form.elu(ctx, h))
            n += 1
            continue
        for _j in range(c.num_residual_layers - 1):
            h = unit(n, h, last=False)
            n += 2
        h = stage(n, h, pre=0 if one_unit and n == 1 else None)
        n += 3
    return cv(n, form.elu(ctx, h))


def downsample(ctx: Any, W: Callable[[str], Tensor], form: ConvForm, c: CodecEncoderConfig,
               x: Tensor) -> Tensor:  # fmt: skip
    """The stride-2 downsampling conv (no bias, replicate padding): 25 Hz -> 12.5 Hz."""
    return causal_conv(ctx, W, form, "cenc.downsample", x, c.downsample_kernel, stride=2,
                       replicate=True, bias=False)  # fmt: skip
