"""What the server sends is the decoder's audio: PCM sample for sample against the engine
decoding the same codes in this process, compressed formats decoded again and compared with
that PCM (correlation), and time-stretch keeping the sound (not silence of the right length)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.service.helpers import FRAME_SAMPLES, Server, codes

N = 24  # frames: the gentle ramp 1, 1, 1, 2, 2, 3, 4, 6 and a 4-frame chunk (the server
# speaks each request alone, so QTTS_CHUNK_RAMP=auto is gentle; QTTS_CHUNK_MAX_FRAMES=16)


@pytest.fixture(scope="module")
def service_model(stress_gguf_seeded: Path) -> Path:
    """This module's server runs the stress model (tests/conftest.py) of each model seed: its
    audio is O(0.3) and unclipped, so a wrong scale, a clipped or offset sample, or a codec
    that mangles the signal shows. ``$QTTS_TEST_MODEL`` still wins."""
    given = os.environ.get("QTTS_TEST_MODEL")
    return Path(given) if given else stress_gguf_seeded


@pytest.fixture(scope="module")
def expected_pcm(service_model: Path) -> np.ndarray[Any, Any]:
    """The engine's own decode of ``codes(N, seed=7)`` with the server's settings (fast
    precision with the layers its calibration keeps in F32 for the default target, one thread,
    the same chunk ramp), as s16 written out here, independently of service/audio.py."""
    from engine.backend import BackendSet
    from engine.decoder import DecoderModel, StreamingDecoder
    from engine.decoder.calibration_store import calibration_for
    from engine.decoder.precision import DEFAULT_TARGET_DB
    from engine.gguf_model import open_model
    from engine.pipeline import chunk_sizes

    model = open_model(service_model)
    be = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "1"})
    layers = calibration_for(model, be, DEFAULT_TARGET_DB, None)[0].f32_layers
    dec = DecoderModel.load(model, be, precision="fast", f32_layers=layers)
    c = np.asarray(codes(N, seed=7), dtype=np.int32)
    sd = StreamingDecoder(dec)
    pieces, start = [], 0
    for size in chunk_sizes(16, "gentle"):
        if start >= N:
            break
        audio, _ = sd.push(c[:, start : start + size])
        pieces.append(audio)
        start += size
    y = np.concatenate(pieces).astype(np.float64)
    assert y.shape == (N * FRAME_SAMPLES,)
    return np.rint(np.clip(y, -1.0, 1.0) * 32767.0).astype(np.int16)


def _get(server: Server, fmt: str, **extra: Any) -> bytes:
    r = httpx.post(server.url + "/tts", timeout=60,
                   json={"codes": codes(N, seed=7), "format": fmt, **extra})
    assert r.status_code == 200, r.text
    return r.content


def test_pcm_is_the_decoder_output_sample_for_sample(
    server: Server, expected_pcm: np.ndarray[Any, Any]
) -> None:
    for stream in (True, False):
        pcm = np.frombuffer(_get(server, "pcm", stream=stream), dtype="<i2")
        assert pcm.shape == expected_pcm.shape
        _assert_same_pcm(pcm, expected_pcm, stream)
    wav = np.frombuffer(_get(server, "wav")[44:], dtype="<i2")
    _assert_same_pcm(wav, expected_pcm, "wav")


def _assert_same_pcm(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any], what: object) -> None:
    """Equal but for one step of rounding on rare samples: the fast decoder's BF16 rounding
    of a value that falls on a rounding boundary can differ between two processes (seen on the
    unclipped stress model: 13 samples in 46,080, off by 1; on the clipped default model one
    in 11,520). A wrong scale, offset or order moves almost every sample."""
    assert got.shape == want.shape
    diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
    assert diff.max() <= 1 and np.count_nonzero(diff) <= max(4, got.size // 1000), (
        what, int(diff.max()), int(np.count_nonzero(diff)))


def _decode(data: bytes) -> tuple[np.ndarray[Any, Any], int]:
    import av

    out, rate = [], 0
    with av.open(io.BytesIO(data)) as c:
        for frame in c.decode(audio=0):
            a = frame.to_ndarray()
            out.append(a.reshape(-1) if a.shape[0] == 1 else a[0])
            rate = frame.sample_rate
    y = np.concatenate(out).astype(np.float64)
    if np.issubdtype(out[0].dtype, np.integer):
        y /= 32768.0
    return y, rate


def _best_correlation(ref: np.ndarray[Any, Any], got: np.ndarray[Any, Any],
                      max_lag: int = 4000) -> float:
    """Correlation of ``got`` with ``ref`` at the codec delay (0..max_lag) that fits best."""
    n = min(len(ref), len(got)) - max_lag
    assert n > FRAME_SAMPLES
    a, b = ref[:n], got[: n + max_lag]
    size = 1 << int(np.ceil(np.log2(len(b) + n)))
    xc = np.fft.irfft(np.conj(np.fft.rfft(a, size)) * np.fft.rfft(b, size), size)[: max_lag]
    energy = np.concatenate([[0.0], np.cumsum(b * b)])
    window = energy[n : n + max_lag] - energy[:max_lag]
    den = np.sqrt(np.dot(a, a) * np.maximum(window, 1e-30))
    return float(np.max(xc / den))


# Lossless formats give the PCM back exactly; lossy ones keep the waveform. The synthetic
# model's audio is loud noise, the hardest case for a perceptual codec; the bounds are what
# that noise keeps at the service's bit rates with a margin, far above what silence or an
# unrelated signal scores (about 0).
LOSSY_MIN_CORR = {"mp3": 0.5, "aac": 0.5}


def test_flac_is_lossless(server: Server, expected_pcm: np.ndarray[Any, Any]) -> None:
    y, rate = _decode(_get(server, "flac", stream=False))
    assert rate == 24000
    got = np.rint(y * 32768.0).astype(np.int32)
    # within one step: the FLAC path scales floats by 32768 (-1.0 -> -32768), the PCM path by
    # 32767, so a few samples differ by one; anything more is a different signal
    diff = np.abs(got - expected_pcm.astype(np.int32))
    assert got.shape == expected_pcm.shape and diff.max() <= 1, int(diff.max())


@pytest.mark.parametrize("fmt", sorted(LOSSY_MIN_CORR))
def test_lossy_formats_keep_the_waveform(server: Server, expected_pcm: np.ndarray[Any, Any],
                                         fmt: str) -> None:
    y, rate = _decode(_get(server, fmt, stream=False))
    assert rate == 24000
    ref = expected_pcm.astype(np.float64) / 32768.0
    corr = _best_correlation(ref, y, max_lag=3000)
    # the audio of other codes scores clearly less (the tiny model's noise shares much of its
    # structure across codes, so "unrelated" is not zero here)
    other = np.frombuffer(httpx.post(server.url + "/tts", timeout=60, json={
        "codes": codes(N, seed=8), "format": "pcm"}).content, dtype="<i2") / 32768.0
    corr_other = _best_correlation(other, y, max_lag=3000)
    assert corr >= LOSSY_MIN_CORR[fmt], (fmt, corr)
    assert corr - corr_other >= 0.2, (fmt, corr, corr_other)


def test_time_stretch_keeps_the_sound(server: Server, expected_pcm: np.ndarray[Any, Any]
                                      ) -> None:
    fast = np.frombuffer(_get(server, "pcm", speed=2.0), dtype="<i2").astype(np.float64)
    ref = expected_pcm.astype(np.float64)
    assert abs(len(fast) - len(ref) / 2) <= FRAME_SAMPLES
    # same loudness (not silence), and the same spectrum shape: WSOLA keeps the pitch
    rms_ref, rms_fast = np.sqrt(np.mean(ref**2)), np.sqrt(np.mean(fast**2))
    assert 0.5 < rms_fast / rms_ref < 1.5, (rms_fast, rms_ref)

    def band_energy(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        spec = np.abs(np.fft.rfft(x[: 8192] * np.hanning(8192))) ** 2
        bands = np.array_split(spec, 16)
        e = np.array([b.sum() for b in bands])
        return e / e.sum()

    assert np.abs(band_energy(fast) - band_energy(ref)).sum() < 0.5
