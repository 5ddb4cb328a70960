"""Stage 2, pre_conv: causal conv k3, 512 -> 1024.

Math: docs/architecture.md, Pre-conv.
"""

from __future__ import annotations

from engine.decoder.blocks import StageGraph, causal_conv
from engine.decoder.weights import DecoderWeights
from engine.ggml import Tensor


def build(g: StageGraph, w: DecoderWeights, x: Tensor) -> Tensor:
    """[T, 512] -> [T, 1024]."""
    return g.tap(causal_conv(g, "pre_conv", x, w.pre_conv), "dec.pre_conv.out")
