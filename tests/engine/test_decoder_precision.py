"""Fast mode's per-layer precision: the default F32 set, the calibration and `qtts info`."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from cli.main import main
from engine.backend import BackendSet
from engine.decoder import DecoderModel, decode
from engine.decoder.calibration_store import calibration_for
from engine.decoder.precision import (
    bf16_layers,
    calibrate,
    calibration_codes,
    default_f32,
    promotion_order,
    snr_db,
)
from engine.decoder.weights import native_convs, rounds_to_bf16, split_kept, winograd_f32
from engine.ggml import custom_ops, lib
from engine.gguf_model import open_model
from engine.tools.make_model import make_model


@pytest.fixture(scope="module")
def model(tiny_gguf: Path):  # type: ignore[no-untyped-def]
    m = open_model(tiny_gguf)
    yield m
    m.close()


def test_layer_sets(model) -> None:  # type: ignore[no-untyped-def]
    every = bf16_layers(model)
    assert len(every) == len(set(every)) == 4 + 1 + 4 * 7 + 1
    default = default_f32(model)
    assert default <= set(every) and "dec.conv_in" in default and "dec.blk.1.tconv" in default
    promoted = [x for g in promotion_order(model) for x in g]
    assert not set(promoted) & default and set(promoted) | default <= set(every)
    assert promoted[0] == "dec.blk.1.res.0.conv1"  # earliest (most amplified) first
    assert {f"dec.blk.{b}.tconv" for b in range(1, 5)} <= default


def test_kept_layers_are_f32_class(model, bf16_cpu2: BackendSet  # type: ignore[no-untyped-def]
                                   ) -> None:
    """A promoted layer really leaves BF16: with every layer promoted, fast equals exact (F32
    layers) or comes within split products' or F32 Winograd's rounding of it (> 60 dB even on
    this saturated decoder, whose clamp turns a rounding at a zero crossing into a jump)."""
    codes = calibration_codes(model, 6)
    be = bf16_cpu2
    exact = DecoderModel.load(model, be, "exact")
    everything = DecoderModel.load(model, be, "fast", f32_layers=frozenset(bf16_layers(model)))
    bf16 = DecoderModel.load(model, be, "fast", f32_layers=frozenset())
    try:
        a, _ = decode(exact, codes)
        b, _ = decode(everything, codes)
        c, _ = decode(bf16, codes)
    finally:
        for m in (exact, everything, bf16):
            m.close()
    if split_kept(be) or winograd_f32(be):  # split products, or F32 Winograd convs
        assert snr_db(a, b) >= 60.0 and snr_db(a, c) < snr_db(a, b) - 30.0
    else:
        assert np.abs(a - b).max() <= 1e-5
    assert np.abs(a - c).max() > 1e-4


def test_kept_layers_take_the_f32_winograd_kernel_beside_bf16(  # type: ignore[no-untyped-def]
        model, cpu2: BackendSet) -> None:
    """A transposed conv fast mode keeps out of BF16 runs as split BF16 products on AMX tiles;
    elsewhere, where the F32 Winograd kernel has its SIMD path, by that kernel (F32 weights),
    with or without the BF16 kernel beside it; else as the direct F32 conv."""
    if not native_convs(cpu2):
        pytest.skip("qtts's conv kernels are not built for this CPU")
    dec = DecoderModel.load(model, cpu2, "fast")
    try:
        name = "dec.blk.4.tconv"
        assert name in dec.weights.f32_layers
        conv = dec.weights.blocks[3].tconv.conv
        assert conv is not None and conv.packed is not None
        if custom_ops.bf16_available() and custom_ops.amx():
            assert conv.split and not conv.winograd
        elif custom_ops.wino_f32_available():
            assert conv.winograd and not conv.split
            assert conv.packed.type == lib.GGML_TYPE_F32
        else:
            assert not conv.winograd and not conv.split
    finally:
        dec.close()


def _fast_and_exact(model, be: BackendSet  # type: ignore[no-untyped-def]
                    ) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[type-arg]
    codes = calibration_codes(model, 6)
    wavs = []
    for precision in ("exact", "fast"):
        dec = DecoderModel.load(model, be, precision, f32_layers=frozenset())
        try:
            wavs.append(decode(dec, codes)[0])
        finally:
            dec.close()
    return wavs[0], wavs[1]


def test_fast_mode_where_the_bf16_kernel_is_missing(  # type: ignore[no-untyped-def]
        model, cpu2: BackendSet) -> None:
    """qtts's convs without their BF16 kernel: fast mode runs its 7-tap and transposed convs
    by Winograd in F32 where that kernel has its SIMD path (close to exact, not bit for bit),
    otherwise the samples of exact mode bit for bit; with the BF16 kernel it rounds (further
    from exact)."""
    exact, fast = _fast_and_exact(model, cpu2)
    if rounds_to_bf16(cpu2):
        assert not np.array_equal(exact, fast)
    elif winograd_f32(cpu2):
        assert not np.array_equal(exact, fast)
        assert snr_db(exact, fast) >= 70.0
    else:
        assert np.array_equal(exact, fast)


def test_fast_is_exact_without_winograd_where_the_bf16_kernel_is_missing(
        model) -> None:  # type: ignore[no-untyped-def]
    """``QTTS_WINOGRAD=0`` on such a CPU: fast mode is exact mode bit for bit."""
    be = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2",
                              "QTTS_WINOGRAD": "0"})
    try:
        exact, fast = _fast_and_exact(model, be)
        assert np.array_equal(exact, fast) == (not rounds_to_bf16(be))
    finally:
        be.close()


@pytest.fixture(scope="module")
def stress(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A tiny model whose decoder makes a wave (every stage O(1), nothing clipped), unlike the
    default recipe's, which clips most samples."""
    folder = tmp_path_factory.mktemp("stress_decoder")
    make_model(folder, "tiny", seed=0, progress=False, recipe="stress")
    m = open_model(folder / "model.gguf")
    yield m
    m.close()


