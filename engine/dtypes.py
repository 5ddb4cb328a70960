"""The float formats of qtts's GGUF files, converted once for everyone.

* ``bf16_to_f32`` / ``f32_to_bf16``: BF16 bit patterns (uint16) <-> float32, numpy only, so the
  converter (engine/tools) uses them without the native layer. ``f32_to_bf16`` rounds like
  ggml's reference converter (nearest even, NaN kept quiet); ``flush_subnormals`` rounds like
  the AVX512-BF16 instruction our conv kernels use (zero and subnormals to signed zero).
* ``finite_f32`` / ``finite_bits``: whether float32 values, or F16 / BF16 bit patterns, are
  all finite (a damaged weight is refused by the converter and by the loader alike).
* ``to_f32``: any stored tensor (F32, F16, BF16 or a ggml block type) as float32; the block
  types go through ggml's own row converter, the one the compute kernels agree with.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from engine.gguf_schema import GGML_BF16, GGML_F16, GGML_F32


def bf16_to_f32(bits: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """Widen raw BF16 bit patterns to float32 (exact), same shape."""
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


# Elements converted at a time: the temporaries stay in the cache and are reused, where whole-
# array temporaries cost a model's weights fresh pages at every step (docs/performance.md,
# Session 29: most of a fast decoder's load)
_CHUNK = 1 << 18


F16_EXPONENT, BF16_EXPONENT = 0x7C00, 0x7F80  # all exponent bits set: infinite or NaN


def finite_f32(x: npt.NDArray[np.float32]) -> bool:
    """Every value finite, in cache-sized pieces (NaN propagates through max and min, an
    infinity is one of them: no temporaries)."""
    flat = x.reshape(-1)
    return all(np.isfinite(c.max()) and np.isfinite(c.min())
               for c in (flat[i : i + _CHUNK] for i in range(0, flat.size, _CHUNK)))


def finite_bits(bits: npt.NDArray[np.uint16], exponent: int) -> bool:
    """Every F16 (``exponent`` = ``F16_EXPONENT``) or BF16 (``BF16_EXPONENT``) bit pattern
    finite."""
    flat = bits.reshape(-1)
    return all(int(np.bitwise_and(c, 0x7FFF).max()) < exponent
               for c in (flat[i : i + _CHUNK] for i in range(0, flat.size, _CHUNK)))


def block_scales(raw: npt.NDArray[Any], ggml_type: int) -> npt.NDArray[np.uint16]:
    """The F16 scale that starts each block of a Q8_0 / Q4_0 tensor's bytes (a strided
    view)."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][1]
    view: npt.NDArray[np.uint16] = np.asarray(raw).reshape(-1, size)[:, :2].view(np.uint16)
    return view


def f32_to_bf16(x: npt.NDArray[Any], flush_subnormals: bool = False) -> npt.NDArray[np.uint16]:
    """Round float32 to BF16, nearest even, NaN kept quiet; the raw bit patterns (uint16)."""
    f = np.asarray(x, dtype=np.float32)
    u = np.ascontiguousarray(f).reshape(-1).view(np.uint32)
    out = np.empty(u.shape, np.uint16)
    for start in range(0, u.size, _CHUNK):
        _f32_to_bf16_into(u[start : start + _CHUNK], out[start : start + _CHUNK],
                          flush_subnormals)
    return out.reshape(f.shape)


def _f32_to_bf16_into(u: npt.NDArray[np.uint32], out: npt.NDArray[np.uint16],
                      flush_subnormals: bool) -> None:
    # only NaNs, replaced below, can carry past bit 31
    r = u >> np.uint32(16)
    r &= np.uint32(1)
    r += np.uint32(0x7FFF)
    r += u
    r >>= np.uint32(16)
    if flush_subnormals:  # zero and subnormals to signed zero
        tiny = (u & np.uint32(0x7F800000)) == 0
        np.copyto(r, (u >> np.uint32(16)) & np.uint32(0x8000), where=tiny)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    np.copyto(r, (u >> np.uint32(16)) | np.uint32(0x40), where=nan)
    out[...] = r


def to_f32(raw: npt.NDArray[Any], ggml_type: int, shape: tuple[int, ...]
           ) -> npt.NDArray[np.float32]:
    """A stored tensor's bytes (or its typed view) as a new float32 array of ``shape``."""
    if ggml_type == GGML_F32:
        return np.array(np.asarray(raw).view(np.float32).reshape(shape), dtype=np.float32)
    if ggml_type == GGML_F16:
        return np.asarray(raw).view(np.float16).reshape(shape).astype(np.float32)
    if ggml_type == GGML_BF16:
        return bf16_to_f32(np.asarray(raw).view(np.uint16).reshape(shape))
    from engine.ggml import ffi, lib  # block types only: the converter stays native-free

    src = np.ascontiguousarray(np.asarray(raw).view(np.uint8))
    out = np.empty(shape, np.float32)
    lib.ggml_get_type_traits(ggml_type).to_float(
        ffi.from_buffer(src), ffi.cast("float *", ffi.from_buffer(out)), out.size)
    return out
