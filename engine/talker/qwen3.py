"""The one Qwen3 decoder block builder shared by the talker and the code predictor (spec §3.3).

llama.cpp style: ``layer`` reads top to bottom like the paper, from small shared pieces
(``rms_norm``, ``attention``, ``ffn``), and every intermediate is named through ``Builder.cb``:
``talk.blk3.attn_out``, ``cp.blk0.ffn_out``, ... so op logs and placement reports read like the
spec. Shapes below are ggml ``ne`` order (fastest first): activations are ``[hidden, T]``.

Attention with a KV cache in a persistent backend buffer (``KVCache``):

* K is stored per layer as ``[kv_dim, n_ctx]`` (one row per position, RoPE already applied);
* V is stored *transposed*, ``[n_ctx, kv_dim]`` (one row per channel), so ``softmax(QK) V`` is
  one ``mul_mat`` over a strided view with no copy;
* new rows are written with ``ggml_set_rows`` at positions given by *input* index tensors, and
  attention reads a view of the ``set_rows`` result (which orders the read after the write).
  Because positions are inputs, a graph's structure does not depend on the step: the same graph
  can be run again for the next step (see ``engine.talker.runner.CachedGraph``);
* a graph reads ``n_kv`` cache positions; an optional additive mask hides positions not written
  yet (and the future, in a batched prefill). GQA: query head h reads KV head h // (H / H_kv),
  which is exactly ggml's ``mul_mat`` broadcast over dim 2 (and HF's ``repeat_kv``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.backend import BackendSet
from engine.errors import BackendError
from engine.ggml import NULL, Graph, Tensor, ffi, lib
from engine.ggml.graph import new_tensor, set_name
from engine.talker.weights import LayerWeights, StackShape

_NAMES: dict[tuple[str, int, str], bytes] = {}


def _name_bytes(prefix: str, il: int, name: str) -> bytes:
    key = (prefix, il, name)
    b = _NAMES.get(key)
    if b is None:
        s = f"{prefix}.blk{il}.{name}" if il >= 0 else f"{prefix}.{name}"
        b = _NAMES[key] = s.encode()[: lib.GGML_MAX_NAME - 1]
    return b


class Builder:
    """Graph-building helpers bound to one ``Graph`` and one stack's hyper-parameters."""

    def __init__(self, g: Graph, shape: StackShape, capture: bool = False) -> None:
        self.g = g
        self.ctx = g.ctx
        self.shape = shape
        self.capture = capture

    def cb(self, t: Tensor, name: str, il: int = -1) -> Tensor:
        """Name an intermediate ``<prefix>.blk<il>.<name>`` (or ``<prefix>.<name>``).

        With ``capture`` on, the tensor is also a graph output (read back for parity checks).
        """
        lib.ggml_set_name(t, _name_bytes(self.shape.prefix, il, name))
        if self.capture:
            self.g.output(lib.ggml_cont(self.ctx, t), f"tap.{self.shape.prefix}.{il}.{name}")
        return t

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """``weight * x / sqrt(mean(x^2) + eps)`` over ``ne0`` (per head for q/k norms)."""
        return lib.ggml_mul(self.ctx, lib.ggml_rms_norm(self.ctx, x, eps), weight)

    def linear(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        """``W x (+ b)``."""
        y = lib.ggml_mul_mat(self.ctx, w, x)
        return lib.ggml_add(self.ctx, y, b) if b is not None else y


@dataclass
class AttnInputs:
    """Per-graph inputs every layer's attention shares (one set per graph, not per layer)."""

    pos: Tensor  # I32 [T]: RoPE positions of the new rows
    k_idx: Tensor  # I32 [T]: cache rows (positions) the new K rows go to
    v_idx: Tensor  # I32 [kv_dim * T]: flat element indices of the new V values (transposed V)
    mask: Tensor | None  # F32 ne [n_kv, T] additive mask, or None (everything visible)
    n_kv: int  # cache positions the new rows attend to (0 .. n_kv-1)
    # Reused prompt prefix: K/V rows of every layer (ne [kv_dim, P, n_layers], as computed by an
    # earlier prefill) written to cache positions 0..P-1 before the new rows.
    prefix_k: Tensor | None = None
    prefix_v: Tensor | None = None
    prefix_k_idx: Tensor | None = None  # I32 [P]
    prefix_v_idx: Tensor | None = None  # I32 [kv_dim * P]
    snapshot: int = 0  # > 0: output the first `snapshot` new K/V rows of every layer


class KVCache:
    """Per-layer K ``[kv_dim, n_ctx]`` and transposed V ``[n_ctx, kv_dim]`` in one backend buffer.

    Allocated once (per utterance length class or per worker) in the primary backend's buffer
    type and cleared to zeros, so masked-out positions never hold NaN/Inf (0 * NaN would leak).
    """

    def __init__(self, backends: BackendSet, n_layers: int, kv_dim: int, n_ctx: int,
                 ggml_type: int, name: str) -> None:
        self.n_layers, self.kv_dim, self.n_ctx, self.type = n_layers, kv_dim, n_ctx, ggml_type
        params = ffi.new("struct ggml_init_params *")
        params.mem_size = lib.ggml_tensor_overhead() * (2 * n_layers + 4)
        params.mem_buffer = NULL
        params.no_alloc = True
        self.ctx = lib.ggml_init(params[0])
        if self.ctx == NULL:
            raise MemoryError("ggml_init failed for a KV cache context")
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
    """Declare the attention inputs of a graph that writes ``n_new`` rows and reads ``n_kv``."""
    return AttnInputs(
        pos=g.input("pos", (n_new,), np.int32),
        k_idx=g.input("k_idx", (n_new,), np.int32),
        v_idx=g.input("v_idx", (cache.kv_dim * n_new,), np.int32),
        mask=g.input("mask", (n_new, n_kv)) if masked else None,
        n_kv=n_kv,
    )


def attn_uploads(cache: KVCache, pos0: int, n_new: int, n_kv: int | None
                 ) -> dict[str, npt.NDArray[Any]]:
    """Values of the ``attn_inputs`` for rows at positions ``pos0 .. pos0+n_new-1``.

    With ``n_kv`` given, also the mask: query at position p sees cache positions ``<= p``.
    """
    pos = np.arange(pos0, pos0 + n_new, dtype=np.int32)
    up: dict[str, npt.NDArray[Any]] = {"pos": pos, "k_idx": pos, "v_idx": cache.v_index(pos)}
    if n_kv is not None:
        keys = np.arange(n_kv, dtype=np.int32)[None, :]
        up["mask"] = np.where(keys <= pos[:, None], 0.0, -np.inf).astype(np.float32)
    return up


def attention(b: Builder, lw: LayerWeights, il: int, x: Tensor, a: AttnInputs,
              cache: KVCache) -> Tensor:
    """Causal GQA self-attention with per-head q/k RMSNorm and NeoX RoPE; writes the cache."""
    ctx, s = b.ctx, b.shape
    d, n_head, n_kv_head, t = s.head_dim, s.n_head, s.n_kv_head, int(x.ne[1])
    q = lib.ggml_reshape_3d(ctx, lib.ggml_mul_mat(ctx, lw.q, x), d, n_head, t)
    k = lib.ggml_reshape_3d(ctx, lib.ggml_mul_mat(ctx, lw.k, x), d, n_kv_head, t)
    v = b.cb(lib.ggml_mul_mat(ctx, lw.v, x), "v", il)  # [kv_dim, T]
    q = b.cb(b.rms_norm(q, lw.q_norm, s.eps), "q_norm", il)
    k = b.cb(b.rms_norm(k, lw.k_norm, s.eps), "k_norm", il)
    q = b.cb(_rope(ctx, q, a.pos, d, s.rope_theta), "q_rope", il)
    k = b.cb(_rope(ctx, k, a.pos, d, s.rope_theta), "k_rope", il)

    ck, cv = cache.k[il], cache.v[il]
    es = int(ck.nb[0])
    dst_k, dst_v = ck, lib.ggml_reshape_2d(ctx, cv, 1, cache.kv_dim * cache.n_ctx)
    if a.prefix_k is not None and a.prefix_v is not None:
        # Chained set_rows: the new rows are written into the result of the prefix write, so
        # every read below depends on both writes.
        pk, pv = a.prefix_k, a.prefix_v
        n_pre = int(pk.ne[1])
        rows_k = lib.ggml_view_2d(ctx, pk, s.kv_dim, n_pre, pk.nb[1], il * pk.nb[2])
        rows_v = lib.ggml_view_2d(ctx, pv, s.kv_dim, n_pre, pv.nb[1], il * pv.nb[2])
        dst_k = lib.ggml_set_rows(ctx, dst_k, rows_k, a.prefix_k_idx)
        dst_v = lib.ggml_set_rows(ctx, dst_v, lib.ggml_reshape_2d(ctx, rows_v, 1, s.kv_dim * n_pre),
                                  a.prefix_v_idx)
    k_rows = lib.ggml_reshape_2d(ctx, k, s.kv_dim, t)
    k_w = lib.ggml_set_rows(ctx, dst_k, k_rows, a.k_idx)
    v_w = lib.ggml_set_rows(ctx, dst_v, lib.ggml_reshape_2d(ctx, v, 1, s.kv_dim * t), a.v_idx)
    if a.snapshot:
        n = a.snapshot
        b.g.output(lib.ggml_cont(ctx, lib.ggml_view_2d(ctx, k_rows, s.kv_dim, n, k_rows.nb[1], 0)),
                   f"snap_k.{il}")
        b.g.output(lib.ggml_cont(ctx, lib.ggml_view_2d(ctx, v, s.kv_dim, n, v.nb[1], 0)),
                   f"snap_v.{il}")
    b.cb(k_w, "k_write", il)
    b.cb(v_w, "v_write", il)
    n_kv = a.n_kv
    kk = lib.ggml_view_3d(ctx, k_w, d, n_kv_head, n_kv, d * es, s.kv_dim * es, 0)
    kk = lib.ggml_permute(ctx, kk, 0, 2, 1, 3)  # [d, n_kv, H_kv]
    vv = lib.ggml_view_3d(ctx, v_w, n_kv, d, n_kv_head, cache.n_ctx * es,
                          d * cache.n_ctx * es, 0)  # [n_kv, d, H_kv]
    qp = lib.ggml_permute(ctx, q, 0, 2, 1, 3)  # [d, T, H]
    kq = b.cb(lib.ggml_mul_mat(ctx, kk, qp), "kq", il)  # [n_kv, T, H]
    kq = b.cb(lib.ggml_soft_max_ext(ctx, kq, a.mask if a.mask is not None else NULL,
                                    1.0 / math.sqrt(d), 0.0), "kq_soft_max", il)
    kqv = lib.ggml_mul_mat(ctx, vv, kq)  # [d, T, H]
    merged = lib.ggml_cont_2d(ctx, lib.ggml_permute(ctx, kqv, 0, 2, 1, 3), s.q_dim, t)
    b.cb(merged, "kqv_merged", il)
    return b.cb(lib.ggml_mul_mat(ctx, lw.o, merged), "attn_out", il)


def _rope(ctx: Any, x: Tensor, pos: Tensor, n_dims: int, theta: float) -> Tensor:
    # NeoX (rotate-half) over the whole head; with identical position rows the talker's
    # interleaved M-RoPE is exactly this 1-D RoPE (spec §3.3).
    return lib.ggml_rope_ext(ctx, x, pos, NULL, n_dims, lib.GGML_ROPE_TYPE_NEOX, 0, theta, 1.0,
                             0.0, 1.0, 0.0, 0.0)


def ffn(b: Builder, lw: LayerWeights, il: int, x: Tensor) -> Tensor:
    """SwiGLU: ``down(silu(gate x) * up x)``."""
    ctx = b.ctx
    gate = b.cb(lib.ggml_mul_mat(ctx, lw.gate, x), "ffn_gate", il)
    up = b.cb(lib.ggml_mul_mat(ctx, lw.up, x), "ffn_up", il)
    # one fused GLU op instead of silu + mul: one node (and one thread barrier) less per layer
    par = b.cb(lib.ggml_swiglu_split(ctx, gate, up), "ffn_swiglu", il)
    return b.cb(lib.ggml_mul_mat(ctx, lw.down, par), "ffn_out", il)


def layer(b: Builder, lw: LayerWeights, il: int, x: Tensor, a: AttnInputs,
          cache: KVCache) -> Tensor:
    """Pre-norm Qwen3 layer: ``h += Attn(RMSNorm(h)); h += MLP(RMSNorm(h))``."""
    ctx, eps = b.ctx, b.shape.eps
    h = b.cb(b.rms_norm(x, lw.attn_norm, eps), "attn_norm", il)
    x = b.cb(lib.ggml_add(ctx, x, attention(b, lw, il, h, a, cache)), "attn_res", il)
    h = b.cb(b.rms_norm(x, lw.ffn_norm, eps), "ffn_norm", il)
    return b.cb(lib.ggml_add(ctx, x, ffn(b, lw, il, h)), "l_out", il)


def stack(b: Builder, layers: list[LayerWeights], x: Tensor, a: AttnInputs,
          cache: KVCache) -> Tensor:
    """Every layer of a stack, in order."""
    for il, lw in enumerate(layers):
        x = layer(b, lw, il, x, a, cache)
    return x


def last_column(b: Builder, x: Tensor) -> Tensor:
    """The last position of ``[hidden, T]`` as ``[hidden, 1]`` (a view)."""
    t = int(x.ne[1])
    if t == 1:
        return x
    return lib.ggml_view_2d(b.ctx, x, int(x.ne[0]), 1, x.nb[1], (t - 1) * x.nb[1])