def test_calibration(stress, bf16_cpu2: BackendSet) -> None:  # type: ignore[no-untyped-def]
    easy = calibrate(stress, bf16_cpu2, target_db=10.0, frames=6)
    assert easy.met and easy.steps == 0 and easy.f32_layers == default_f32(stress)
    assert 20 < easy.snr_db < 150 and easy.clipped < 0.01 and not easy.saturated
    hard = calibrate(stress, bf16_cpu2, target_db=500.0, frames=6, max_steps=2)
    assert not hard.met and hard.steps == 2 and hard.f32_layers > easy.f32_layers
    assert hard.snr_db > easy.snr_db
    assert "NOT" not in easy.summary() and f"{easy.snr_db:.1f} dB" in easy.summary()
    # unbounded, it promotes until the target holds (every group F32 if need be)
    above = calibrate(stress, bf16_cpu2, target_db=easy.snr_db + 6, frames=6)
    assert above.met and above.steps >= 1


def test_calibration_leaves_a_saturated_decoder_alone(  # type: ignore[no-untyped-def]
        model, bf16_cpu2: BackendSet) -> None:
    """The make-model decoder clips most samples: its SNR is the clamp's, and promotions
    would only cost speed; the calibration says so and keeps the default set."""
    cal = calibrate(model, bf16_cpu2, target_db=35.0, frames=6)
    assert cal.saturated and cal.clipped > 0.5 and not cal.met
    assert cal.steps == 0 and cal.f32_layers == default_f32(model)
    assert "clips" in cal.summary() and "nothing promoted" in cal.summary()


def test_calibration_is_kept_per_model_file(  # type: ignore[no-untyped-def]
        stress, bf16_cpu2: BackendSet, tmp_path: Path) -> None:
    target = calibrate(stress, bf16_cpu2, target_db=0.0).snr_db + 4  # a promotion or more
    first, kept = calibration_for(stress, bf16_cpu2, target, tmp_path)
    assert not kept and first.met and first.steps >= 1
    (record,) = tmp_path.glob("decoder-*.json")
    again, kept = calibration_for(stress, bf16_cpu2, target, tmp_path)
    assert kept and again == first  # read back, not measured
    # another target, or arithmetic: a record of its own
    other, kept = calibration_for(stress, bf16_cpu2, target - 10, tmp_path)
    assert not kept and other.steps == 0 and len(list(tmp_path.glob("decoder-*.json"))) == 2
    # a damaged record, or one naming layers the model does not have: measured again
    for bad in ("{not json", '{"f32_layers": ["dec.nope"], "snr_db": 99, "target_db": 1, '
                '"steps": 0, "seconds": 0, "clipped": 0}'):
        record.write_text(bad)
        again, kept = calibration_for(stress, bf16_cpu2, target, tmp_path)
        assert not kept and again.f32_layers == first.f32_layers
    # the model file changed (a new modification time): its old record no longer applies
    os.utime(stress.path, ns=(time.time_ns(), time.time_ns()))
    assert not calibration_for(stress, bf16_cpu2, target, tmp_path)[1]
    # a folder that cannot be written: measured, not kept, no error
    blocked = tmp_path / "file"
    blocked.write_text("")
    cal, kept = calibration_for(stress, bf16_cpu2, target, blocked / "sub")
    assert not kept and cal.f32_layers == first.f32_layers


def test_load_with_calibration(model, bf16_cpu2: BackendSet  # type: ignore[no-untyped-def]
                               ) -> None:
    dec = DecoderModel.load(model, bf16_cpu2, "fast", calibrate_db=10.0)
    try:
        assert dec.calibration is not None and dec.calibration.met
        assert dec.weights.f32_layers == dec.calibration.f32_layers
    finally:
        dec.close()
    dec = DecoderModel.load(model, bf16_cpu2, "exact", calibrate_db=10.0)
    assert dec.calibration is None  # nothing to calibrate: exact is all F32
    dec.close()


def test_info_reports_the_measured_snr(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    assert main(["info", "--model", str(tiny_gguf), "--target", "5"]) == 0
    out = capsys.readouterr().out
    assert "decoder fast mode" in out and "dB against exact mode" in out and "met" in out
    assert "layers kept in F32: 9 (9 by default)" in out
