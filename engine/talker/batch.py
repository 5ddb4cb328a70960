"""Several sessions in one graph: the batched talker step and the batched code-predictor pass.

The batch is a dimension of the graphs, not a Python loop over sessions, so the weights are
read once per step for every session and the same graphs run batched on an accelerator.

* **Talker step** over B sessions (``BatchedTalker.step``): the B frame inputs are the columns
  of one ``[hidden, B]`` activation; every projection, norm, RoPE and MLP runs over the B
  columns at once. Attention is per session inside the same graph: each session has its own KV
  cache (``TalkerModel.new_cache``: a session's memory is its own and goes when it ends), its
  own position and its own number of cache positions read. On host-memory caches one node per
  layer (``custom_ops.attn_step``) writes every session's K/V row into its own cache and
  attends to its own rows 0 .. position; elsewhere each column is a view that does the same
  with ggml's nodes. The graph's structure depends on which caches take part (and, with
  ggml's nodes, on each one's 64-position read bucket), so it is rebuilt when a session joins
  or leaves (or crosses a bucket): rare next to the steps.
* **Code predictor** over B rows (``BatchedTalker.predict``): the code predictor's 16-position
  cache is rewritten every frame, so a batch needs no per-session state: one cache of B slots
  of 16 positions, and each of the 15 passes is one graph whose attention is ``attn_step``
  over the slots (or a 4-D ``mul_mat`` over (slot, head)). One set of 15 graphs per batch
  size, built at warm-up or when first used.

Same results as one session alone: every session's attention reads exactly its own rows, its
sampling keeps its own RNG (``engine.talker.generate.FrameSampler``), and the matrix products run
the kernels the unbatched graphs run (``TalkerWeights.mul_mat`` on the stored weights where a
session alone has one row; the int8 GEMM only in code-predictor pass 0, whose rows it rounds one
by one, as alone). With Q4_0 weights (what a worker serves) a row among several gets exactly what
it gets alone (``engine.ggml.gemv_q4`` by construction, and ggml's Q4_0 kernels where that op is
not used; a matrix the converter kept at F16 among them is multiplied one column at a time),
so a session's logits and codes are bit for bit those it gets alone. With
F16/F32 weights ggml multiplies one row with a dot product and several with its tiled GEMM
(llamafile sgemm), which round differently: logits agree to float rounding, and the codes too
unless two candidates tie within it. tests/engine/test_batch.py checks both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.errors import InputError
from engine.ggml import NULL, Graph, Tensor, custom_ops, lib
from engine.talker.model import STEP_BUCKET, TalkerModel, _graph_nodes, codes_embedding
from engine.talker.qwen3 import Builder, KVCache, attention_out, stack
from engine.talker.runner import CachedGraph
from engine.talker.weights import LayerWeights
from engine.transformer import attend, rms_norm, rope

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]


@dataclass
class StepRow:
    """One session's input to a batched talker step."""

    cache: KVCache  # the session's own talker cache
    codes: I32  # [16]: the frame just generated
    text_add: F32  # [hidden]: its text row (trailing text, tts_eos or pad)
    pos: int  # the cache position this step writes


@dataclass
class _RowInputs:
    cache: KVCache
    k_idx: Tensor
    v_idx: Tensor
    mask: Tensor
    n_kv: int


