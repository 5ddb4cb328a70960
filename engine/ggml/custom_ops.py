"""qtts's own ggml custom ops (native/ops/*.c): graph-building wrappers.

Layout is the decoder's "time-major" one: an activation of numpy shape ``[T, C]`` is a ggml
tensor with ``ne = [C, T]`` (channels fastest, contiguous rows); per-channel parameters are F32
vectors of numpy shape ``[C]``.

The C functions run inside ggml's CPU backend through ``ggml_map_custom3`` /
``ggml_custom_4d`` with ``GGML_N_TASKS_MAX`` (one task per compute thread). ggml stores only the
raw function pointer in the node, so the cffi function objects are kept alive here for the life
of the process. A ``GGML_ASSERT`` inside an op aborts the process, so every shape and type rule
the C code relies on is checked here first and raised as ``ValueError`` / ``TypeError``.

Custom ops run on the CPU backend only. CUDA/Vulkan/Metal report them unsupported, so the
scheduler runs these nodes on the CPU fallback. **The RPC backend (ggml 0.20.2) reports every op
as supported**: a custom node scheduled there would send a raw function pointer of this process
to the rpc-server process, which would call it (read from ggml-rpc.cpp: no op check on the
server side; not tried). Pin custom nodes to the CPU
(``ggml_backend_sched_set_tensor_backend(sched, node, cpu)``) whenever RPC is in the set.
Neither op is eligible for ggml-alloc's in-place reuse, so dst never aliases an input.

Ops: ``snake_beta``; ``elu`` and ``gelu_erf`` (vectorised); ``kv_write_transposed`` (a
prefill's V rows into the channel-major cache); ``pool_stats`` (per-channel mean and variance
over time); ``argmax`` (rows over every thread); ``attn_causal`` (a prefill's attention over
the talker cache, fused); ``attn_step`` (the attention of decoding steps, several sessions'
caches and their K/V writes in one node); ``attn_window`` (the decoder pre-transformer's
sliding-window attention, chunking-invariant); ``attn_full`` (causal attention over a whole
input on the conv tiles); ``conv1d_tm`` (exact F32 direct conv, weights from
``pack_conv_weight``), ``seanet_unit`` and ``seanet_stage`` (a residual unit of the codec
encoder on it, and a unit with the strided conv after it, fused);
``conv1d_tm_bf16`` (its fast-mode twin: BF16 weights from ``pack_conv_weight_bf16`` and
BF16-rounded input, F32 sums; AVX512_BF16 when ``bf16_available()``, else a slow portable
path);
``conv1d_wino_bf16`` and ``conv1d_wino_f32`` (fast mode's Winograd convs, BF16 and F32);
``gemm_i8`` and ``gemv_q4`` (the talker's quantised products). The convs take their left history
either in front of the input (``xp``) or as a tensor of its own (``hist=``), which spares the
graph a concat of the whole activation; the results are the same bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from math import prod
from typing import Any

import numpy as np

from engine.dtypes import bf16_to_f32, f32_to_bf16
from engine.errors import NativeBuildError
from engine.ggml.graph import Tensor
from engine.ggml.native import ffi, lib, ops

# ggml.h spells it "(-1)", which the binding's integer-macro filter does not pick up.
GGML_N_TASKS_MAX = -1
# ggml_custom_4d takes fewer sources than GGML_MAX_SRC (it asserts n_args < GGML_MAX_SRC)
MAX_CUSTOM_SOURCES = int(lib.GGML_MAX_SRC) - 1

ISA_NAMES = {0: "scalar", 2: "avx2", 5: "avx512"}

# Function pointers handed to ggml, per library object: cffi keeps the library (and thus the
# code) alive while these objects are referenced.
_FN_CACHE: dict[tuple[int, str, str], tuple[Any, Any]] = {}


def _library(library: Any | None) -> Any:
    lib_ops = ops if library is None else library
    if lib_ops is None:
        raise NativeBuildError(
            "the qtts native ops library (libqtts_ops) is not built: run `make native` "
            "(or `python native/build.py`) with native/ops/*.c present"
        )
    return lib_ops


def _fn(library: Any | None, name: str, ctype: str) -> Any:
    lib_ops = _library(library)
    key = (id(lib_ops), name, ctype)
    hit = _FN_CACHE.get(key)
    if hit is None:
        hit = (lib_ops, ffi.cast(ctype, getattr(lib_ops, name)))
        _FN_CACHE[key] = hit
    return hit[1]


def available() -> bool:
    """Whether libqtts_ops is built and loaded."""
    return ops is not None


def simd_isa(library: Any | None = None) -> str:
    """The SIMD path of the variant in use: ``"avx512"``, ``"avx2"`` or ``"scalar"``."""
    return ISA_NAMES.get(int(_library(library).qtts_ops_isa()), "unknown")


def variant(library: Any | None = None) -> str:
    """The ISA variant of the kernels this process runs, chosen when libqtts_ops was loaded:
    the best of ``variants()`` the CPU supports (``"native"`` in a -march=native build)."""
    return str(ffi.string(_library(library).qtts_ops_variant()).decode())


def variants(library: Any | None = None) -> list[str]:
    """The ISA variants built into libqtts_ops, best first."""
    return str(ffi.string(_library(library).qtts_ops_variants()).decode()).split(",")


def kernel_paths(library: Any | None = None) -> dict[str, str]:
    """What each op runs in the variant in use: the SIMD path, or "portable C"."""
    isa = simd_isa(library)
    bf16 = has_fast_path(library, "qtts_conv1d_tm_bf16_fast")
    i8 = has_fast_path(library, "qtts_gemm_i8_fast")
    bf16_path = "avx512_bf16" if bf16 else "portable C"
    return {
        "snake": isa,
        "conv1d_tm": f"{isa} (block {conv_block(library)})",
        "conv1d_tm_bf16": "amx_bf16 (tiles)" if amx(library) else bf16_path,
        "conv1d_wino_bf16": bf16_path,
        "gemm_i8": ("amx_int8 (tiles)" if i8 and amx(library) and gemm_i8_amx(library)
                    else "avx512_vnni" if i8 else "portable C"),
        "gemv_q4": (("avx512_vnni" if isa == "avx512" else isa)
                    if has_fast_path(library, "qtts_gemv_q4_fast") else "portable C"),
        "attn_causal": isa if attn_causal_fast(library) else "portable C",
        "attn_step": isa if attn_causal_fast(library) else "portable C",
        "attn_window": isa if attn_causal_fast(library) else "portable C",
        "conv1d_wino_f32": "avx2" if wino_f32_available(library) else "portable C",
    }


def gemm_i8_amx(library: Any | None = None) -> bool:
    """Whether the variant in use has the int8 GEMM's AMX-INT8 tile path (it runs while
    ``amx()``, on matrices of whole 256-input and 32-output blocks)."""
    return has_fast_path(library, "qtts_gemm_i8_amx_built")


def amx(library: Any | None = None) -> bool:
    """Whether ``conv1d_tm_bf16`` runs on AMX-BF16 tiles (a CPU with AMX, the OS granting this
    process the tile state, a variant with the tile kernel, not turned off by ``set_amx``)."""
    try:
        lib_ops = _library(library)
    except NativeBuildError:
        return False
    probe = getattr(lib_ops, "qtts_ops_amx", None)
    return probe is not None and bool(probe())


def set_amx(on: bool, library: Any | None = None) -> bool:
    """Allow or forbid the AMX tile path of ``conv1d_tm_bf16`` for this process (the library
    re-chooses its variant; packed weights stay valid). Not while a graph runs. Returns
    ``amx()``; False without the library or on a library that predates the switch."""
    try:
        lib_ops = _library(library)
    except NativeBuildError:
        return False
    switch = getattr(lib_ops, "qtts_ops_set_amx", None)
    return switch is not None and bool(switch(1 if on else 0))


def _check_f32(t: Tensor, what: str) -> None:
    if t.type != lib.GGML_TYPE_F32:
        raise TypeError(f"{what} must be F32, got ggml type {int(t.type)}")


def _check_vector(t: Tensor, n: int, what: str) -> None:
    _check_f32(t, what)
    if not lib.ggml_is_contiguous(t) or int(lib.ggml_nelements(t)) != n:
        raise ValueError(
            f"{what} must be a contiguous F32 vector of {n} elements, "
            f"got ne={[int(t.ne[i]) for i in range(4)]}"
        )


def snake_beta(ctx: Any, x: Tensor, exp_alpha: Tensor, inv_beta: Tensor, *,
               library: Any | None = None) -> Tensor:
    """Fused multi-threaded SnakeBeta: ``x + inv_beta * sin(exp_alpha * x)**2`` per channel.

    Args:
        ctx: the graph's ggml context (``Graph.ctx``).
        x: F32, contiguous, ne = [C, T] (numpy ``[T, C]``; more trailing dims are allowed:
            every row of C values is one time step).
        exp_alpha: F32 vector ne = [C] holding ``exp(alpha)`` (precomputed at load).
        inv_beta: F32 vector ne = [C] holding ``1 / (exp(beta) + 1e-9)`` (precomputed at load).
        library: for tests only: another build of libqtts_ops (``ffi.dlopen``) to run instead.

    Returns:
        A new F32 tensor shaped like ``x``. Rows are split over the compute threads; the
        result does not depend on the thread count. |exp_alpha * x| above
        QTTS_SNAKE_FAST_MAX (131072) is computed with double-precision libm.
    """
    _check_f32(x, "snake_beta: x")
    if not lib.ggml_is_contiguous(x):
        raise ValueError("snake_beta: x must be contiguous (ggml_cont it first)")
    c = int(x.ne[0])
    _check_vector(exp_alpha, c, "snake_beta: exp_alpha")
    _check_vector(inv_beta, c, "snake_beta: inv_beta")
    fn = _fn(library, "qtts_snake_beta_op", "ggml_custom3_op_t")
    return lib.ggml_map_custom3(ctx, x, exp_alpha, inv_beta, fn, GGML_N_TASKS_MAX, ffi.NULL)


def elu(ctx: Any, x: Tensor, *, library: Any | None = None) -> Tensor:
    """ELU (alpha 1), ``x > 0 ? x : expm1(x)``, with a vectorised expm1 (about 1 ulp; ggml's
    own ELU calls libm once per element). ``x``: F32, contiguous, any shape; returns a new
    tensor shaped like it. Elements are split over the compute threads."""
    return _elementwise(ctx, x, "elu", library)


def _elementwise(ctx: Any, x: Tensor, what: str, library: Any | None) -> Tensor:
    """The node of the element-wise op ``qtts_<what>_op`` on ``x`` (F32, contiguous)."""
    _check_f32(x, f"{what}: x")
    if not lib.ggml_is_contiguous(x):
        raise ValueError(f"{what}: x must be contiguous (ggml_cont it first)")
    fn = _fn(library, f"qtts_{what}_op", "ggml_custom1_op_t")
    return lib.ggml_map_custom1(ctx, x, fn, GGML_N_TASKS_MAX, ffi.NULL)


def gelu_erf(ctx: Any, x: Tensor, *, library: Any | None = None) -> Tensor:
    """GELU with the exact erf (``ggml_gelu_erf``), vectorised: within 6 ulp of the float64
    GELU from x = -5 up and 11 below (ggml calls libm's erff once per element, and its
    ``1 + erf`` cancels below x = -1: 100 ulp at -3, every digit lost below -5). ``x``: F32,
    contiguous, any shape; returns a new tensor shaped like it."""
    return _elementwise(ctx, x, "gelu_erf", library)


def argmax(ctx: Any, x: Tensor, *, library: Any | None = None) -> Tensor:
    """Row argmax, I32 ``[rows]``: the first index of each row's largest value (torch's rule
    for ties; ``ggml_argmax`` takes the last, and runs on one thread), NaN never taken, 0 for
    a row with nothing above -inf. Rows are shared out over the compute threads and read in
    vector lanes. ``x``: F32 ``[n, rows]``, 2-D, contiguous rows (any row stride)."""
    _check_f32(x, "argmax: x")
    if int(x.nb[0]) != 4 or int(x.ne[2]) != 1 or int(x.ne[3]) != 1:
        raise ValueError("argmax: x must be 2-D with contiguous rows")
    fn = _fn(library, "qtts_argmax_op", "ggml_custom_op_t")
    args = ffi.new("struct ggml_tensor *[1]", [x])
    return lib.ggml_custom_4d(ctx, lib.GGML_TYPE_I32, int(x.ne[1]), 1, 1, 1, args, 1, fn,
                              GGML_N_TASKS_MAX, ffi.NULL)


def kv_write_transposed(ctx: Any, dst: Tensor, v: Tensor, *,
                        library: Any | None = None) -> Tensor:
    """``dst[c, p] = v[p, c]``, in place: a block of new V rows (F32 ``[C, n]``, contiguous
    rows) into a view of a cache's channel-major V (F16 or F32 ``[n, C]``, contiguous rows, any
    row stride), converted as ggml's CPY converts. Returns the written view (read the cache
    through it, so the reads come after the write). ~10x ggml's CPY through a transposed view,
    which strides across the cache for every element."""
    _check_f32(v, "kv_write_transposed: v")
    if int(dst.type) not in (lib.GGML_TYPE_F16, lib.GGML_TYPE_F32):
        raise TypeError("kv_write_transposed: the cache must be F16 or F32")
    if int(dst.nb[0]) != int(lib.ggml_type_size(dst.type)) or int(v.nb[0]) != 4:
        raise ValueError("kv_write_transposed: rows must be contiguous")
    if (int(dst.ne[0]), int(dst.ne[1])) != (int(v.ne[1]), int(v.ne[0])) or any(
            int(t.ne[i]) != 1 for t in (dst, v) for i in (2, 3)):
        raise ValueError("kv_write_transposed: dst must be v transposed, both 2-D")
    fn = _fn(library, "qtts_kv_write_transposed_op", "ggml_custom2_op_t")
    return lib.ggml_map_custom2_inplace(ctx, dst, v, fn, GGML_N_TASKS_MAX, ffi.NULL)


def channel_join(ctx: Any, parts: list[Tensor], *, library: Any | None = None) -> Tensor:
    """``[T, C_0 + C_1 + ...]`` from time-major parts ``[T, C_i]`` (F32, contiguous rows, any
    row stride: channel-range views too), up to ``MAX_CUSTOM_SOURCES`` of them, in one node: a
    memcpy per part and row, where ggml's CONCAT joins two at a time element by element."""
    if not 1 <= len(parts) <= MAX_CUSTOM_SOURCES:
        raise ValueError(f"channel_join: 1 to {MAX_CUSTOM_SOURCES} parts, got {len(parts)}")
    t = int(parts[0].ne[1])
    for i, p in enumerate(parts):
        _check_f32(p, f"channel_join: part {i}")
        if int(p.nb[0]) != 4 or int(p.ne[1]) != t or int(p.ne[2]) != 1 or int(p.ne[3]) != 1:
            raise ValueError(f"channel_join: part {i} must be [{t}, C] with contiguous rows")
    fn = _fn(library, "qtts_channel_join_op", "ggml_custom_op_t")
    args = ffi.new(f"struct ggml_tensor *[{len(parts)}]", parts)
    return lib.ggml_custom_4d(ctx, lib.GGML_TYPE_F32, sum(int(p.ne[0]) for p in parts), t, 1, 1,
                              args, len(parts), fn, GGML_N_TASKS_MAX, ffi.NULL)


