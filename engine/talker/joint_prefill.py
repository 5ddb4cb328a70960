"""Several joining utterances' prompts in one prefill graph (``FrameScheduler``'s joiners: live
text ones by default, its ``joint_prefill``).

Utterances that join the batch together (three realtime sessions opening at once) would prefill
one a round, each graph reading the talker's weights for a few dozen rows, and the last one's
first frame would wait for the others' prefills, code-predictor passes, decoder pushes and
steps. Here their rows are the columns of one graph: every projection and MLP runs over all of
them, attention per utterance over its own cache, as ``engine.talker.batch`` does for steps.

Each utterance gets bit for bit what its prefill alone (``TalkerModel.prefill_chunks``) gives
it, with the talker a worker serves (Q4_0): its text projection is a product of its own; the
int8 GEMM (``gemm_i8``) quantises and sums row by row, so only utterances whose rows alone take
it (``I8_MIN_ROWS`` or more) join together, and those of one row together (streaming-text
openings: the stored weights throughout); attention is ``attention``'s, per utterance (the fused
``attn_causal`` where the prefill uses it); the last layer, as alone, computes queries,
output projection and MLP for each utterance's last position only, on the stored weights
(one column alone; Q4_0's row kernels give a row the same among several). With F32/F16 weights
ggml multiplies several rows with a tiled GEMM that rounds differently from one (as the batched
step): the results agree to float rounding. An utterance that needs more than one chunk, or
whose prefix is to be kept for the next request (``kept_prefix``), prefills alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.ggml import Graph, Tensor, lib
from engine.talker.prompt import Prompt
from engine.talker.qwen3 import (
    I8_MIN_ROWS,
    AttnInputs,
    Builder,
    KVCache,
    attn_uploads,
    cache_attention,
    ffn,
    prefill_n_kv,
    write_kv_block,
)
from engine.talker.runner import execute_timed
from engine.transformer import rms_norm, rope

if TYPE_CHECKING:
    from engine.talker.model import PrefillOut, TalkerModel


@dataclass
class Joiner:
    """One utterance of a joint prefill: its prompt, cache and reused prefix rows."""

    prompt: Prompt
    cache: KVCache
    start: int  # its first position computed here (after the reused prefix)
    reuse: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]] | None

    @property
    def n(self) -> int:
        return self.prompt.length - self.start

    def text_ids(self) -> np.ndarray[Any, Any]:
        p = self.prompt
        return np.concatenate([p.text_ids[self.start:], p.trailing_ids,
                               np.asarray([p.pad_id], dtype=np.int32)]).astype(np.int32)


def joiner(talker: TalkerModel, prompt: Prompt, cache: KVCache) -> Joiner | None:
    """``prompt`` as a joiner of a joint prefill into ``cache``, or None where it prefills
    alone (module docstring)."""
    n_pre, reuse = talker.kept_prefix(prompt)
    if n_pre and reuse is None:
        return None  # its prefill alone keeps the prefix rows for the next request
    j = Joiner(prompt, cache, n_pre if reuse is not None else 0, reuse)
    if j.n > talker.prefill_chunk or cache.n_ctx < prompt.length + 1:
        return None
    return j


def int8_rows(j: Joiner) -> bool:
    """Whether ``j``'s rows alone would be enough for the int8 GEMM: only joiners alike in this
    prefill together (a lone new row, a streaming-text opening, multiplies the stored weights)."""
    return j.n >= I8_MIN_ROWS


def prefill_joint(talker: TalkerModel, joiners: Sequence[Joiner]) -> list[PrefillOut]:
    """Prefill every joiner's prompt into its cache in one graph; their ``PrefillOut``s. The
    joiners are alike in ``int8_rows``."""
    from engine.talker.model import PrefillOut, _as_f32, _graph_nodes

    int8 = int8_rows(joiners[0])
    if any(int8_rows(j) != int8 for j in joiners):
        raise ValueError("joiners of one prefill must all have one row or all several")

    w = talker.weights
    shape = w.talker_shape
    n_layers = len(w.layers)
    kv = shape.kv_dim
    offs = np.cumsum([0] + [j.n for j in joiners])
    n_all, n_b = int(offs[-1]), len(joiners)
    text_ids = [j.text_ids() for j in joiners]
    n_text = [int(ids.shape[0]) for ids in text_ids]

    def build(g: Graph) -> None:
        ctx = g.ctx
        b = Builder(g, shape, int8=int8, mul_mat=w.mul_mat)
        one = Builder(g, shape, int8=False, mul_mat=w.mul_mat)  # a lone column's products
        parts = []
        for i, j in enumerate(joiners):
            x, txt = talker.prompt_embeddings(b, j.n, n_text[i], j.prompt.embed_add is not None,
                                              suffix=f".{i}")
            tail = lib.ggml_view_2d(ctx, txt, int(txt.ne[0]), n_text[i] - j.n, txt.nb[1],
                                    j.n * txt.nb[1])
            g.output(lib.ggml_cont(ctx, tail), f"text_tail.{i}")
            parts.append(x)
        x = parts[0]
        for p in parts[1:]:
            x = lib.ggml_concat(ctx, x, p, 1)
        pos = g.input("pos", (n_all,), np.int32)
        last_idx = g.input("last_idx", (n_b,), np.int32)
        pos_last = g.input("pos_last", (n_b,), np.int32)
        rows = []
        for i, j in enumerate(joiners):
            a = AttnInputs(pos=lib.ggml_view_1d(ctx, pos, j.n, int(offs[i]) * pos.nb[0]),
                           mask=g.input(f"mask.{i}", (j.n, prefill_n_kv(j.prompt.length,
                                                                      j.cache.n_ctx))),
                           n_kv=prefill_n_kv(j.prompt.length, j.cache.n_ctx), causal=True)
            if j.reuse is not None:
                a.prefix_k = _as_f32(ctx, g.input(f"prefix_k.{i}", (n_layers, j.start, kv),
                                                  talker.kv_np))
                a.prefix_v = _as_f32(ctx, g.input(f"prefix_v.{i}", (n_layers, j.start, kv),
                                                  talker.kv_np))
            rows.append(a)
        for il, lw in enumerate(w.layers):
            last = il == n_layers - 1
            h = rms_norm(ctx, x, lw.attn_norm, shape.eps)
            attn = _attention(b, one if last else b, lw, il, h, joiners, rows, offs, pos,
                              (last_idx, pos_last) if last else None)
            if last:
                x = lib.ggml_get_rows(ctx, x, last_idx)
            x = lib.ggml_add(ctx, x, attn)
            h = rms_norm(ctx, x, lw.ffn_norm, shape.eps)
            x = lib.ggml_add(ctx, x, ffn(one if last else b, lw, il, h))
        x = rms_norm(ctx, x, w.output_norm, shape.eps)
        g.output(x, "hidden")
        g.output(w.mul_mat(ctx, w.codec_head, x), "logits")

    up: dict[str, np.ndarray[Any, Any]] = {
        "pos": np.concatenate([np.arange(j.start, j.prompt.length) for j in joiners]
                              ).astype(np.int32),
        "last_idx": (offs[1:] - 1).astype(np.int32),
        "pos_last": np.asarray([j.prompt.length - 1 for j in joiners], dtype=np.int32),
    }
    for i, j in enumerate(joiners):
        p = j.prompt
        up[f"text_ids.{i}"] = text_ids[i]
        up[f"codec_ids.{i}"] = p.codec_ids[j.start:]
        up[f"codec_mask.{i}"] = p.codec_mask[j.start:].reshape(j.n, 1)
        if p.embed_add is not None:
            up[f"embed_add.{i}"] = np.ascontiguousarray(p.embed_add[j.start:], dtype=np.float32)
        up[f"mask.{i}"] = attn_uploads(j.cache, j.start, j.n,
                                       prefill_n_kv(p.length, j.cache.n_ctx),
                                       indices=False)["mask"]
        if j.reuse is not None:
            up[f"prefix_k.{i}"], up[f"prefix_v.{i}"] = j.reuse
    out = execute_timed(talker.backends, build, up,
                        max_nodes=_graph_nodes(n_layers, n_all) + 96 * n_b * n_layers,
                        stats=talker.stats)
    talker.last_prefill_positions = n_all
    logits = out["logits"].reshape(n_b, -1)
    hidden = out["hidden"].reshape(n_b, -1)
    result = []
    for i, j in enumerate(joiners):
        n_trail = int(j.prompt.trailing_ids.shape[0])
        tail = out[f"text_tail.{i}"].reshape(n_trail + 1, -1)
        result.append(PrefillOut(logits=logits[i], hidden=hidden[i], trailing=tail[:n_trail],
                                 pad=tail[n_trail]))
    return result


def _attention(b: Builder, proj: Builder, lw: Any, il: int, x: Tensor,
               joiners: Sequence[Joiner], rows: list[AttnInputs], offs: np.ndarray[Any, Any],
               pos: Tensor, last: tuple[Tensor, Tensor] | None) -> Tensor:
    # ``qwen3.attention`` for each joiner's columns of x (positions ``pos``), the projections
    # over them all; ``last`` (the last layer: the columns of each joiner's last position and
    # their positions) queries from those only, ``proj`` multiplying what a lone column would
    ctx, s = b.ctx, b.shape
    d, n_head, n_kv_head, t = s.head_dim, s.n_head, s.n_kv_head, int(x.ne[1])
    if b.int8_rows(lw, x):  # as alone: one GEMM for the three (q for every row)
        q_proj, k_proj, v = b.matmuls(lw, "qkv", x)
        if last is not None:
            q_proj = lib.ggml_get_rows(ctx, q_proj, last[0])
    else:
        q_proj = (b.matmul(lw, "q", x) if last is None
                  else proj.matmul(lw, "q", lib.ggml_get_rows(ctx, x, last[0])))
        k_proj = b.matmul(lw, "k", x)
        v = b.matmul(lw, "v", x)
    tq = int(q_proj.ne[1])
    q = lib.ggml_view_3d(ctx, q_proj, d, n_head, tq, d * q_proj.nb[0], q_proj.nb[1], 0)
    k = lib.ggml_view_3d(ctx, k_proj, d, n_kv_head, t, d * k_proj.nb[0], k_proj.nb[1], 0)
    q = rms_norm(ctx, q, lw.q_norm, s.eps)
    k = rms_norm(ctx, k, lw.k_norm, s.eps)
    q = rope(ctx, q, pos if last is None else last[1], d, s.rope_theta)
    k = rope(ctx, k, pos, d, s.rope_theta)
    k_rows = lib.ggml_reshape_2d(ctx, k, s.kv_dim, t)
    merged: Tensor | None = None
    for i, (j, a) in enumerate(zip(joiners, rows, strict=True)):
        c, o0, n = j.cache, int(offs[i]), j.n
        k_i = lib.ggml_view_2d(ctx, k_rows, s.kv_dim, n, k_rows.nb[1], o0 * k_rows.nb[1])
        v_i = lib.ggml_view_2d(ctx, v, s.kv_dim, n, v.nb[1], o0 * v.nb[1])
        k_w, v_w = write_kv_block(b, a, il, k_i, v_i, c)
        qi0, nq = (o0, n) if last is None else (i, 1)
        q_i = lib.ggml_view_3d(ctx, q, d, n_head, nq, q.nb[1], q.nb[2], qi0 * q.nb[2])
        pos_q, mask = a.pos, a.mask
        if last is not None:  # as alone: the last position's query, its mask row
            assert mask is not None
            pos_q = lib.ggml_view_1d(ctx, last[1], 1, i * last[1].nb[0])
            mask = lib.ggml_view_2d(ctx, mask, int(mask.ne[0]), 1, mask.nb[1],
                                    (n - 1) * mask.nb[1])
        o = cache_attention(b, a, il, q_i, k_w, v_w, c, pos_q, mask)
        merged = o if merged is None else lib.ggml_concat(ctx, merged, o, 1)
    assert merged is not None
    return proj.matmul(lw, "o", merged)
