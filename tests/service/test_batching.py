"""QTTS_MAX_BATCH > 1 on a real server: several text requests share one worker's steps, each
gets exactly its audio alone; cancel, kill -9 and metrics keep their meaning. And a batching
worker's own loop, driven through its pipe as the pool drives it."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.tools.make_model import make_model
from service.protocol import Job, Ready, RunJob, StepDone, StopWorker, TextIn
from service.settings import Settings
from service.worker import worker_main
from tests.service.helpers import (
    FRAME_SAMPLES,
    Server,
    metric,
    server_starter,
    tracebacks_logged,
    wait_metric,
)

FRAME_S = FRAME_SAMPLES / 24000
TEXTS = ["Hello there, how are you?", "Batching shares the weights.", "A third voice joins."]


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Q4_0: a row batched is bit for bit that row alone (engine/talker/batch.py)
    folder = tmp_path_factory.mktemp("svc_q4")
    make_model(folder, size="tiny", seed=3, progress=False, dtype="q4_0")
    return folder / "model.gguf"


@pytest.fixture
def batch_server(q4_model: Path, tmp_path: Path) -> Any:
    yield from server_starter(q4_model, tmp_path)


def _body(i: int, seconds: float = 2.0) -> dict[str, Any]:
    return {"text": TEXTS[i % len(TEXTS)], "voice": "ryan", "seed": 10 + i,
            "max_seconds": seconds, "format": "pcm"}


def _post_all(server: Server, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    out: list[httpx.Response | None] = [None] * len(bodies)

    def one(i: int) -> None:
        out[i] = httpx.post(server.url + "/tts", json=bodies[i], timeout=120)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in out)
    return [r for r in out if r is not None]


def test_batched_requests_equal_alone(batch_server: Any) -> None:
    # a fixed ramp: the chunks, and so the bytes on any decoder, are those alone (the auto
    # ramp's chunks depend on the company: tests/engine/test_batching.py)
    server = batch_server(workers=1, max_batch=3, chunk_ramp="double")
    bodies = [_body(i) for i in range(3)]
    alone = [httpx.post(server.url + "/tts", json=b, timeout=120) for b in bodies]
    together = _post_all(server, bodies)
    for a, b in zip(alone, together, strict=True):
        assert a.status_code == b.status_code == 200
        assert len(a.content) > 0 and a.content == b.content
    ms = server.metrics()
    steps = metric(ms, "qtts_batch_size_count")
    assert steps > 0
    # some steps served more than one stream (the three overlapped on one worker)
    assert metric(ms, "qtts_batch_size_sum") > steps
    assert metric(ms, "qtts_batch_size_bucket", le="1.0") < steps
    assert metric(ms, "qtts_batch_step_seconds_count", stage="talker") > 0
    assert metric(ms, "qtts_capacity") == 3


def test_an_error_in_a_step_fails_that_batch_and_the_worker_goes_on(batch_server: Any) -> None:
    """An engine error in a batched step (here a fault before each request's first chunk is
    sent) fails every request of that batch with a 500 that shows no traceback; the worker is
    not restarted and takes the next requests on a fresh, warmed-up runner (they fail at the
    same point: the fault hits every request)."""
    server = batch_server(workers=1, max_batch=2, test_fault="raise@chunk=0")
    for _ in range(2):
        rs = _post_all(server, [_body(0), _body(1)])
        for r in rs:
            assert r.status_code == 500, r.text
            assert "InjectedFault" in r.json()["error"]["message"]
            assert "Traceback" not in r.text
    ms = wait_metric(server, "qtts_requests_total", 4, route="/tts", outcome="error")
    assert metric(ms, "qtts_requests_total", route="/tts", outcome="error") == 4
    assert metric(ms, "qtts_worker_restarts_total") == 0
    assert httpx.get(server.url + "/readyz", timeout=5).status_code == 200
    # one record a failed step, naming how many jobs it ended: the pairs may share a step
    failed = tracebacks_logged(server, "a batch step failed")
    assert sum(int(re.search(r"\((\d+)\)", r["msg"])[1]) for r in failed) == 4, failed


def test_kill_ends_every_job_of_that_worker_only(batch_server: Any) -> None:
    # each chunk waits 0.1 s in the worker: a job alone takes ~0.5 s on this model, so without
    # it the first jobs could end before the poll below saw all three running
    server = batch_server(workers=2, max_batch=2, queue_size=4, test_fault="sleep=0.1@chunk")
    results: list[tuple[int, bool]] = []  # (bytes received, ended as an error)
    lock = threading.Lock()

    def one(i: int) -> None:
        got, failed = 0, False
        try:
            with httpx.stream("POST", server.url + "/tts", json=_body(i, 20.0),
                              timeout=120) as r:
                failed = r.status_code != 200  # died before its first byte: a 503
                for piece in r.iter_raw():
                    got += len(piece)
        except httpx.HTTPError:
            failed = True  # died mid-stream: the connection is dropped
        with lock:
            results.append((got, failed))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    # the pool spreads them: one worker runs two jobs, the other one
    deadline = time.monotonic() + 30
    two, total = None, 0
    while time.monotonic() < deadline and not (two is not None and total == 3):
        ws = server.workers()
        two = next((w for w in ws if w["running"] == 2), None)
        total = sum(w["running"] for w in ws)  # the third may still be on its way
        time.sleep(0.01)
    assert two is not None and total == 3, server.workers()
    os.kill(int(two["pid"]), signal.SIGKILL)
    for t in threads:
        t.join()
    assert sum(failed for _, failed in results) == 2  # both jobs of the dead worker
    ms = wait_metric(server, "qtts_requests_total", 2, route="/tts", outcome="worker_died")
    # the other worker's job ran to its end (a random-weight model speaks to its budget)
    assert metric(ms, "qtts_requests_total", route="/tts", outcome="ok") + metric(
        ms, "qtts_requests_total", route="/tts", outcome="truncated_no_eos") == 1
    ok = [got for got, failed in results if not failed]
    assert len(ok) == 1 and ok[0] > 0
    assert metric(ms, "qtts_worker_restarts_total") == 1


@pytest.mark.parametrize("max_batch", [1, 2])
def test_group_sigterm_drains_the_queued_requests_too(batch_server: Any, max_batch: int) -> None:
    """systemd's stop signals the whole process group, workers too: the requests still queued
    when it came are served by the drain, not failed by a worker that left at the signal."""
    server = batch_server(workers=1, max_batch=max_batch, queue_size=4, drain_seconds=60,
                          shutdown_delay_seconds=0, test_fault="sleep=0.05@chunk")
    n = max_batch + 1
    out: list[httpx.Response | None] = [None] * n

    def one(i: int) -> None:
        out[i] = httpx.post(server.url + "/tts", json=_body(i, 1.0), timeout=120)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    wait_metric(server, "qtts_requests_waiting", 1, timeout=30)
    os.killpg(server.proc.pid, signal.SIGTERM)
    for t in threads:
        t.join()
    assert [r.status_code if r else None for r in out] == [200] * n, [
        r.text for r in out if r is not None and r.status_code != 200]
    # a random-weight model speaks to its budget: every one of them whole
    assert {len(r.content) for r in out if r is not None} == {2 * FRAME_SAMPLES * 12}
    assert server.proc.wait(60) == 0
    assert "exited" not in server.log()


def test_cancel_one_stream_others_finish(batch_server: Any) -> None:
    server = batch_server(workers=1, max_batch=3, chunk_ramp="double")
    alone = httpx.post(server.url + "/tts", json=_body(1), timeout=120).content
    out: dict[int, bytes] = {}

    def full(i: int) -> None:
        out[i] = httpx.post(server.url + "/tts", json=_body(i), timeout=120).content

    t = threading.Thread(target=full, args=(1,))
    t.start()
    # a client that reads one chunk and hangs up: its stream is cancelled within a frame
    with httpx.stream("POST", server.url + "/tts", json=_body(0, 30.0), timeout=120) as r:
        next(r.iter_raw())
    t.join()
    assert out[1] == alone
    ms = wait_metric(server, "qtts_requests_total", 1, route="/tts", outcome="client_gone")
    assert metric(ms, "qtts_requests_running") == 0


def test_realtime_sessions_share_a_batching_worker(batch_server: Any) -> None:
    """Three realtime sessions writing their text over ~1.5 s, one of them pausing longer than
    its buffer, on ONE worker with QTTS_MAX_BATCH=3: they speak at once (each later session's
    first audio comes before the first session is done; the steps carried several rows), each
    utterance is whole; and all text at once still equals POST /tts with text_mode stream."""
    import asyncio
    import json

    from websockets.asyncio.client import connect

    from tests.service.realtime_helpers import (
        open_session,
        run,
        send,
        speak,
        words,
        ws_url,
    )

    server = batch_server(workers=1, max_batch=3)
    text = "Batching lets several voices speak at once on one worker, step by step."

    async def session(i: int, t0: float) -> tuple[float, float, list[dict[str, Any]], bytes]:
        await asyncio.sleep(0.15 * i)
        async with connect(ws_url(server)) as ws:
            await open_session(ws, voice="ryan", seed=20 + i, start="immediate")
            first = 0.0

            async def write() -> None:
                for j, w in enumerate(words(text)):
                    await send(ws, type="text", text=w)
                    await asyncio.sleep(0.6 if (i == 1 and j == 3) else 0.08)
                await send(ws, type="end")

            writer = asyncio.create_task(write())
            events: list[dict[str, Any]] = []
            audio = b""
            async for msg in ws:
                if isinstance(msg, bytes):
                    first = first or time.monotonic() - t0
                    audio += msg
                    continue
                events.append(json.loads(msg))
                if events[-1]["type"] == "done":
                    break
            await writer
            return first, time.monotonic() - t0, events, audio

    async def together() -> list[tuple[float, float, list[dict[str, Any]], bytes]]:
        t0 = time.monotonic()
        return list(await asyncio.gather(*(session(i, t0) for i in range(3))))

    out = run(together())
    for first, _, events, audio in out:
        usage = events[-1]["usage"]
        assert usage["outcome"] in ("ok", "truncated_no_eos"), events[-1]
        assert first > 0 and len(audio) == 2 * FRAME_SAMPLES * usage["frames"]
    assert out[1][0] < out[0][1] and out[2][0] < out[0][1]  # not one after another
    ms = server.metrics()
    assert metric(ms, "qtts_batch_size_bucket", le="1.0") < metric(ms, "qtts_batch_size_count")

    got = run(speak(server, text, voice="ryan", seed=11))[1]
    r = httpx.post(server.url + "/tts", json={"text": text, "seed": 11, "format": "pcm",
                                              "voice": "ryan", "text_mode": "stream"},
                   timeout=120)
    assert r.status_code == 200 and len(got) > 0 and got == r.content


def test_a_realtime_utterance_of_a_killed_worker_counts_as_worker_died(batch_server: Any
                                                                        ) -> None:
    """kill -9 of the worker speaking a realtime utterance: the session gets the worker_died
    error and the done (outcome error) and goes on; the counter and the log line say
    worker_died, as the HTTP routes' do, and the utterance has no audio-behind-text time."""
    from websockets.asyncio.client import connect

    from tests.service.realtime_helpers import collect, first_audio, open_session, run, send, ws_url

    server = batch_server(workers=1, max_batch=2, test_fault="sleep=0.1@chunk")

    async def session() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with connect(ws_url(server)) as ws:
            await open_session(ws, voice="ryan", seed=3)
            await send(ws, type="text", text=TEXTS[0] * 4)
            await send(ws, type="end")
            await first_audio(ws)
            os.kill(int(server.workers()[0]["pid"]), signal.SIGKILL)
            died, _ = await collect(ws)
            _wait_workers(server)
            await send(ws, type="text", text=TEXTS[1])
            await send(ws, type="end")
            again, _ = await collect(ws)
            return died, again

    died, again = run(session())
    assert [e["code"] for e in died if e["type"] == "error"] == ["worker_died"]
    assert died[-1]["usage"]["outcome"] == "error"
    assert again[-1]["usage"]["outcome"] in ("ok", "truncated_no_eos")
    route = "/v1/tts/realtime"
    ms = wait_metric(server, "qtts_requests_total", 1, route=route, outcome="worker_died")
    assert metric(ms, "qtts_requests_total", route=route, outcome="error") == 0
    assert metric(ms, "qtts_realtime_audio_behind_text_seconds_count") == 1  # the second only
    assert len(server.wait_request_lines(
        lambda rec: rec.get("route") == route and rec.get("outcome") == "worker_died")) == 1


