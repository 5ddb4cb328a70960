"""Overload, worker death (kill -9 mid-stream), SIGTERM drain and the API key, each on its own
real server."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import httpx
import psutil
import pytest

from tests.service.helpers import FRAME_SAMPLES, codes, decoded_seconds, metric, wait_metric

FRAME_S = FRAME_SAMPLES / 24000


def _busy_pid(server: Any, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for w in server.workers():
            if w["state"] == "busy":
                return int(w["pid"])
        time.sleep(0.01)
    raise AssertionError("no busy worker")


def _wait_ready(server: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(server.url + "/readyz").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError("server did not get ready again")


def _wait_draining(server: Any, timeout: float = 30.0) -> None:
    """Until the front end stops being ready (503 or its listener closed): the event that
    SIGTERM was handled, instead of a sleep."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(server.url + "/readyz", timeout=2).status_code != 200:
                return
        except httpx.HTTPError:
            return
        time.sleep(0.02)
    raise AssertionError("SIGTERM never made the server stop being ready")


def test_overload_rejects_at_once_and_accepted_ones_complete(make_server: Any) -> None:
    server = make_server(workers=1, queue_size=1, retry_after_seconds=2)
    n = 300  # long enough that a running request outlasts any refusal, even on a busy machine
    results: list[tuple[int, dict[str, str], bytes, float]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        t0 = time.monotonic()
        r = httpx.post(server.url + "/tts", json={"codes": codes(n, seed=i), "format": "wav"},
                       timeout=60)
        with lock:
            results.append((r.status_code, dict(r.headers), r.content, time.monotonic() - t0))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] == 503]
    assert len(ok) + len(rejected) == 6
    assert len(ok) >= 2 and len(rejected) >= 1  # one runs, one waits, the rest are refused
    for _status, headers, body, _ in rejected:
        assert headers["retry-after"] == "2"
        assert b'"code":"queue_full"' in body
    # refusals come at once, not after the running request
    assert min(r[3] for r in rejected) < min(r[3] for r in ok)
    for _, _, body, _ in ok:
        assert abs(decoded_seconds(body, "wav") - n * FRAME_S) < 1e-3
    ms = wait_metric(server, "qtts_requests_total", len(ok), route="/tts", outcome="ok")
    assert metric(ms, "qtts_rejections_total", reason="queue_full") == len(rejected)
    assert metric(ms, "qtts_requests_total", route="/tts", outcome="rejected") == len(rejected)
    assert metric(ms, "qtts_requests_total", route="/tts", outcome="ok") == len(ok)
    assert metric(ms, "qtts_request_queue_seconds_count") == len(ok)


