"""The HTTP API against a real server (2 workers, tiny model): streaming, formats, OpenAI
client, validation, disconnects, metrics and request logs."""

from __future__ import annotations

import base64
import gzip
import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.service.helpers import (
    FRAME_SAMPLES,
    Server,
    codes,
    decoded_seconds,
    metric,
    wait_metric,
)

FRAME_S = FRAME_SAMPLES / 24000


def test_health_ready_docs(server: Server) -> None:
    assert httpx.get(server.url + "/healthz").json()["status"] == "ok"
    r = httpx.get(server.url + "/readyz")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    assert len(r.json()["workers"]) == 2
    assert httpx.get(server.url + "/docs").status_code == 200
    spec = httpx.get(server.url + "/openapi.json").json()
    assert {"/tts", "/v1/audio/speech", "/v1/audio/voices", "/v1/models"} <= set(spec["paths"])


def test_head_is_get_without_the_body(server: Server) -> None:
    """Probes and balancers that check with HEAD see what GET answers (it was a 405)."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for path in ("/healthz", "/readyz", "/metrics", "/v1/models", "/playground"):
            got, head = client.get(path), client.head(path)
            assert (head.status_code, head.content) == (got.status_code, b""), path
            assert head.headers["content-type"] == got.headers["content-type"], path
            assert "content-length" in head.headers, path
        r = client.head("/tts")  # a POST route: 405, as GET gets
        assert r.status_code == 405 and r.content == b""
        assert client.head("/nowhere").status_code == 404
        assert client.get("/healthz").json()["status"] == "ok"  # the connection serves on


def test_router_errors_name_the_route_and_carry_a_request_id(server: Server) -> None:
    """No route and a method a route does not take: our JSON shape naming what was asked, with
    X-Request-Id as every other error (they were a bare "Not Found" with no id)."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = client.get("/v1/audio/speeches", headers={"X-Request-Id": "req-7"})
        assert r.status_code == 404 and r.headers["x-request-id"] == "req-7"
        err = r.json()["error"]
        assert err["code"] == "not_found" and err["type"] == "not_found_error"
        assert "/v1/audio/speeches" in err["message"] and "/docs" in err["message"]
        r = client.delete("/tts")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert len(r.headers["x-request-id"]) == 32
        assert r.json()["error"]["code"] == "method_not_allowed"
        assert r.json()["error"]["message"] == "DELETE is not allowed on /tts (allowed: POST)"
        # Allow lists every route's methods at the path (it named the first route's alone)
        r = client.put("/v1/audio/voices")
        assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD, POST"
        r = client.put("/v1/audio/voices/voice_x")
        assert r.headers["allow"] == "DELETE, GET, HEAD" and "(allowed: DELETE, GET, HEAD)" in (
            r.json()["error"]["message"])
        r = client.get("/v1/tts/realtime")  # a WebSocket route asked over plain HTTP
        assert r.status_code == 426 and r.headers["upgrade"] == "websocket"
        assert r.json()["error"]["code"] == "upgrade_required"
        # a trailing slash names the same route (it was a bare 307 built from the Host header)
        r = client.post("/tts/", json={"codes": codes(2), "format": "pcm"},
                        headers={"Host": "elsewhere.example"})
        assert r.status_code == 200 and len(r.content) == 2 * FRAME_SAMPLES * 2
        assert client.get("/v1/models/").json()["object"] == "list"
        r = client.get("/x" * 5000)  # a client's path is echoed clipped
        assert r.status_code == 404 and len(r.json()["error"]["message"]) < 400


def test_models_and_voices_from_model_metadata(server: Server) -> None:
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "qtts"
    assert models["data"][0]["synthetic"] is True
    # the OpenAI client's models.retrieve: the served model by id, a clear 404 for another
    assert httpx.get(server.url + "/v1/models/qtts").json() == models["data"][0]
    r = httpx.get(server.url + "/v1/models/gpt-4o-mini-tts")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    client = pytest.importorskip("openai").OpenAI(base_url=server.url + "/v1", api_key="unused")
    assert client.models.retrieve("qtts").id == "qtts"
    v = httpx.get(server.url + "/v1/audio/voices").json()
    assert "ryan" in v["voices"] and "english" in v["languages"]
    assert {"id": "ryan", "name": "ryan", "object": "voice"} in v["data"]


