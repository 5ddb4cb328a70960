"""Graph builders shared by both transformers: the decoder's pre-transformer and the Qwen3
talker / code predictor.

Each takes the ggml context and returns the new node; activations are ``[channels, T]`` and
attention heads ``[head_dim, heads, T]`` (ggml ``ne`` order, fastest first). What differs
between the two stacks (the decoder's sliding window carried across pushes, the talker's KV
cache, layer scales, q/k norms) stays with each; the math they share is written here once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from engine.ggml import NULL, Tensor, lib

Namer = Callable[[Tensor, str], Tensor]


def _unnamed(t: Tensor, _name: str) -> Tensor:
    return t


def rms_norm(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over ``ne0`` (per head for q/k norms)."""
    return lib.ggml_mul(ctx, lib.ggml_rms_norm(ctx, x, eps), weight)


def rope(ctx: Any, x: Tensor, pos: Tensor, n_dims: int, theta: float) -> Tensor:
    """NeoX (rotate-half) RoPE over the first ``n_dims`` of every head, positions ``pos``.

    With identical position rows the talker's interleaved M-RoPE is exactly this 1-D RoPE.
    """
    return lib.ggml_rope_ext(ctx, x, pos, NULL, n_dims, lib.GGML_ROPE_TYPE_NEOX, 0, theta, 1.0,
                             0.0, 1.0, 0.0, 0.0)


def swiglu(ctx: Any, gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` as ggml's one fused GLU op: one node (and one thread barrier) less
    per layer than silu + mul."""
    return lib.ggml_swiglu_split(ctx, gate, up)


def attend(ctx: Any, q: Tensor, k: Tensor, v_t: Tensor, mask: Tensor | None,
           name: Namer = _unnamed) -> Tensor:
    """``softmax(K^T Q / sqrt(d) + mask) V`` for every head, the heads merged: ``[d * H, T]``.

    ``q``: ``[d, H, T]``; ``k``: ``[d, Tk, H_kv]``; ``v_t``: V transposed, ``[Tk, d, H_kv]``;
    ``mask``: additive ``[Tk, T]`` or None. GQA: query head h reads KV head h // (H / H_kv),
    which is ggml's ``mul_mat`` broadcast over dim 2. ``name`` labels the scores
    (``kq``, ``kq_soft_max``) for op logs and captures.
    """
    d, n_head, t = int(q.ne[0]), int(q.ne[1]), int(q.ne[2])
    qp = lib.ggml_permute(ctx, q, 0, 2, 1, 3)  # [d, T, H]
    kq = name(lib.ggml_mul_mat(ctx, k, qp), "kq")  # [Tk, T, H]
    kq = name(lib.ggml_soft_max_ext(ctx, kq, mask if mask is not None else NULL,
                                    1.0 / math.sqrt(d), 0.0), "kq_soft_max")
    kqv = lib.ggml_mul_mat(ctx, v_t, kq)  # [d, T, H]
    return lib.ggml_cont_2d(ctx, lib.ggml_permute(ctx, kqv, 0, 2, 1, 3), d * n_head, t)
