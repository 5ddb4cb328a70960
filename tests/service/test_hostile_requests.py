"""Hostile request bodies on a real server: the former 500s are 400s naming the field, every
answer keeps the connection usable, and nothing a client sends can forge a log line."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from service.guard import ErrorGuard
from service.metrics import Metrics
from tests.service.helpers import codes, free_port, metric, parse_metrics, wait_metric

SURROGATE = "a\ud800b"


def post_raw(client: httpx.Client, url: str, body: dict[str, Any]) -> httpx.Response:
    # json.dumps writes a lone surrogate as the escape "\ud800": what an attacker sends
    return client.post(url, content=json.dumps(body).encode(),
                       headers={"content-type": "application/json"})


CASES = [
    ("/tts", {"codes": [[2**63] + [0] * 3] + [[0] * 4] * 15}, "codes"),
    ("/tts", {"codes": [[0] * 4] * 15 + [[0, 0, 0, -(2**63) - 1]]}, "codes"),
    ("/tts", {"text": SURROGATE, "voice": "ryan"}, "text"),
    ("/tts", {"text": "hello", "voice": "ryan", "instruct": SURROGATE}, "instruct"),
    ("/tts", {"text": "hello", "voice": SURROGATE}, "voice"),
    ("/v1/audio/speech", {"model": "qtts", "input": SURROGATE, "voice": "ryan"}, "input"),
    ("/v1/audio/speech", {"model": "qtts", "input": "hi", "voice": "ryan",
                          "instructions": SURROGATE}, "instructions"),
    ("/tts", {"text": "hello", "voice": "ryan", "temperature": 1e-45}, "temperature"),
    ("/v1/audio/speech", {"model": "qtts", "input": "hi", "voice": "ryan",
                          "temperature": 1e-45}, "temperature"),
]


def test_former_500s_are_400s_on_one_kept_alive_connection(server: Any) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for i, (route, body, field) in enumerate(CASES):
            rid = f"hostile-{i}"
            r = client.post(route, content=json.dumps(body).encode(),
                            headers={"content-type": "application/json", "x-request-id": rid})
            assert r.status_code == 400, (route, field, r.text)
            assert r.json()["error"]["field"] == field
            assert r.headers["x-request-id"] == rid
        # the same connection still serves a real request
        r = client.post("/tts", json={"codes": codes(2), "format": "pcm"})
        assert r.status_code == 200 and len(r.content) == 2 * 1920 * 2
    ids = {line["id"]: line for line in server.request_lines()}
    for i in range(len(CASES)):
        assert ids[f"hostile-{i}"]["status"] == 400
        assert ids[f"hostile-{i}"]["outcome"] == "rejected"
    assert "Traceback" not in server.log()


VOICE_FORMS = 'voice: must be a voice name or {"id": "<voice id>"}'
MESSAGES: list[tuple[str, bytes | dict[str, Any], str]] = [
    ("/tts", {"text": "hi", "voice": ["ryan"]}, VOICE_FORMS),
    ("/tts", {"text": "hi", "voice": {"id": 5}}, VOICE_FORMS),
    ("/v1/audio/speech", {"model": "m", "input": "hi", "voice": {"id": "ryan", "x": 1}},
     VOICE_FORMS),
    ("/v1/audio/speech", {"model": "m", "input": "hi", "voice": 7}, VOICE_FORMS),
    ("/tts", {"text": "hi", "voice": SURROGATE},
     "voice: has a lone surrogate U+D800 at character 1: not valid Unicode text"),
    ("/tts", {"text": "hi", "voice": {"id": SURROGATE}},
     "voice: has a lone surrogate U+D800 at character 1: not valid Unicode text"),
    ("/tts", {"codes": [[1.5]] * 16}, "codes.0.0: Input should be a valid integer"),
    ("/tts", b'{"text": "\xff\xfe", "voice": "ryan"}', "body: is not valid JSON ("),
    ("/tts", b"[" * 100_000 + b"]" * 100_000, "body: is not valid JSON ("),
    ("/tts", b'{"text": "hi",', "body: is not valid JSON"),
    # valid JSON, but longer than Python's integer conversion limit: not "not valid JSON"
    ("/tts", b'{"text": "hi", "voice": "ryan", "seed": 1' + b"0" * 5000 + b"}",
     "body: has a number of more than 4300 digits"),
    # less than the one frame a request makes: 0.32 s were sent for 0.1 (0.08 s for 0.001)
    ("/tts", {"text": "hi", "voice": "ryan", "max_seconds": 0.1, "speed": 0.25},
     "max_seconds: 0.1 s is shorter than one codec frame (0.32 s at speed 0.25)"),
    ("/v1/audio/speech", {"model": "m", "input": "", "voice": "ryan", "codes": [[1, 2, 3]] * 16,
                          "max_seconds": 0.001},
     "max_seconds: 0.001 s is shorter than one codec frame (0.08 s at speed 1)"),
]


def test_messages_name_the_field_as_the_client_wrote_it(server: Any) -> None:
    """A value of neither accepted form, or a body no JSON reader takes: one message naming
    the field (no pydantic names for a union's members, never a field-less 400)."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for route, body, message in MESSAGES:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = client.post(route, content=content, headers={"content-type": "application/json"})
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["message"].startswith(message), (body, err)
            assert err["field"] == message.split(":")[0].split(".")[0], (body, err)
        # both forms of a voice still speak
        for voice in ("ryan", {"id": "ryan"}):
            r = client.post("/v1/audio/speech", json={
                "model": "m", "input": "hi", "voice": voice, "response_format": "pcm",
                "max_seconds": 0.2})
            assert r.status_code == 200 and r.content, r.text


def test_a_body_of_a_million_mistakes_is_one_report(server: Any) -> None:
    """A body under the cap whose every code is a float, or with 300k unknown fields: pydantic
    reported each mistake and FastAPI copied every report (a 4 MB body held the event loop
    ~10 s and 1 GB); the first is all a 400 names, and all that is made."""
    from pydantic import ValidationError

    from service.realtime import TextDelta
    from service.schemas import SpeechRequest, TTSRequest

    floats = {"codes": [[1.5] * 60_000] * 16, "format": "pcm"}
    unknown = {"text": "hi", "voice": "ryan", **{f"k{i}": 0 for i in range(300_000)}}
    for model, body in ((TTSRequest, floats), (TTSRequest, unknown),
                        (SpeechRequest, {**unknown, "model": "m", "input": "hi"}),
                        (TextDelta, {**unknown, "type": "text"})):
        with pytest.raises(ValidationError) as err:
            model.model_validate(body)
        assert err.value.error_count() == 1, (model, err.value.errors()[:2])
    # (this server's body cap is 300 kB)
    floats["codes"] = [[1.5] * 3000] * 16
    unknown = {"text": "hi", "voice": "ryan", **{f"k{i}": 0 for i in range(20_000)}}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for body, message in ((floats, "codes.0.0: Input should be a valid integer"),
                              (unknown, "k0: is not a known field")):
            r = post_raw(client, "/tts", body)
            assert r.status_code == 400 and r.json()["error"]["message"] == message, r.text
        assert client.get("/healthz").status_code == 200


def test_worker_errors_name_the_openai_fields(server: Any) -> None:
    """The engine says text/instruct; the OpenAI route's client sent input/instructions."""
    body = {"model": "qtts", "input": "\U0001f600" * 2100, "voice": "ryan"}  # > 2048 tokens
    r = httpx.post(server.url + "/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["field"] == "input" and err["message"].startswith("input: ")
    assert "tokens; the limit is 2048" in err["message"]
    # (this tiny CustomVoice model does not honour instructions: the worker refuses them)
    body = {"model": "qtts", "input": "hi", "voice": "ryan", "instructions": "whisper"}
    r = httpx.post(server.url + "/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["field"] == "instructions"


def test_long_values_are_not_echoed_whole(server: Any) -> None:
    """An error names a client's unknown key, voice, language or voice id by its first
    characters only: a 200 kB one made a 600 kB answer (key, message and field) and log line."""
    big = "x" * 200_000
    cases = [("/tts", {"text": "hi", "voice": "ryan", big: 1}, big[:64]),
             ("/tts", {"text": "hi", "voice": big}, "voice"),
             ("/tts", {"text": "hi", "voice": "ryan", "language": big}, "language"),
             ("/v1/audio/speech", {"model": "qtts", "input": "hi", "voice": "ryan",
                                   "language": " " + big}, "language")]
    for route, body, name in cases:
        r = httpx.post(server.url + route, json=body, timeout=60)
        assert r.status_code == 400, r.text[:300]
        assert len(r.content) < 2000, r.text[:300]
        assert r.json()["error"]["field"].startswith(name), r.text[:300]
    assert max(len(line) for line in server.log().splitlines()) < 4000


def test_token_caps_are_checked_before_the_queue(server: Any) -> None:
    """A text over its token cap is a 400 ``too_long`` from the front end, like a text over
    the character cap: it never reaches a worker (queued behind other work it would wait for
    its refusal, or get a 503 with a Retry-After that no retry can satisfy)."""
    text = "\U0001f600" * 2100  # 2100 characters (under the 4096 cap), > 2048 tokens
    before = sum(w["jobs_done"] for w in server.workers())
    for route, body, name in (
            ("/tts", {"text": text, "voice": "ryan"}, "text"),
            ("/v1/audio/speech", {"model": "qtts", "input": text, "voice": "ryan"}, "input")):
        r = httpx.post(server.url + route, json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["field"], err["code"]) == (name, "too_long"), err
        assert err["message"].startswith(f"{name}: ")
        assert "the limit is 2048 tokens" in err["message"]
    assert sum(w["jobs_done"] for w in server.workers()) == before


def test_sequential_requests_go_round_the_workers(server: Any) -> None:
    """Dispatch picks the idle worker that waited longest: every worker keeps serving."""
    before = {w["index"]: w["jobs_done"] for w in server.workers()}
    for _ in range(6):
        r = httpx.post(server.url + "/tts", json={"codes": codes(1), "format": "pcm"}, timeout=30)
        assert r.status_code == 200
    after = {w["index"]: w["jobs_done"] for w in server.workers()}
    assert {i: after[i] - before[i] for i in after} == {0: 3, 1: 3}


def test_unknown_field_names_cannot_forge_log_lines(make_server: Any) -> None:
    server = make_server(log_format="text")
    forged = "x\n2030-01-01 00:00:00,000 INFO qtts.request: /tts ok forged"
    evil = {"codes": codes(1), forged: 1}
    r = httpx.post(server.url + "/tts", content=json.dumps(evil).encode(),
                   headers={"content-type": "application/json", "x-request-id": "evil-1"},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"
    assert "forged" in r.json()["error"]["message"]  # named, escaped, still valid JSON
    wait_metric(server, "qtts_requests_total", 1, route="/tts", outcome="rejected")
    lines = server.log().splitlines()
    # every record starts with a timestamp: no line starts with the forged one's
    assert not any(line.startswith("2030-01-01") for line in lines)
    (line,) = [x for x in lines if "evil-1" in x and "qtts.request" in x]
    assert re.search(r'field="x\\n2030-01-01', line)  # quoted and escaped in place
    # a key with a lone surrogate: a 400 as well, JSON and log intact
    r = httpx.post(server.url + "/tts", content=b'{"codes": [[0]], "\\ud800\\n": 1}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "Logging error" not in server.log()


def test_request_id_and_path_values_are_escaped(make_server: Any) -> None:
    server = make_server(log_format="text")
    # a request id that is not a plain token is replaced, never logged raw
    r = httpx.post(server.url + "/tts", json={"codes": codes(1), "format": "pcm"},
                   headers={"x-request-id": "a b\tc"}, timeout=30)
    assert r.status_code == 200
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])


# -- the guard on its own app: an exception no handler answers --------------------------------


async def _boom(request: Request) -> PlainTextResponse:
    raise RuntimeError("unexpected\ninjected")


async def _fine(request: Request) -> PlainTextResponse:
    return PlainTextResponse("fine")


@pytest.fixture
def guarded() -> Iterator[tuple[str, Metrics, list[logging.LogRecord]]]:
    metrics = Metrics()
    # as in the service: inside Starlette's own error middleware, around everything else
    app = Starlette(routes=[Route("/tts", _boom, methods=["POST"]), Route("/fine", _fine)],
                    middleware=[Middleware(ErrorGuard, metrics=lambda: metrics,
                                           synth_routes=("/tts",))])
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    for name in ("qtts.app", "qtts.request"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,
                                           lifespan="off"))
    t = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", metrics, records
    finally:
        server.should_exit = True
        t.join(10)
        for name in ("qtts.app", "qtts.request"):
            logging.getLogger(name).removeHandler(handler)


def test_unexpected_error_gets_json_id_log_line_and_counter(
        guarded: tuple[str, Metrics, list[logging.LogRecord]]) -> None:
    url, metrics, records = guarded
    with httpx.Client(base_url=url, timeout=10) as client:
        r = client.post("/tts", json={}, headers={"x-request-id": "ignored-here"})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["code"] == "internal_error" and err["type"] == "server_error"
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
        # the kept-alive connection is not reset: the next request on it is answered
        assert client.get("/fine").text == "fine"
    tracebacks = [x for x in records if x.exc_info]
    assert len(tracebacks) == 1
    (line,) = [x for x in records if x.name == "qtts.request"]
    assert line.__dict__["status"] == 500 and line.__dict__["outcome"] == "error"
    assert line.__dict__["id"] == r.headers["x-request-id"]
    ms = parse_metrics(metrics.render().decode())
    assert metric(ms, "qtts_internal_errors_total", route="/tts") == 1
    assert metric(ms, "qtts_requests_total", route="/tts", outcome="error") == 1

