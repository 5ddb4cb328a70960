"""qtts's Q4_0 step kernel (native/ops/gemv_q4.c): ``y = W x`` for a few rows of ``x``.

A talker or code-predictor step multiplies one row (one per session in a batched step) by every
matrix, so it is bound by how fast the kernel consumes the weight stream. ggml's repacked Q4_0
GEMV reaches about half of the machine's read bandwidth on matrices that do not fit the cache;
this op (AVX512-VNNI or AVX2, nibbles and scales in one sequential stream, prefetched) gets
close to it, and several rows reuse each block from L1 (docs/performance.md, Kernels). Its
products are ggml's Q4_0 x Q8_0 dot (the input rounded per 32 values as ggml rounds it); each
output is one F32 chain over the blocks in order, so a row's result does not depend on how many
rows share the call or on the thread count: a batched step equals the unbatched one bit for bit.

``pack`` re-lays a GGUF Q4_0 matrix out for the op; ``gemv_q4`` adds the op to a graph;
``reference`` is its numpy model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.ggml.custom_ops import GGML_N_TASKS_MAX, _check_f32, _fn, _library, has_fast_path
from engine.ggml.graph import Tensor
from engine.ggml.native import ffi, lib

ROWS = 16  # QTTS_GEMV_Q4_ROWS: output rows per packed block
BYTES = 288  # QTTS_GEMV_Q4_BYTES: packed bytes per (16 rows, 32 inputs)
QK, Q4_0_BLOCK_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_0]  # 32 inputs in 18 bytes


def fast_available(library: Any | None = None) -> bool:
    """Whether ``gemv_q4`` runs on a SIMD kernel, AVX512-VNNI or AVX2 (else a portable path:
    same bits, slower than ggml's own GEMV)."""
    return has_fast_path(library, "qtts_gemv_q4_fast")


def packable(n: int, k: int) -> bool:
    """Whether an ``[N, K]`` Q4_0 matrix fits the op's layout."""
    return n > 0 and k > 0 and n % ROWS == 0 and k % QK == 0


def pack(q4: Any, n: int, k: int, *, library: Any | None = None) -> npt.NDArray[np.int8]:
    """GGUF Q4_0 bytes of an ``[N, K]`` matrix (ggml ne ``[K, N]``) -> the op's ``w``:
    int8 ``[N/16, K/32, 288]`` (ggml ne ``[288, K/32, N/16]``)."""
    if not packable(n, k):
        raise ValueError(f"gemv_q4.pack: [{n}, {k}] needs N % {ROWS} == 0 and K % {QK} == 0")
    src = np.frombuffer(q4, np.uint8)
    if src.size != n * k // QK * Q4_0_BLOCK_BYTES:
        raise ValueError(f"gemv_q4.pack: {src.size} bytes is not a Q4_0 [{n}, {k}] matrix")
    out = np.empty((n // ROWS, k // QK, BYTES), np.int8)
    _library(library).qtts_gemv_q4_pack(
        ffi.cast("const uint8_t *", ffi.from_buffer(src)), n, k,
        ffi.cast("uint8_t *", ffi.from_buffer(out)))
    return out


def gemv_q4(ctx: Any, x: Tensor, w: Tensor, *, library: Any | None = None) -> Tensor:
    """``W x`` for F32 ``x`` of ne ``[K, a, b, c]`` (rows contiguous, any strides) and a packed
    ``w`` (``pack``, ne ``[288, K/32, N/16]``): a new contiguous F32 tensor ``[N, a, b, c]``.
    CPU backend only (a custom op)."""
    _check_f32(x, "gemv_q4: x")
    k = int(x.ne[0])
    if (int(w.type) != lib.GGML_TYPE_I8 or int(w.ne[0]) != BYTES or int(w.ne[1]) * QK != k
            or int(w.ne[3]) != 1 or not lib.ggml_is_contiguous(w)):
        raise ValueError(f"gemv_q4: w must be a packed I8 tensor of ne [{BYTES}, {k // QK}, N/16]"
                         f", got type {int(w.type)} ne={[int(w.ne[i]) for i in range(4)]}")
    if int(x.nb[0]) != 4:
        raise ValueError("gemv_q4: x rows must be contiguous F32")
    fn = _fn(library, "qtts_gemv_q4_op", "ggml_custom_op_t")
    args = ffi.new("struct ggml_tensor *[2]", [x, w])
    return lib.ggml_custom_4d(ctx, lib.GGML_TYPE_F32, int(w.ne[2]) * ROWS, int(x.ne[1]),
                              int(x.ne[2]), int(x.ne[3]), args, 2, fn, GGML_N_TASKS_MAX, ffi.NULL)


def _q8_rows(x: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    # [T, K] -> int values and F16-rounded scales [T, K/32], ggml's Q8_0 rounding
    t, k = x.shape
    blk = x.reshape(t, k // QK, QK)
    amax = np.abs(blk).max(axis=2)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, 0).astype(np.float32)
    q = np.clip(np.rint(blk * inv[:, :, None]), -127, 127).astype(np.int64)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    return q, d


def reference(q4: Any, n: int, k: int, x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """What ``gemv_q4`` computes, in numpy: GGUF Q4_0 bytes of ``[N, K]``, ``x`` ``[T, K]`` ->
    ``[T, N]``. Exact integer block sums; the F32 chain in float64 (the op rounds once per
    block, so the two agree to a few F32 ulps of the partial sums)."""
    raw = np.frombuffer(q4, np.uint8).reshape(n, k // QK, Q4_0_BLOCK_BYTES)
    dw = raw[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)  # [N, nkb]
    qs = raw[:, :, 2:].astype(np.int64)
    u = np.concatenate([qs & 0x0F, qs >> 4], axis=2) - 8  # [N, nkb, 32]
    xq, xd = _q8_rows(np.asarray(x, np.float32))
    t = x.shape[0]
    sums = np.einsum("tbk,nbk->tnb", xq.reshape(t, k // QK, QK), u)
    scale = (dw[None, :, :] * xd[:, None, :]).astype(np.float32).astype(np.float64)
    out: npt.NDArray[np.float32] = np.sum(sums * scale, axis=2).astype(np.float32)
    return out
