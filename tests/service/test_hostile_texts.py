"""Hostile texts on a real server (tiny model): token caps as 400s naming the field, texts at the
caps served with the worker's memory back to where it was, a long prefill cancelled without a
kill."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from engine.gguf_model import open_model

CHAR_CAP = 4096
UNITS = {"emoji": "\U0001f600", "cjk": "\u4e00", "combining": "e\u0301"}


@pytest.fixture(scope="module")
def tokenizer(service_model: Path) -> Any:
    m = open_model(service_model)
    try:
        return m.tokenizer()
    finally:
        m.close()


def at_token_cap(tokenizer: Any, unit: str, cap: int) -> str:
    """The most repeats of ``unit`` whose tokens fit in ``cap``."""
    lo, hi = 1, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits = len(tokenizer.encode(unit * mid).ids) <= cap
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    return unit * lo


def worker_rss(server: Any) -> int:
    (w,) = server.workers()
    return int(psutil.Process(int(w["pid"])).memory_info().rss)


def speak(server: Any, route: str, text: str, **extra: Any) -> httpx.Response:
    if route == "/tts":
        body = {"text": text, "voice": "ryan", "format": "pcm", "max_seconds": 1, **extra}
    else:
        body = {"model": "qtts", "input": text, "voice": "ryan", "response_format": "pcm",
                "max_seconds": 1, **extra}
    return httpx.post(server.url + route, json=body, timeout=120)


@pytest.mark.parametrize("unit", list(UNITS))
def test_hostile_texts_at_the_caps(make_server: Any, tokenizer: Any, unit: str) -> None:
    server = make_server(workers=1)
    assert speak(server, "/tts", "Warm up.").status_code == 200
    before = worker_rss(server)
    u = UNITS[unit]
    at_chars = u * (CHAR_CAP // len(u))
    n_tokens = len(tokenizer.encode(at_chars).ids)
    for route, field in (("/tts", "text"), ("/v1/audio/speech", "input")):
        r = speak(server, route, at_chars)
        if n_tokens > 2048:  # the default token cap: a 400 naming the field, the count, the cap
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["field"] == field
            assert f"{n_tokens} tokens" in err["message"] and "2048" in err["message"]
        else:
            assert r.status_code == 200 and r.content
    at_tokens = at_token_cap(tokenizer, u, 2048)
    for route in ("/tts", "/v1/audio/speech"):
        r = speak(server, route, at_tokens)
        assert r.status_code == 200, r.text
        assert 0 < len(r.content) <= 2 * 24000 * 1.1  # max_seconds 1 (+ the last chunk)
    after = worker_rss(server)
    assert after <= before * 1.10, (before, after)


def test_cancel_during_a_long_prefill_frees_the_worker(make_server: Any, tokenizer: Any
                                                       ) -> None:
    """One prompt of ~2000 positions run one position per graph (a prefill of seconds on the
    tiny model): the client leaves during it, and the worker stops between two graphs, well
    within the cancel grace, instead of being killed."""
    server = make_server(workers=1, prefill_chunk=1, segment_tokens=2048,
                         cancel_grace_seconds=1)
    (w0,) = server.workers()
    text = at_token_cap(tokenizer, UNITS["cjk"], 2048)
    body = httpx.Request("POST", server.url + "/tts", json={
        "text": text, "voice": "ryan", "format": "pcm"}).read()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /tts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 10
        while server.workers()[0]["state"] != "busy":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.3)  # well inside the prefill
    deadline = time.monotonic() + 30
    while True:
        (w,) = server.workers()
        if w["state"] == "idle" and w["jobs_done"] == w0["jobs_done"] + 1:
            break
        assert time.monotonic() < deadline, w
        time.sleep(0.05)
    assert w["pid"] == w0["pid"]  # the same process: not killed and replaced
    assert "unresponsive" not in server.log()
    (line,) = [x for x in server.request_lines() if x.get("route") == "/tts"]
    assert line["outcome"] == "client_gone" and line["frames"] == 0
    assert line["status"] == 499  # it left before any status line: not logged as a 200
    assert speak(server, "/tts", "Still here.").status_code == 200
