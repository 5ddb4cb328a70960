"""Real faults in real workers (``QTTS_TEST_FAULT``, service/faults.py): a worker that raises,
hangs, fails to start or is slow, and what the front end and the client see. Each test has its
own server; every wait is on an observable event (a metric, a status), bounded only so that a
hang fails instead of blocking the suite."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from service.faults import Fault, InjectedFault
from tests.service.helpers import (
    FRAME_SAMPLES,
    Server,
    codes,
    metric,
    tracebacks_logged,
    wait_metric,
)

HANG_BOUND = 60.0  # seconds: only a hang reaches it


def _until(what: str, cond: Callable[[], Any], timeout: float = HANG_BOUND) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def _restarts(server: Server) -> float:
    """Worker restarts so far; 0 while the front end is not listening yet."""
    try:
        return metric(server.metrics(), "qtts_worker_restarts_total")
    except httpx.HTTPError:
        return 0.0


def test_fault_syntax() -> None:
    assert Fault.parse("raise@start") == Fault("raise", "start")
    assert Fault.parse("hang@chunk=2") == Fault("hang", "chunk", 2)
    assert Fault.parse("sleep=0.5@chunk") == Fault("sleep", "chunk", None, 0.5)
    assert Fault.parse("raise@text=1") == Fault("raise", "text", 1)
    assert Fault.parse("sleep=2@done") == Fault("sleep", "done", None, 2.0)
    for bad in ("raise", "boom@start", "raise@middle", "raise@clone=2", "raise@done=1"):
        with pytest.raises(ValueError, match="QTTS_TEST_FAULT"):
            Fault.parse(bad)
    with pytest.raises(InjectedFault):
        Fault.parse("raise@chunk=1").hit("chunk", 1)
    Fault.parse("raise@chunk=1").hit("chunk", 0)  # another chunk: nothing happens


def test_worker_exception_is_a_json_500_with_the_request_id(make_server: Any) -> None:
    server = make_server(test_fault="raise@chunk=0")
    for stream in (False, True):  # nothing was sent yet either way: a clean error response
        rid = f"boom-{stream}"
        r = httpx.post(server.url + "/tts", headers={"X-Request-Id": rid}, timeout=60,
                       json={"codes": codes(5), "format": "wav", "stream": stream})
        assert r.status_code == 500, r.text
        assert r.headers["x-request-id"] == rid
        err = r.json()["error"]
        assert "RuntimeError" in err["message"] or "InjectedFault" in err["message"], err
        assert "Traceback" not in r.text
    ms = wait_metric(server, "qtts_requests_total", 2, route="/tts", outcome="error")
    assert metric(ms, "qtts_requests_total", route="/tts", outcome="error") == 2
    assert metric(ms, "qtts_worker_restarts_total") == 0  # an exception is not a crash
    ok = httpx.post(server.url + "/tts", json={"codes": codes(1), "format": "pcm"}, timeout=60)
    assert ok.status_code == 500  # the fault hits every job; the worker keeps serving
    assert len(tracebacks_logged(server, "failed: internal error")) == 3  # one a job


def test_error_after_streaming_started_is_an_incomplete_transfer(make_server: Any) -> None:
    server = make_server(test_fault="raise@chunk=3")
    received = 0
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream("POST", server.url + "/tts", timeout=60,
                          json={"codes": codes(200), "format": "pcm"}) as r:
            assert r.status_code == 200  # headers went out with the first chunk
            for piece in r.iter_raw():
                received += len(piece)
    # chunks 0..2 of the ramp arrived, then the transfer was cut
    assert 0 < received < 200 * FRAME_SAMPLES * 2
    ms = wait_metric(server, "qtts_requests_total", 1, route="/tts", outcome="error")
    assert metric(ms, "qtts_requests_total", route="/tts", outcome="error") == 1


def test_worker_failing_at_start_backs_off_and_is_never_ready(
    service_model: Any, tmp_path: Any
) -> None:
    server = Server(service_model, tmp_path, test_fault="raise@start")
    try:
        _until("a failed start", lambda: _restarts(server) >= 1)
        r = httpx.get(server.url + "/readyz", timeout=5)
        assert r.status_code == 503
        r = httpx.post(server.url + "/tts", json={"codes": codes(2), "format": "pcm"},
                       timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert "InjectedFault" in r.json()["error"]["message"]
        # backoff: restarts wait 1, 2, 4 ... s, so 4 s after the first failure there are at
        # most 3 (a loaded machine only makes that fewer); without backoff, one per spawn
        first = metric(server.metrics(), "qtts_worker_restarts_total")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4:
            time.sleep(0.2)
        assert metric(server.metrics(), "qtts_worker_restarts_total") - first <= 3
        assert httpx.get(server.url + "/readyz", timeout=5).status_code == 503
    finally:
        server.stop()


def test_watchdog_kills_a_worker_stuck_at_start(service_model: Any, tmp_path: Any) -> None:
    server = Server(service_model, tmp_path, test_fault="hang@start", worker_start_timeout=1)
    try:
        _until("the stuck start killed", lambda: _restarts(server) >= 1)
        assert "unresponsive: killing it" in server.log()
        assert httpx.get(server.url + "/readyz", timeout=5).status_code == 503
    finally:
        server.stop()


def test_watchdog_kills_a_worker_deaf_to_cancel(make_server: Any) -> None:
    # the worker hangs before its first chunk, so a cancel can never end the job by itself
    server = make_server(test_fault="hang@chunk=0", cancel_grace_seconds=1)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up waiting and disconnects
        httpx.post(server.url + "/tts", json={"codes": codes(100), "format": "pcm"},
                   timeout=httpx.Timeout(HANG_BOUND, read=1.0))
    # the client left: the cancel is ignored, so after the grace the watchdog kills the worker
    ms = wait_metric(server, "qtts_worker_restarts_total", 1, timeout=HANG_BOUND)
    assert metric(ms, "qtts_worker_restarts_total") == 1
    assert "unresponsive: killing it" in server.log()
    _until("a replacement worker", lambda: httpx.get(server.url + "/readyz").status_code == 200)


def test_client_gone_while_queued_never_runs(make_server: Any) -> None:
    server = make_server(workers=1, queue_size=4, test_fault="sleep=0.1@chunk")
    done: dict[str, int] = {}

    def first() -> None:  # holds the only worker
        r = httpx.post(server.url + "/tts", json={"codes": codes(60), "format": "pcm"},
                       timeout=HANG_BOUND)
        done["status"] = r.status_code

    t = threading.Thread(target=first)
    t.start()
    _until("the worker busy", lambda: metric(server.metrics(), "qtts_requests_running") == 1)
    # a queued request whose client goes away: a raw socket sends it, then closes
    payload = json.dumps({"codes": codes(60, seed=1), "format": "pcm"}).encode()
    raw = (b"POST /tts HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
           + f"content-length: {len(payload)}\r\n\r\n".encode() + payload)
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(raw)
        _until("the request queued",
               lambda: metric(server.metrics(), "qtts_requests_waiting") == 1)
    _until("the queue emptied", lambda: metric(server.metrics(), "qtts_requests_waiting") == 0)
    t.join(HANG_BOUND)
    assert done["status"] == 200
    ms = wait_metric(server, "qtts_requests_total", 1, route="/tts", outcome="client_gone")
    assert metric(ms, "qtts_requests_total", route="/tts", outcome="client_gone") == 1
    assert metric(ms, "qtts_requests_total", route="/tts", outcome="ok") == 1
    # the worker ran one job only: the abandoned one was dropped from the queue
    assert [w["jobs_done"] for w in server.workers() if "jobs_done" in w] in ([], [1])


def test_drain_past_its_limit_cuts_the_stream(make_server: Any) -> None:
    server = make_server(workers=1, drain_seconds=1, test_fault="sleep=0.3@chunk")
    received = 0
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream("POST", server.url + "/tts", timeout=HANG_BOUND,
                          json={"codes": codes(400), "format": "pcm"}) as r:
            assert r.status_code == 200
            it = r.iter_raw()
            received += len(next(it))
            os.killpg(server.proc.pid, signal.SIGTERM)
            for piece in it:  # ~29 chunks at 0.3 s each: far past the 1 s drain and 1 s cut grace
                received += len(piece)
    assert received < 400 * FRAME_SAMPLES * 2
    assert server.proc.wait(HANG_BOUND) is not None
    # cut on purpose: a warning line and the request line's timeout, not a traceback
    assert "Traceback" not in server.log()
    assert "was cut" in server.log()
    assert [rec["outcome"] for rec in server.request_lines()] == ["timeout"]


def test_a_stall_is_counted_with_how_long_the_listener_waited(make_server: Any) -> None:
    """The worker sleeps 1 s before its fourth chunk: a client playing the first three chunks'
    ~0.24 s of audio as it came waits ~0.8 s. The request log line and the counters say one
    gap and that wait (the counters: the sums of the log lines)."""
    server: Server = make_server(workers=1, test_fault="sleep=1.0@chunk=3")
    r = httpx.post(server.url + "/tts", json={"codes": codes(24), "format": "pcm"},
                   timeout=HANG_BOUND)
    assert r.status_code == 200 and len(r.content) == 2 * 24 * FRAME_SAMPLES
    (line,) = server.wait_request_lines(lambda rec: rec.get("route") == "/tts")
    assert line["stream_gaps"] >= 1
    # (at most the sleep and the pushes of a slow machine: not the whole request's time)
    assert 0.5 < line["stream_gap_seconds"] < 2.0, line
    ms = server.metrics()
    assert metric(ms, "qtts_stream_gaps_total") == line["stream_gaps"]
    assert metric(ms, "qtts_stream_gap_seconds_total") == pytest.approx(
        line["stream_gap_seconds"], abs=1e-3)
