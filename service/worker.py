"""The worker process: loads the model once (service/synthesizer.py), warms up, then
synthesizes one job at a time, or up to ``QTTS_MAX_BATCH`` text jobs at once (the batch loop).

It talks to the front end over one duplex pipe with the messages of service/protocol.py:
``RunJob`` / ``StopWorker`` in; ``Ready`` or ``Fatal`` once, then ``Chunk``* and ``Done`` or
``Failed`` per job out.

Cancellation is a shared 64-bit integer: the front end writes the id of the job to stop, the
worker's pipeline compares it with its current job before every talker step and decoder push.
No HTTP here, and the engine is only touched through its public names.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from service.protocol import (
    CancelJob,
    Chunk,
    Done,
    Failed,
    Fatal,
    Finish,
    Job,
    Ready,
    RunJob,
    StepDone,
    StopWorker,
    TextIn,
    WorkerOptions,
    batchable,
)
from service.synthesizer import BufferFeed, Synthesizer, stage_seconds

if TYPE_CHECKING:
    from engine.batching import BatchRunner
    from engine.pipeline import StreamInfo

log = logging.getLogger("qtts.worker")


def worker_main(conn: Any, cancel: Any, opts: WorkerOptions) -> None:
    """Entry point of a worker process (``multiprocessing`` spawn). ``conn``: its end of the
    pipe; ``cancel``: the shared id of the job to stop."""
    # Ctrl-C, or SIGTERM to the whole process group (systemd, `kill -- -PGID`), reaches every
    # worker with the front end: the front end drains (the queued requests too: a worker that
    # left at the signal would fail the jobs sent to it meanwhile) and then says StopWorker. A
    # worker whose front end is gone finds its pipe closed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from engine.options import EngineOptions
    from service.logs import setup_logging

    setup_logging(opts.env.get("QTTS_LOG_FORMAT", "text"), opts.env.get("QTTS_LOG_LEVEL", "info"))
    from service import faults

    try:
        fault = faults.from_env()
        if fault is not None:
            fault.hit("start")
        t0 = time.perf_counter()
        # the engine's options: its own QTTS_* variables with what the settings decided (threads,
        # prefix pinning) on top; read here, once, and passed down
        options = replace(EngineOptions.from_env({**os.environ, **opts.env}),
                          pin_prefixes=opts.pin_prefixes)
        synth = Synthesizer(opts, options)
        synth.conn = conn
        synth.on_stop = _stop_after_job
        load = time.perf_counter() - t0
        warm = synth.warm_up(opts.warmup_frames)
        runner = None
        if opts.max_batch > 1 and synth.pipeline.has_talker:
            from engine.batching import BatchRunner

            runner = BatchRunner(synth.pipeline, opts.max_batch)
            warm += runner.warm_up()
        conn.send(Ready(pid=os.getpid(), index=opts.index, backend=synth.backend_name,
                        load_seconds=load, warmup_seconds=warm,
                        decoder_snr_db=synth.decoder_snr_db))
    except Exception as e:
        try:
            conn.send(Fatal(f"{type(e).__name__}: {e}"))
        finally:
            sys.exit(1)

    if runner is not None:
        _serve_batched(conn, cancel, synth, fault, runner)
        return
    while not _STATE["term"]:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # front end gone
        match msg:
            case StopWorker():
                return
            case TextIn() | CancelJob():
                pass  # for a job that already ended (cancelled, failed)
            case RunJob(job=job):
                try:
                    _run_job(conn, cancel, synth, job, fault)
                except (BrokenPipeError, EOFError, ConnectionResetError):
                    return  # front end gone mid-request


_STATE = {"term": False}  # StopWorker came: leave after the running jobs
# A new job (or text that may start a waiting live one) waits this long for the next message,
# and at most GATHER_MAX_S in all, before the next round: jobs sent at one moment then prefill
# and step together
GATHER_GAP_S = 0.003
GATHER_MAX_S = 0.010


class _Running:
    """A job in the batch: what its Done reports."""

    def __init__(self, job: Job, info: StreamInfo) -> None:
        self.job = job
        self.info = info  # what the engine reports of its stream (the text's tokens)
        self.frames = 0
        self.sent = 0
        self.t0 = time.perf_counter()


def _serve_batched(conn: Any, cancel: Any, synth: Synthesizer, fault: Any,
                   runner: BatchRunner) -> None:
    """The batch loop (QTTS_MAX_BATCH > 1): up to ``runner.max_batch`` text jobs, live text
    among them, share each step (engine/batching.py; the runner was warmed up before Ready).
    Between steps it reads its pipe: new jobs join, ``TextIn`` goes to its live job's feed,
    ``CancelJob`` marks a job to stop (the runner drops it before its next frame). A job that
    must run alone (codes, a one-shot reference; the pool sends one only to an empty worker)
    runs to its end as without batching. While every live job waits for text, the loop waits
    on its pipe instead of spinning. A new job, or text that may start a live one, waits a few
    ms for the messages sent with it (``GATHER_GAP_S``), so that jobs started at one moment
    prefill and step together.
    A job whose own work raises (its live text, its sampling, its prefill: the runner's
    ``Rejected``) fails alone; an error in a batched pass fails every job of the batch (a 500
    each) and the loop goes on with a fresh batch."""
    from engine.batching import BatchRunner, Finished, Rejected
    from engine.errors import QttsError
    from engine.pipeline import StreamInfo, as_request

    max_batch = runner.max_batch
    live_jobs = itertools.count()  # QTTS_TEST_FAULT's ``text=N`` counts them (tests only)
    running: dict[int, _Running] = {}  # stream id -> job
    stop: set[int] = set()  # ids of the jobs to cancel
    feeds: dict[int, tuple[BufferFeed, int]] = {}  # job id -> its live text, its stream id
    gather = False  # a job came, or text that may start one: wait a moment for others

    def flag(job_id: int) -> Callable[[], bool]:
        return lambda: job_id in stop or cancel.value == job_id

    def deliver(sid: int, item: Any) -> None:
        r = running[sid]
        if isinstance(item, Finished | Rejected):
            del running[sid]
            stop.discard(r.job.id)
            feeds.pop(r.job.id, None)
            if isinstance(item, Rejected):
                conn.send(_failure(r.job.id, item.error))
                return
            if fault is not None:  # QTTS_TEST_FAULT (tests only)
                fault.hit("done")
            conn.send(Done(r.job.id, Finish(item.outcome), r.frames,
                           time.perf_counter() - r.t0, r.info.text_tokens, r.info.guessed,
                           r.info.refuted))
            return
        if fault is not None:  # QTTS_TEST_FAULT (tests only)
            fault.hit("chunk", r.sent)
        r.sent += 1
        r.frames += item.frames
        conn.send(Chunk(r.job.id, np.asarray(item.audio, dtype=np.float32),
                        stage_seconds(item.timings), int(item.frames)))

    def handle(msg: Any) -> None:
        nonlocal gather
        match msg:
            case StopWorker():
                # as the one-job loop: exit after the running jobs (the pool cancels them
                # first when it stops)
                _STATE["term"] = True
            case CancelJob(job_id=jid):
                stop.add(jid)
            case TextIn(job_id=jid):
                if jid in feeds:
                    feed, sid = feeds[jid]
                    feed.put(msg)
                    # text that may start its job: others may be about to start too
                    gather = gather or sid in runner.starting
            case RunJob(job=job) if not batchable(job):
                _run_job(conn, cancel, synth, job, fault)
            case RunJob(job=job) if _STATE["term"]:
                conn.send(Failed(job.id, 503, None, "worker stopping"))
            case RunJob(job=job):
                try:
                    voice = synth.voice_of(job)  # a stored voice: loaded once, cached
                    req: Any = job if voice is None else replace(as_request(job),
                                                                 voice_prompt=voice)
                    info = StreamInfo()
                    if job.live:
                        feed = BufferFeed(None if fault is None else partial(
                            fault.hit, "text", next(live_jobs)))
                        sid = runner.submit_live(req, feed, cancel=flag(job.id), info=info,
                                                 min_tokens=job.min_tokens)
                        feeds[job.id] = (feed, sid)
                    else:
                        sid = runner.submit(req, cancel=flag(job.id), info=info)
                except QttsError as e:
                    conn.send(_failure(job.id, e))
                    return
                running[sid] = _Running(job, info)
                gather = gather or bool(runner.free)

    later: list[Any] = []  # what ``pump`` read in a step and left for the loop, in order

    def pump() -> None:
        # in a step (BatchRunner.step): live text and cancels at once; a message after one it
        # left waits too, so that a job's text never comes before the job
        try:
            while conn.poll(0):
                msg = conn.recv()
                if not later and isinstance(msg, TextIn | CancelJob):
                    handle(msg)
                else:
                    later.append(msg)
        except (EOFError, OSError):
            return  # the loop finds the pipe closed

    while True:
        if _STATE["term"] and not running and not later:
            return
        left, later[:] = later[:], []
        for msg in left:
            handle(msg)
        # idle: until a message; every live job waiting for text: for its text
        wait: float | None = 0 if left else (0.02 if runner.idle else 0) if running else None
        gather_until: float | None = None
        while True:
            if gather:
                # jobs sent at one moment (sessions one event started), or the texts that start
                # them, arrive a fraction of a millisecond apart: one that missed this read
                # would wait a whole round (the others' prefill, frame and push) behind them
                gather = False
                now = time.perf_counter()
                gather_until = gather_until or now + GATHER_MAX_S
                wait = max(0.0, min(GATHER_GAP_S, gather_until - now))
            if not conn.poll(wait):
                break
            wait = 0
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return  # front end gone
            handle(msg)
        if not running:
            stop.clear()
            continue
        try:
            # each chunk goes out as soon as it is decoded, not after the batch's other pushes
            runner.step(deliver, pump)
        except (BrokenPipeError, EOFError, ConnectionResetError):
            return
        except Exception as e:
            if not isinstance(e, QttsError):
                log.error("a batch step failed: every job of this worker ends (%d)",
                          len(running), exc_info=e)
            message = str(e) if isinstance(e, QttsError) else (
                f"internal error: {type(e).__name__}")
            for r in running.values():
                conn.send(Failed(r.job.id, 500, None, message))
            running.clear()
            feeds.clear()
            runner.close()
            runner = BatchRunner(synth.pipeline, max_batch)
            runner.warm_up()
            continue
        last = runner.last
        if last.cp_rows:
            conn.send(StepDone(max(last.batch, last.cp_rows), last.talker_s,
                               last.code_predictor_s, runner.decoder_s))
        if not running:
            synth.pipeline.release()


def _stop_after_job() -> None:
    _STATE["term"] = True


def _failure(job_id: int, e: Exception) -> Failed:
    """A job's exception as its ``Failed`` answer: an ``InputError`` is a 400 naming its field,
    another engine error a 500 with its message, anything else a 500 naming only its type (the
    traceback goes to the log, one record in the JSON format, never to the client)."""
    from engine.errors import InputError, QttsError

    if isinstance(e, InputError):
        return Failed(job_id, 400, e.field, str(e), e.code)
    if isinstance(e, QttsError):
        return Failed(job_id, 500, None, str(e))
    log.error("job %d failed: internal error", job_id, exc_info=e)
    return Failed(job_id, 500, None, f"internal error: {type(e).__name__}")


@contextmanager
def _answering_failures(conn: Any, job_id: int) -> Iterator[None]:
    """Run one job: an exception becomes its ``Failed`` answer (``_failure``), except a broken
    pipe to the front end, which goes on up (the worker's loop ends on it)."""
    try:
        yield
    except (BrokenPipeError, EOFError, ConnectionResetError):
        raise
    except Exception as e:
        conn.send(_failure(job_id, e))


def _run_job(conn: Any, cancel: Any, synth: Synthesizer, job: Job,
             fault: Any = None) -> None:
    def cancelled() -> bool:
        return bool(cancel.value == job.id)

    if job.kind == "clone":
        _run_clone(conn, synth, job, fault)
        return
    frames = sent = 0
    t0 = time.perf_counter()
    with _answering_failures(conn, job.id):
        from engine.pipeline import StreamInfo

        info = StreamInfo()
        gen = synth.stream(job, cancelled, info)
        while True:
            try:
                audio, timings, n = next(gen)
            except StopIteration as stop:
                finish = stop.value
                break
            if fault is not None:  # QTTS_TEST_FAULT (tests only)
                fault.hit("chunk", sent)
            sent += 1
            frames += n
            conn.send(Chunk(job.id, audio, timings, n))
        if fault is not None:  # QTTS_TEST_FAULT (tests only)
            fault.hit("done")
        conn.send(Done(job.id, finish, frames, time.perf_counter() - t0, info.text_tokens,
                       info.guessed, info.refuted))


def _run_clone(conn: Any, synth: Synthesizer, job: Job, fault: Any = None) -> None:
    with _answering_failures(conn, job.id):
        msg = synth.clone(job)
        if fault is not None:  # QTTS_TEST_FAULT (tests only): a crash mid-create
            fault.hit("clone")
        conn.send(msg)