def test_streaming_is_real(server: Server) -> None:
    """The first chunk arrives while later frames are still being decoded."""
    n = 400
    arrivals: list[tuple[float, int]] = []
    t0 = time.monotonic()
    with httpx.stream("POST", server.url + "/tts", json={"codes": codes(n), "format": "pcm"},
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["x-sample-rate"] == "24000" and r.headers["x-audio-format"] == "pcm"
        assert r.headers["content-type"] == "audio/pcm" and r.headers["x-request-id"]
        assert "content-length" not in r.headers
        for piece in r.iter_raw():
            arrivals.append((time.monotonic() - t0, len(piece)))
    total = sum(b for _, b in arrivals)
    assert total == n * FRAME_SAMPLES * 2
    # the first frame (1 of 400) is out as its own small chunk, the rest in many more (how
    # early it comes is a speed claim: bench/ measures time to first audio)
    assert arrivals[0][1] < total / 4
    assert len(arrivals) >= 5


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "mp3", "opus", "aac"])
@pytest.mark.parametrize("stream", [True, False])
def test_every_format_decodes_to_the_expected_length(server: Server, fmt: str,
                                                     stream: bool) -> None:
    n = 25
    r = httpx.post(server.url + "/tts", json={"codes": codes(n, seed=1), "format": fmt,
                                              "stream": stream}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-audio-format"] == fmt
    if stream:
        assert "content-length" not in r.headers
    else:
        assert int(r.headers["content-length"]) == len(r.content)
    got = decoded_seconds(r.content, fmt)
    assert abs(got - n * FRAME_S) < 0.1, (fmt, got)


def test_wav_stream_has_exactly_one_header(server: Server) -> None:
    n = 30
    r = httpx.post(server.url + "/tts", json={"codes": codes(n, seed=2), "format": "wav"},
                   timeout=60)
    data = r.content
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt "
    assert len(data) == 44 + n * FRAME_SAMPLES * 2
    assert data.count(b"WAVEfmt ") == 1


def test_streamed_pcm_equals_whole_file(server: Server) -> None:
    """Chunked streaming changes nothing in the samples (the decoder carries state)."""
    body = {"codes": codes(20, seed=3), "format": "pcm"}
    a = httpx.post(server.url + "/tts", json=body, timeout=60).content
    b = httpx.post(server.url + "/tts", json={**body, "stream": False}, timeout=60).content
    assert a == b


def test_speed_time_stretches(server: Server) -> None:
    n = 50
    r = httpx.post(server.url + "/tts", json={"codes": codes(n), "format": "wav", "speed": 2.0},
                   timeout=60)
    assert r.status_code == 200
    assert abs(decoded_seconds(r.content, "wav") - n * FRAME_S / 2) < 0.1


def test_max_seconds_caps_codes(server: Server) -> None:
    r = httpx.post(server.url + "/tts", json={"codes": codes(40), "format": "pcm",
                                              "max_seconds": 1.0}, timeout=60)
    assert len(r.content) == int(1.0 * 12.5) * FRAME_SAMPLES * 2


@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0])
def test_max_seconds_caps_the_audio_received_at_any_speed(server: Server, speed: float) -> None:
    """``max_seconds`` is the audio the client gets: slowed 4x, a 1 s cap gave 3.8 s (it counted
    the audio before the tempo change; so did the server cap: 480 s for a 120 s cap)."""
    r = httpx.post(server.url + "/tts", json={"codes": codes(60), "format": "pcm",
                                              "max_seconds": 2.0, "speed": speed}, timeout=60)
    assert r.status_code == 200
    made = int(2.0 * speed * 12.5)  # whole frames within the cap, before the tempo change
    assert len(r.content) == round(made * FRAME_SAMPLES / speed) * 2
    assert len(r.content) / 2 / 24000 <= 2.0


def test_request_id_is_echoed(server: Server) -> None:
    r = httpx.post(server.url + "/tts", json={"codes": codes(2), "format": "pcm"},
                   headers={"X-Request-Id": "abc-123"}, timeout=60)
    assert r.headers["x-request-id"] == "abc-123"


