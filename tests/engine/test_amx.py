"""The AMX tile paths (the BF16 conv, native/ops/conv1d_tm_bf16.c; the int8 GEMM,
native/ops/gemm_i8.c) and their switch.

On a CPU with AMX-BF16 (and the OS granting the tile state) the BF16 conv runs on tiles by
default, so every BF16 conv test runs that path there; these tests add the shapes the tiles cut
awkwardly (input pairs not a multiple of 16, time not a multiple of 16 or 32, output blocks
not full, several time chunks, strided views, the history apart) against float64, and the
switch back to the AVX512-BF16 kernels (``co.set_amx(False)``, ``QTTS_AMX=0``), which must
work on every CPU.
"""

from __future__ import annotations

import importlib.util
import platform
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.backend import BackendSet
from engine.decoder import DecoderModel
from engine.ggml import Graph, ffi, lib, native_info
from engine.ggml import custom_ops as co
from engine.gguf_model import open_model
from tests.engine.test_custom_ops import (
    BF16,
    check_conv,
    conv_data,
    conv_ref_bf16,
    run_conv_bf16,
    run_conv_two_ways,
)

needs_ops = pytest.mark.usefixtures("native_ops")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def amx_on() -> Iterator[None]:
    """The tile path, where this CPU has it; restored afterwards."""
    if not co.set_amx(True):
        pytest.skip(f"no AMX-BF16 here (kernels: {co.variant()}); the tile path is not run")
    yield
    co.set_amx(True)


@pytest.fixture
def restore_amx() -> Iterator[None]:
    before = co.amx()
    yield
    co.set_amx(before)


AMX_CASES = [  # (C_in, C_out, T, K, d)
    (96, 96, 1, 7, 1),  # one step: a single 16-row tile, 15 rows dropped
    (96, 96, 17, 7, 3),  # one 32-row tile, 15 rows dropped
    (96, 96, 33, 7, 9),  # a 32-row tile then a 16-row one
    (34, 33, 15, 7, 1),  # 17 pairs: a last group of 1 pair; 33 outputs: a 1-wide block
    (40, 40, 47, 3, 2),  # 20 pairs (a group of 4), 40 outputs (a half block)
    (95, 100, 333, 7, 3),  # odd C_in (zero pad channel), 3 blocks + 4
    (1, 3, 20, 3, 2),  # one input channel
    (200, 70, 401, 7, 1),  # 100 pairs (a group of 4), 2 blocks + 6, two time chunks
    (96, 1, 500, 7, 1),  # decoder.6: 96 -> 1
    (96, 96, 1000, 1, 1),  # the 1x1 conv, several time chunks
    (768, 768, 40, 7, 3),
    (1536, 768, 9, 7, 1),  # 768 pairs in one reduction
]


@needs_ops
@pytest.mark.parametrize("c_in,c_out,t,k,d", AMX_CASES)
def test_amx_conv_matches_float64(amx_on: None, cpu2: BackendSet, c_in: int, c_out: int,
                                  t: int, k: int, d: int) -> None:
    rng = np.random.default_rng(5 + c_in + 7 * c_out + 13 * t + d + 3 * k)
    xp, w, b = conv_data(rng, c_in, c_out, t, k, d)
    check_conv(run_conv_bf16(cpu2, xp, w, b, d), conv_ref_bf16(xp, w, b, d))


@needs_ops
@pytest.mark.parametrize("c_in,c_out,t,k,d", [(96, 96, 1001, 7, 3), (34, 33, 15, 7, 1),
                                              (768, 40, 30, 7, 1)])
def test_amx_threads_identical(amx_on: None, cpu1: BackendSet, cpu2: BackendSet, c_in: int,
                               c_out: int, t: int, k: int, d: int) -> None:
    rng = np.random.default_rng(23)
    xp, w, b = conv_data(rng, c_in, c_out, t, k, d)
    assert np.array_equal(run_conv_bf16(cpu1, xp, w, b, d), run_conv_bf16(cpu2, xp, w, b, d))