def _wait_workers(server: Server, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(server.metrics(), "qtts_workers_alive") == 1:
            return
        time.sleep(0.05)
    raise AssertionError("no replacement worker")


@pytest.fixture
def worker_pipe(q4_model: Path, tmp_path: Path) -> Iterator[Connection]:
    """A batching worker process (B = 3) started as the pool starts one; its pipe, once the
    worker is ready."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    cancel = ctx.Value("q", 0, lock=False)
    opts = Settings(model=q4_model, data_dir=tmp_path, max_batch=3,
                    threads_per_worker=1).worker_options(0, max_frames_cap=250)
    proc = ctx.Process(target=worker_main, args=(child, cancel, opts), daemon=True)
    proc.start()
    child.close()
    try:
        assert parent.poll(300) and isinstance(parent.recv(), Ready)
        yield parent
    finally:
        parent.send(StopWorker())
        proc.join(timeout=20)
        if proc.is_alive():
            proc.kill()


def _first_step(conn: Connection) -> StepDone:
    while True:
        assert conn.poll(120), "no step reported"
        msg = conn.recv()
        if isinstance(msg, StepDone):
            return msg


def test_jobs_sent_together_take_their_first_step_together(worker_pipe: Connection) -> None:
    """Jobs that reach a batching worker a moment apart (sessions an event started at once)
    prefill and take their first step together: the second does not wait a whole round (the
    first one's prefill, frame and push) behind the first."""
    for i in range(2):
        if i:
            time.sleep(0.002)  # the second job's message after the first's, not with it
        worker_pipe.send(RunJob(Job(id=i + 1, kind="text", text=TEXTS[i], voice="ryan",
                                    frame_limit=4)))
    assert _first_step(worker_pipe).batch == 2


def test_live_jobs_started_by_text_together_step_together(worker_pipe: Connection) -> None:
    """Live jobs waiting for their start policy, whose starting text comes a moment apart
    (realtime sessions fed by one event), start in the same step."""
    for i in range(2):
        worker_pipe.send(RunJob(Job(id=i + 1, kind="text", text="Well", voice="ryan",
                                    frame_limit=4, live=True, min_tokens=4)))
    time.sleep(0.5)  # both wait for text
    for i in range(2):
        if i:
            time.sleep(0.002)
        worker_pipe.send(TextIn(i + 1, text=", here is the answer to your question. "))
    step = _first_step(worker_pipe)
    for i in range(2):
        worker_pipe.send(TextIn(i + 1, end=True))
    assert step.batch == 2