def test_openai_client_create_and_streaming(server: Server) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    n = 25
    extra = {"codes": codes(n, seed=4)}
    resp = client.audio.speech.create(model="qtts", voice="ryan", input="",
                                      response_format="wav", extra_body=extra)
    assert abs(decoded_seconds(resp.content, "wav") - n * FRAME_S) < 0.01
    chunks = []
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="ryan", input="", response_format="mp3", extra_body=extra
    ) as stream:
        assert stream.headers["content-type"] == "audio/mpeg"
        for c in stream.iter_bytes():
            chunks.append(c)
    assert abs(decoded_seconds(b"".join(chunks), "mp3") - n * FRAME_S) < 0.1


def test_openai_sse_stream_format(server: Server) -> None:
    n = 20
    events = []
    with httpx.stream("POST", server.url + "/v1/audio/speech", timeout=60, json={
        "model": "qtts", "voice": "ryan", "input": "", "response_format": "pcm",
        "stream_format": "sse", "codes": codes(n, seed=5),
    }) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert events[-1]["type"] == "speech.audio.done"
    assert events[-1]["usage"]["output_tokens"] == n
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert len(pcm) == n * FRAME_SAMPLES * 2
    assert events[-1]["qtts"]["ttfa_seconds"] > 0
    # the whole file as one event (stream false): its done event reports first audio too
    r = httpx.post(server.url + "/v1/audio/speech", timeout=60, json={
        "model": "qtts", "voice": "ryan", "input": "", "response_format": "flac",
        "stream_format": "sse", "stream": False, "codes": codes(n, seed=5)})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["speech.audio.delta", "speech.audio.done"]
    assert events[-1]["qtts"]["ttfa_seconds"] > 0


