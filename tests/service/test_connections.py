"""Connections and shutdown on a real server: idle/partial connections are closed by their
timeouts, POST to a GET route is a 405, SIGTERM drains with readiness 503 first and exits 0."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from tests.service.helpers import FRAME_SAMPLES, codes


def closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Read until the server closes (True) or ``seconds`` pass (False); what it sent."""
    sock.settimeout(0.2)
    got = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True, got
        if not data:
            return True, got
        got += data
    return False, got


@pytest.fixture
def timed_server(make_server: Any) -> Any:
    return make_server(header_timeout=1, body_timeout=1, keepalive_timeout=1)


def test_silent_connection_is_closed(timed_server: Any) -> None:
    with socket.create_connection(("127.0.0.1", timed_server.port)) as s:
        closed, got = closed_within(s, 10)
    assert closed and got == b""


def test_partial_headers_are_cut_with_408(timed_server: Any) -> None:
    with socket.create_connection(("127.0.0.1", timed_server.port)) as s:
        s.sendall(b"POST /tts HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
        for _ in range(3):  # trickling bytes does not keep it open
            time.sleep(0.3)
            s.sendall(b"X-A: b\r\n")
        closed, got = closed_within(s, 10)
    assert closed and got.startswith(b"HTTP/1.1 408 ")
    head, _, body = got.partition(b"\r\n\r\n")
    # the shape of every other error (the gate's body 408 included): its type, a request id
    assert json.loads(body)["error"] == {
        "message": "request headers not received within 1 s", "type": "timeout_error",
        "param": "headers", "field": "headers", "code": "request_timeout"}
    assert b"x-request-id: " in head.lower()


def test_partial_body_gets_408_naming_the_body(timed_server: Any) -> None:
    with socket.create_connection(("127.0.0.1", timed_server.port)) as s:
        s.sendall(b"POST /tts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"codes\":")
        closed, got = closed_within(s, 10)
    assert closed and got.startswith(b"HTTP/1.1 408 ")
    assert b'"field":"body"' in got and b"x-request-id" in got.lower()


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nbad header line\r\n\r\n",
    b"POST /tts HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabc",
])
def test_an_unreadable_request_gets_a_json_400(server: Any, request_bytes: bytes) -> None:
    """Bytes h11 cannot read as a request: a 400 in the JSON shape of every other error,
    with a request id, and the connection closed (uvicorn's own answer is plain text)."""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(request_bytes)
        closed, got = closed_within(s, 10)
    head, _, body = got.partition(b"\r\n\r\n")
    assert closed and head.startswith(b"HTTP/1.1 400 "), got
    assert b"content-type: application/json" in head.lower()
    assert b"x-request-id: " in head.lower()
    err = json.loads(body)["error"]
    assert err["code"] == "bad_request" and err["message"].startswith("request: ")
    # the server still serves
    assert httpx.get(server.url + "/healthz", timeout=10).status_code == 200


def test_idle_keep_alive_connection_is_closed(timed_server: Any) -> None:
    with socket.create_connection(("127.0.0.1", timed_server.port)) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        closed, got = closed_within(s, 10)
    assert closed and got.startswith(b"HTTP/1.1 200 ")


def test_a_prompt_client_is_not_cut(timed_server: Any) -> None:
    # the timers reset per request: several requests on one connection, each in time
    with httpx.Client(base_url=timed_server.url, timeout=30) as c:
        for _ in range(3):
            assert c.post("/tts", json={"codes": codes(2), "format": "pcm"}).status_code == 200
            time.sleep(0.5)


# (POST /v1/audio/voices creates a voice: tests/service/test_voices_http.py)
@pytest.mark.parametrize("path", ["/v1/models", "/healthz", "/readyz", "/metrics",
                                  "/v1/audio/voices/voice_x"])
def test_post_to_a_get_route_is_405(server: Any, path: str) -> None:
    r = httpx.post(server.url + path, content=b"x", headers={"content-type": "text/plain"})
    assert r.status_code == 405, r.text
    assert set(r.headers["allow"].split(", ")) <= {"GET", "HEAD", "DELETE"}
    assert "GET" in r.headers["allow"] and r.json()["error"]["type"] == "invalid_request_error"


def test_sigterm_drains_with_readiness_503_then_exits_0(make_server: Any) -> None:
    server = make_server(workers=1, shutdown_delay_seconds=2, drain_seconds=60)
    n = 250
    result: dict[str, Any] = {}
    idle = httpx.Client(base_url=server.url, timeout=30)  # a kept-alive, idle connection
    assert idle.get("/readyz").status_code == 200

    def long_request() -> None:
        r = httpx.post(server.url + "/tts", json={"codes": codes(n), "format": "pcm"},
                       timeout=120)
        result["status"], result["bytes"] = r.status_code, len(r.content)

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 20
    while server.workers()[0]["state"] != "busy":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    server.proc.send_signal(15)
    time.sleep(0.3)
    # draining: the listener is open, readiness is 503, new work is refused with 503
    r = idle.get("/readyz")
    assert r.status_code == 503 and r.json()["status"] == "draining"
    r = httpx.post(server.url + "/tts", json={"codes": codes(2)}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
    assert r.headers["retry-after"]
    t.join(120)
    assert result == {"status": 200, "bytes": n * FRAME_SAMPLES * 2}  # in-flight finished
    assert server.proc.wait(60) == 0
    idle.close()
    log = server.log()
    assert "draining" in log and "Traceback" not in log
