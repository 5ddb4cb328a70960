"""The one Qwen3 decoder block builder shared by the talker and the code predictor.

Math: docs/architecture.md, Qwen3 block.

llama.cpp style: ``layer`` reads top to bottom like the paper, from small shared pieces
(``rms_norm``, ``attention``, ``ffn``), and every intermediate is named through ``Builder.cb``:
``talk.blk3.attn_out``, ``cp.blk0.ffn_out``, ... so op logs and placement reports read like the
math. Shapes below are ggml ``ne`` order (fastest first): activations are ``[hidden, T]``.

Attention with a KV cache in a persistent backend buffer (``KVCache``):

* K is stored per layer as ``[kv_dim, n_ctx]`` (one row per position, RoPE already applied);
* V is stored *transposed*, ``[n_ctx, kv_dim]`` (one row per channel), so ``softmax(QK) V`` is
  one ``mul_mat`` over a strided view with no copy;
* graphs that are run again for later steps (``engine.talker.runner.CachedGraph``) write their
  new rows with ``ggml_set_rows`` at positions given by *input* index tensors, so a graph's
  structure does not depend on the step. A one-off prefill instead writes the cache's first
  rows (the reused prompt prefix, then its own rows) with one ``ggml_cpy`` per tensor, which is
  far cheaper than scattering the transposed V element by element;
* attention reads a view of the write's result (which orders the read after the write);
* a graph reads ``n_kv`` cache positions; an optional additive mask hides positions not written
  yet (and the future, in a batched prefill). GQA: query head h reads KV head h // (H / H_kv),
  which is exactly ggml's ``mul_mat`` broadcast over dim 2 (and HF's ``repeat_kv``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.backend import BackendSet
from engine.errors import BackendError
from engine.ggml import NULL, Graph, Tensor, custom_ops, ffi, lib
from engine.ggml.gemm_i8 import gemm_i8
from engine.ggml.graph import new_tensor, no_alloc_context, set_name
from engine.talker.weights import I8_GROUPS, LayerWeights, StackShape
from engine.transformer import attend, rms_norm, rope, swiglu

_NAMES: dict[tuple[str, int, str], bytes] = {}
KV_READ_PAD = 16  # see prefill_n_kv
# Rows from which a layer with int8 copies multiplies through gemm_i8 (see ``Builder.matmul``)
I8_MIN_ROWS = 2
MulMat = Callable[[Any, Tensor, Tensor], Tensor]


def _name_bytes(prefix: str, il: int, name: str) -> bytes:
    key = (prefix, il, name)
    b = _NAMES.get(key)
    if b is None:
        s = f"{prefix}.blk{il}.{name}" if il >= 0 else f"{prefix}.{name}"
        b = _NAMES[key] = s.encode()[: lib.GGML_MAX_NAME - 1]
    return b


class Builder:
    """Graph-building helpers bound to one ``Graph`` and one stack's hyper-parameters."""

    def __init__(self, g: Graph, shape: StackShape, capture: bool = False,
                 int8: bool = True, mul_mat: MulMat = lib.ggml_mul_mat) -> None:
        self.g = g
        self.ctx = g.ctx
        self.shape = shape
        self.capture = capture
        # False: never the int8 GEMM (a batched step's rows must multiply exactly as one row)
        self.int8 = int8
        # W x for a stored weight: TalkerWeights.mul_mat, which knows the re-laid-out matrices
        self.mul_mat = mul_mat

    def cb(self, t: Tensor, name: str, il: int = -1) -> Tensor:
        """Name an intermediate ``<prefix>.blk<il>.<name>`` (or ``<prefix>.<name>``).

        With ``capture`` on, the tensor is also a graph output (read back for parity checks).
        """
        lib.ggml_set_name(t, _name_bytes(self.shape.prefix, il, name))
        if self.capture:
            self.g.output(lib.ggml_cont(self.ctx, t), f"tap.{self.shape.prefix}.{il}.{name}")
        return t

    def int8_rows(self, lw: LayerWeights, x: Tensor) -> bool:
        """Whether ``x``'s rows multiply the layer's int8 copies: several rows (a prefill), copies
        present. (One row, a step: ggml's ``mul_mat`` on the stored matrix (``mul_mat``), which
        is memory-bound and reads fewer bytes that way.)"""
        return self.int8 and lw.i8 is not None and int(x.ne[1]) >= I8_MIN_ROWS

    def matmul(self, lw: LayerWeights, field: str, x: Tensor) -> Tensor:
        """``W x`` for the layer matrix ``field`` (``"q"`` ... ``"down"``): the W8A8 ``gemm_i8``
        (compute-bound work, where it beats ggml's Q4_0 GEMM) for ``int8_rows`` where ``field``
        is a group of its own (``o``, ``down``; the others go through ``matmuls``), else the
        stored matrix."""
        if self.int8_rows(lw, x) and lw.i8 is not None and field in lw.i8:
            return gemm_i8(self.ctx, x, lw.i8[field])
        return self.mul_mat(self.ctx, getattr(lw, field), x)

    def matmuls(self, lw: LayerWeights, group: str, x: Tensor) -> list[Tensor]:
        """``W x`` for each matrix of an ``I8_GROUPS`` group (they multiply the same ``x``):
        for ``int8_rows`` one GEMM over the group, returned as views of its rows (each with the
        bits of a GEMM of its own; the rows are the GEMM's, so they are strided); else one
        product each."""
        fields = I8_GROUPS[group]
        if not self.int8_rows(lw, x):
            return [self.mul_mat(self.ctx, getattr(lw, f), x) for f in fields]
        assert lw.i8 is not None
        y = gemm_i8(self.ctx, x, lw.i8[group])
        out, off = [], 0
        for f in fields:
            n = int(getattr(lw, f).ne[1])
            out.append(lib.ggml_view_2d(self.ctx, y, n, int(y.ne[1]), y.nb[1], off * y.nb[0]))
            off += n
        return out

    def linear(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        """``W x (+ b)``."""
        y = self.mul_mat(self.ctx, w, x)
        return lib.ggml_add(self.ctx, y, b) if b is not None else y


@dataclass
class AttnInputs:
    """Per-graph inputs every layer's attention shares (one set per graph, not per layer).

    With ``k_idx``/``v_idx`` the new rows are scattered with ``set_rows`` (reusable step graphs);
    without them (a prefill) they are the cache's rows ``P .. P+T-1`` after a reused prefix of
    ``P`` rows (``prefix_k``/``prefix_v``, or none: ``P = 0``), written as one block.
    """

    pos: Tensor  # I32 [T]: RoPE positions of the new rows
    mask: Tensor | None  # F32 ne [n_kv, T] additive mask, or None (everything visible)
    n_kv: int  # cache positions the new rows attend to (0 .. n_kv-1)
    k_idx: Tensor | None = None  # I32 [T]: cache rows (positions) the new K rows go to
    v_idx: Tensor | None = None  # I32 [kv_dim * T]: flat element indices of the new V values
    # Reused prompt prefix (prefill only): F32 K/V rows of every layer, ne [kv_dim, P, n_layers],
    # as computed by an earlier prefill, written to cache positions 0..P-1 before the new rows.
    prefix_k: Tensor | None = None
    prefix_v: Tensor | None = None
    snapshot: int = 0  # > 0: output the first `snapshot` new K/V rows of every layer
    # Prefill chunk after the first (chunked prefill): cache position of this graph's first row.
    # The rows before it are already in the cache, written by earlier chunks.
    row0: int = 0
    # The mask is "cache rows <= the query's position" (attn_uploads), which a fused attention
    # can apply itself; False for any other mask (a batch of pinned prefixes).
    causal: bool = False
    # A step graph on a cache qtts's ops may touch: ``custom_ops.attn_step`` writes the new rows
    # and attends in one node (no indices, no mask: it reads rows 0 .. pos)
    fused_step: bool = False


class KVCache:
    """Per-layer K ``[kv_dim, n_ctx]`` and transposed V ``[n_ctx, kv_dim]`` in one backend buffer.

    Allocated once (per utterance length class or per worker) in the primary backend's buffer
    type and cleared to zeros, so masked-out positions never hold NaN/Inf (0 * NaN would leak).
    """

    def __init__(self, backends: BackendSet, n_layers: int, kv_dim: int, n_ctx: int,
                 ggml_type: int, name: str) -> None:
        self.n_layers, self.kv_dim, self.n_ctx, self.type = n_layers, kv_dim, n_ctx, ggml_type
        self.ctx = no_alloc_context(2 * n_layers + 4, what="a KV cache context")
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        for il in range(n_layers):
            self.k.append(set_name(new_tensor(self.ctx, ggml_type, (n_ctx, kv_dim)),
                                   f"{name}.cache_k.{il}"))
            self.v.append(set_name(new_tensor(self.ctx, ggml_type, (kv_dim, n_ctx)),
                                   f"{name}.cache_v.{il}"))
        buft = lib.ggml_backend_get_default_buffer_type(backends.primary)
        self.buffer = lib.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx, buft)
        if self.buffer == NULL:
            lib.ggml_free(self.ctx)
            self.ctx = None
            raise BackendError(f"cannot allocate the {name} KV cache ({n_ctx} positions)")
        lib.ggml_backend_buffer_clear(self.buffer, 0)
        self.nbytes = int(lib.ggml_backend_buffer_get_size(self.buffer))
        # qtts's own ops on this cache (the V write, the fused prefill attention): in host
        # memory, with the native ops built and not switched off (QTTS_CUSTOM_OPS=0)
        self.native = (bool(lib.ggml_backend_buffer_is_host(self.buffer))
                       and bool(backends.custom_ops) and custom_ops.available())

    def copy_into(self, dst: KVCache) -> None:
        """Every position of every layer into the first positions of ``dst`` (a cache of the
        same layers and type, at least as long): how a growing session keeps its rows."""
        if (dst.n_layers, dst.kv_dim, dst.type) != (self.n_layers, self.kv_dim, self.type) or \
                dst.n_ctx < self.n_ctx:
            raise BackendError("copy_into: the destination cache does not fit")
        es = int(lib.ggml_type_size(self.type))
        row = self.n_ctx * es  # one V channel (or the K rows' bytes per channel)
        k = np.empty(self.kv_dim * row, dtype=np.uint8)
        v = np.empty((self.kv_dim, row), dtype=np.uint8)
        v_dst = np.zeros((self.kv_dim, dst.n_ctx * es), dtype=np.uint8)
        for il in range(self.n_layers):
            # K: one row per position, so the old rows are the new cache's first bytes
            lib.ggml_backend_tensor_get(self.k[il], ffi.from_buffer(k), 0, k.nbytes)
            lib.ggml_backend_tensor_set(dst.k[il], ffi.from_buffer(k), 0, k.nbytes)
            # V: one row per channel, each longer in the new cache
            lib.ggml_backend_tensor_get(self.v[il], ffi.from_buffer(v), 0, v.nbytes)
            v_dst[:, :row] = v
            lib.ggml_backend_tensor_set(dst.v[il], ffi.from_buffer(v_dst), 0, v_dst.nbytes)

    def v_index(self, positions: npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
        """Flat indices into the transposed V of channel e at position p: ``e * n_ctx + p``.

        Ordered like the new V values ``[kv_dim, T]`` flattened (channel fastest).
        """
        e = np.arange(self.kv_dim, dtype=np.int64)[None, :] * self.n_ctx
        idx = e + np.asarray(positions, dtype=np.int64)[:, None]
        return np.ascontiguousarray(idx.reshape(-1), dtype=np.int32)

    def close(self) -> None:
        """Free the buffer and the metadata context."""
        if getattr(self, "buffer", None) is not None and self.buffer != NULL:
            lib.ggml_backend_buffer_free(self.buffer)
        self.buffer = None
        if getattr(self, "ctx", None) is not None:
            lib.ggml_free(self.ctx)
            self.ctx = None

    def __del__(self) -> None:
        self.close()


def attn_inputs(g: Graph, cache: KVCache, n_new: int, n_kv: int, masked: bool) -> AttnInputs:
    """Inputs of a reusable graph that scatters ``n_new`` rows (``set_rows``), reads ``n_kv``;
    on a cache qtts's ops may touch, the positions alone (``custom_ops.attn_step``)."""
    if cache.native:
        return AttnInputs(pos=g.input("pos", (n_new,), np.int32), mask=None, n_kv=n_kv,
                          fused_step=True)
    return AttnInputs(
        pos=g.input("pos", (n_new,), np.int32),
        mask=g.input("mask", (n_new, n_kv)) if masked else None,
        n_kv=n_kv,
        k_idx=g.input("k_idx", (n_new,), np.int32),
        v_idx=g.input("v_idx", (cache.kv_dim * n_new,), np.int32),
    )


def prefill_inputs(g: Graph, n_new: int, n_kv: int, row0: int = 0) -> AttnInputs:
    """Inputs of a one-off prefill graph: the new rows are written as one block, no indices.

    ``row0``: cache position of the first new row (a later chunk of a chunked prefill).
    """
    return AttnInputs(pos=g.input("pos", (n_new,), np.int32),
                      mask=g.input("mask", (n_new, n_kv)), n_kv=n_kv, row0=row0, causal=True)


def attn_uploads(cache: KVCache, pos0: int, n_new: int, n_kv: int | None,
                 indices: bool = True) -> dict[str, npt.NDArray[Any]]:
    """Values of the attention inputs for rows at positions ``pos0 .. pos0+n_new-1``.

    With ``n_kv`` given, also the mask: query at position p sees cache positions ``<= p``.
    ``indices=False``: no ``set_rows`` indices (``prefill_inputs``). With indices on a cache
    qtts's ops may touch, the positions alone (``attn_inputs``).
    """
    pos = np.arange(pos0, pos0 + n_new, dtype=np.int32)
    up: dict[str, npt.NDArray[Any]] = {"pos": pos}
    if indices and cache.native:
        return up
    if indices:
        up.update(k_idx=pos, v_idx=cache.v_index(pos))
    if n_kv is not None:
        keys = np.arange(n_kv, dtype=np.int32)[None, :]
        up["mask"] = np.where(keys <= pos[:, None], 0.0, -np.inf).astype(np.float32)
    return up


def prefill_n_kv(n_positions: int, n_ctx: int) -> int:
    """Cache positions a prefill over ``n_positions`` reads: rounded up to ``KV_READ_PAD``.

    The padding is masked out (those rows hold zeros or older rows: finite, weighted 0); it
    lets both attention matmuls take ggml's tiled llamafile GEMM, which needs ``n_kv`` (the
    rows of ``K``, the inner size of ``softmax(QK) V``) a multiple of 16 for F16/F32 on
    AVX-512, instead of one dot product per output (docs/performance.md, Figures behind the
    code). ``n_ctx`` is a multiple of 64, so the read never leaves the cache.
    """
    return min(-(-n_positions // KV_READ_PAD) * KV_READ_PAD, n_ctx)


def attention(b: Builder, lw: LayerWeights, il: int, x: Tensor, a: AttnInputs,
              cache: KVCache, last_only: bool = False) -> Tensor:
    """Causal GQA self-attention with per-head q/k RMSNorm and NeoX RoPE; writes the cache.

    ``last_only``: K/V of every position go to the cache, but only the last position queries
    (output ``[hidden, 1]``): the last layer of a prefill, whose other outputs nobody reads.
    """
    ctx, s = b.ctx, b.shape
    d, n_head, n_kv_head, t = s.head_dim, s.n_head, s.n_kv_head, int(x.ne[1])
    xq, pos_q, mask_q = x, a.pos, a.mask
    if last_only and t > 1:
        xq = last_column(b, x)
        pos_q = lib.ggml_view_1d(ctx, a.pos, 1, (t - 1) * a.pos.nb[0])
        if a.mask is not None:
            mask_q = lib.ggml_view_2d(ctx, a.mask, int(a.mask.ne[0]), 1, a.mask.nb[1],
                                      (t - 1) * a.mask.nb[1])
    tq = int(xq.ne[1])
    if b.int8_rows(lw, x):  # one GEMM for the three (q for every row, the last one taken)
        q_proj, k_proj, v = b.matmuls(lw, "qkv", x)
        if tq < t:
            q_proj = lib.ggml_view_2d(ctx, q_proj, int(q_proj.ne[0]), 1, q_proj.nb[1],
                                      (t - 1) * q_proj.nb[1])
    else:
        q_proj = b.matmul(lw, "q", xq)
        k_proj = b.matmul(lw, "k", x)
        v = b.matmul(lw, "v", x)
    # (views: the rows of a group's GEMM are strided)
    q = lib.ggml_view_3d(ctx, q_proj, d, n_head, tq, d * q_proj.nb[0], q_proj.nb[1], 0)
    k = lib.ggml_view_3d(ctx, k_proj, d, n_kv_head, t, d * k_proj.nb[0], k_proj.nb[1], 0)
    v = b.cb(v, "v", il)  # [kv_dim, T]
    q = b.cb(rms_norm(b.ctx, q, lw.q_norm, s.eps), "q_norm", il)
    k = b.cb(rms_norm(b.ctx, k, lw.k_norm, s.eps), "k_norm", il)
    q = b.cb(rope(ctx, q, pos_q, d, s.rope_theta), "q_rope", il)
    k = b.cb(rope(ctx, k, a.pos, d, s.rope_theta), "k_rope", il)

    k_rows = lib.ggml_reshape_2d(ctx, k, s.kv_dim, t)
    if a.fused_step:
        return attention_out(b, lw, il, custom_ops.attn_step(
            ctx, q, k_rows, v, a.pos, [custom_ops.StepCache(cache.k[il], cache.v[il], 0,
                                                            cache.n_ctx)], b.g.keep))
    if a.snapshot:
        n = a.snapshot
        b.g.output(lib.ggml_cont(ctx, lib.ggml_view_2d(ctx, k_rows, s.kv_dim, n, k_rows.nb[1], 0)),
                   f"snap_k.{il}")
        b.g.output(lib.ggml_cont(ctx, lib.ggml_view_2d(ctx, v, s.kv_dim, n, v.nb[1], 0)),
                   f"snap_v.{il}")
    if a.k_idx is not None and a.v_idx is not None:
        k_w, v_w = _scatter_kv(b, a, il, k_rows, v, cache)
    else:
        k_w, v_w = write_kv_block(b, a, il, k_rows, v, cache)
    if not a.row0:  # (a later chunk's k_w/v_w are the cache tensors themselves: no renaming)
        b.cb(k_w, "k_write", il)
        b.cb(v_w, "v_write", il)
    return attention_out(b, lw, il, cache_attention(b, a, il, q, k_w, v_w, cache, pos_q, mask_q))


def attention_out(b: Builder, lw: LayerWeights, il: int, merged: Tensor) -> Tensor:
    """The output projection of the heads merged ``[d * H, T]`` (both named for the callback)."""
    return b.cb(b.matmul(lw, "o", b.cb(merged, "kqv_merged", il)), "attn_out", il)


def cache_attention(b: Builder, a: AttnInputs, il: int, q: Tensor, k_w: Tensor, v_w: Tensor,
                    cache: KVCache, pos_q: Tensor, mask_q: Tensor | None) -> Tensor:
    """Queries ``q`` [d, H, T] at ``pos_q`` over the first ``a.n_kv`` rows of layer ``il`` of
    ``cache``, read through ``k_w``/``v_w`` (the results of its K/V writes, from position 0);
    the heads merged, ``[d * H, T]``: the fused op where ``fused_attention`` allows it, else
    ggml's nodes with ``mask_q``."""
    # Views of the write results (from cache position 0, which both writes start at or cover),
    # so every read is ordered after the writes; n_kv may reach past the rows written here.
    ctx, s = b.ctx, b.shape
    d, n_kv_head = s.head_dim, s.n_kv_head
    n_kv, es = a.n_kv, int(cache.k[il].nb[0])
    if fused_attention(b, a, cache):
        kk = lib.ggml_view_2d(ctx, k_w, s.kv_dim, n_kv, cache.k[il].nb[1], 0)
        vv = lib.ggml_view_2d(ctx, v_w, n_kv, s.kv_dim, cache.v[il].nb[1], 0)
        return custom_ops.attn_causal(ctx, q, kk, vv, pos_q)
    kk = lib.ggml_view_3d(ctx, k_w, d, n_kv_head, n_kv, d * es, s.kv_dim * es, 0)
    kk = lib.ggml_permute(ctx, kk, 0, 2, 1, 3)  # [d, n_kv, H_kv]
    vv = lib.ggml_view_3d(ctx, v_w, n_kv, d, n_kv_head, cache.n_ctx * es,
                          d * cache.n_ctx * es, 0)  # [n_kv, d, H_kv]
    return attend(ctx, q, kk, vv, mask_q, lambda t, name: b.cb(t, name, il))


def fused_attention(b: Builder, a: AttnInputs, cache: KVCache) -> bool:
    # qtts's fused op where it fits: a prefill graph with the causal mask (the op applies it
    # itself) over a cache its native ops may touch, on a SIMD build (its portable C path is
    # slower than ggml's nodes). The last layer's lone query fills 1/16 of its lanes and is
    # slower than ggml's nodes by ~0.2 ms, but keeps F32 where those round Q to F16.
    s = b.shape
    return (a.causal and a.k_idx is None and cache.native and s.n_head % s.n_kv_head == 0
            and s.n_head // s.n_kv_head <= 16 and custom_ops.attn_causal_fast())


def _scatter_kv(b: Builder, a: AttnInputs, il: int, k_rows: Tensor, v: Tensor,
                cache: KVCache) -> tuple[Tensor, Tensor]:
    # set_rows at input positions: K row by row, transposed V element by element. The results
    # are views of the whole cache tensors.
    ctx = b.ctx
    assert a.k_idx is not None and a.v_idx is not None
    n_new = int(k_rows.ne[1]) * int(k_rows.ne[0])
    dst_v = lib.ggml_reshape_2d(ctx, cache.v[il], 1, cache.kv_dim * cache.n_ctx)
    k_w = lib.ggml_set_rows(ctx, cache.k[il], k_rows, a.k_idx)
    v_w = lib.ggml_set_rows(ctx, dst_v, lib.ggml_reshape_2d(ctx, v, 1, n_new), a.v_idx)
    return k_w, v_w


def write_kv_block(b: Builder, a: AttnInputs, il: int, k_rows: Tensor, v: Tensor,
                    cache: KVCache) -> tuple[Tensor, Tensor]:
    # Prefill: cache rows 0..n-1 = [reused prefix rows;] this graph's rows, one cpy per tensor
    # (V through a transposed view into the channel-major cache). The results are views of the
    # cache starting at position 0.
    ctx, kv = b.ctx, cache.kv_dim
    if a.row0:
        return _write_kv_rows_at(b, a.row0, k_rows, v, cache, il)
    if a.prefix_k is not None and a.prefix_v is not None:
        k_rows = lib.ggml_concat(ctx, _layer_rows(ctx, a.prefix_k, il), k_rows, 1)
        v = lib.ggml_concat(ctx, _layer_rows(ctx, a.prefix_v, il), v, 1)
    n = int(k_rows.ne[1])
    ck, cv = cache.k[il], cache.v[il]
    k_w = lib.ggml_cpy(ctx, k_rows, lib.ggml_view_2d(ctx, ck, kv, n, ck.nb[1], 0))
    v_w = _write_v_transposed(ctx, cache, v, lib.ggml_view_2d(ctx, cv, n, kv, cv.nb[1], 0))
    return k_w, v_w


def _write_v_transposed(ctx: Any, cache: KVCache, v: Tensor, dst: Tensor) -> Tensor:
    # V rows [kv_dim, n] into the channel-major cache view dst [n, kv_dim]: qtts's op on a cache
    # in host memory (the CPU backend), ggml's CPY through a transposed view elsewhere
    if cache.native and int(v.nb[0]) == 4:
        return custom_ops.kv_write_transposed(ctx, dst, v)
    return lib.ggml_cpy(ctx, lib.ggml_transpose(ctx, v), dst)


def _write_kv_rows_at(b: Builder, row0: int, k_rows: Tensor, v: Tensor, cache: KVCache,
                      il: int) -> tuple[Tensor, Tensor]:
    # A later prefill chunk: its rows go to positions row0.. while the attention reads every
    # position from 0, earlier chunks' rows included. A view of the copy's result cannot start
    # before row0, so the copies are put in the graph first and the reads are plain views of
    # the cache tensors: the backends run a graph's nodes in order (llama.cpp relies on the
    # same), so the reads see the rows written here.
    ctx, kv = b.ctx, cache.kv_dim
    n = int(k_rows.ne[1])
    ck, cv = cache.k[il], cache.v[il]
    es = int(ck.nb[0])
    if row0 + n > cache.n_ctx:
        raise BackendError(f"prefill rows {row0}..{row0 + n - 1} past the cache ({cache.n_ctx})")
    b.g.expand(lib.ggml_cpy(ctx, k_rows, lib.ggml_view_2d(ctx, ck, kv, n, ck.nb[1],
                                                          row0 * ck.nb[1])))
    b.g.expand(_write_v_transposed(ctx, cache, v,
                                   lib.ggml_view_2d(ctx, cv, n, kv, cv.nb[1], row0 * es)))
    return ck, cv


def _layer_rows(ctx: Any, rows: Tensor, il: int) -> Tensor:
    # layer il of a per-layer stack of rows ne [kv_dim, P, n_layers]: ne [kv_dim, P]
    return lib.ggml_view_2d(ctx, rows, int(rows.ne[0]), int(rows.ne[1]), rows.nb[1],
                            il * rows.nb[2])


def ffn(b: Builder, lw: LayerWeights, il: int, x: Tensor) -> Tensor:
    """SwiGLU: ``down(silu(gate x) * up x)``."""
    gate, up = b.matmuls(lw, "gate_up", x)
    gate = b.cb(gate, "ffn_gate", il)
    up = b.cb(up, "ffn_up", il)
    par = b.cb(swiglu(b.ctx, gate, up), "ffn_swiglu", il)
    return b.cb(b.matmul(lw, "down", par), "ffn_out", il)


AttnFn = Callable[[Builder, LayerWeights, int, Tensor], Tensor]


def layer(b: Builder, lw: LayerWeights, il: int, x: Tensor, a: AttnInputs | AttnFn,
          cache: KVCache | None, last_only: bool = False) -> Tensor:
    """Pre-norm Qwen3 layer: ``h += Attn(RMSNorm(h)); h += MLP(RMSNorm(h))``.

    ``last_only``: output the last position only (``[hidden, 1]``; K/V still cover every one).
    ``a``: the attention inputs of ``attention``, or an attention of its own ``(b, lw, il, h)``
    (the batched graphs of ``engine.talker.batch``).
    """
    ctx, eps = b.ctx, b.shape.eps
    h = b.cb(rms_norm(b.ctx, x, lw.attn_norm, eps), "attn_norm", il)
    if isinstance(a, AttnInputs):
        assert cache is not None
        attn = attention(b, lw, il, h, a, cache, last_only)
    else:
        attn = a(b, lw, il, h)
    if last_only:
        x = last_column(b, x)
    x = b.cb(lib.ggml_add(ctx, x, attn), "attn_res", il)
    h = b.cb(rms_norm(b.ctx, x, lw.ffn_norm, eps), "ffn_norm", il)
    return b.cb(lib.ggml_add(ctx, x, ffn(b, lw, il, h)), "l_out", il)


def stack(b: Builder, layers: list[LayerWeights], x: Tensor, a: AttnInputs | AttnFn,
          cache: KVCache | None, last_only: bool = False) -> Tensor:
    """Every layer of a stack, in order.

    ``last_only``: only the last position's output is wanted (a prefill feeding its head), so
    the last layer computes its queries, attention output and MLP for that position only.
    """
    for il, lw in enumerate(layers):
        x = layer(b, lw, il, x, a, cache, last_only and il == len(layers) - 1)
    return x


def last_column(b: Builder, x: Tensor) -> Tensor:
    """The last position of ``[hidden, T]`` as ``[hidden, 1]`` (a view)."""
    t = int(x.ne[1])
    if t == 1:
        return x
    return lib.ggml_view_2d(b.ctx, x, int(x.ne[0]), 1, x.nb[1], (t - 1) * x.nb[1])