def time_join(ctx: Any, parts: Sequence[Tensor], *, library: Any | None = None) -> Tensor:
    """``[T_0 + T_1 + ..., C]`` from time-major parts ``[T_i >= 1, C]`` (F32, contiguous rows,
    any row stride: row-range views too), up to ``MAX_CUSTOM_SOURCES`` of them, in one node: a
    memcpy per row, where ggml's CONCAT joins two at a time element by element."""
    if not 1 <= len(parts) <= MAX_CUSTOM_SOURCES:
        raise ValueError(f"time_join: 1 to {MAX_CUSTOM_SOURCES} parts, got {len(parts)}")
    c = int(parts[0].ne[0])
    for i, p in enumerate(parts):
        _check_f32(p, f"time_join: part {i}")
        if (int(p.nb[0]) != 4 or int(p.ne[0]) != c or int(p.ne[1]) < 1 or int(p.ne[2]) != 1
                or int(p.ne[3]) != 1):
            raise ValueError(f"time_join: part {i} must be [T >= 1, {c}] with contiguous rows")
    fn = _fn(library, "qtts_time_join_op", "ggml_custom_op_t")
    args = ffi.new(f"struct ggml_tensor *[{len(parts)}]", list(parts))
    return lib.ggml_custom_4d(ctx, lib.GGML_TYPE_F32, c, sum(int(p.ne[1]) for p in parts), 1, 1,
                              args, len(parts), fn, GGML_N_TASKS_MAX, ffi.NULL)