def step_n_kv(pos: int, n_ctx: int) -> int:
    """Cache positions a step at ``pos`` reads: the 64-position bucket (like ``step``)."""
    return min(-(-(pos + 1) // STEP_BUCKET) * STEP_BUCKET, n_ctx)


class BatchedTalker:
    """The batched step and code-predictor graphs of one ``TalkerModel`` (module docstring).

    One scheduler per worker drives it; the graphs are cached state, like the model's own.
    """

    def __init__(self, talker: TalkerModel) -> None:
        self.talker = talker
        # (key, graph, the caches it writes: held so no cache id is reused while it is cached)
        self._step: tuple[tuple[tuple[int, int], ...], CachedGraph, list[KVCache]] | None = None
        self._cp: dict[int, tuple[KVCache, list[CachedGraph]]] = {}

    # -- talker step -------------------------------------------------------------------------

    def step(self, rows: Sequence[StepRow]) -> tuple[F32, F32]:
        """One talker step for every row; returns (logits [B, vocab], hidden [B, hidden])."""
        if not rows:
            raise ValueError("a batched step needs at least one row")
        for r in rows:
            if r.pos >= r.cache.n_ctx:
                raise InputError("max_frames", f"talker cache too small for position {r.pos}")
        fused = all(r.cache.native for r in rows)
        # the fused attention reads rows 0 .. pos itself: no read width in the graph
        key = tuple((id(r.cache), 0 if fused else step_n_kv(r.pos, r.cache.n_ctx))
                    for r in rows)
        if self._step is None or self._step[0] != key:
            self.drop_step_graph()
            caches = [r.cache for r in rows]
            graph = CachedGraph(self.talker.backends,
                                self._step_builder(caches, [k for _, k in key], fused),
                                _graph_nodes(len(self.talker.weights.layers), 1)
                                + 64 * len(rows) * len(self.talker.weights.layers),
                                self.talker.stats)
            self._step = (key, graph, caches)
        n = len(rows)
        codes = np.stack([np.asarray(r.codes, dtype=np.int32) for r in rows], axis=1)
        up: dict[str, np.ndarray[Any, Any]] = {
            "codes": np.ascontiguousarray(codes),
            "text_add": np.ascontiguousarray(
                np.stack([np.asarray(r.text_add, dtype=np.float32) for r in rows])),
            "pos": np.asarray([r.pos for r in rows], dtype=np.int32),
        }
        if not fused:  # ggml's nodes: each row's write indices and mask
            for i, (r, (_, width)) in enumerate(zip(rows, key, strict=True)):
                p = np.asarray([r.pos], dtype=np.int32)
                up[f"k_idx.{i}"] = p
                up[f"v_idx.{i}"] = r.cache.v_index(p)
                up[f"mask.{i}"] = np.where(np.arange(width)[None, :] <= r.pos, 0.0,
                                           -np.inf).astype(np.float32)
        out = self._step[1].run(up)
        return out["logits"].reshape(n, -1), out["hidden"].reshape(n, -1)

    def drop_step_graph(self) -> None:
        """Free the cached step graph (and let go of the caches it refers to)."""
        if self._step is not None:
            self._step[1].close()
            self._step = None

    def _step_builder(self, caches: list[KVCache], n_kvs: list[int],
                      fused: bool) -> Callable[[Graph], None]:
        w = self.talker.weights
        n_groups = self.talker.n_groups
        shape = w.talker_shape
        n = len(caches)

        def build(g: Graph) -> None:
            ctx = g.ctx
            b = Builder(g, shape, int8=False, mul_mat=w.mul_mat)
            codes = g.input("codes", (n_groups, n), np.int32)  # one row per codebook
            x = codes_embedding(ctx, w, codes, n, int(codes.nb[1]))
            x = b.cb(lib.ggml_add(ctx, x, g.input("text_add", (n, shape.hidden))), "inp_embd")
            pos = g.input("pos", (n,), np.int32)
            rows = [] if fused else [
                _RowInputs(c, g.input(f"k_idx.{i}", (1,), np.int32),
                           g.input(f"v_idx.{i}", (c.kv_dim,), np.int32),
                           g.input(f"mask.{i}", (1, k)), k)
                for i, (c, k) in enumerate(zip(caches, n_kvs, strict=True))]

            def attn(b: Builder, lw: LayerWeights, il: int, h: Tensor) -> Tensor:
                if fused:
                    return _fused_attention(b, lw, il, h, pos, [
                        custom_ops.StepCache(c.k[il], c.v[il], 0, c.n_ctx) for c in caches])
                return _rows_attention(b, lw, il, h, pos, rows)

            x = stack(b, w.layers, x, attn, None)
            x = b.cb(rms_norm(ctx, x, w.output_norm, shape.eps), "out_norm")
            g.output(x, "hidden")
            g.output(w.mul_mat(ctx, w.codec_head, x), "logits")

        return build

    # -- code predictor ----------------------------------------------------------------------

    def predict(self, hidden: F32, c0: Sequence[int],
                choose: Sequence[Callable[[F32, int], int]]) -> I32:
        """Codebooks 1..15 of B frames: ``hidden`` [B, hidden] and ``c0`` [B] of each row;
        ``choose[b](logits, j)`` picks row b's code j+1 from pass j. Returns [B, 15]."""
        n = len(c0)
        if hidden.shape[0] != n or len(choose) != n or n < 1:
            raise ValueError("predict needs one hidden row, c0 and chooser per session")
        cache, graphs = self._cp_graphs(n)
        slots = np.arange(n, dtype=np.int32)[:, None] * self.talker.n_groups
        codes = np.empty((n, self.talker.n_groups - 1), dtype=np.int32)
        prev = np.asarray(c0, dtype=np.int32)
        for j, graph in enumerate(graphs):
            pos = np.arange(2, dtype=np.int32)[None, :] if j == 0 else np.asarray(
                [[j + 1]], dtype=np.int32)
            pos = np.broadcast_to(pos, (n, pos.shape[1]))
            rows = (slots + pos).reshape(-1).astype(np.int32)
            up: dict[str, np.ndarray[Any, Any]] = {
                "code": prev,
                "pos": np.ascontiguousarray(pos.reshape(-1)),
            }
            if not cache.native:
                up.update(k_idx=rows, v_idx=cache.v_index(rows))
            if j == 0:
                up["hidden"] = np.ascontiguousarray(hidden, dtype=np.float32)
                if not cache.native:
                    up["mask"] = np.asarray([[0.0, -np.inf], [0.0, 0.0]], dtype=np.float32)
            logits = graph.run(up)["logits"].reshape(n, -1)
            prev = np.asarray([choose[b](logits[b], j) for b in range(n)], dtype=np.int32)
            codes[:, j] = prev
        return codes

    def warm_up(self, max_batch: int) -> None:
        """Build (and run once, on zeros) the code-predictor graphs of every batch size up to
        ``max_batch``: built on first use, they cost the first frame of a batch of that size
        ~4x its pass (15 graphs to build and allocate), which lands on someone's first audio."""
        hs = self.talker.weights.talker_shape.hidden
        for n in range(1, max_batch + 1):
            self.predict(np.zeros((n, hs), np.float32), [0] * n,
                         [lambda logits, j: 0] * n)

    def _cp_graphs(self, n: int) -> tuple[KVCache, list[CachedGraph]]:
        got = self._cp.get(n)
        if got is not None:
            return got
        t = self.talker
        w = t.weights
        shape = w.cp_shape
        n_slot = t.n_groups
        cache = KVCache(t.backends, len(w.cp_layers), shape.kv_dim, n_slot * n, t.kv_type, "cpb")
        nodes = _graph_nodes(len(w.cp_layers), 2)

        def project(b: Builder, x: Tensor) -> Tensor:
            if w.cp_mtp_w is None:
                return x
            return b.cb(b.linear(x, w.cp_mtp_w, w.cp_mtp_b), "mtp_proj")

        def head(b: Builder, g: Graph, x: Tensor, per: int, j: int) -> None:
            if per > 1:  # each slot's last position
                x = lib.ggml_cont(b.ctx, lib.ggml_view_2d(b.ctx, x, int(x.ne[0]), n,
                                                          per * x.nb[1], (per - 1) * x.nb[1]))
            x = b.cb(rms_norm(b.ctx, x, w.cp_output_norm, shape.eps), "out_norm")
            g.output(w.mul_mat(b.ctx, w.cp_heads[j], x), "logits")

        def attn_fn(g: Graph, per: int, n_kv: int, masked: bool
                    ) -> Callable[[Builder, LayerWeights, int, Tensor], Tensor]:
            pos = g.input("pos", (per * n,), np.int32)
            if cache.native:  # slot i: positions i * n_slot .. of the one cache
                def fused(b: Builder, lw: LayerWeights, il: int, h: Tensor) -> Tensor:
                    return _fused_attention(b, lw, il, h, pos, [
                        custom_ops.StepCache(cache.k[il], cache.v[il], i * n_slot, n_slot)
                        for i in range(n)])

                return fused
            k_idx = g.input("k_idx", (per * n,), np.int32)
            v_idx = g.input("v_idx", (shape.kv_dim * per * n,), np.int32)
            mask = g.input("mask", (per, n_kv)) if masked else None

            def attn(b: Builder, lw: LayerWeights, il: int, h: Tensor) -> Tensor:
                return _slots_attention(b, lw, il, h, cache, n_slot, n, per, n_kv, pos, k_idx,
                                        v_idx, mask)

            return attn

        def first(g: Graph) -> None:
            ctx = g.ctx
            # two rows per slot: alone, pass 0 takes the int8 GEMM when the layers have int8
            # copies (``Builder.matmul``), and its rows are quantised one by one, so it does
            # batched too; the later passes are one row alone, so never the int8 GEMM here
            b = Builder(g, shape, mul_mat=w.mul_mat)
            hs = w.talker_shape.hidden
            hidden = lib.ggml_reshape_3d(ctx, g.input("hidden", (n, hs)), hs, 1, n)
            e0 = lib.ggml_get_rows(ctx, w.codec_embd, g.input("code", (n,), np.int32))
            pair = lib.ggml_concat(ctx, hidden, lib.ggml_reshape_3d(ctx, e0, hs, 1, n), 1)
            x = project(b, b.cb(lib.ggml_reshape_2d(ctx, pair, hs, 2 * n), "inp_embd"))
            x = stack(b, w.cp_layers, x, attn_fn(g, 2, 2, True), None)
            head(b, g, x, 2, 0)

        def nxt(j: int) -> Callable[[Graph], None]:
            def build(g: Graph) -> None:
                b = Builder(g, shape, int8=False, mul_mat=w.mul_mat)
                code = g.input("code", (n,), np.int32)
                x = project(b, b.cb(lib.ggml_get_rows(g.ctx, w.cp_embd[j - 1], code),
                                    "inp_embd"))
                # position j+1 attends to every position 0..j+1 written this frame: no mask
                x = stack(b, w.cp_layers, x, attn_fn(g, 1, j + 2, False), None)
                head(b, g, x, 1, j)

            return build

        graphs = [CachedGraph(t.backends, first, nodes, t.stats)]
        for j in range(1, t.n_groups - 1):
            graphs.append(CachedGraph(t.backends, nxt(j), nodes, t.stats))
        self._cp[n] = (cache, graphs)
        return cache, graphs

    def close(self) -> None:
        """Free every batched graph and the code predictor's batch caches."""
        self.drop_step_graph()
        for cache, graphs in self._cp.values():
            for g in graphs:
                g.close()
            cache.close()
        self._cp.clear()


def _qkv(b: Builder, lw: LayerWeights, il: int, x: Tensor, pos: Tensor
         ) -> tuple[Tensor, Tensor, Tensor]:
    # q [d, H, T], k rows [kv_dim, T], v [kv_dim, T] of T columns: normed and RoPE'd
    ctx, s = b.ctx, b.shape
    d, t = s.head_dim, int(x.ne[1])
    q = lib.ggml_reshape_3d(ctx, b.matmul(lw, "q", x), d, s.n_head, t)
    k = lib.ggml_reshape_3d(ctx, b.matmul(lw, "k", x), d, s.n_kv_head, t)
    v = b.cb(b.matmul(lw, "v", x), "v", il)
    q = b.cb(rms_norm(ctx, q, lw.q_norm, s.eps), "q_norm", il)
    k = b.cb(rms_norm(ctx, k, lw.k_norm, s.eps), "k_norm", il)
    q = b.cb(rope(ctx, q, pos, d, s.rope_theta), "q_rope", il)
    k = b.cb(rope(ctx, k, pos, d, s.rope_theta), "k_rope", il)
    return q, lib.ggml_reshape_2d(ctx, k, s.kv_dim, t), v


def _fused_attention(b: Builder, lw: LayerWeights, il: int, x: Tensor, pos: Tensor,
                     caches: list[custom_ops.StepCache]) -> Tensor:
    # every session's K/V writes and attention in one node (``custom_ops.attn_step``)
    q, k_rows, v = _qkv(b, lw, il, x, pos)
    return attention_out(b, lw, il, custom_ops.attn_step(b.ctx, q, k_rows, v, pos, caches,
                                                         b.g.keep))


def _rows_attention(b: Builder, lw: LayerWeights, il: int, x: Tensor, pos: Tensor,
                    rows: list[_RowInputs]) -> Tensor:
    # Column i is session i: its K/V row goes to its own cache, it attends to its own n_kv rows
    ctx, s = b.ctx, b.shape
    d, n_kv_head = s.head_dim, s.n_kv_head
    q, k_rows, v = _qkv(b, lw, il, x, pos)
    merged: Tensor | None = None
    for i, r in enumerate(rows):
        c = r.cache
        k_i = lib.ggml_view_2d(ctx, k_rows, s.kv_dim, 1, k_rows.nb[1], i * k_rows.nb[1])
        v_i = lib.ggml_view_2d(ctx, v, s.kv_dim, 1, v.nb[1], i * v.nb[1])
        q_i = lib.ggml_view_3d(ctx, q, d, s.n_head, 1, q.nb[1], q.nb[2], i * q.nb[2])
        dst_v = lib.ggml_reshape_2d(ctx, c.v[il], 1, c.kv_dim * c.n_ctx)
        k_w = lib.ggml_set_rows(ctx, c.k[il], k_i, r.k_idx)
        v_w = lib.ggml_set_rows(ctx, dst_v, lib.ggml_reshape_2d(ctx, v_i, 1, s.kv_dim), r.v_idx)
        es = int(c.k[il].nb[0])
        kk = lib.ggml_view_3d(ctx, k_w, d, n_kv_head, r.n_kv, d * es, s.kv_dim * es, 0)
        kk = lib.ggml_permute(ctx, kk, 0, 2, 1, 3)  # [d, n_kv, H_kv]
        vv = lib.ggml_view_3d(ctx, v_w, r.n_kv, d, n_kv_head, c.n_ctx * es,
                              d * c.n_ctx * es, 0)  # [n_kv, d, H_kv]
        o = attend(ctx, q_i, kk, vv, r.mask)
        merged = o if merged is None else lib.ggml_concat(ctx, merged, o, 1)
    assert merged is not None
    return attention_out(b, lw, il, merged)


def _slots_attention(b: Builder, lw: LayerWeights, il: int, x: Tensor, cache: KVCache,
                     n_slot: int, n: int, per: int, n_kv: int, pos: Tensor, k_idx: Tensor,
                     v_idx: Tensor, mask: Tensor | None) -> Tensor:
    # n slots of n_slot positions in one cache; each slot's ``per`` new rows (columns
    # slot*per ..) attend to its first n_kv positions: one 4-D product over (slot, head)
    ctx, s = b.ctx, b.shape
    d, n_head, n_kv_head = s.head_dim, s.n_head, s.n_kv_head
    q, k_rows, v = _qkv(b, lw, il, x, pos)
    dst_v = lib.ggml_reshape_2d(ctx, cache.v[il], 1, cache.kv_dim * cache.n_ctx)
    k_w = lib.ggml_set_rows(ctx, cache.k[il], k_rows, k_idx)
    v_w = lib.ggml_set_rows(ctx, dst_v, lib.ggml_reshape_2d(ctx, v, 1, s.kv_dim * per * n),
                            v_idx)
    es = int(cache.k[il].nb[0])
    kk = lib.ggml_view_4d(ctx, k_w, d, n_kv_head, n_kv, n, d * es, s.kv_dim * es,
                          n_slot * s.kv_dim * es, 0)
    kk = lib.ggml_permute(ctx, kk, 0, 2, 1, 3)  # [d, n_kv, H_kv, n]
    vv = lib.ggml_view_4d(ctx, v_w, n_kv, d, n_kv_head, n, cache.n_ctx * es,
                          d * cache.n_ctx * es, n_slot * es, 0)  # [n_kv, d, H_kv, n]
    q4 = lib.ggml_permute(ctx, lib.ggml_reshape_4d(ctx, q, d, n_head, per, n), 0, 2, 1, 3)
    kq = b.cb(lib.ggml_mul_mat(ctx, kk, q4), "kq", il)  # [n_kv, per, H, n]
    kq = b.cb(lib.ggml_soft_max_ext(ctx, kq, mask if mask is not None else NULL,
                                    1.0 / math.sqrt(d), 0.0), "kq_soft_max", il)
    kqv = lib.ggml_mul_mat(ctx, vv, kq)  # [d, per, H, n]
    merged = lib.ggml_cont_2d(ctx, lib.ggml_permute(ctx, kqv, 0, 2, 1, 3), d * n_head, per * n)
    return attention_out(b, lw, il, merged)
