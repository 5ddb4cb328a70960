"""qtts's INT8 GEMM custom op (native/ops/gemm_i8.c): ``y = W x`` in W8A8 for prefills.

A prompt's prefill multiplies every talker matrix by tens to hundreds of rows at once, which is
compute-bound; ggml's Q4_0 GEMM rescales every 32-element block in F32, which caps its rate
(docs/performance.md, Figures behind the code). This op keeps an int8 copy of the weight, rounded
per (output channel, 256 inputs), rounds the input the same way per (row, 256 inputs) inside the
op, and sums with AVX512-VNNI (64 int8 MACs per instruction). Single-row steps stay on ggml's Q4_0
``mul_mat``, which reads fewer bytes.

``pack`` turns an F32 ``[N, K]`` matrix into the op's three arrays; ``I8Matrix`` holds them as
ggml tensors; ``gemm_i8`` adds the op to a graph; ``reference`` is the exact numpy model of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.ggml.custom_ops import GGML_N_TASKS_MAX, _check_f32, _fn, _library, has_fast_path
from engine.ggml.graph import Tensor
from engine.ggml.native import ffi, lib

BLOCK = 32  # QTTS_GEMM_I8_BLOCK: output channels per packed block
KBLOCK = 256  # QTTS_GEMM_I8_KBLOCK: input channels per scale


def fast_available(library: Any | None = None) -> bool:
    """Whether ``gemm_i8`` runs on its AVX512-VNNI kernel (else a portable path: exact, slow)."""
    return has_fast_path(library, "qtts_gemm_i8_fast")


@dataclass
class PackedI8:
    """``qtts_gemm_i8_pack``'s output for one ``[N, K]`` matrix (numpy, ready to upload)."""

    n: int
    k: int
    wq: npt.NDArray[np.int8]  # [ceil(N/32), ceil(K/4), 32 * 4]
    ws: npt.NDArray[np.float32]  # [ceil(N/32), ceil(K/256), 32]
    wc: npt.NDArray[np.int32]  # [ceil(N/32), ceil(K/256), 32]


def pack(w: npt.NDArray[np.float32], *, library: Any | None = None) -> PackedI8:
    """F32 matrix ``[N, K]`` (ggml ne ``[K, N]``: one output channel per row) -> its int8 form."""
    if w.ndim != 2:
        raise ValueError(f"gemm_i8.pack: the matrix must be [N, K], got shape {w.shape}")
    n, k = (int(s) for s in w.shape)
    nob, ng, nkb = -(-n // BLOCK), -(-k // 4), -(-k // KBLOCK)
    src = np.ascontiguousarray(w, dtype=np.float32)
    wq = np.empty((nob, ng, BLOCK * 4), np.int8)
    ws = np.empty((nob, nkb, BLOCK), np.float32)
    wc = np.empty((nob, nkb, BLOCK), np.int32)
    _library(library).qtts_gemm_i8_pack(
        ffi.cast("const float *", ffi.from_buffer(src)), n, k,
        ffi.cast("int8_t *", ffi.from_buffer(wq)), ffi.cast("float *", ffi.from_buffer(ws)),
        ffi.cast("int32_t *", ffi.from_buffer(wc)))
    return PackedI8(n, k, wq, ws, wc)


@dataclass
class I8Matrix:
    """One packed matrix as ggml tensors (I8 ``wq``, F32 ``ws``, I32 ``wc``) in a CPU buffer."""

    n: int
    k: int
    wq: Tensor
    ws: Tensor
    wc: Tensor


def gemm_i8(ctx: Any, x: Tensor, m: I8Matrix, *, library: Any | None = None) -> Tensor:
    """``W x`` for F32 ``x`` of ne ``[K, T]`` (rows contiguous): a new F32 tensor ``[N, T]``.

    Same value as ``reference``: the weight as packed, the input rounded per (row, 256
    channels) to int8, exact int32 sums, one F32 scale per block. Independent of the thread
    count. CPU backend only (a custom op).
    """
    _check_f32(x, "gemm_i8: x")
    if int(x.ne[0]) != m.k or int(x.ne[2]) != 1 or int(x.ne[3]) != 1:
        raise ValueError(f"gemm_i8: x has ne={[int(x.ne[i]) for i in range(4)]}, the matrix "
                         f"takes [{m.k}, T, 1, 1]")
    nob, ng, nkb = -(-m.n // BLOCK), -(-m.k // 4), -(-m.k // KBLOCK)
    for t, ggml_type, ne, what in ((m.wq, lib.GGML_TYPE_I8, [BLOCK * 4, ng, nob, 1], "wq"),
                                   (m.ws, lib.GGML_TYPE_F32, [BLOCK, nkb, nob, 1], "ws"),
                                   (m.wc, lib.GGML_TYPE_I32, [BLOCK, nkb, nob, 1], "wc")):
        got = [int(t.ne[i]) for i in range(4)]
        if int(t.type) != ggml_type or got != ne or not lib.ggml_is_contiguous(t):
            raise ValueError(f"gemm_i8: {what} must be a contiguous ggml type {ggml_type} tensor "
                             f"of ne={ne} (pack), got type {int(t.type)} ne={got}")
    if int(x.nb[0]) != 4:
        raise ValueError("gemm_i8: x rows must be contiguous F32")
    fn = _fn(library, "qtts_gemm_i8_op", "ggml_custom_op_t")
    args = ffi.new("struct ggml_tensor *[4]", [x, m.wq, m.ws, m.wc])
    return lib.ggml_custom_4d(ctx, lib.GGML_TYPE_F32, m.n, int(x.ne[1]), 1, 1, args, 4, fn,
                              GGML_N_TASKS_MAX, ffi.NULL)


def _round_blocks(a: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.int64],
                                                       npt.NDArray[np.float32]]:
    # [R, K] -> int values [R, K] and scales [R, ceil(K/256)], the kernel's rounding rule
    r, k = a.shape
    nkb = -(-k // KBLOCK)
    q = np.zeros((r, k), np.int64)
    s = np.zeros((r, nkb), np.float32)
    for b in range(nkb):
        blk = a[:, b * KBLOCK:(b + 1) * KBLOCK]
        sc = (np.abs(blk).max(axis=1) / np.float32(127)).astype(np.float32)
        inv = np.where(sc > 0, np.float32(1) / np.where(sc > 0, sc, 1), 0).astype(np.float32)
        q[:, b * KBLOCK:(b + 1) * KBLOCK] = np.clip(np.rint(blk * inv[:, None]), -127, 127)
        s[:, b] = sc
    return q, s


def reference(w: npt.NDArray[np.float32], x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """What ``gemm_i8`` computes, in numpy: ``w`` ``[N, K]``, ``x`` ``[T, K]`` -> ``[T, N]``.

    Exact integer block sums; the F32 epilogue in float64 (the op's fused multiply-add rounds
    once per block, so the two agree to a few F32 ulps of each block's partial sum).
    """
    wq, wsc = _round_blocks(np.asarray(w, np.float32))
    xq, xsc = _round_blocks(np.asarray(x, np.float32))
    out = np.zeros((x.shape[0], w.shape[0]), np.float64)
    for b in range(wsc.shape[1]):
        sl = slice(b * KBLOCK, (b + 1) * KBLOCK)
        sums = xq[:, sl] @ wq[:, sl].T
        out += sums * (wsc[None, :, b].astype(np.float32) * xsc[:, b, None]).astype(np.float64)
    return out.astype(np.float32)