def pool_stats(ctx: Any, x: Tensor, weights: Tensor | None = None, *,
               library: Any | None = None) -> Tensor:
    """Per-channel mean and variance over time of channel-major ``x`` (F32 ne ``[T, C]``,
    contiguous rows), weighted by ``weights`` (same shape; e.g. a softmax over time) or
    uniformly: ne ``[2 * C]``, the C means then the C variances. Sums in double, in one node
    (ggml's broadcast SUB along ne0 runs one element per call)."""
    srcs = [x] if weights is None else [x, weights]
    for name, t in zip(("x", "weights"), srcs, strict=False):
        _check_f32(t, f"pool_stats: {name}")
        if int(t.nb[0]) != 4 or int(t.ne[2]) != 1 or int(t.ne[3]) != 1:
            raise ValueError(f"pool_stats: {name} must be 2-D with contiguous rows")
    if weights is not None and (int(weights.ne[0]), int(weights.ne[1])) != (
            int(x.ne[0]), int(x.ne[1])):
        raise ValueError("pool_stats: weights must be shaped like x")
    fn = _fn(library, "qtts_pool_stats_op", "ggml_custom_op_t")
    args = ffi.new(f"struct ggml_tensor *[{len(srcs)}]", srcs)
    return lib.ggml_custom_4d(ctx, lib.GGML_TYPE_F32, 2 * int(x.ne[1]), 1, 1, 1, args, len(srcs),
                              fn, GGML_N_TASKS_MAX, ffi.NULL)


def attn_causal_fast(library: Any | None = None) -> bool:
    """Whether ``attn_causal`` has its SIMD path here (AVX-512 or AVX2); the portable C path
    is correct but slower than ggml's nodes."""
    return has_fast_path(library, "qtts_attn_causal_fast")