def test_a_first_chunk_of_two_frames_on_the_wire(service_model: Path,
                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    """``QTTS_FIRST_CHUNK_FRAMES=2``: the first audio event carries two frames, then the
    ramp goes on (one SSE delta per decoder chunk)."""
    s = Server(service_model, tmp_path_factory.mktemp("first2"), first_chunk_frames=2)
    try:
        s.wait_ready()
        with httpx.stream("POST", s.url + "/v1/audio/speech", timeout=60, json={
            "model": "qtts", "voice": "ryan", "input": "", "response_format": "pcm",
            "stream_format": "sse", "codes": codes(9, seed=5),
        }) as r:
            deltas = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and "speech.audio.delta" in line]
    finally:
        s.stop()
    frames = [len(base64.b64decode(e["audio"])) // (2 * FRAME_SAMPLES) for e in deltas]
    assert frames == [2, 1, 1, 2, 2, 1]


def test_openai_sse_usage_counts_text_tokens(server: Server, service_model: Path) -> None:
    """``usage.input_tokens`` is the text's tokens under the model's tokenizer (as OpenAI
    counts them), not its characters."""
    from cli.tokenize import tokenize

    text = "Hello there, how are you today?"
    events = []
    with httpx.stream("POST", server.url + "/v1/audio/speech", timeout=60, json={
        "model": "qtts", "voice": "ryan", "input": text, "response_format": "pcm",
        "stream_format": "sse", "max_seconds": 0.5, "seed": 3,
    }) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    usage = events[-1]["usage"]
    ids, _ = tokenize(str(service_model), text)
    assert usage["input_tokens"] == len(ids) and len(ids) != len(text)
    assert usage["output_tokens"] >= 1
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def _text_ready(server: Server) -> bool:
    return bool(httpx.get(server.url + "/v1/models").json()["data"][0]["text"])


def test_text_request_streams(server: Server) -> None:
    """Text through the talker (random weights: the tiny model speaks noise, and may never
    emit end-of-speech, so max_seconds bounds it)."""
    if not _text_ready(server):
        pytest.skip("the engine has no text pipeline")
    body = {"text": "Hello there, how are you today?", "voice": "Ryan", "language": "English",
            "format": "pcm", "seed": 7, "max_seconds": 2.0, "temperature": 0.8, "top_k": 40}
    t0 = time.monotonic()
    arrivals = []
    data = b""
    with httpx.stream("POST", server.url + "/tts", json=body, timeout=60,
                      headers={"X-Request-Id": "text-1"}) as r:
        assert r.status_code == 200, r.read()
        for piece in r.iter_raw():
            arrivals.append(time.monotonic() - t0)
            data += piece
    assert 0 < len(data) <= 25 * FRAME_SAMPLES * 2 and len(data) % (FRAME_SAMPLES * 2) == 0
    assert len(arrivals) >= 2 and arrivals[0] < arrivals[-1]
    # the same seed gives the same audio
    again = httpx.post(server.url + "/tts", json={**body, "stream": False}, timeout=60).content
    assert again == data
    ms = server.metrics()
    for stage in ("prefill", "talker_step", "code_predictor"):
        assert metric(ms, "qtts_stage_seconds_count", stage=stage) > 0, stage
    assert metric(ms, "qtts_stage_seconds_count", stage="talker_step") >= len(data) / 2 / 1920


def test_text_through_the_openai_client(server: Server) -> None:
    openai = pytest.importorskip("openai")
    if not _text_ready(server):
        pytest.skip("the engine has no text pipeline")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    resp = client.audio.speech.create(model="tts-1", voice="vivian", input="Good morning!",
                                      response_format="opus",
                                      extra_body={"max_seconds": 1.0, "seed": 3})
    assert 0 < decoded_seconds(resp.content, "opus") <= 1.1


def test_text_errors_from_the_pipeline_name_the_field(server: Server) -> None:
    if not _text_ready(server):
        pytest.skip("the engine has no text pipeline")
    # this tiny CustomVoice model does not honour instructions: the worker's pipeline says so
    r = httpx.post(server.url + "/tts", json={"text": "hi", "voice": "ryan", "instruct": "whisper"},
                   timeout=60)
    assert r.status_code == 400, "this CustomVoice model must refuse instruct"
    assert r.json()["error"]["field"] == "instruct"
    # a codes request validates it too (docs: ignored, still validated)
    r = httpx.post(server.url + "/tts", json={"codes": codes(2), "instruct": "x" * 5000},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["field"] == "instruct", r.text[:300]


BAD = [
    # route, body, status, field, message fragment
    ("/tts", {}, 400, "text", "empty"),
    ("/tts", {"text": "   "}, 400, "text", "empty"),
    # nothing to speak: NUL, zero-width and BOM characters, a lone combining mark, an escape
    ("/tts", {"text": "\u0000\u200b\ufeff"}, 400, "text", "nothing to speak"),
    ("/tts", {"text": " \u0301\u0302 "}, 400, "text", "nothing to speak"),
    ("/tts", {"text": "x" * 5000}, 400, "text", "limit is 4096"),
    ("/tts", {"text": "hi", "voice": "nobody"}, 400, "voice", "ryan"),
    ("/tts", {"text": "hi", "language": "klingon"}, 400, "language", "english"),
    ("/tts", {"text": "hi", "format": "ogg"}, 400, "format", "wav"),
    ("/tts", {"text": "hi", "temperature": 5.0}, 400, "temperature", "cap"),
    ("/tts", {"text": "hi", "top_k": 0}, 400, "top_k", "greater than or equal"),
    ("/tts", {"text": "hi", "top_p": 1.5}, 400, "top_p", "less than or equal"),
    ("/tts", {"text": "hi", "repetition_penalty": 0.5}, 400, "repetition_penalty", "greater"),
    ("/tts", {"text": "hi", "speed": 0.1}, 400, "speed", "greater than or equal"),
    ("/tts", {"text": "hi", "speed": float("nan")}, 400, "speed", "finite number"),
    ("/tts", {"text": "hi", "max_seconds": float("inf")}, 400, "max_seconds", "finite number"),
    ("/v1/audio/speech", {"model": "qtts", "voice": "ryan", "input": "hi",
                          "temperature": float("nan")}, 400, "temperature", "finite number"),
    ("/tts", {"text": "hi", "max_seconds": 10_000}, 400, "max_seconds", "server limit"),
    ("/tts", {"codes": [[1, 2]] * 15}, 400, "codes", "16 rows"),
    ("/tts", {"codes": [[1, 2]] * 15 + [[1]]}, 400, "codes", "equal"),
    ("/tts", {"codes": [[0, 4096]] * 16}, 400, "codes", "outside 0..2047"),
    ("/tts", {"codes": "abc"}, 400, "codes", "list"),
    ("/tts", {"codes": [[1]] * 16, "text": "hi"}, 400, "text", "not both"),
    ("/tts", {"text": "hi", "nonsense": 1}, 400, "nonsense", "not a known field"),
    ("/v1/audio/speech", {"model": "qtts", "voice": "ryan", "input": ""}, 400, "input", "empty"),
    ("/v1/audio/speech", {"model": "qtts", "voice": "ryan", "input": "\u001b\u200d"}, 400, "input",
     "nothing to speak"),
    ("/v1/audio/speech", {"model": "qtts", "input": "hi"}, 400, "voice", "required"),
    ("/v1/audio/speech", {"model": "qtts", "voice": "x", "input": "hi"}, 400, "voice", "ryan"),
    ("/v1/audio/speech", {"model": "qtts", "voice": "ryan", "input": "hi",
                          "response_format": "ogg"}, 400, "response_format", "mp3"),
    ("/v1/audio/speech", {"model": "qtts", "voice": "ryan", "input": "hi",
                          "stream_format": "ws"}, 400, "stream_format", "sse"),
    ("/v1/audio/speech", {"model": "qtts", "voice": "ryan", "input": "hi",
                          "speed": 5}, 400, "speed", "4"),
]


@pytest.mark.parametrize(("route", "body", "status", "field", "fragment"), BAD)
def test_bad_input_is_a_4xx_naming_the_field(server: Server, route: str, body: dict,
                                            status: int, field: str, fragment: str) -> None:
    # (json.dumps writes NaN and Infinity as Python's JSON reader takes them)
    r = httpx.post(server.url + route, content=json.dumps(body), timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field and err["param"] == field, err
    assert fragment in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_null_is_a_field_not_sent_on_both_routes(server: Server) -> None:
    """The SDKs send an option given as None as null: every optional field takes its default
    (speed, format, stream and stream_format were a 400 while seed or language took it)."""
    for route, body, nulls in (
        ("/tts", {"text": "Hi.", "voice": "ryan"}, ("speed", "format", "stream", "language")),
        ("/v1/audio/speech", {"model": "qtts", "input": "Hi.", "voice": "ryan"},
         ("speed", "response_format", "stream_format", "stream", "instructions")),
    ):  # fmt: skip
        base = {**body, "seed": 1, "max_seconds": 0.24}
        plain = httpx.post(server.url + route, json=base, timeout=60)
        nulled = httpx.post(server.url + route, json={**base, **dict.fromkeys(nulls)}, timeout=60)
        assert plain.status_code == nulled.status_code == 200, nulled.text
        assert nulled.headers["content-type"] == plain.headers["content-type"]
        assert nulled.content == plain.content
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()["components"]["schemas"]
    assert {"type": "null"} in doc["TTSRequest"]["properties"]["speed"]["anyOf"]
    # an unknown field is refused whatever its value
    r = httpx.post(server.url + "/tts", json={"text": "Hi.", "voice": "ryan", "instructions": None},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["field"] == "instructions", r.text


def test_a_missing_voice_has_one_code_on_both_routes(server: Server) -> None:
    for route, body in (("/tts", {"text": "hi"}),
                        ("/v1/audio/speech", {"model": "qtts", "input": "hi"})):
        err = httpx.post(server.url + route, json=body, timeout=10).json()["error"]
        assert (err["field"], err["code"]) == ("voice", "voice_required"), (route, err)


def test_malformed_transport_is_a_4xx(server: Server) -> None:
    url = server.url + "/tts"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "body"
    r = httpx.post(url, content=b"text=hi", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["field"] == "content-type"
    r = httpx.post(url, content=b"{}")  # no content type
    assert r.status_code == 415
    for enc, body in (("gzip", gzip.compress(b'{"codes": []}')), ("br", b'{"codes": []}')):
        # (gzip was "not valid JSON", a plain body labelled br was read as it came)
        r = httpx.post(url, content=body, headers={"content-type": "application/json",
                                                   "content-encoding": enc})
        assert r.status_code == 415 and r.json()["error"]["field"] == "content-encoding"
    big = json.dumps({"codes": codes(5000)}).encode()  # over the 300 kB cap of this server
    r = httpx.post(url, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["field"] == "body"

    def gen():  # chunked upload without Content-Length
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    r = httpx.post(url, content=gen(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert httpx.get(url).status_code == 405
    assert httpx.get(server.url + "/nowhere").json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("kind", ["codes", "text"])
def test_disconnect_mid_stream_frees_the_worker(server: Server, kind: str) -> None:
    if kind == "text" and not _text_ready(server):
        pytest.skip("the engine has no text pipeline")
    before = server.metrics()
    gone0 = metric(before, "qtts_requests_total", route="/tts", outcome="client_gone")
    n = 1000  # ~80 s of audio, several seconds of work on the tiny model
    body: dict = {"codes": codes(n), "format": "pcm"}
    if kind == "text":  # random talker weights: it rarely ends by itself before max_seconds
        body = {"text": "Tell me a long story. " * 20, "voice": "ryan", "format": "pcm",
                "max_seconds": n / 12.5, "seed": 5}
    arrivals = []
    with httpx.stream("POST", server.url + "/tts", json=body, timeout=60) as r:
        it = r.iter_raw()
        received = 0
        while received < 30 * FRAME_SAMPLES * 2:  # 30 frames in: well into the stream
            piece = next(it, None)
            if piece is None:
                pytest.skip("the request ended by itself before the disconnect")
            received += len(piece)
            arrivals.append(time.monotonic())
        assert metric(server.metrics(), "qtts_requests_running") >= 1
    t_close = time.monotonic()
    freed = None
    while time.monotonic() - t_close < 60:  # a bound for a hang, not a speed claim
        ms = server.metrics()
        if (metric(ms, "qtts_requests_running") == 0
                and metric(ms, "qtts_requests_total", route="/tts", outcome="client_gone")
                == gone0 + 1):
            freed = time.monotonic() - t_close
            break
        time.sleep(0.02)
    assert freed is not None, "the worker still runs the abandoned request"
    assert all(w["state"] == "idle" for w in server.workers())


def test_metrics_after_requests(server: Server) -> None:
    """Counters move by exactly this test's own traffic (the tests run in any order)."""
    before = server.metrics()
    ok0 = metric(before, "qtts_requests_total", route="/tts", outcome="ok")
    rej0 = metric(before, "qtts_requests_total", route="/tts", outcome="rejected")
    inv0 = metric(before, "qtts_rejections_total", reason="invalid")
    audio0 = metric(before, "qtts_audio_seconds_total")
    counts0 = {h: metric(before, h + "_count") for h in HISTOGRAMS}
    for fmt in ("mp3", "pcm"):  # every histogram gets observations of its own
        r = httpx.post(server.url + "/tts", json={"codes": codes(12), "format": fmt}, timeout=60)
        assert r.status_code == 200
    for _ in range(3):
        assert httpx.post(server.url + "/tts", json={"text": ""}, timeout=10).status_code == 400
    oks, served, audio = 2, 2, 24 * FRAME_S  # ok outcomes, 200 responses, audio seconds
    text = _text_ready(server)
    if text:  # random weights rarely end by themselves: often "truncated" at max_seconds
        r = httpx.post(server.url + "/tts", timeout=60, headers={"X-Request-Id": "metrics-text"},
                       json={"text": "Hi.", "voice": "ryan", "format": "pcm", "seed": 1,
                             "max_seconds": 0.5})
        assert r.status_code == 200
        served, audio = 3, audio + len(r.content) / 2 / 24000
        line = wait_log_line(server, "metrics-text")
        oks += line["outcome"] == "ok"
    ms = wait_metric(server, "qtts_request_duration_seconds_count",
                     counts0["qtts_request_duration_seconds"] + served)
    assert metric(ms, "qtts_workers_alive") == 2
    # the autoscaler's denominator: 2 workers x the default batch of 4
    assert metric(ms, "qtts_capacity") == 8
    assert metric(ms, "qtts_requests_waiting") == 0
    assert metric(ms, "qtts_requests_running") == 0
    assert metric(ms, "qtts_requests_total", route="/tts", outcome="ok") == ok0 + oks
    assert metric(ms, "qtts_requests_total", route="/tts", outcome="rejected") == rej0 + 3
    assert metric(ms, "qtts_rejections_total", reason="invalid") == inv0 + 3
    assert metric(ms, "qtts_audio_seconds_total") - audio0 == pytest.approx(audio, abs=1e-3)
    assert metric(ms, "qtts_worker_restarts_total") == 0
    # the gap counter is the sum of the gaps the request log lines report
    gaps = sum(rec["stream_gaps"] for rec in server.request_lines() if "stream_gaps" in rec)
    assert metric(ms, "qtts_stream_gaps_total") == gaps
    waited = sum(rec["stream_gap_seconds"] for rec in server.request_lines()
                 if "stream_gap_seconds" in rec)
    assert metric(ms, "qtts_stream_gap_seconds_total") == pytest.approx(waited, abs=1e-3)
    assert metric(ms, "qtts_build_info", version="0.1.0", backend="cpu", model="qtts") == 1
    for stage in ("quant", "preconv", "pretr", "upsample", "bigvgan", "encode"):
        assert metric(ms, "qtts_stage_seconds_count", stage=stage) > 0, stage
        assert metric(ms, "qtts_stage_seconds_sum", stage=stage) > 0, stage
    if text:  # the text request above
        for stage in ("prefill", "talker_step", "code_predictor"):
            assert metric(ms, "qtts_stage_seconds_count", stage=stage) > 0
    for h in HISTOGRAMS:
        assert metric(ms, h + "_count") == counts0[h] + served, h
        assert metric(ms, h + "_sum") > 0, h
        # the +Inf bucket holds every observation
        assert metric(ms, h + "_bucket", le="+Inf") == metric(ms, h + "_count"), h
    assert (metric(ms, "qtts_request_queue_seconds_sum")
            <= metric(ms, "qtts_request_duration_seconds_sum"))


def wait_log_line(server: Server, rid: str) -> dict:
    """The request's log line (written just after its last byte)."""
    lines = server.wait_request_lines(lambda rec: rec.get("id") == rid)
    if not lines:
        raise AssertionError(f"no request log line for {rid}")
    return lines[0]


HISTOGRAMS = ("qtts_time_to_first_audio_seconds", "qtts_request_queue_seconds",
              "qtts_request_duration_seconds", "qtts_rtf")


def test_one_structured_log_line_per_request(server: Server) -> None:
    rid = "log-line-test"
    httpx.post(server.url + "/tts", json={"codes": codes(10), "format": "pcm"},
               headers={"X-Request-Id": rid}, timeout=60)
    deadline = time.monotonic() + 5  # the line is written just after the last byte is sent
    while True:
        lines = [rec for rec in server.request_lines() if rec.get("id") == rid]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(lines) == 1
    rec = lines[0]
    for key in ("id", "route", "voice", "chars", "audio_seconds", "queue_seconds",
                "ttfa_seconds", "rtf", "outcome"):
        assert key in rec, key
    assert rec["outcome"] == "ok" and rec["route"] == "/tts"
    assert rec["audio_seconds"] == pytest.approx(10 * FRAME_S, abs=1e-3)
    assert rec["rtf"] > 0 and rec["ttfa_seconds"] > 0 and rec["queue_seconds"] >= 0


def test_codes_to_pcm_gives_one_frame_of_samples_per_code_column(server: Server) -> None:
    """Length and not silence only: that the samples are the decoder's, sample for sample, is
    tests/service/test_audio_truth.py's check."""
    r = httpx.post(server.url + "/tts", json={"codes": codes(3), "format": "pcm"}, timeout=60)
    pcm = np.frombuffer(r.content, dtype="<i2")
    assert len(pcm) == 3 * FRAME_SAMPLES and np.abs(pcm).max() > 0
