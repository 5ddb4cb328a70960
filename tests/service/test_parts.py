"""Service parts without a server: settings, request schemas, encoders, time-stretch, metrics."""

from __future__ import annotations

import io
import itertools
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pydantic
import pytest

from service.audio import TimeStretch, encode_whole, make_encoder, wav_header
from service.errors import ApiError
from service.metrics import OUTCOMES, STAGES, Metrics
from service.schemas import SpeechRequest, TTSRequest
from service.settings import Settings
from service.validation import check_codes
from tests.service.helpers import decoded_seconds

SR = 24000


def tone(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QTTS_WORKERS", "3")
    monkeypatch.setenv("QTTS_THREADS_PER_WORKER", "2")
    monkeypatch.setenv("QTTS_API_KEY", "k")
    monkeypatch.setenv("QTTS_LOG_FORMAT", "json")
    monkeypatch.setenv("QTTS_BACKEND", "cpu")  # the engine's variable: ignored here, no error
    s = Settings()
    assert (s.workers, s.threads_per_worker, s.api_key, s.log_format) == (3, 2, "k", "json")
    assert s.worker_env()["QTTS_THREADS"] == "2"
    monkeypatch.setenv("QTTS_WORKERS", "0")
    with pytest.raises(pydantic.ValidationError, match="workers"):
        Settings()


@pytest.mark.parametrize(
    ("body", "field", "needle"),
    [
        ({"codes": [["a", 1]] * 16}, "codes", "valid integer"),
        ({"codes": [[1.5, 1]] * 16}, "codes", "valid integer"),
        ({"text": "hi", "format": "ogg"}, "format", "'wav'"),
        ({"text": "hi", "speed": 9}, "speed", "less than or equal to 4"),
        ({"text": "hi", "top_p": 0}, "top_p", "greater than 0"),
        ({"text": "hi", "seed": -1}, "seed", "greater than or equal to 0"),
        ({"text": "hi", "bogus": 1}, "bogus", "Extra inputs"),
    ],
)
def test_tts_request_errors_name_the_field(body: dict, field: str, needle: str) -> None:
    with pytest.raises(pydantic.ValidationError) as ei:
        TTSRequest.model_validate(body)
    err = ei.value.errors()[0]
    assert err["loc"][0] == field
    assert needle in err["msg"]


@pytest.mark.parametrize(
    ("codes", "needle"),
    [
        ([[1, 2]] * 15, "expected 16 rows"),
        ([[1, 2]] * 15 + [[1]], "row 15 has 1 codes"),
        ([[]] * 16, "no frames"),
        ([[0, 2048]] * 16, "code 2048 at [0][1]"),
        ([[0, -1]] * 16, "code -1 at [0][1]"),
    ],
)
def test_codes_shape_and_ids_follow_the_model(codes: list[list[int]], needle: str) -> None:
    with pytest.raises(ApiError) as ei:
        check_codes(codes, n_codebooks=16, codebook_size=2048)
    assert ei.value.field == "codes" and ei.value.status == 400
    assert needle in ei.value.message
    check_codes([[0, 2047]] * 16, n_codebooks=16, codebook_size=2048)
    with pytest.raises(ApiError, match=r"outside 0\.\.1023"):  # the model's size, not a constant
        check_codes([[0, 2047]] * 8, n_codebooks=8, codebook_size=1024)


def test_speech_request_openai_shape() -> None:
    r = SpeechRequest.model_validate(
        {"model": "tts-1", "input": "hello", "voice": {"id": "ryan"}, "response_format": "opus",
         "speed": 1.5, "stream_format": "sse", "instructions": "calm"}
    )
    assert r.voice_name == "ryan" and r.response_format == "opus"
    assert SpeechRequest.model_validate({"model": "m", "input": "x", "voice": "v"}
                                        ).response_format == "mp3"


@pytest.mark.parametrize("fmt", ["pcm", "wav", "flac", "mp3", "opus", "aac"])
def test_streaming_encoders_decode_to_the_input_length(fmt: str) -> None:
    x = tone(2.0)
    enc = make_encoder(fmt, SR)
    bounds = np.cumsum([0, 1, 2, 4, 8, 8]) * 1920  # the worker's chunk ramp, then the rest
    pieces = [enc.encode(x[a:b]) for a, b in itertools.pairwise(bounds)]
    pieces.append(enc.encode(x[bounds[-1] :]))
    data = b"".join(pieces) + enc.finish()
    assert abs(decoded_seconds(data, fmt) - 2.0) < 0.1
    if fmt in ("pcm", "wav", "mp3", "opus"):
        assert pieces[0], f"{fmt}: the first chunk produced no bytes"


def test_wav_stream_has_one_header_and_whole_file_exact_sizes() -> None:
    x = tone(1.0)
    enc = make_encoder("wav", SR)
    data = enc.encode(x[:1920]) + enc.encode(x[1920:]) + enc.finish()
    assert data.count(b"RIFF") == 1 and data.count(b"WAVEfmt ") == 1
    assert data[:4] == b"RIFF" and struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    assert len(data) == 44 + 2 * len(x)
    whole = encode_whole("wav", x, SR)
    assert whole[:44] == wav_header(len(x), SR)
    assert struct.unpack("<I", whole[4:8])[0] == len(whole) - 8
    import soundfile as sf

    y, sr = sf.read(io.BytesIO(whole), dtype="float32")
    assert sr == SR and len(y) == len(x) and np.max(np.abs(y - x)) < 1e-4


@pytest.mark.parametrize("fmt", ["flac", "mp3", "opus", "aac", "pcm"])
def test_whole_file_encoders(fmt: str) -> None:
    assert abs(decoded_seconds(encode_whole(fmt, tone(1.5), SR), fmt) - 1.5) < 0.1


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.5, 2.0, 4.0])
def test_time_stretch_streaming_length(speed: float) -> None:
    """The stretched stream is input / speed long, and the input's end is in it: slowed down,
    the filter's last window (17-56 ms at 0.5x-0.25x, a final consonant) was lost."""
    x = tone(2.0)
    ts = TimeStretch(speed, SR)
    cuts = [0, 1920, 5760, 13440, 28800, len(x)]  # a stream's chunks: 1, 2, 4, 8 frames, the rest
    out = [ts.push(x[a:b]) for a, b in itertools.pairwise(cuts)] + [ts.flush()]
    y = np.concatenate(out)
    assert len(y) == round(len(x) / speed)
    assert np.all(np.isfinite(y)) and np.max(np.abs(y)) < 1.0
    loud = np.flatnonzero(np.abs(y) > 0.5 * np.max(np.abs(x)))
    assert loud[-1] > len(y) - 0.035 * SR, (len(y) - loud[-1]) / SR
    assert ts.flush().size == 0


