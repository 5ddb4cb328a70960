"""Stage 5, the BigVGAN-style wave generator: decoder.0 .. decoder.6.

Math: docs/architecture.md, Wave generator.

conv_in (k7) -> four blocks [snake -> transposed conv (x8, x5, x4, x3) -> residual units with
dilation 1, 3, 9] -> snake -> conv_out (k7, 96 -> 1) -> clamp to [-1, 1].
"""

from __future__ import annotations

from engine.decoder.blocks import StageGraph, causal_conv, causal_tconv
from engine.decoder.weights import DecoderBlock, DecoderWeights, ResidualUnit
from engine.ggml import Tensor, lib


def residual_unit(g: StageGraph, key: str, x: Tensor, ru: ResidualUnit) -> Tensor:
    """``x + conv1x1(snake(conv_k7_dilated(snake(x))))``."""
    y = causal_conv(g, f"{key}.conv1", x, ru.conv1, ru.dilation, act=ru.snake1)
    return causal_conv(g, f"{key}.conv2", y, ru.conv2, act=ru.snake2, residual=x)


def decoder_block(g: StageGraph, b: int, x: Tensor, blk: DecoderBlock) -> Tensor:
    """snake -> transposed conv upsampling -> three residual units."""
    x = causal_tconv(g, f"blk{b}.tconv", x, blk.tconv, act=blk.snake)
    for r, ru in enumerate(blk.res):
        x = g.tap(residual_unit(g, f"blk{b}.res{r}", x, ru), f"dec.blk{b}.res{r}")
    return x


def build(g: StageGraph, w: DecoderWeights, x: Tensor) -> Tensor:
    """[4T, 1024] -> waveform [1920 T] (time-major [T', 1] is the same memory)."""
    x = g.tap(causal_conv(g, "conv_in", x, w.conv_in), "dec.conv_in.out")
    for b, blk in enumerate(w.blocks, start=1):
        x = g.tap(decoder_block(g, b, x, blk), f"dec.blk{b}.out")
    x = causal_conv(g, "conv_out", x, w.conv_out, act=w.snake_out)
    return g.tap(lib.ggml_clamp(g.ctx, x, -1.0, 1.0), "dec.wav")