def test_worker_killed_mid_stream(make_server: Any) -> None:
    server = make_server(workers=1)
    # 1) streaming: the connection is dropped, the client sees an incomplete transfer
    received = 0
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream("POST", server.url + "/tts",
                          json={"codes": codes(1000), "format": "wav"}, timeout=60) as r:
            assert r.status_code == 200
            it = r.iter_raw()
            received += len(next(it))
            os.kill(_busy_pid(server), signal.SIGKILL)
            for piece in it:
                received += len(piece)
    assert 44 <= received < 44 + 1000 * FRAME_SAMPLES * 2
    _wait_ready(server)
    ms = wait_metric(server, "qtts_requests_total", 1, route="/tts", outcome="worker_died")
    assert metric(ms, "qtts_requests_total", route="/tts", outcome="worker_died") == 1
    assert metric(ms, "qtts_worker_restarts_total") == 1
    assert metric(ms, "qtts_workers_alive") == 1
    assert metric(ms, "qtts_requests_running") == 0

    # 2) the next request succeeds on the replacement
    r = httpx.post(server.url + "/tts", json={"codes": codes(10), "format": "wav"}, timeout=60)
    assert r.status_code == 200 and abs(decoded_seconds(r.content, "wav") - 10 * FRAME_S) < 1e-3

    # 3) whole-file request: nothing was sent yet, so it gets a 503 to retry
    box: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: box.setdefault("r", httpx.post(
        server.url + "/tts", json={"codes": codes(1000), "format": "wav", "stream": False},
        timeout=60)))
    t.start()
    os.kill(_busy_pid(server), signal.SIGKILL)
    t.join()
    r = box["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_died"
    assert "retry-after" in r.headers
    _wait_ready(server)
    ms = wait_metric(server, "qtts_requests_total", 2, route="/tts", outcome="worker_died")
    assert metric(ms, "qtts_worker_restarts_total") == 2
    assert metric(ms, "qtts_workers_alive") == 1
    assert metric(ms, "qtts_requests_total", route="/tts", outcome="worker_died") == 2


def test_sigterm_drains_in_flight_work(make_server: Any) -> None:
    server = make_server(workers=1, drain_seconds=20, api_key="s3cret")
    auth = {"Authorization": "Bearer s3cret"}
    n = 150
    proc = psutil.Process(server.proc.pid)
    children = proc.children(recursive=True)
    assert children
    body = bytearray()
    with httpx.stream("POST", server.url + "/tts", headers=auth,
                      json={"codes": codes(n), "format": "wav"}, timeout=60) as r:
        it = r.iter_raw()
        body += next(it)
        # like systemd: SIGTERM to the whole process group, front end and workers alike
        os.killpg(server.proc.pid, signal.SIGTERM)
        _wait_draining(server)
        # no new work once draining: the listener is closed (or a 503 on a live connection)
        with pytest.raises(httpx.HTTPError):
            rr = httpx.post(server.url + "/tts", headers=auth,
                            json={"codes": codes(2), "format": "pcm"}, timeout=5)
            assert rr.status_code == 503
            raise httpx.HTTPError("refused with 503")
        for piece in it:
            body += piece
    # the in-flight request finished completely
    assert len(body) == 44 + n * FRAME_SAMPLES * 2
    # a clean drain exits 0 (not "terminated by SIGTERM")
    assert server.proc.wait(20) == 0
    assert "Application shutdown complete" in server.log()
    # workers (and multiprocessing's helper) are gone, none left orphaned
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [(c.pid, c.name()) for c in alive]


def test_api_key(make_server: Any) -> None:
    server = make_server(api_key="s3cret")
    body = {"codes": codes(3), "format": "pcm"}
    r = httpx.post(server.url + "/tts", json=body)
    assert r.status_code == 401 and r.json()["error"]["field"] == "authorization"
    assert r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/tts", json=body, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    assert httpx.get(server.url + "/v1/models").status_code == 401
    r = httpx.post(server.url + "/tts", json=body, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and len(r.content) == 3 * FRAME_SAMPLES * 2
    r = httpx.post(server.url + "/tts", json=body, headers={"X-API-Key": "s3cret"})
    assert r.status_code == 200
    # health and metrics stay open for probes and scrapers
    assert httpx.get(server.url + "/readyz").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
    out = client.audio.speech.create(model="qtts", voice="ryan", input="", response_format="pcm",
                                     extra_body={"codes": codes(3)})
    assert len(out.content) == 3 * FRAME_SAMPLES * 2
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.audio.speech.create(model="qtts", voice="ryan", input="hi")
    assert metric(server.metrics(), "qtts_rejections_total", reason="unauthorized") == 4


def test_not_ready_before_warm_up_and_request_timeout(service_model: Any, tmp_path: Any) -> None:
    from tests.service.helpers import Server

    # a slow worker (0.1 s per chunk, service/faults.py) outlives the 0.3 s timeout on any
    # hardware; 1000 frames alone might not
    server = Server(service_model, tmp_path, warmup_frames=64, request_timeout=0.3,
                    test_fault="sleep=0.1@chunk")
    try:
        seen: list[tuple[int, str]] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                r = httpx.get(server.url + "/readyz", timeout=1)
            except httpx.HTTPError:
                time.sleep(0.02)
                continue
            seen.append((r.status_code, r.json()["status"]))
            assert httpx.get(server.url + "/healthz").status_code == 200
            if r.status_code == 200:
                break
            time.sleep(0.02)
        assert seen[0] == (503, "starting"), seen[:3]
        assert seen[-1] == (200, "ready")

        # a stream that outlives the request timeout is cut: an incomplete transfer
        with pytest.raises(httpx.RemoteProtocolError):
            with httpx.stream("POST", server.url + "/tts", timeout=30,
                              json={"codes": codes(1000), "format": "pcm"}) as r:
                assert r.status_code == 200
                for _ in r.iter_raw():
                    pass
        # a whole-file request gets a 504 with the error body
        r = httpx.post(server.url + "/tts", timeout=30,
                       json={"codes": codes(1000), "format": "pcm", "stream": False})
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        ms = wait_metric(server, "qtts_requests_total", 2, route="/tts", outcome="timeout")
        assert metric(ms, "qtts_requests_total", route="/tts", outcome="timeout") == 2
        _wait_ready(server)
        assert metric(server.metrics(), "qtts_requests_running") == 0
    finally:
        server.stop()