def test_metrics_names_and_bounded_labels() -> None:
    m = Metrics()
    m.set_build_info("0.1.0", "cpu", "qtts")
    m.observe_stages({"bigvgan": 0.01, "unknown_stage": 1.0})
    text = m.render().decode()
    for name in ("qtts_stage_seconds_bucket", "qtts_time_to_first_audio_seconds_bucket",
                 "qtts_request_queue_seconds_bucket", "qtts_request_duration_seconds_bucket",
                 "qtts_rtf_bucket", "qtts_requests_total", "qtts_audio_seconds_total",
                 "qtts_worker_restarts_total", "qtts_stream_gaps_total", "qtts_requests_running",
                 "qtts_requests_waiting", "qtts_workers_alive", "qtts_build_info", "qtts_capacity"):
        assert name in text, name
    for s in STAGES:
        assert f'stage="{s}"' in text
    for o in OUTCOMES:
        assert f'outcome="{o}"' in text
    assert "unknown_stage" not in text
    assert 'qtts_rtf_bucket{le="0.05"}' in text and 'qtts_rtf_bucket{le="4.0"}' in text
    # the first-audio alert (deploy/prometheus/alerts.yml) counts this bucket edge
    assert 'qtts_time_to_first_audio_seconds_bucket{le="2.0"}' in text


@pytest.mark.parametrize(("args", "env", "needle"), [
    (["--model", "/nonexistent/model.gguf"], {}, "file not found"),
    (["--model", "x.gguf"], {"QTTS_WORKERS": "0"}, "QTTS_WORKERS"),
    # settings that passed every lower bound, then overflowed at start
    ([], {"QTTS_MAX_AUDIO_SECONDS": "inf"}, "QTTS_MAX_AUDIO_SECONDS: Input should be a finite"),
    ([], {"QTTS_DRAIN_SECONDS": "inf"}, "QTTS_DRAIN_SECONDS"),
    ([], {"QTTS_API_KEY": " "}, "QTTS_API_KEY"),
    # the engine's own: a worker could never start on them, and was restarted for ever
    ([], {"QTTS_BACKEND": "bogus"}, "QTTS_BACKEND='bogus' is unknown"),
    ([], {"QTTS_BACKEND_FALLBACK": "cpu,nope"}, "unknown backend(s) nope"),
    ([], {"QTTS_THREADS": "100000"}, "QTTS_THREADS=100000 must be <= 256"),
    ([], {"QTTS_THREADS": "abc"}, "QTTS_THREADS='abc' is not an integer"),
    ([], {"QTTS_DEVICE": "-1"}, "QTTS_DEVICE=-1"),
    ([], {"QTTS_CUSTOM_OPS": "maybe"}, "QTTS_CUSTOM_OPS='maybe'"),
    ([], {"QTTS_MAX_MATMUL_ROWS": "0"}, "QTTS_MAX_MATMUL_ROWS=0"),
])
def test_serve_refuses_bad_settings_in_one_line(args: list[str], env: dict[str, str],
                                                 needle: str, service_model: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "cli", "serve", *args], env={
        **os.environ, "QTTS_MODEL": str(service_model), **env}, capture_output=True,
        text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
