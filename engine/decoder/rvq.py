"""Stage 1, RVQ dequantisation: 16 codebook lookups -> [T, 512].

Math: docs/architecture.md, RVQ dequantisation.
"""

from __future__ import annotations

import numpy as np

from engine.decoder.blocks import StageGraph, linear
from engine.decoder.weights import DecoderWeights
from engine.ggml import Tensor, lib


def build(g: StageGraph, w: DecoderWeights, n_frames: int) -> Tensor:
    """``P_first E_0[c_0] + P_rest sum_q E_q[c_q]``; input ``codes`` is int32 [16, T]."""
    ctx = g.ctx
    n_q = len(w.codebooks)
    codes = g.input("codes", (n_q, n_frames), dtype=np.int32)

    def lookup(q: int) -> Tensor:
        ids = lib.ggml_view_1d(ctx, codes, n_frames, q * codes.nb[1])
        return lib.ggml_get_rows(ctx, w.codebooks[q], ids)  # [256, T]

    rest = lookup(1)
    for q in range(2, n_q):
        rest = lib.ggml_add(ctx, rest, lookup(q))
    first = linear(g, lookup(0), w.first_proj)
    return g.tap(lib.ggml_add(ctx, first, linear(g, rest, w.rest_proj)), "dec.rvq.out")
