"""Mimi's encoder transformer on ggml: pre-LayerNorm layers, causal attention with NeoX RoPE,
a GELU (erf) MLP and per-channel layer scales. Time-major (ggml ``ne = [C, T]``).

The reference builds a plain causal mask here (``create_causal_mask``; the config's sliding window
is not applied without a cache), so every frame attends to all earlier frames.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.codec_encoder.schema import CodecEncoderConfig
from engine.ggml import NULL, Tensor, lib


def causal_mask(t: int) -> npt.NDArray[np.float32]:
    """``[T, T]`` additive mask: query ``i`` sees keys ``j <= i``."""
    return np.where(np.tri(t, dtype=bool), 0.0, -np.inf).astype(np.float32)


def _layer_norm(ctx: Any, x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    return lib.ggml_add(ctx, lib.ggml_mul(ctx, lib.ggml_norm(ctx, x, eps), w), b)


def _attention(ctx: Any, W: Callable[[str], Tensor], c: CodecEncoderConfig, g: str, x: Tensor,
               pos: Tensor, mask: Tensor) -> Tensor:  # fmt: skip
    d, nh, nkv, t = c.head_dim, c.num_attention_heads, c.num_key_value_heads, int(x.ne[1])

    def heads(name: str, n: int, rope: bool) -> Tensor:
        h = lib.ggml_reshape_3d(ctx, lib.ggml_mul_mat(ctx, W(name), x), d, n, t)
        if rope:
            h = lib.ggml_rope_ext(ctx, h, pos, NULL, d, lib.GGML_ROPE_TYPE_NEOX, 0,
                                  c.rope_theta, 1.0, 0.0, 1.0, 0.0, 0.0)  # fmt: skip
        return h

    q = heads(g + "attn_q.weight", nh, True)
    k = heads(g + "attn_k.weight", nkv, True)
    v = heads(g + "attn_v.weight", nkv, False)
    qp = lib.ggml_permute(ctx, q, 0, 2, 1, 3)  # [d, T, H]
    kp = lib.ggml_permute(ctx, k, 0, 2, 1, 3)  # [d, Tk, Hkv]; GQA broadcasts over heads
    scores = lib.ggml_mul_mat(ctx, kp, qp)  # [Tk, T, H]
    probs = lib.ggml_soft_max_ext(ctx, scores, mask, 1.0 / math.sqrt(d), 0.0)
    vt = lib.ggml_cont(ctx, lib.ggml_permute(ctx, v, 1, 2, 0, 3))  # [Tk, d, Hkv]
    out = lib.ggml_mul_mat(ctx, vt, probs)  # [d, T, H]
    out = lib.ggml_cont(ctx, lib.ggml_permute(ctx, out, 0, 2, 1, 3))  # [d, H, T]
    out = lib.ggml_reshape_2d(ctx, out, d * nh, t)
    return lib.ggml_mul_mat(ctx, W(g + "attn_out.weight"), out)


def transformer(ctx: Any, W: Callable[[str], Tensor], c: CodecEncoderConfig, x: Tensor,
                pos: Tensor, mask: Tensor) -> Tensor:  # fmt: skip
    """Graph: time-major ``[hidden, T]`` -> same; ``pos`` int32 [T], ``mask`` [T, T]."""
    h = x
    for il in range(c.num_hidden_layers):
        g = f"cenc.tr.{il}."
        a = _layer_norm(ctx, h, W(g + "attn_norm.weight"), W(g + "attn_norm.bias"), c.norm_eps)
        a = _attention(ctx, W, c, g, a, pos, mask)
        h = lib.ggml_add(ctx, h, lib.ggml_mul(ctx, a, W(g + "attn_scale")))
        m = _layer_norm(ctx, h, W(g + "ffn_norm.weight"), W(g + "ffn_norm.bias"), c.norm_eps)
        m = lib.ggml_gelu_erf(ctx, lib.ggml_mul_mat(ctx, W(g + "ffn_up.weight"), m))
        m = lib.ggml_mul_mat(ctx, W(g + "ffn_down.weight"), m)
        h = lib.ggml_add(ctx, h, lib.ggml_mul(ctx, m, W(g + "ffn_scale")))
    return h
