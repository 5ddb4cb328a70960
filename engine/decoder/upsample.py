"""Stage 4, upsampler: twice (transposed conv k2 s2 -> ConvNeXt block), 12.5 -> 50 Hz.

Math: docs/architecture.md, Upsampler.
"""

from __future__ import annotations

from engine.decoder.blocks import StageGraph, causal_tconv, history_rows, linear, rows
from engine.decoder.weights import ConvNeXt, DecoderWeights
from engine.ggml import Tensor, custom_ops, lib


def depthwise_conv(g: StageGraph, key: str, x: Tensor, blk: ConvNeXt) -> Tensor:
    """Causal depthwise conv k7: per-channel taps on shifted rows (exact F32, elementwise)."""
    ctx = g.ctx

    def taps(xp: Tensor, n: int) -> Tensor:
        y = None
        for j, tap in enumerate(blk.dw_taps):
            part = lib.ggml_mul(ctx, rows(ctx, xp, j, n), tap)
            y = part if y is None else lib.ggml_add(ctx, y, part)
        return y

    return lib.ggml_add(ctx, history_rows(g, key, x, len(blk.dw_taps) - 1, taps), blk.dw_bias)


def convnext(g: StageGraph, key: str, x: Tensor, blk: ConvNeXt, eps: float) -> Tensor:
    """``x + gamma * pw2(gelu_erf(pw1(LayerNorm(dwconv(x)))))``."""
    ctx = g.ctx
    y = depthwise_conv(g, key, x, blk)
    y = lib.ggml_add(ctx, lib.ggml_mul(ctx, lib.ggml_norm(ctx, y, eps), blk.norm_w), blk.norm_b)
    h = linear(g, y, blk.pw1)
    # the native op: vectorised (ggml's calls libm's erff per element)
    h = custom_ops.gelu_erf(ctx, h) if g.use_custom_ops else lib.ggml_gelu_erf(ctx, h)
    y = linear(g, h, blk.pw2)
    return lib.ggml_add(ctx, x, lib.ggml_mul(ctx, y, blk.gamma))


def build(g: StageGraph, w: DecoderWeights, x: Tensor) -> Tensor:
    """[T, 1024] -> [4T, 1024]."""
    for i, (tconv, blk) in enumerate(w.upsample):
        x = causal_tconv(g, f"up.{i}.tconv", x, tconv)
        x = g.tap(convnext(g, f"up.{i}.dwconv", x, blk, w.cfg.layer_norm_eps), f"dec.up{i}.out")
    return x
