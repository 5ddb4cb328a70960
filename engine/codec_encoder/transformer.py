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
from engine.ggml import custom_ops as co
from engine.ggml.ops1d import ConvForm, pad_zero

LINEARS = ("attn_q", "attn_k", "attn_v", "attn_out", "ffn_up", "ffn_down")


def linear(ctx: Any, W: Callable[[str], Tensor], form: ConvForm,
           zero_bias: Callable[[int], Tensor], name: str, x: Tensor, n_out: int
           ) -> Tensor:  # fmt: skip
    """``x`` [T, C_in] times a weight packed as a 1x1 conv (``ConvForm.pack``)
    -> ``[T, n_out]``: the direct conv kernel runs these products faster than
    ``ggml_mul_mat``."""
    return form.conv(ctx, W(name), zero_bias(n_out), x)


# ggml's fast F32 GEMM needs the inner length a multiple of 16, and the product of the
# attention weights and the values sums over the keys: the transformer runs on that many frames
GEMM_ROWS = 16


def padded_length(t: int) -> int:
    """Frames the transformer runs on for ``t``: ``t`` rounded up to ``GEMM_ROWS``. The extra
    frames come last, so under the causal mask no real frame attends to them."""
    return -(-t // GEMM_ROWS) * GEMM_ROWS


def causal_mask(t: int) -> npt.NDArray[np.float32]:
    """``[T, T]`` additive mask: query ``i`` sees keys ``j <= i``."""
    return np.where(np.tri(t, dtype=bool), 0.0, -np.inf).astype(np.float32)


def _layer_norm(ctx: Any, x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    return lib.ggml_add(ctx, lib.ggml_mul(ctx, lib.ggml_norm(ctx, x, eps), w), b)


def _attention(ctx: Any, W: Callable[[str], Tensor], form: ConvForm, zb: Callable[[int], Tensor],
               c: CodecEncoderConfig, g: str, x: Tensor, pos: Tensor, mask: Tensor
               ) -> Tensor:  # fmt: skip
    d, nh, nkv, t = c.head_dim, c.num_attention_heads, c.num_key_value_heads, int(x.ne[1])

    def lin(name: str, v: Tensor, n_out: int) -> Tensor:
        return linear(ctx, W, form, zb, name, v, n_out)

    def heads(name: str, n: int, rope: bool) -> Tensor:
        h = lib.ggml_reshape_3d(ctx, lin(name, x, d * n), d, n, t)
        if rope:
            h = lib.ggml_rope_ext(ctx, h, pos, NULL, d, lib.GGML_ROPE_TYPE_NEOX, 0,
                                  c.rope_theta, 1.0, 0.0, 1.0, 0.0, 0.0)  # fmt: skip
        return h

    q = heads(g + "attn_q.weight", nh, True)
    k = heads(g + "attn_k.weight", nkv, True)
    v = heads(g + "attn_v.weight", nkv, False)
    if form.direct:  # one node on the conv kernel's tiles
        return lin(g + "attn_out.weight", co.attn_full(ctx, q, k, v), c.hidden_size)
    # contiguous per-head copies (small) let ggml_mul_mat take its fast GEMM path
    qp = lib.ggml_cont(ctx, lib.ggml_permute(ctx, q, 0, 2, 1, 3))  # [d, T, H]
    kp = lib.ggml_cont(ctx, lib.ggml_permute(ctx, k, 0, 2, 1, 3))  # [d, Tk, Hkv]; GQA broadcasts
    scores = lib.ggml_mul_mat(ctx, kp, qp)  # [Tk, T, H]
    probs = lib.ggml_soft_max_ext(ctx, scores, mask, 1.0 / math.sqrt(d), 0.0)
    vt = lib.ggml_cont(ctx, lib.ggml_permute(ctx, v, 1, 2, 0, 3))  # [Tk, d, Hkv]
    out = lib.ggml_mul_mat(ctx, vt, probs)  # [d, T, H]: Tk a multiple of GEMM_ROWS
    out = lib.ggml_cont(ctx, lib.ggml_permute(ctx, out, 0, 2, 1, 3))  # [d, H, T]
    out = lib.ggml_reshape_2d(ctx, out, d * nh, t)
    return lin(g + "attn_out.weight", out, c.hidden_size)


def transformer(ctx: Any, W: Callable[[str], Tensor], form: ConvForm,
                zero_bias: Callable[[int], Tensor],
                c: CodecEncoderConfig, x: Tensor, pos: Tensor, mask: Tensor
                ) -> Tensor:  # fmt: skip
    """Graph: time-major ``x`` [T, hidden] -> same; ``pos`` int32 [T'], ``mask`` [T', T'] for
    ``T' = padded_length(T)`` (zero frames are appended and cut off again);
    ``zero_bias(n)``: an F32 vector of ``n`` zeros (the linears have no bias)."""
    t, tp = int(x.ne[1]), int(pos.ne[0])
    if tp != padded_length(t) or int(mask.ne[0]) != tp or int(mask.ne[1]) != tp:
        raise ValueError(f"transformer: {t} frames need pos and mask for {padded_length(t)}")
    h = pad_zero(ctx, x, 0, tp - t)
    for il in range(c.num_hidden_layers):
        g = f"cenc.tr.{il}."
        a = _layer_norm(ctx, h, W(g + "attn_norm.weight"), W(g + "attn_norm.bias"), c.norm_eps)
        a = _attention(ctx, W, form, zero_bias, c, g, a, pos, mask)
        h = lib.ggml_add(ctx, h, lib.ggml_mul(ctx, a, W(g + "attn_scale")))
        m = _layer_norm(ctx, h, W(g + "ffn_norm.weight"), W(g + "ffn_norm.bias"), c.norm_eps)
        m = form.gelu_erf(ctx, linear(ctx, W, form, zero_bias, g + "ffn_up.weight", m,
                                      c.intermediate_size))  # fmt: skip
        m = linear(ctx, W, form, zero_bias, g + "ffn_down.weight", m, c.hidden_size)
        h = lib.ggml_add(ctx, h, lib.ggml_mul(ctx, m, W(g + "ffn_scale")))
    return lib.ggml_view_2d(ctx, h, int(h.ne[0]), t, h.nb[1], 0) if tp > t else h