@needs_ops
@pytest.mark.parametrize("c,t,k,d", [(96, 2, 7, 3), (95, 50, 7, 9), (34, 300, 3, 1)])
def test_amx_history_apart_equals_concat(amx_on: None, cpu1: BackendSet, cpu2: BackendSet,
                                         c: int, t: int, k: int, d: int) -> None:
    rng = np.random.default_rng(c + t)
    hist = rng.standard_normal(((k - 1) * d, c)).astype(np.float32)
    x = rng.standard_normal((t, c)).astype(np.float32)
    w = (rng.standard_normal((c, c, k)) / np.sqrt(c * k)).astype(np.float32)
    cat1, two1, cat2, two2 = run_conv_two_ways([cpu1, cpu2], "bf16", hist, x, w, d)
    assert np.array_equal(two1, cat1) and np.array_equal(two2, cat2)
    assert np.array_equal(two1, two2)
    xp = np.concatenate([hist, x])
    bias = np.random.default_rng(c).standard_normal(c).astype(np.float32)  # run_conv_two_ways'
    check_conv(two2, conv_ref_bf16(xp, w, bias, d))


@needs_ops
def test_amx_on_a_strided_view(amx_on: None, cpu2: BackendSet) -> None:
    """Input rows a view of a wider buffer (row stride != C_in), at an offset."""
    rng = np.random.default_rng(8)
    c, t, k, d = 34, 45, 7, 2
    wide = rng.standard_normal((t + (k - 1) * d, 3 * c + 1)).astype(np.float32)
    w = (rng.standard_normal((c, c, k)) / np.sqrt(c * k)).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    wp = co.bf16_bits(co.pack_conv_weight_bf16(w))
    g = Graph()
    tx, tb = g.input("x", wide.shape), g.input("b", b.shape)
    tw = g.input("w", wp.shape, ggml_type=BF16)
    view = lib.ggml_view_2d(g.ctx, tx, c, wide.shape[0], tx.nb[1], 4 * (c + 1))
    g.output(co.conv1d_tm_bf16(g.ctx, view, tw, tb, d), "y")
    y = cpu2.execute(g, {"x": wide, "w": wp, "b": b})["y"].reshape(t, c)
    g.close()
    check_conv(y, conv_ref_bf16(wide[:, c + 1:2 * c + 1], w, b, d))


@needs_ops
@pytest.mark.parametrize("n,k,t", [(64, 1024, 57), (3072, 1024, 134), (32, 512, 400),
                                   (96, 3072, 1), (64, 256, 17), (100, 300, 13)])
def test_amx_int8_gemm_is_the_vnni_gemm_bit_for_bit(amx_on: None, cpu1: BackendSet,
                                                    cpu2: BackendSet, n: int, k: int,
                                                    t: int) -> None:
    """The int8 GEMM on AMX-INT8 tiles (whole 256-input and 32-channel blocks; other shapes
    stay on VPDPBUSD): exact integer sums and the same epilogue, so the same bits as the VNNI
    kernel, for row counts that fill one, two or part of a 32-row tile, on any thread count."""
    from engine.ggml import gemm_i8 as gi
    from tests.engine.test_gemm_i8 import data, run_gemm

    if not gi.fast_available():
        pytest.skip("no AVX512-VNNI: the int8 GEMM's portable path")
    w, x = data(np.random.default_rng(n + k + t), n, k, t)
    tiles = run_gemm(cpu2, w, x)
    assert np.array_equal(tiles, run_gemm(cpu1, w, x))
    assert not co.set_amx(False)
    vector = run_gemm(cpu2, w, x)
    assert np.array_equal(tiles, vector)
    assert np.abs(tiles - gi.reference(w, x)).max() <= 1e-6 * np.abs(tiles).max()


@needs_ops
def test_amx_is_another_path_than_avx512(amx_on: None, cpu2: BackendSet) -> None:
    """The switch really changes the kernel (the tiles sum in another order), and both paths
    stay within the BF16 contract."""
    rng = np.random.default_rng(3)
    xp, w, b = conv_data(rng, 768, 768, 40, 7, 3)
    tiles = run_conv_bf16(cpu2, xp, w, b, 3)
    assert not co.set_amx(False) and not co.amx()
    vector = run_conv_bf16(cpu2, xp, w, b, 3)
    ref = conv_ref_bf16(xp, w, b, 3)
    check_conv(tiles, ref)
    check_conv(vector, ref)
    assert not np.array_equal(tiles, vector)


