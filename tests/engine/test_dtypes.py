"""engine/dtypes.py: the one BF16 conversion and the one F32 dequantisation, against ggml's own."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from engine.dtypes import bf16_to_f32, f32_to_bf16, to_f32
from engine.ggml import ffi, lib
from engine.gguf_schema import GGML_BF16, GGML_F16, GGML_F32, GGML_Q4_0, GGML_Q8_0


def _hard_values() -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * np.exp(rng.uniform(-100, 85, 4096))).astype(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 3.4e38, 1.0 + 2**-8,
                        1.0 + 3 * 2**-8], np.float32)
    bits = np.array([0x7F800001, 0xFFC00001, 0x00000001], np.uint32).view(np.float32)
    return np.concatenate([x, special, bits])


@pytest.mark.parametrize("copies", [1, 130])  # 130: past the chunks converted at a time
def test_f32_to_bf16_is_ggmls_reference_rounding(copies: int) -> None:
    x = np.tile(_hard_values(), copies)
    want = np.empty(x.size, np.uint16)
    lib.ggml_fp32_to_bf16_row_ref(ffi.cast("float *", ffi.from_buffer(x)),
                                  ffi.cast("ggml_bf16_t *", ffi.from_buffer(want)), x.size)
    assert np.array_equal(f32_to_bf16(x), want)


@pytest.mark.parametrize("copies", [1, 130])
def test_flushing_sends_zero_and_subnormals_to_signed_zero_only(copies: int) -> None:
    x = np.tile(_hard_values(), copies)
    plain, flushed = f32_to_bf16(x), f32_to_bf16(x, flush_subnormals=True)
    tiny = (x.view(np.uint32) & 0x7F800000) == 0
    assert np.array_equal(flushed[~tiny], plain[~tiny])
    assert np.array_equal(flushed[tiny], (x[tiny].view(np.uint32) >> 16).astype(np.uint16)
                          & 0x8000)


def test_bf16_round_trip_and_shapes() -> None:
    x = np.arange(-6, 6, dtype=np.float32).reshape(3, 4) / 4  # exact in BF16
    bits = f32_to_bf16(x)
    assert bits.shape == (3, 4) and bits.dtype == np.uint16
    assert np.array_equal(bf16_to_f32(bits), x)
    assert f32_to_bf16(np.float32(1.5)).shape == ()  # 0-d stays 0-d


@pytest.mark.parametrize("gtype", [GGML_Q8_0, GGML_Q4_0])
def test_block_types_dequantise_like_gguf(gtype: int) -> None:
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    q = np.asarray(gguf_quants.quantize(x, GGMLQuantizationType(gtype)))
    got = to_f32(q, gtype, (4, 64))
    want = np.asarray(gguf_quants.dequantize(q, GGMLQuantizationType(gtype)), np.float32)
    assert got.shape == (4, 64) and got.dtype == np.float32
    assert np.array_equal(got, want.reshape(4, 64))


def test_float_types_convert_exactly_into_a_new_array() -> None:
    x = np.random.default_rng(2).standard_normal((2, 8)).astype(np.float32)
    f32 = to_f32(x, GGML_F32, (2, 8))
    assert np.array_equal(f32, x) and not np.shares_memory(f32, x)
    h = x.astype(np.float16)
    assert np.array_equal(to_f32(h, GGML_F16, (2, 8)), h.astype(np.float32))
    b = f32_to_bf16(x)
    assert np.array_equal(to_f32(b, GGML_BF16, (2, 8)), bf16_to_f32(b))
