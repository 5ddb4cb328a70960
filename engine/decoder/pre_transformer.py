"""Stage 3, pre-transformer: 8 pre-norm layers with sliding-window causal attention.

Math: docs/architecture.md, Pre-transformer.

Streaming: every layer carries the RoPE'd keys and the values of its last ``window-1``
positions, so a chunk's queries see exactly the keys a single pass would show them. Positions
keep counting across chunks; carried slots before position 0 are masked out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.decoder.blocks import StageGraph, linear
from engine.decoder.weights import DecoderWeights, Linear, PreTransformerLayer
from engine.ggml import Tensor, custom_ops, lib
from engine.transformer import attend, rms_norm, rope, swiglu


def attention_mask(pos0: int, n_new: int, window: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    """[n_new, window-1+n_new] additive mask: query p sees keys k with p-window < k <= p, k >= 0."""
    n_cache = window - 1
    q_pos = pos0 + np.arange(n_new)[:, None]
    k_pos = pos0 - n_cache + np.arange(n_cache + n_new)[None, :]
    visible = (k_pos <= q_pos) & (k_pos > q_pos - window) & (k_pos >= 0)
    return np.where(visible, 0.0, -np.inf).astype(np.float32)


def self_attention(g: StageGraph, w: DecoderWeights, il: int, x: Tensor, pos: Tensor,
                   mask: Tensor | None) -> Tensor:
    """Multi-head attention over [carried window ; new rows] with NeoX RoPE, scale 1/sqrt(d)."""
    ctx, cfg, lw = g.ctx, w.cfg, w.layers[il]
    n_head, n_kv, d_head = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    t = int(x.ne[1])
    n_cache = cfg.sliding_window - 1

    def heads(proj: Linear, n: int) -> Tensor:
        return lib.ggml_reshape_3d(ctx, linear(g, x, proj), d_head, n, t)

    # GQA: K and V have num_key_value_heads heads; query head h reads KV head h // (H / H_kv)
    # (attn_window's hk = h / G, ggml's mul_mat broadcast in ``attend``), as repeat_kv does
    q = rope(ctx, heads(lw.q, n_head), pos, d_head, cfg.rope_theta)
    k = rope(ctx, heads(lw.k, n_kv), pos, d_head, cfg.rope_theta)
    v = heads(lw.v, n_kv)
    if g.use_custom_ops:  # chunking-invariant: a stream's bits do not depend on its chunks
        # each stream attends to its own window (one stream: the whole of q, k, v)
        def attend_window(qs: Tensor, ks: Tensor, vs: Tensor, ps: Tensor, stream: int
                          ) -> Tensor:
            k_all = _windowed(g, f"pretr.{il}.k", ks, n_cache, stream)
            v_all = _windowed(g, f"pretr.{il}.v", vs, n_cache, stream)
            return custom_ops.attn_window(ctx, qs, k_all, v_all, ps, cfg.sliding_window)

        if not g.joint:
            return linear(g, attend_window(q, k, v, pos, 0), lw.o)
        streams = zip(_split_heads(g, q), _split_heads(g, k), _split_heads(g, v),
                      _split_positions(g, pos), strict=True)
        return linear(g, g.join([attend_window(qs, ks, vs, ps, s)
                                 for s, (qs, ks, vs, ps) in enumerate(streams)]), lw.o)
    assert mask is not None and not g.joint
    k_all = _windowed(g, f"pretr.{il}.k", k, n_cache)
    v_all = _windowed(g, f"pretr.{il}.v", v, n_cache)
    kp = lib.ggml_permute(ctx, k_all, 0, 2, 1, 3)  # [d, Tk, H]
    vt = lib.ggml_cont(ctx, lib.ggml_permute(ctx, v_all, 1, 2, 0, 3))  # [Tk, d, H]
    return linear(g, attend(ctx, q, kp, vt, mask), lw.o)


def _windowed(g: StageGraph, key: str, h: Tensor, n_cache: int, stream: int = 0) -> Tensor:
    """[d, H, T] new heads after the carried [d, H, n_cache] ones; carries the last n_cache."""
    ctx = g.ctx
    if n_cache == 0:  # sliding_window 1: a query sees its own key only, nothing is carried
        return h  # (a zero-row carried tensor reads back out of bounds)
    d, n_head, t = int(h.ne[0]), int(h.ne[1]), int(h.ne[2])
    prev = g.carried(key, (n_cache, n_head, d), stream)
    full = lib.ggml_concat(ctx, prev, h, 2)
    tail = lib.ggml_view_3d(ctx, full, d, n_head, n_cache, full.nb[1], full.nb[2],
                            t * full.nb[2])
    g.carry(key, tail, stream)
    return full


def _split_heads(g: StageGraph, h: Tensor) -> list[Tensor]:
    """Each stream's positions of joined [d, H, T] heads, as views."""
    d, n_head = int(h.ne[0]), int(h.ne[1])
    flat = lib.ggml_reshape_2d(g.ctx, h, d * n_head, int(h.ne[2]))
    return [lib.ggml_reshape_3d(g.ctx, part, d, n_head, int(part.ne[1]))
            for part in g.split(flat)]


def _split_positions(g: StageGraph, pos: Tensor) -> list[Tensor]:
    """Each stream's part of the joined positions, as views."""
    column = lib.ggml_reshape_2d(g.ctx, pos, 1, int(pos.ne[0]))
    return [lib.ggml_reshape_1d(g.ctx, part, int(part.ne[1])) for part in g.split(column)]


def mlp(g: StageGraph, x: Tensor, lw: PreTransformerLayer) -> Tensor:
    """SwiGLU: ``down(silu(gate x) * up x)``."""
    return linear(g, swiglu(g.ctx, linear(g, x, lw.gate), linear(g, x, lw.up)), lw.down)


def layer(g: StageGraph, w: DecoderWeights, il: int, h: Tensor, pos: Tensor,
          mask: Tensor | None) -> Tensor:
    """``h += s_attn * Attn(RMSNorm(h)); h += s_mlp * MLP(RMSNorm(h))``."""
    ctx, lw, eps = g.ctx, w.layers[il], w.cfg.rms_norm_eps
    a = self_attention(g, w, il, rms_norm(ctx, h, lw.attn_norm, eps), pos, mask)
    h = lib.ggml_add(ctx, h, lib.ggml_mul(ctx, a, lw.attn_scale))
    m = mlp(g, rms_norm(ctx, h, lw.ffn_norm, eps), lw)
    return g.tap(lib.ggml_add(ctx, h, lib.ggml_mul(ctx, m, lw.ffn_scale)), f"dec.pretr.blk{il}")


def build(g: StageGraph, w: DecoderWeights, x: Tensor) -> Tensor:
    """[T, latent] -> [T, latent]; inputs ``pos`` (int32 [T]) and, with ggml's attention,
    ``mask`` come from the driver."""
    t = int(x.ne[1])
    n_keys = w.cfg.sliding_window - 1 + t
    pos = g.input("pos", (t,), dtype=np.int32)
    mask = None if g.use_custom_ops else g.input("mask", (t, n_keys))
    h = linear(g, x, w.in_proj)
    for il in range(len(w.layers)):
        h = layer(g, w, il, h, pos, mask)
    h = rms_norm(g.ctx, h, w.final_norm, w.cfg.rms_norm_eps)
    return g.tap(linear(g, h, w.out_proj), "dec.pretr.out")

