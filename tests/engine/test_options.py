"""EngineOptions: read once from the variables, carried by the BackendSet to what reads them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.backend import BackendSet
from engine.decoder import DecoderModel, StreamingDecoder
from engine.errors import BackendError
from engine.ggml import custom_ops
from engine.gguf_model import open_model
from engine.options import DiagnosticSettings, EngineOptions

CPU1 = {"QTTS_BACKEND": "cpu", "QTTS_THREADS": "1"}


def test_an_empty_environment_gives_the_defaults() -> None:
    assert EngineOptions.from_env({}) == EngineOptions()
    o = EngineOptions()
    assert (o.backend, o.device, o.threads, o.max_matmul_rows) == ("auto", None, None, None)
    assert o.custom_ops and o.winograd and o.int8_prefill and o.pin_prefixes
    assert not o.profile and not o.debug_backend and o.diagnostics == DiagnosticSettings()


def test_every_variable_reaches_its_field() -> None:
    o = EngineOptions.from_env({
        "QTTS_BACKEND": "rpc", "QTTS_BACKEND_FALLBACK": "cuda,cpu", "QTTS_DEVICE": "1",
        "QTTS_THREADS": "3", "QTTS_RPC_SERVERS": "127.0.0.1:1", "QTTS_MAX_MATMUL_ROWS": "64",
        "QTTS_CUSTOM_OPS": "0", "QTTS_DEBUG_BACKEND": "1", "QTTS_OP_LOG": "1",
        "QTTS_OP_FILTER": "mul_mat, im2col", "QTTS_CHECK_DETERMINISM": "1",
        "QTTS_WINOGRAD": "0", "QTTS_INT8_PREFILL": "0", "QTTS_PIN_PREFIXES": "0",
        "QTTS_PROFILE": "1", "QTTS_AMX": "0",
    })
    assert (o.backend, o.backend_fallback, o.device, o.threads, o.rpc_servers) == (
        "rpc", "cuda,cpu", "1", "3", "127.0.0.1:1")
    assert o.max_matmul_rows == 64 and not o.custom_ops and o.debug_backend
    assert o.diagnostics == DiagnosticSettings(True, frozenset({"MUL_MAT", "IM2COL"}), True)
    assert not o.winograd and not o.int8_prefill and not o.pin_prefixes and o.profile
    assert not o.amx and EngineOptions.from_env({}).amx


def test_on_off_variables_are_1_or_0_and_anything_else_is_refused() -> None:
    assert not EngineOptions.from_env({"QTTS_WINOGRAD": "0"}).winograd
    assert EngineOptions.from_env({"QTTS_PROFILE": "1"}).profile
    assert EngineOptions.from_env({"QTTS_PROFILE": ""}) == EngineOptions.from_env({})
    # the words the service's settings take for a boolean (QTTS_PIN_PREFIXES is both): "no"
    # once kept a default-on option on without a word
    assert not EngineOptions.from_env({"QTTS_WINOGRAD": "no"}).winograd
    assert not EngineOptions.from_env({"QTTS_PIN_PREFIXES": "False"}).pin_prefixes
    assert EngineOptions.from_env({"QTTS_PROFILE": "on"}).profile
    for name, raw in (("QTTS_WINOGRAD", "maybe"), ("QTTS_PROFILE", "2")):
        with pytest.raises(BackendError, match=f"{name}='{raw}': use 1 \\(on\\) or 0"):
            EngineOptions.from_env({name: raw})


def test_overrides_win_over_the_environment() -> None:
    o = EngineOptions.from_env({"QTTS_THREADS": "8", "QTTS_PIN_PREFIXES": "1"}, threads="2",
                               pin_prefixes=False)
    assert o.threads == "2" and not o.pin_prefixes
    assert o.replace(backend="cpu").backend == "cpu" and o.backend == "auto"


@pytest.mark.parametrize("raw, message", [
    ("many", "QTTS_MAX_MATMUL_ROWS='many' is not an integer"),
    ("0", "QTTS_MAX_MATMUL_ROWS=0 must be >= 1"),
])
def test_a_bad_row_limit_is_one_line(raw: str, message: str) -> None:
    with pytest.raises(BackendError, match=message):
        EngineOptions.from_env({"QTTS_MAX_MATMUL_ROWS": raw})


def test_the_backend_set_carries_its_options() -> None:
    o = EngineOptions.from_env({**CPU1, "QTTS_CUSTOM_OPS": "0", "QTTS_MAX_MATMUL_ROWS": "32",
                                "QTTS_DEBUG_BACKEND": "1"})
    bs = BackendSet.from_options(o)
    try:
        assert bs.options is o and bs.threads == 1 and bs.name == "cpu"
        assert not bs.custom_ops and bs.max_matmul_rows == 32 and bs.debug
    finally:
        bs.close()


def test_profile_prints_decoder_stage_times_only_when_on(
        tiny_gguf: Path, capfd: pytest.CaptureFixture[str]) -> None:
    model = open_model(tiny_gguf)
    codes = np.zeros((16, 2), dtype=np.int32)
    for profile in (False, True):
        bs = BackendSet.from_options(EngineOptions.from_env(CPU1, profile=profile))
        dec = DecoderModel.load(model, bs, "exact")
        capfd.readouterr()
        StreamingDecoder(dec).push(codes)
        err = capfd.readouterr().err
        assert ("[qtts profile] push 2 frame(s)" in err) == profile
        dec.close()
        bs.close()


def test_winograd_option_reaches_the_decoder_weights(tiny_gguf: Path) -> None:
    model = open_model(tiny_gguf)
    # QTTS_AMX=0: on AMX tiles the direct conv replaces Winograd (tests/engine/test_amx.py)
    amx = custom_ops.amx()
    on = BackendSet.from_options(EngineOptions.from_env({**CPU1, "QTTS_AMX": "0"}))
    off = BackendSet.from_options(EngineOptions.from_env({**CPU1, "QTTS_WINOGRAD": "0"}))
    dec_on, dec_off = DecoderModel.load(model, on, "fast"), DecoderModel.load(model, off, "fast")
    try:
        # Winograd needs the BF16 kernel; where it is missing both are off
        assert dec_on.weights._winograd == dec_on.weights._bf16_kernel
        assert not dec_off.weights._winograd
    finally:
        for x in (dec_on, dec_off, on, off):
            x.close()
        custom_ops.set_amx(amx)  # process-wide: leave it as the other tests expect
