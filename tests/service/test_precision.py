"""Fast mode's precision in the service: a worker measures its decoder against exact mode at load
(``QTTS_PRECISION_TARGET_DB``), keeps more layers in F32 until the target holds, reports what
it measured, and keeps the result for its next start; the audio it serves holds the target."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from engine.backend import BackendSet
from engine.decoder.precision import calibrate, snr_db
from engine.gguf_model import open_model
from engine.tools.make_model import make_model
from tests.service.helpers import Server, codes, server_starter

CODES = codes(24, seed=5)


@pytest.fixture(scope="module")
def wave_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # a decoder that makes a wave (the stress recipe: nothing clipped), where an SNR means
    # something; the default recipe's clips most samples and is left alone (engine tests)
    folder = tmp_path_factory.mktemp("svc_stress")
    make_model(folder, size="tiny", seed=2, progress=False, recipe="stress")
    return folder / "model.gguf"


@pytest.fixture
def start(wave_model: Path, tmp_path: Path) -> Any:
    yield from server_starter(wave_model, tmp_path)


def _pcm(server: Server) -> np.ndarray:  # type: ignore[type-arg]
    r = httpx.post(server.url + "/tts", json={"codes": CODES, "format": "pcm"}, timeout=60)
    assert r.status_code == 200, r.text
    return np.frombuffer(r.content, dtype="<i2").astype(np.float64) / 32768.0


def test_workers_hold_the_target_and_keep_their_calibration(
        start: Any, wave_model: Path, tmp_path: Path) -> None:
    with open_model(wave_model) as m:
        be = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "1"})
        default_db = calibrate(m, be, target_db=0.0).snr_db
        be.close()
    target = round(default_db + 4.0, 1)  # above what the default F32 set gives: promotions
    data = tmp_path / "data"
    exact = _pcm(start(precision="exact"))
    plain = _pcm(start(precision="fast", precision_target_db=0))
    server = start(precision="fast", precision_target_db=target, data_dir=data)
    (w,) = server.workers()
    assert w["decoder_snr_db"] is not None and w["decoder_snr_db"] >= target
    assert "fast-mode calibration" in server.log() and " 0 promoted" not in server.log()
    calibrated = _pcm(server)
    assert snr_db(exact, plain) < target <= snr_db(exact, calibrated) + 0.5  # (PCM rounding)
    # the next start reads the calibration back
    again = start(precision="fast", precision_target_db=target, data_dir=data)
    assert "kept from an earlier start" in again.log()
    assert again.workers()[0]["decoder_snr_db"] == w["decoder_snr_db"]
    assert np.array_equal(_pcm(again), calibrated)
    assert len(list((data / "calibration").glob("decoder-*.json"))) == 1


def test_the_default_target_is_the_engines() -> None:
    from engine.decoder.precision import DEFAULT_TARGET_DB
    from service.settings import Settings

    assert Settings.model_fields["precision_target_db"].default == DEFAULT_TARGET_DB