def attn_causal(ctx: Any, q: Tensor, k: Tensor, v: Tensor, pos: Tensor, *,
                library: Any | None = None) -> Tensor:
    """Causal GQA attention over a KV cache in one node: ``softmax(K q / sqrt(d)) V`` per
    query head, a query at position ``p`` seeing cache rows ``0 .. p``; the heads merged,
    ``[d * H, T]`` (F32). ``q``: F32 ``[d, H, T]`` (rows of ``d`` contiguous); ``k``: the
    cache's position-major K, ``[d * H_kv, n_kv]``; ``v``: its channel-major V,
    ``[n_kv, d * H_kv]`` (F16 or F32, contiguous rows, any row stride); ``pos``: I32 ``[T]``,
    each below ``n_kv`` (a larger one reads rows up to ``n_kv`` only). F32 sums throughout;
    keys past a query's position are never scored."""
    _check_f32(q, "attn_causal: q")
    d, n_head, t = int(q.ne[0]), int(q.ne[1]), int(q.ne[2])
    kv_dim, n_kv = int(k.ne[0]), int(k.ne[1])
    for x, name in ((k, "k"), (v, "v")):
        if int(x.type) not in (lib.GGML_TYPE_F16, lib.GGML_TYPE_F32):
            raise TypeError(f"attn_causal: {name} must be F16 or F32")
        if int(x.nb[0]) != int(lib.ggml_type_size(x.type)) or int(x.ne[2]) != 1:
            raise ValueError(f"attn_causal: {name} must be 2-D with contiguous rows")
    if int(q.nb[0]) != 4 or int(q.ne[3]) != 1:
        raise ValueError("attn_causal: q must be [d, H, T] with contiguous rows")
    if kv_dim % d or n_head % (kv_dim // d) or n_head // (kv_dim // d) > 16:
        raise ValueError(f"attn_causal: {n_head} query heads of {d} over a K of {kv_dim} "
                         "channels: need a whole number (<= 16) of query heads per KV head")
    if (int(v.ne[0]), int(v.ne[1])) != (n_kv, kv_dim):
        raise ValueError("attn_causal: v must be [n_kv, d * H_kv], k's shape transposed")
    if int(pos.type) != lib.GGML_TYPE_I32 or int(pos.ne[0]) != t or not lib.ggml_is_contiguous(pos):
        raise ValueError("attn_causal: pos must be a contiguous I32 [T]")
    fn = _fn(library, "qtts_attn_causal_op", "ggml_custom_op_t")
    args = ffi.new("struct ggml_tensor *[4]", [q, k, v, pos])
    return lib.ggml_custom_4d(ctx, lib.GGML_TYPE_F32, d * n_head, t, 1, 1, args, 4, fn,
                              GGML_N_TASKS_MAX, ffi.NULL)


def attn_window(ctx: Any, q: Tensor, k: Tensor, v: Tensor, pos: Tensor, window: int, *,
                library: Any | None = None) -> Tensor:
    """Sliding-window causal attention in one node: ``softmax(k q / sqrt(d)) v`` per query
    head, the query at position ``p`` seeing the keys at positions ``max(0, p - window + 1) ..
    p``; the heads merged, ``[d * H, T]`` (F32). ``q``: ``[d, H, T]``; ``k``, ``v``: ``[d,
    H_kv, Tk]``, the ``Tk - T`` carried rows (the positions before the chunk's) then the
    chunk's; ``pos``: I32 ``[T]``, the chunk's consecutive positions. F32 throughout; each
    query's keys are summed in position order, so the result does not depend on where a chunk
    starts (a stream's bits are the same in any chunking) or on the thread count."""
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_f32(x, f"attn_window: {name}")
        if int(x.nb[0]) != 4 or int(x.ne[3]) != 1:
            raise ValueError(f"attn_window: {name} must be 3-D with contiguous rows")
    d, n_head, t = int(q.ne[0]), int(q.ne[1]), int(q.ne[2])
    shape = [int(k.ne[i]) for i in range(3)]
    if shape != [int(v.ne[i]) for i in range(3)] or shape[0] != d or shape[2] < t:
        raise ValueError(f"attn_window: k and v must both be [{d}, H_kv, >= {t}], got "
                         f"{shape} and {[int(v.ne[i]) for i in range(3)]}")
    if shape[1] < 1 or n_head % shape[1]:
        raise ValueError(f"attn_window: {n_head} query heads over {shape[1]} KV heads")
    if window < 1:
        raise ValueError(f"attn_window: window must be >= 1, got {window}")
    if int(pos.type) != lib.GGML_TYPE_I32 or int(pos.ne[0]) != t or not lib.ggml_is_contiguous(pos):
        raise ValueError("attn_window: pos must be a contiguous I32 [T]")
    fn = _fn(library, "qtts_attn_window_op", "ggml_custom_op_t")
    args = ffi.new("struct ggml_tensor *[4]", [q, k, v, pos])
    return lib.ggml_custom_4d(ctx, lib.GGML_TYPE_F32, d * n_head, t, 1, 1, args, 4, fn,
                              GGML_N_TASKS_MAX, ffi.cast("void *", window))


def attn_full(ctx: Any, q: Tensor, k: Tensor, v: Tensor, *,
              library: Any | None = None) -> Tensor:  # fmt: skip
    """Causal attention over a whole input in one node: ``softmax(k q / sqrt(d)) v`` per query
    head, the query at position ``t`` seeing keys ``0 .. t``; the heads merged, ``[d * H, T]``
    (F32). ``q``: ``[d, H, T]`` with each position's heads contiguous; ``k``, ``v``: ``[d, H_kv,
    T]``, rows of ``d`` contiguous. The products run on ``conv1d_tm``'s register tiles (each
    sum in key or channel order); the result does not depend on the thread count."""
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_f32(x, f"attn_full: {name}")
        if int(x.nb[0]) != 4 or int(x.ne[3]) != 1:
            raise ValueError(f"attn_full: {name} must be 3-D with contiguous rows")
    d, n_head, t = int(q.ne[0]), int(q.ne[1]), int(q.ne[2])
    if int(q.nb[1]) != 4 * d:
        raise ValueError("attn_full: q must hold each position's heads contiguously")
    shape = [int(k.ne[i]) for i in range(3)]
    if shape != [int(v.ne[i]) for i in range(3)] or shape[0] != d or shape[2] != t:
        raise ValueError(f"attn_full: k and v must both be [{d}, H_kv, {t}], got {shape} and "
                         f"{[int(v.ne[i]) for i in range(3)]}")
    if shape[1] < 1 or n_head % shape[1]:
        raise ValueError(f"attn_full: {n_head} query heads over {shape[1]} KV heads")
    fn = _fn(library, "qtts_attn_full_op", "ggml_custom_op_t")
    args = ffi.new("struct ggml_tensor *[3]", [q, k, v])
    return lib.ggml_custom_4d(ctx, lib.GGML_TYPE_F32, d * n_head, t, 1, 1, args, 3, fn,
                              GGML_N_TASKS_MAX, ffi.NULL)


@dataclass(frozen=True)
class StepCache:
    """One session's K/V cache of one layer, as ``attn_step`` reads and writes it: the cache's
    position-major K and channel-major V tensors (host memory), the position its rows start
    at (a slot of a shared cache) and how many positions it has from there."""

    k: Tensor
    v: Tensor
    first: int
    n_ctx: int


def attn_step(ctx: Any, q: Tensor, k: Tensor, v: Tensor, pos: Tensor, caches: list[StepCache],
              keep: list[Any], *, library: Any | None = None) -> Tensor:
    """The attention of a decoding step for several sessions in one node, their K/V writes
    included: column ``t`` belongs to session ``t // per`` (``per = T / len(caches)``
    consecutive columns each, taken in order); its K row ``k[t]`` and V row ``v[t]`` go into
    that session's cache at position ``pos[t]``, then its query heads attend over the cache
    rows ``0 .. pos[t]``. ``q``: F32 ``[d, H, T]`` (rows of ``d`` contiguous); ``k``, ``v``: F32
    ``[d * H_kv, T]`` (contiguous rows); ``pos``: I32 ``[T]``, each below its session's
    ``n_ctx`` (checked by the caller: the op writes nothing for one outside and gives zeros).
    Returns ``[d * H, T]`` F32, the heads merged. The op writes the caches through pointers
    held in an argument block appended to ``keep`` (the graph's ``keep``): the caches must
    outlive the graph. F32 sums in a fixed order: a session's result does not depend on the
    other sessions or the thread count."""
    _check_f32(q, "attn_step: q")
    d, n_head, t = int(q.ne[0]), int(q.ne[1]), int(q.ne[2])
    kv_dim = int(k.ne[0])
    if int(q.nb[0]) != 4 or int(q.ne[3]) != 1:
        raise ValueError("attn_step: q must be [d, H, T] with contiguous rows")
    for x, name in ((k, "k"), (v, "v")):
        _check_f32(x, f"attn_step: {name}")
        if int(x.nb[0]) != 4 or (int(x.ne[0]), int(x.ne[1])) != (kv_dim, t) or int(x.ne[2]) != 1:
            raise ValueError(f"attn_step: {name} must be [{kv_dim}, {t}] with contiguous rows")
    if kv_dim % d or n_head % (kv_dim // d):
        raise ValueError(f"attn_step: {n_head} query heads of {d} over K of {kv_dim} channels")
    if int(pos.type) != lib.GGML_TYPE_I32 or int(pos.ne[0]) != t or not lib.ggml_is_contiguous(pos):
        raise ValueError("attn_step: pos must be a contiguous I32 [T]")
    if not caches or t % len(caches):
        raise ValueError(f"attn_step: {t} columns do not split over {len(caches)} sessions")
    f16 = int(caches[0].k.type) == lib.GGML_TYPE_F16
    args = [len(caches), t // len(caches), int(f16)]
    for c in caches:
        es = int(lib.ggml_type_size(c.k.type))
        if {int(c.k.type), int(c.v.type)} != {lib.GGML_TYPE_F16 if f16 else lib.GGML_TYPE_F32}:
            raise TypeError("attn_step: every cache must be F16, or every cache F32")
        if (int(c.k.ne[0]), int(c.v.ne[1])) != (kv_dim, kv_dim) or c.first < 0 or \
                c.first + c.n_ctx > min(int(c.k.ne[1]), int(c.v.ne[0])):
            raise ValueError("attn_step: a cache does not hold these rows")
        if c.k.data == ffi.NULL or c.v.data == ffi.NULL:
            raise ValueError("attn_step: a cache has no memory (not allocated)")
        args += [int(ffi.cast("intptr_t", c.k.data)) + c.first * int(c.k.nb[1]), int(c.k.nb[1]),
                 int(ffi.cast("intptr_t", c.v.data)) + c.first * es, int(c.v.nb[1]), c.n_ctx]
    block = ffi.new("int64_t[]", args)
    keep.append(block)
    fn = _fn(library, "qtts_attn_step_op", "ggml_custom_op_t")
    srcs = ffi.new("struct ggml_tensor *[4]", [q, k, v, pos])
    return lib.ggml_custom_4d(ctx, lib.GGML_TYPE_F32, d * n_head, t, 1, 1, srcs, 4, fn,
                              GGML_N_TASKS_MAX, block)


def _check_rows(t: Tensor, c_in: int, what: str, name: str) -> None:
    """A 2-D F32 [C_in, rows] input with contiguous rows (any row stride)."""
    _check_f32(t, f"{what}: {name}")
    if int(t.ne[0]) != c_in:
        raise ValueError(f"{what}: {name} has {int(t.ne[0])} channels, w expects {c_in}")
    if int(t.ne[2]) != 1 or int(t.ne[3]) != 1:
        raise ValueError(f"{what}: {name} must be 2-D, ne = [C_in, rows]")
    if int(t.nb[0]) != 4 or int(t.nb[1]) % 4 != 0 or int(t.nb[1]) < 4 * c_in:
        raise ValueError(f"{what}: {name} rows must be contiguous F32")


def _conv_sources(what: str, xp: Tensor, hist: Tensor | None, c_in: int, k: int,
                  dilation: int) -> tuple[int, list[Tensor]]:
    """Checks the input (and the separate history); returns (T, the op's sources after w and
    bias: [] or [hist])."""
    _check_rows(xp, c_in, what, "xp" if hist is None else "x")
    pad = (k - 1) * dilation
    if hist is None:
        t = int(xp.ne[1]) - pad
        if t < 1:
            raise ValueError(
                f"{what}: xp has {int(xp.ne[1])} rows, needs more than the {pad} of history"
            )
        return t, []
    t = int(xp.ne[1])
    if t < 1:
        raise ValueError(f"{what}: x has no rows")
    if pad == 0:
        if int(hist.ne[1]) != 0:
            raise ValueError(f"{what}: K = 1 has no history; pass hist=None")
        return t, []
    _check_rows(hist, c_in, what, "hist")
    if int(hist.ne[1]) != pad:
        raise ValueError(
            f"{what}: hist has {int(hist.ne[1])} rows, must be (K-1)*dilation = {pad}"
        )
    return t, [hist]


def conv_block(library: Any | None = None) -> int:
    """Output channels per packed weight block of ``conv1d_tm`` (32 for AVX-512, 16 for AVX2,
    64 for the scalar build)."""
    return int(_library(library).qtts_conv1d_tm_block())


def pack_conv_weight(w: np.ndarray[Any, Any], *, library: Any | None = None
                     ) -> np.ndarray[Any, Any]:
    """PyTorch Conv1d weight ``[C_out, C_in, K]`` -> the packed F32 array ``conv1d_tm`` takes.

    The result has numpy shape ``[ceil(C_out / B), K, C_in, B]`` (ggml ne = [B, C_in, K, n]),
    ``B = conv_block()``: block j holds output channels j*B .. j*B+B-1, zero past C_out, so
    the kernel streams each block's weights contiguously. Do this once, at load time, for the
    library that will run it (``library``: as in ``conv1d_tm``).
    """
    if w.ndim != 3:
        raise ValueError(f"conv weight must be [C_out, C_in, K], got shape {w.shape}")
    b = conv_block(library)
    c_out, c_in, k = w.shape
    n = -(-c_out // b)
    padded = np.zeros((n * b, c_in, k), np.float32)
    padded[:c_out] = w
    # [n*B, C_in, K] -> [n, B, C_in, K] -> [n, K, C_in, B]
    return np.ascontiguousarray(padded.reshape(n, b, c_in, k).transpose(0, 3, 2, 1))


def pack_conv_weight_winograd(w: np.ndarray[Any, Any], *, library: Any | None = None
                              ) -> np.ndarray[Any, Any]:  # fmt: skip
    """A conv weight ``[C_out, C_in, K]`` of K = 2 or 3 taps (g0, g1[, g2]) packed as
    ``pack_conv_weight`` packs K + 2 taps: the K, then gp and gm, what ``conv1d_tm``,
    ``seanet_unit`` and ``seanet_stage`` take with ``wino`` to run the conv in Winograd groups
    (load time): F(3, 2) for K = 2, gp = (g0 + g1) / 2 and gm = (g0 - g1) / 2; F(2, 3) for
    K = 3, gp = (g0 + g1 + g2) / 2 and gm = (g1 - g0 - g2) / 2."""
    if w.ndim != 3 or w.shape[2] not in (2, 3):
        raise ValueError(f"Winograd groups need a 2- or 3-tap weight [C_out, C_in, K], got "
                         f"{w.shape}")
    g = [w[:, :, k].astype(np.float32) for k in range(w.shape[2])]
    half = np.float32(0.5)
    if len(g) == 2:
        gp, gm = (g[0] + g[1]) * half, (g[0] - g[1]) * half
    else:
        gp, gm = (g[0] + g[1] + g[2]) * half, (g[1] - g[0] - g[2]) * half
    return pack_conv_weight(np.stack([*g, gp, gm], axis=2), library=library)


def conv1d_tm(ctx: Any, xp: Tensor, w: Tensor, bias: Tensor, dilation: int = 1, *,
              hist: Tensor | None = None, wino: bool = False,
              library: Any | None = None) -> Tensor:
    """Exact-F32 causal dilated conv1d in the time-major layout (register-blocked C kernel).

    ``y[t, o] = bias[o] + sum_k sum_c W[o, c, k] * xp[t + k*dilation, c]`` (W as in PyTorch)

    Args:
        ctx: the graph's ggml context.
        xp: F32 input *with its left history already in front*: ne = [C_in, T + (K-1)*dilation]
            (numpy ``[T + P, C_in]``); rows must be contiguous (nb[0] = 4) but the row stride
            may be larger (a view of a wider buffer is fine); 2-D only.
        w: the packed weight from ``pack_conv_weight``: F32, contiguous,
            ne = [B, C_in, K, ceil(C_out / B)], B = ``conv_block()``.
        bias: F32 vector ne = [C_out] (it also gives C_out).
        dilation: d >= 1 (ignored when K = 1).
        hist: the history apart from the new rows, so that no concat is needed: then ``xp``
            holds only the T new rows, ne = [C_in, T], and ``hist`` (F32, ne = [C_in,
            (K-1)*dilation], rows contiguous, any row stride, 2-D) the rows that precede them;
            the result is bit for bit that of ``xp = concat(hist, x)`` (the op reads across the
            join itself). With K = 1 there is no history: None, or a tensor of 0 rows (ignored).
        wino: ``w`` is a conv of 2 or 3 taps and dilation 1 packed by
            ``pack_conv_weight_winograd``: the conv runs in Winograd groups, F(3, 2) or F(2, 3),
            four products over C_in for every three or two outputs instead of six (F32
            throughout, other roundings than the direct sums).
        library: for tests only: another build of libqtts_ops to run instead.

    Returns:
        A new F32 tensor ne = [C_out, T] (numpy ``[T, C_out]``). Threads share out time chunks
        (and output-channel blocks); the result does not depend on the thread count.
    """
    _check_f32(xp, "conv1d_tm: xp")
    _check_f32(w, "conv1d_tm: w")
    _check_f32(bias, "conv1d_tm: bias")
    if not lib.ggml_is_contiguous(w):
        raise ValueError("conv1d_tm: w must be contiguous")
    b = conv_block(library)
    c_out = int(bias.ne[0])
    c_in, k, n_blocks = int(w.ne[1]), int(w.ne[2]), int(w.ne[3])
    if wino:
        if k not in (4, 5) or dilation != 1:
            raise ValueError(f"conv1d_tm: wino takes 2 or 3 taps of dilation 1 packed as 4 or 5 "
                             f"(pack_conv_weight_winograd), got {k} packed, dilation {dilation}")
        k -= 2
        rows, stride = int(xp.ne[1]), int(xp.nb[1])
        if hist is None and rows >= k:  # the history rows apart, as the op takes them
            hist = lib.ggml_view_2d(ctx, xp, c_in, k - 1, stride, 0)
            xp = lib.ggml_view_2d(ctx, xp, c_in, rows - k + 1, stride, (k - 1) * stride)
    if int(w.ne[0]) != b or n_blocks != -(-c_out // b):
        raise ValueError(
            f"conv1d_tm: w has ne={[int(w.ne[i]) for i in range(4)]}; for {c_out} output "
            f"channels (the bias) it must be packed as [{b}, C_in, K, {-(-c_out // b)}] "
            "(pack_conv_weight)"
        )
    if dilation < 1:
        raise ValueError(f"conv1d_tm: dilation must be >= 1, got {dilation}")
    t, extra = _conv_sources("conv1d_tm", xp, hist, c_in, k, dilation)
    _check_vector(bias, c_out, "conv1d_tm: bias")
    fn = _fn(library, "qtts_conv1d_tm_op", "ggml_custom_op_t")
    srcs = [xp, w, bias, *extra]
    args = ffi.new(f"struct ggml_tensor *[{len(srcs)}]", srcs)
    ud = (1 | int(lib.QTTS_CONV_WINOGRAD)) if wino else (dilation if k > 1 else 1)
    return lib.ggml_custom_4d(ctx, lib.GGML_TYPE_F32, c_out, t, 1, 1, args, len(srcs), fn,
                              GGML_N_TASKS_MAX, ffi.cast("void *", ud))


def _seanet_unit_checks(what: str, h: Tensor, w3: Tensor, b3: Tensor, w1: Tensor, b1: Tensor,
                        dilation: int, library: Any | None, h_channels: int | None = None,
                        wino: bool = False) -> int:  # fmt: skip
    """``h`` [C, T] (``h_channels`` when it is a pre-conv's input instead); ``wino``: w3 of 3
    taps and dilation 1 packed for Winograd groups. Returns the unit's flags for the op."""
    _check_f32(h, f"{what}: h")
    if not lib.ggml_is_contiguous(h) or int(h.ne[2]) != 1 or int(h.ne[3]) != 1:
        raise ValueError(f"{what}: h must be a contiguous 2-D F32 tensor [C, T]")
    if dilation < 1 or dilation > int(lib.QTTS_CONV_DILATION_MASK):
        raise ValueError(f"{what}: dilation must be in 1 .. 65535, got {dilation}")
    c, r = int(b1.ne[0]), int(b3.ne[0])
    if int(h.ne[0]) != (c if h_channels is None else h_channels):
        raise ValueError(f"{what}: h has {int(h.ne[0])} channels, expected "
                         f"{c if h_channels is None else h_channels}")
    if wino and dilation != 1:
        raise ValueError(f"{what}: Winograd groups need dilation 1, got {dilation}")
    _check_packed(what, "w3", w3, c, r, 5 if wino else None, library)
    _check_packed(what, "w1", w1, r, c, 1, library)
    _check_vector(b3, r, f"{what}: b3")
    _check_vector(b1, c, f"{what}: b1")
    return dilation | (int(lib.QTTS_SEANET_UNIT_WINO) if wino else 0)


def _check_packed(what: str, name: str, w: Tensor, c_in: int, c_out: int, taps: int | None,
                  library: Any | None) -> None:  # fmt: skip
    """``w``: a conv ``c_in -> c_out`` packed by ``pack_conv_weight`` (``taps`` of them)."""
    blk = conv_block(library)
    _check_f32(w, f"{what}: {name}")
    ne = [int(w.ne[i]) for i in range(4)]
    if (not lib.ggml_is_contiguous(w) or ne[0] != blk or ne[1] != c_in
            or ne[3] != -(-c_out // blk) or (taps is not None and ne[2] != taps)):
        raise ValueError(f"{what}: {name} has ne={ne}; a conv {c_in} -> {c_out} packed by "
                         f"pack_conv_weight has [{blk}, {c_in}, {taps or 'K'}, "
                         f"{-(-c_out // blk)}]")


def seanet_unit(ctx: Any, h: Tensor, w3: Tensor, b3: Tensor, w1: Tensor, b1: Tensor,
                dilation: int = 1, *, elu_out: bool = False, wino: bool = False,
                library: Any | None = None) -> Tensor:  # fmt: skip
    """One SEANet residual unit in a single node: ``s = h + conv1(ELU(convK(ELU(h))))``, and
    ``ELU(s)`` with ``elu_out`` (the unit whose sum only feeds an ELU).

    ``h``: F32 ne = [C, T], contiguous. ``w3``/``b3``: a causal conv C -> R of K taps (dilation
    ``dilation``, zero history), ``w1``/``b1``: a 1-tap conv R -> C, both packed by
    ``pack_conv_weight`` (``wino``: w3 of 3 taps and dilation 1 packed by
    ``pack_conv_weight_winograd``, the conv in Winograd F(2, 3) groups). Every value is bit for
    bit that of the separate ``elu``, ``conv1d_tm`` (the same ``wino``) and add nodes; the node
    runs slice by slice in time, so the unit's intermediates (three activations the size of
    ``h`` or half of it) never leave the cache.
    """
    flags = _seanet_unit_checks("seanet_unit", h, w3, b3, w1, b1, dilation, library, wino=wino)
    fn = _fn(library, "qtts_seanet_unit_op", "ggml_custom_op_t")
    args = ffi.new("struct ggml_tensor *[5]", [h, w3, b3, w1, b1])
    flags |= int(lib.QTTS_SEANET_ELU_OUT) if elu_out else 0
    return lib.ggml_custom_4d(ctx, lib.GGML_TYPE_F32, int(h.ne[0]), int(h.ne[1]), 1, 1, args,
                              5, fn, GGML_N_TASKS_MAX, ffi.cast("void *", flags))


def seanet_stage(ctx: Any, h: Tensor, w3: Tensor, b3: Tensor, w1: Tensor, b1: Tensor,
                 ws: Tensor, bs: Tensor, stride: int, dilation: int = 1, *,
                 wino: bool = False, unit_wino: bool = False,
                 pre: tuple[Tensor, Tensor] | None = None,
                 library: Any | None = None) -> Tensor:  # fmt: skip
    """A SEANet unit and the strided conv after it in a single node:
    ``conv_s(ELU(h + conv1(ELU(convK(ELU(h))))))`` -> F32 ne = [C_out, ceil(T / stride)].

    ``h`` .. ``b1`` as for :func:`seanet_unit`; ``ws``/``bs``: the causal conv of ``2 * stride``
    taps with stride ``stride`` (zero padding: ``stride`` rows in front, the rows that complete
    the last window after), folded (``ops1d.fold_weight``) and packed by ``pack_conv_weight``:
    ne = [B, stride * C, 2, ceil(C_out / B)]. ``pre``: the weight and bias of a causal conv of
    one input channel (K0 taps, K0 - 1 zero rows in front, packed) that makes ``h`` from the
    node's ``h`` [1, T] (the encoder's first conv over the waveform). ``wino``: ``ws`` packed
    by ``pack_conv_weight_winograd``, the strided conv in Winograd F(3, 2) groups;
    ``unit_wino``: the unit's, as ``seanet_unit`` with ``wino``. Every value is bit for bit
    that of the separate nodes (that conv, ``seanet_unit`` with ``elu_out``, then ``conv1d_tm``
    on the folded rows, with the same choices); each slice of the unit's input and output is
    made and convolved while it is in the cache."""
    flags = _seanet_unit_checks("seanet_stage", h, w3, b3, w1, b1, dilation, library,
                                None if pre is None else 1, wino=unit_wino)
    if stride < 1 or stride >= 1 << (63 - int(lib.QTTS_SEANET_STRIDE_SHIFT)):
        raise ValueError(f"seanet_stage: stride must be >= 1, got {stride}")
    c, c_out = int(b1.ne[0]), int(bs.ne[0])
    _check_packed("seanet_stage", "ws", ws, stride * c, c_out, 4 if wino else 2, library)
    _check_vector(bs, c_out, "seanet_stage: bs")
    srcs = [h, w3, b3, w1, b1, ws, bs]
    if pre is not None:
        _check_packed("seanet_stage", "pre weight", pre[0], 1, c, None, library)
        _check_vector(pre[1], c, "seanet_stage: pre bias")
        srcs += list(pre)
    fn = _fn(library, "qtts_seanet_stage_op", "ggml_custom_op_t")
    args = ffi.new(f"struct ggml_tensor *[{len(srcs)}]", srcs)
    flags |= stride << int(lib.QTTS_SEANET_STRIDE_SHIFT)
    if wino:
        flags |= int(lib.QTTS_SEANET_WINO)
    return lib.ggml_custom_4d(ctx, lib.GGML_TYPE_F32, c_out, -(-int(h.ne[1]) // stride), 1, 1,
                              args, len(srcs), fn, GGML_N_TASKS_MAX, ffi.cast("void *", flags))


# ---------------------------------------------------------------------------------------------
# BF16 direct conv (fast mode)

CONV_BF16_BLOCK = 32  # QTTS_CONV_BF16_BLOCK: output channels per packed block, every build


def bf16_available(library: Any | None = None) -> bool:
    """Whether ``conv1d_tm_bf16`` has its AVX512_BF16 kernel (VDPBF16PS: two BF16 products per
    lane and instruction; docs/performance.md, Figures behind the code). False when libqtts_ops
    is missing, predates the op, or was compiled without AVX512_BF16: the op then still runs, on
    a portable C path that is correct but slow, so keep the F32 ``conv1d_tm`` there."""
    return has_fast_path(library, "qtts_conv1d_tm_bf16_fast")


def has_fast_path(library: Any | None, probe: str) -> bool:
    """Whether libqtts_ops is loaded, has the probe function ``probe`` and it returns 1 (the
    op's SIMD kernel was compiled in)."""
    try:
        lib_ops = _library(library)
    except NativeBuildError:
        return False
    fast = getattr(lib_ops, probe, None)
    return fast is not None and bool(fast())


def round_bf16(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """float32 -> float32 holding the nearest BF16 value, as the kernel rounds its input
    (VCVTNEPS2BF16): round to nearest even, zero and subnormals to signed zero, NaN quieted."""
    return bf16_to_f32(bf16_bits(a))


def bf16_bits(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The BF16 bit patterns (uint16) of ``round_bf16(a)``: what a GGML_TYPE_BF16 tensor holds
    (for uploading a packed weight as a graph input rather than through ``add_array``)."""
    return f32_to_bf16(np.asarray(a, dtype=np.float32), flush_subnormals=True)


def pack_conv_weight_bf16(w: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """PyTorch Conv1d weight ``[C_out, C_in, K]`` -> the packed weight ``conv1d_tm_bf16`` takes.

    Returns **float32** values that are exactly BF16 (``round_bf16``), numpy shape
    ``[ceil(C_out / 32), K, ceil(C_in / 2), 64]``: element ``[j, k, p, 2*i + e]`` is
    ``W[j*32 + i, 2*p + e, k]`` (pairs of consecutive input channels interleaved per output
    lane, the operand layout of VDPBF16PS), zero past C_out and past C_in. Upload it as a
    BF16 tensor, losslessly: ``WeightStore.add_array(name, arr, lib.GGML_TYPE_BF16)`` (ggml
    ne = [64, ceil(C_in / 2), K, ceil(C_out / 32)]); or ``bf16_bits(arr)`` for raw uint16 bits.
    The layout is the same for every build of libqtts_ops.
    """
    return round_bf16(_bf16_layout(w))


def _bf16_layout(w: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    # pack_conv_weight_bf16's layout of W, not rounded
    if w.ndim != 3:
        raise ValueError(f"conv weight must be [C_out, C_in, K], got shape {w.shape}")
    b = CONV_BF16_BLOCK
    c_out, c_in, k = w.shape
    n, cp = -(-c_out // b), -(-c_in // 2)
    padded = np.asarray(w, dtype=np.float32)
    if padded.shape != (n * b, 2 * cp, k):  # zero rows past C_out, a zero channel past C_in
        padded = np.zeros((n * b, 2 * cp, k), np.float32)
        padded[:c_out, :c_in] = w
    # [n*B, 2*cp, K] -> [n, B, cp, 2, K] -> [n, K, cp, B, 2]
    packed = padded.reshape(n, b, cp, 2, k).transpose(0, 4, 2, 1, 3).reshape(n, k, cp, 2 * b)
    return np.ascontiguousarray(packed)


def pack_conv_weight_bf16_split(w: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """PyTorch Conv1d weight ``[C_out, C_in, K]`` -> the packed weight of ``conv1d_tm_bf16``
    with ``split=True``: ``pack_conv_weight_bf16`` of hi(W) = ``round_bf16(W)`` and of lo(W) =
    ``round_bf16(W - hi(W))`` one after the other along the taps, numpy shape
    ``[ceil(C_out / 32), 2K, ceil(C_in / 2), 64]`` (ggml ne = [64, ceil(C_in / 2), 2K, ...]);
    upload it as BF16, like the other."""
    packed = _bf16_layout(np.asarray(w, dtype=np.float32))
    k = packed.shape[1]
    out = np.empty((packed.shape[0], 2 * k, *packed.shape[2:]), np.float32)
    # a block at a time: cache-sized temporaries. Never in place: where the layout needs no
    # padding or reordering, ``packed`` is the caller's own weight.
    for block, wb in zip(out, packed, strict=True):
        hi = block[:k]
        hi[...] = round_bf16(wb)
        block[k:] = round_bf16(wb - hi)
    return out


def conv1d_tm_bf16(ctx: Any, xp: Tensor, w: Tensor, bias: Tensor, dilation: int = 1, *,
                   hist: Tensor | None = None, snake: tuple[Tensor, Tensor] | None = None,
                   residual: Tensor | None = None, split: bool = False,
                   library: Any | None = None) -> Tensor:
    """BF16 causal dilated conv1d in the time-major layout (fast mode; F32 in and out).

    ``y[t, o] = bias[o] + sum_k sum_c bf16(W[o, c, k]) * bf16(xp[t + k*dilation, c])``, the
    products summed in F32: the only error beyond rounding the weights and the input to BF16
    is F32 accumulation. Same contract as ``conv1d_tm`` otherwise.

    Args:
        ctx: the graph's ggml context.
        xp: F32 input with its left history in front: ne = [C_in, T + (K-1)*dilation]; rows
            contiguous (nb[0] = 4), any row stride; 2-D only. Rounded to BF16 inside the op.
        w: the packed weight from ``pack_conv_weight_bf16`` as a BF16 tensor, contiguous,
            ne = [64, ceil(C_in / 2), K, ceil(C_out / 32)]. (An odd C_in packs like C_in + 1
            with a zero channel; the shape cannot tell the two apart.)
        bias: F32 vector ne = [C_out] (it also gives C_out).
        dilation: d >= 1 (ignored when K = 1).
        hist: the history apart from the new rows (no concat needed), as in ``conv1d_tm``:
            ``xp`` then holds the T new rows only; bit for bit the result on the concatenation.
        snake: ``(exp_alpha, inv_beta)`` F32 vectors of C_in: the conv reads
            ``snake_beta(xp)`` (and of ``hist``), applied row by row while the input is
            converted, so the activation is never written out. Bit for bit the result of
            ``snake_beta`` before the conv; the history to carry is then the *input* rows.
        residual: F32 [C_out, T] (rows contiguous) added to the result, bit for bit
            ``ggml_add(residual, conv)``, without a pass of its own.
        split: ``w`` from ``pack_conv_weight_bf16_split``: each product is hi(W) hi(x) +
            hi(W) lo(x) + lo(W) hi(x), lo(x) = bf16(x - hi(x)): ~16 significant bits of
            each operand (an error of F32's order, ~1e-6 relative on O(1) data, where plain
            BF16 gives ~1e-3), three times the products, twice the weight bytes (F32's).
        library: for tests only: another build of libqtts_ops to run instead.

    Returns:
        A new F32 tensor ne = [C_out, T]. The result does not depend on the thread count.
        ``bf16_available()`` says whether this runs on the AVX512_BF16 kernel or the slow
        portable one.
    """
    return _bf16_conv("conv1d_tm_bf16", "qtts_conv1d_tm_bf16_op", ctx, xp, w, bias, dilation,
                      hist, snake, residual, library, split)


def pack_conv_weight_wino_bf16(w: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """PyTorch Conv1d weight ``[C_out, C_in, K]``, K = 7 or 2 -> the packed weight
    ``conv1d_wino_bf16`` takes.

    Returns float32 values that are exactly BF16, numpy shape ``[ceil(C_out / 32),
    ceil(C_in / 2), S, 64]``: element ``[j, p, k, 2*i + e]`` is slot k's ``G[o = j*32 + i,
    c = 2p + e]``, formed in float64 from the taps ``g_k = W[:, :, k]`` and rounded once. K = 7
    (S = 10): ``g0, (g0+g1+g2)/2, (g0-g1+g2)/2, g2`` of taps 0-2, the same of taps 3-5, then
    ``g6, -g6``. K = 2 (S = 3): ``g0 + g1/2, g1/2 - g0, g1``. Upload as a BF16 tensor (ggml ne =
    [64, S, ceil(C_in / 2), ceil(C_out / 32)]).
    """
    if w.ndim != 3 or w.shape[2] not in (7, 2):
        raise ValueError(f"winograd conv weight must be [C_out, C_in, 7 or 2], got {w.shape}")
    b = CONV_BF16_BLOCK
    c_out, c_in, k = w.shape
    n, cp = -(-c_out // b), -(-c_in // 2)
    n_slots = 10 if k == 7 else 3
    out = np.empty((n, cp, n_slots, 2 * b), np.float32)
    # one block of 32 outputs at a time: a model's widest convs would otherwise hold several
    # float64 copies of the whole weight (~0.8 GB of peak RSS at load)
    for j in range(n):
        g = np.zeros((b, 2 * cp, k), np.float64)
        part = w[j * b:(j + 1) * b]
        g[:part.shape[0], :c_in] = part
        t = [g[..., i] for i in range(k)]
        if k == 7:
            slots = []
            for g0, g1, g2 in (t[0:3], t[3:6]):
                slots += [g0, (g0 + g1 + g2) / 2, (g0 - g1 + g2) / 2, g2]
            slots += [t[6], -t[6]]
        else:
            slots = [t[0] + t[1] / 2, t[1] / 2 - t[0], t[1]]
        # [S, B, 2cp] -> [S, B, cp, 2] -> [cp, S, B, 2]
        st = np.stack(slots).reshape(n_slots, b, cp, 2).transpose(2, 0, 1, 3)
        out[j] = round_bf16(np.ascontiguousarray(st.reshape(cp, n_slots, 2 * b),
                                                 dtype=np.float32))
    return out


def conv1d_wino_bf16(ctx: Any, xp: Tensor, w: Tensor, bias: Tensor, dilation: int = 1, *,
                     hist: Tensor | None = None, snake: tuple[Tensor, Tensor] | None = None,
                     residual: Tensor | None = None, library: Any | None = None) -> Tensor:
    """``conv1d_tm_bf16`` for K = 7 / K = 2 by Winograd F(2,3) / F(2,2) over output pairs
    (t, t + dilation): 10 BF16 channel-contractions per pair instead of 14, or 3 instead of 4
    (native/ops/conv1d_wino_bf16.c).

    Same arguments and result as ``conv1d_tm_bf16`` except ``w``, from
    ``pack_conv_weight_wino_bf16`` (its slot count gives K); the value differs from it by
    rounding only (the transformed inputs and weights are rounded to BF16, which costs a little
    SNR per conv; docs/performance.md, Figures behind the code).
    """
    return _bf16_conv("conv1d_wino_bf16", "qtts_conv1d_wino_bf16_op", ctx, xp, w, bias,
                      dilation, hist, snake, residual, library)


def _bf16_conv(what: str, op: str, ctx: Any, xp: Tensor, w: Tensor, bias: Tensor,
               dilation: int, hist: Tensor | None, snake: tuple[Tensor, Tensor] | None,
               residual: Tensor | None, library: Any | None, split: bool = False) -> Tensor:
    # the checks both BF16 kernels' GGML_ASSERTs need, as exceptions; then the node
    wino = op == "qtts_conv1d_wino_bf16_op"
    _check_f32(xp, f"{what}: xp")
    packer = "pack_conv_weight_wino_bf16" if wino else "pack_conv_weight_bf16"
    if w.type != lib.GGML_TYPE_BF16:
        raise TypeError(
            f"{what}: w must be BF16 ({packer}, uploaded as GGML_TYPE_BF16), got ggml type "
            f"{int(w.type)}"
        )
    _check_f32(bias, f"{what}: bias")
    if not lib.ggml_is_contiguous(w):
        raise ValueError(f"{what}: w must be contiguous")
    b = CONV_BF16_BLOCK
    c_out = int(bias.ne[0])
    c_in = int(xp.ne[0])
    n_blocks = int(w.ne[3])
    # direct: [2B, cp, K, n]; winograd: [2B, S, cp, n] with S = 10 (K = 7) or 3 (K = 2)
    cp, k = (int(w.ne[2]), 7 if int(w.ne[1]) == 10 else 2) if wino else (int(w.ne[1]),
                                                                         int(w.ne[2]))
    layout = f"[{2 * b}, 10 or 3, ceil(C_in/2)" if wino else f"[{2 * b}, ceil(C_in/2), K"
    if split:
        packer, layout = "pack_conv_weight_bf16_split", f"[{2 * b}, ceil(C_in/2), 2K"
        k //= 2
    if (int(w.ne[0]) != 2 * b or n_blocks != -(-c_out // b)
            or (wino and int(w.ne[1]) not in (10, 3)) or (split and int(w.ne[2]) % 2)):
        raise ValueError(
            f"{what}: w has ne={[int(w.ne[i]) for i in range(4)]}; for {c_out} output "
            f"channels (the bias) it must be packed as {layout}, {-(-c_out // b)}] ({packer})"
        )
    if cp != -(-c_in // 2):
        raise ValueError(
            f"{what}: {'xp' if hist is None else 'x'} has {c_in} channels, w expects "
            f"{2 * cp - 1} or {2 * cp}"
        )
    return _fused_conv(what, op, ctx, xp, w, bias, dilation, k, hist, snake, residual, library,
                       lib.QTTS_CONV_SPLIT if split else 0)


def _fused_conv(what: str, op: str, ctx: Any, xp: Tensor, w: Tensor, bias: Tensor,
                dilation: int, k: int, hist: Tensor | None, snake: tuple[Tensor, Tensor] | None,
                residual: Tensor | None, library: Any | None, mode: int = 0) -> Tensor:
    """The node of a conv with the fused sources of qtts_conv_srcs.h (its weight checked by the
    caller): checks the rest, sets the flags (``mode``: more of them, e.g. QTTS_CONV_SPLIT)."""
    c_out, c_in = int(bias.ne[0]), int(xp.ne[0])
    if dilation < 1:
        raise ValueError(f"{what}: dilation must be >= 1, got {dilation}")
    t, extra = _conv_sources(what, xp, hist, c_in, k, dilation)
    _check_vector(bias, c_out, f"{what}: bias")
    if dilation > lib.QTTS_CONV_DILATION_MASK:
        raise ValueError(f"{what}: dilation {dilation} > {lib.QTTS_CONV_DILATION_MASK}")
    flags = (dilation if k > 1 else 1) | mode
    srcs = [xp, w, bias, *extra]
    if extra:
        flags |= lib.QTTS_CONV_HIST
    if snake is not None:
        _check_vector(snake[0], c_in, f"{what}: snake exp_alpha")
        _check_vector(snake[1], c_in, f"{what}: snake inv_beta")
        srcs += list(snake)
        flags |= lib.QTTS_CONV_SNAKE
    if residual is not None:
        _check_f32(residual, f"{what}: residual")
        if [int(residual.ne[i]) for i in range(4)] != [c_out, t, 1, 1]:
            raise ValueError(
                f"{what}: residual has ne={[int(residual.ne[i]) for i in range(4)]}, "
                f"the result is [{c_out}, {t}, 1, 1]"
            )
        if int(residual.nb[0]) != 4:
            raise ValueError(f"{what}: residual rows must be contiguous F32")
        srcs.append(residual)
        flags |= lib.QTTS_CONV_RESIDUAL
    fn = _fn(library, op, "ggml_custom_op_t")
    args = ffi.new(f"struct ggml_tensor *[{len(srcs)}]", srcs)
    return lib.ggml_custom_4d(ctx, lib.GGML_TYPE_F32, c_out, t, 1, 1, args, len(srcs), fn,
                              GGML_N_TASKS_MAX, ffi.cast("void *", flags))


# ---------------------------------------------------------------------------------------------
# F32 Winograd conv (fast mode without the BF16 kernels)

CONV_WINO_F32_BLOCK = 16  # QTTS_CONV_WINO_F32_BLOCK
# conv1d_wino_f32's finite points per kernel size (native/ops/conv1d_wino_f32.c), infinity
# after them: F(6,7) and F(6,2)
WINO_F32_POINTS = {7: (0, 1, -1, 2, -2, 0.5, -0.5, 0.25, -0.25, 1.5, -1.5),
                   2: (0, 1, -1, 2, -2, 0.5)}
WINO_F32_TILE = 6  # outputs per tile


def wino_f32_available(library: Any | None = None) -> bool:
    """Whether ``conv1d_wino_f32`` has its AVX2/FMA kernel (the portable path is correct but
    slower than ``conv1d_tm``)."""
    return has_fast_path(library, "qtts_conv1d_wino_f32_fast")


def wino_f32_filter(k: int) -> np.ndarray[Any, Any]:
    """F(6,k)'s filter transform G, ``[k + 5, k]`` float64 (k = 7 or 2): row i is ``[a^0 ..
    a^(k-1)] / prod_{j != i} (a - a_j)`` for finite point a = a_i, the last row (infinity)
    ``[0 .. 0, 1]``; exact fractions, rounded once."""
    pts = [Fraction(p) for p in WINO_F32_POINTS[k]]
    g = np.zeros((len(pts) + 1, k), np.float64)
    for i, a in enumerate(pts):
        f = prod((a - b for j, b in enumerate(pts) if j != i), start=Fraction(1))
        g[i] = [float(a ** e / f) for e in range(k)]
    g[-1, -1] = 1.0
    return g


def pack_conv_weight_wino_f32(w: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """PyTorch Conv1d weight ``[C_out, C_in, K]``, K = 7 or 2 -> the packed F32 weight
    ``conv1d_wino_f32`` takes: numpy ``[ceil(C_out / 16), K + 5, C_in, 16]`` (ggml ne = [16,
    C_in, K + 5, n]), element ``[j, p, c, i]`` = ``sum_k G[p, k] W[j*16 + i, c, k]`` formed in
    float64 and rounded once, zero past C_out (G: ``wino_f32_filter(K)``). (K + 5)/K of the
    direct weight's size: 12/7, 7/2."""
    if w.ndim != 3 or w.shape[2] not in WINO_F32_POINTS:
        raise ValueError(f"winograd conv weight must be [C_out, C_in, 7 or 2], got {w.shape}")
    b = CONV_WINO_F32_BLOCK
    c_out, c_in, k = w.shape
    n = -(-c_out // b)
    g = wino_f32_filter(k)
    out = np.zeros((n, g.shape[0], c_in, b), np.float32)
    for j in range(n):  # a block at a time: no float64 copy of the whole weight
        part = w[j * b:(j + 1) * b].astype(np.float64)  # [B', C_in, K]
        out[j, :, :, :part.shape[0]] = np.einsum("pk,ock->pco", g, part)
    return out


def conv1d_wino_f32(ctx: Any, xp: Tensor, w: Tensor, bias: Tensor, dilation: int = 1, *,
                    hist: Tensor | None = None, snake: tuple[Tensor, Tensor] | None = None,
                    residual: Tensor | None = None, library: Any | None = None) -> Tensor:
    """The K = 7 or K = 2 causal dilated conv by Winograd F(6,7) / F(6,2) in F32, over tiles of
    six output steps (t, t + d, .., t + 5d): 12 channel-contractions per tile instead of 42, 7
    instead of 12 (native/ops/conv1d_wino_f32.c). Fast mode's convs where the BF16 kernels are
    missing.

    Same arguments and result as ``conv1d_tm_bf16`` (``hist``, ``snake`` and ``residual``
    fused, bit for bit as separate ops would feed it) except ``w``, from
    ``pack_conv_weight_wino_f32`` as an F32 tensor (its K + 5 points give K); the value differs
    from the direct F32 conv by rounding only (K = 7: 91-102 dB SNR on random data against
    116-127 dB).
    """
    what = "conv1d_wino_f32"
    _check_f32(xp, f"{what}: xp")
    _check_f32(w, f"{what}: w")
    _check_f32(bias, f"{what}: bias")
    if not lib.ggml_is_contiguous(w):
        raise ValueError(f"{what}: w must be contiguous")
    b, c_out, c_in = CONV_WINO_F32_BLOCK, int(bias.ne[0]), int(xp.ne[0])
    k = int(w.ne[2]) - WINO_F32_TILE + 1
    want = [b, c_in, int(w.ne[2]), -(-c_out // b)]
    if k not in WINO_F32_POINTS or [int(w.ne[i]) for i in range(4)] != want:
        raise ValueError(
            f"{what}: w has ne={[int(w.ne[i]) for i in range(4)]}; for {c_in} input and "
            f"{c_out} output channels it must be [{b}, {c_in}, 12 or 7, {-(-c_out // b)}] "
            "(pack_conv_weight_wino_f32)"
        )
    return _fused_conv(what, "qtts_conv1d_wino_f32_op", ctx, xp, w, bias, dilation, k, hist,
                       snake, residual, library)
