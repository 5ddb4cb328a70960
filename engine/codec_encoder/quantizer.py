"""Mimi's split residual VQ (encode side) on ggml: nearest codebook entry per level.

The semantic RVQ (first ``num_semantic_quantizers`` levels) and the acoustic RVQ (the rest) each
project the same embedding with their own 1x1 ``input_proj``; each level picks the entry with
the smallest Euclidean distance, i.e. the largest ``2 x.e - |e|^2``, and subtracts it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.codec_encoder.schema import CODEBOOK_EPS, CodecEncoderConfig
from engine.ggml import Tensor, lib
from engine.ggml.ops1d import ConvForm


def codebook(embed_sum: npt.NDArray[np.float32], usage: npt.NDArray[np.float32]
             ) -> npt.NDArray[np.float32]:  # fmt: skip
    """``embed_sum / max(usage, eps)`` in F32, as ``MimiEuclideanCodebook.embed`` computes it."""
    return (embed_sum / np.maximum(usage, np.float32(CODEBOOK_EPS))[:, None]).astype(np.float32)


def neg_half_norms(embed: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """``-|e|^2 / 2`` per entry, shaped ``[size]``: the score is ``x.e - |e|^2 / 2``, computed
    as a 1x1 conv whose bias is this vector."""
    e = embed.astype(np.float64)
    out: npt.NDArray[np.float32] = (-0.5 * (e * e).sum(axis=1)).astype(np.float32)
    return out


def encode(ctx: Any, W: Callable[[str], Tensor], form: ConvForm,
           zero_bias: Callable[[int], Tensor], c: CodecEncoderConfig, x: Tensor
           ) -> Tensor:  # fmt: skip
    """Graph: time-major ``[hidden, T]`` -> codes int32 ne ``[T, n_q]`` (numpy ``[n_q, T]``).
    The input projections and the scores run on the direct conv kernel (``.packed`` weights:
    ``ConvForm.pack``; the score's bias is ``-|e|^2 / 2``)."""
    codes: list[Tensor] = []
    nsem = c.num_semantic_quantizers
    for short, levels in (("sem", range(nsem)), ("ac", range(nsem, c.num_quantizers))):
        if len(levels) == 0:
            continue
        r = form.conv(ctx, W(f"cenc.vq.{short}_in_proj.packed"), zero_bias(c.codebook_dim), x)
        for q in levels:
            e = W(f"cenc.vq.cb.{q}.embed")
            score = form.conv(ctx, W(f"cenc.vq.cb.{q}.packed"), W(f"cenc.vq.cb.{q}.neg_half_norm"),
                              r)  # fmt: skip
            idx = form.argmax(ctx, score)  # [T] int32
            codes.append(idx)
            if q + 1 < levels.stop:
                r = lib.ggml_sub(ctx, r, lib.ggml_get_rows(ctx, e, idx))
    out = lib.ggml_reshape_2d(ctx, codes[0], int(codes[0].ne[0]), 1)
    for idx in codes[1:]:
        out = lib.ggml_concat(ctx, out, lib.ggml_reshape_2d(ctx, idx, int(idx.ne[0]), 1), 1)
    return out