@needs_ops
def test_amx_off_falls_back_on_any_cpu(restore_amx: None, cpu2: BackendSet) -> None:
    assert not co.set_amx(False) and not co.amx()
    paths = co.kernel_paths()
    assert paths["conv1d_tm_bf16"] in ("avx512_bf16", "portable C")
    assert co.variant() != "amx_bf16"
    rng = np.random.default_rng(4)
    for c_in, c_out, t, k, d in [(34, 33, 15, 7, 1), (96, 96, 301, 7, 3)]:
        xp, w, b = conv_data(rng, c_in, c_out, t, k, d)
        check_conv(run_conv_bf16(cpu2, xp, w, b, d), conv_ref_bf16(xp, w, b, d))
    on = co.set_amx(True)
    assert on == co.amx()
    assert (co.kernel_paths()["conv1d_tm_bf16"] == "amx_bf16 (tiles)") == on


@needs_ops
def test_qtts_amx_0_reaches_the_decoder(restore_amx: None, tiny_gguf: Path) -> None:
    """QTTS_AMX=0: the decoder loads with the tiles off (and Winograd back on where the
    AVX512-BF16 kernel runs); QTTS_AMX=1 turns them back on where the CPU has them."""
    model = open_model(tiny_gguf)
    env = {"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2"}
    try:
        off = DecoderModel.load(model, BackendSet.from_env({**env, "QTTS_AMX": "0"}), "fast")
        assert not co.amx()
        assert off.weights._winograd == co.bf16_available()
        off.close()
        on = DecoderModel.load(model, BackendSet.from_env(env), "fast")
        amx: Any = co.amx()
        assert on.weights._winograd == (co.bf16_available() and not amx)
        on.close()
    finally:
        model.close()


@needs_ops
def test_portable_dispatch_names_and_leaves_amx(tmp_path: Path, cpu2: BackendSet) -> None:
    """The portable build's dispatch: ``amx_bf16`` first where the CPU has AMX, and
    ``avx512_bf16`` once AMX is forbidden; both compute the same contract."""
    if shutil.which("cc") is None or platform.machine() != "x86_64" or not co.set_amx(True):
        pytest.skip("no AMX-BF16 here (or no cc on x86-64): the amx_bf16 variant is not run")
    spec = importlib.util.spec_from_file_location("qtts_native_build",
                                                  REPO / "native" / "build.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    flags = dict(build.X86_OPS_VARIANTS)
    out = tmp_path / "libqtts_ops_amx.so"
    build.compile_ops(Path(native_info()["prefix"]),
                      [(n, flags[n]) for n in ("amx_bf16", "avx512_bf16")], out)
    library = ffi.dlopen(str(out))
    assert co.variants(library) == ["amx_bf16", "avx512_bf16"]
    assert co.variant(library) == "amx_bf16" and co.amx(library)
    assert co.kernel_paths(library)["conv1d_tm_bf16"] == "amx_bf16 (tiles)"
    assert co.kernel_paths(library)["gemm_i8"] == "amx_int8 (tiles)"
    from tests.engine.test_gemm_i8 import data, run_gemm

    w8, x8 = data(np.random.default_rng(8), 96, 1024, 45)
    i8_tiles = run_gemm(cpu2, w8, x8, library)
    rng = np.random.default_rng(6)
    xp, w, b = conv_data(rng, 200, 70, 401, 7, 1)
    ref = conv_ref_bf16(xp, w, b, 1)
    tiles = run_conv_bf16(cpu2, xp, w, b, 1, library)
    check_conv(tiles, ref)
    assert not co.set_amx(False, library)
    assert co.variant(library) == "avx512_bf16" and not co.amx(library)
    assert co.kernel_paths(library)["conv1d_tm_bf16"] == "avx512_bf16"
    assert co.kernel_paths(library)["gemm_i8"] == "avx512_vnni"
    assert np.array_equal(i8_tiles, run_gemm(cpu2, w8, x8, library))
    vector = run_conv_bf16(cpu2, xp, w, b, 1, library)
    check_conv(vector, ref)
    assert not np.array_equal(tiles, vector)
    assert co.set_amx(True, library) and co.variant(library) == "amx_bf16"
