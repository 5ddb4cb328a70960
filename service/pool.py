"""The worker pool of the front end: processes, a bounded queue, cancellation, restarts, drain.

One asyncio event loop owns all pool state. Each worker process has a duplex pipe and a reader
thread that forwards its messages to the loop. A request is a ``Ticket``: it waits in the
queue (at most ``queue_size`` wait; one more is refused at once), runs on one worker, and
receives the worker's messages as events on its own asyncio queue:

  ("chunk", audio, timings, frames) | ("done", info) | ("error", info) | ("worker_died", code)

The HTTP side adds ("client_gone",) itself. A worker that dies (even SIGKILL) closes its pipe:
the reader sees EOF, the ticket gets ``worker_died``, and a replacement starts. A worker that
neither finishes nor dies within ``cancel_grace_seconds`` of a cancel is killed.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from service.capacity import capacity
from service.metrics import Metrics
from service.schemas import Job
from service.settings import Settings
from service.worker import worker_main

log = logging.getLogger("qtts.pool")


class PoolFull(Exception):
    """Every worker is busy and the queue is full."""


class PoolDraining(Exception):
    """The server is shutting down and takes no new work."""


class PoolNotReady(Exception):
    """No worker is alive and the last start failed: waiting would not help."""


@dataclass(eq=False)
class Ticket:
    """One request's life in the pool."""

    job: Job
    enqueued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    finished_at: float | None = None
    worker: WorkerHandle | None = None
    state: str = "waiting"  # waiting | running | finished
    cancel_requested_at: float | None = None
    events: asyncio.Queue[tuple[Any, ...]] = field(default_factory=asyncio.Queue)

    @property
    def queue_seconds(self) -> float | None:
        return None if self.started_at is None else self.started_at - self.enqueued_at

    def push(self, event: tuple[Any, ...]) -> None:
        self.events.put_nowait(event)


@dataclass(eq=False)
class WorkerHandle:
    index: int
    process: Any
    conn: Any
    cancel: Any  # multiprocessing.Value('q'): id of the job to cancel
    state: str = "starting"  # starting | idle | busy | dead
    ticket: Ticket | None = None
    info: dict[str, Any] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)
    jobs_done: int = 0

    @property
    def pid(self) -> int | None:
        return self.process.pid  # type: ignore[no-any-return]


class WorkerPool:
    """``settings.workers`` processes behind a queue of ``settings.queue_size``."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self._ctx = mp.get_context("spawn")
        self._ids = itertools.count(1)
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._workers: list[WorkerHandle | None] = [None] * settings.workers
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._start_failures = [0] * settings.workers
        self.last_fatal: str | None = None
        self.draining = False
        self.stopping = False
        self.backend: str | None = None
        self._idle_event: asyncio.Event | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle_event = asyncio.Event()
        self.metrics.capacity.set(capacity(self.settings))
        for i in range(self.settings.workers):
            self._spawn(i)
        self._watchdog = asyncio.create_task(self._watch())

    def _spawn(self, index: int) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        cancel = self._ctx.Value("q", 0, lock=False)
        env = self.settings.worker_env()
        proc = self._ctx.Process(
            target=worker_main,
            name=f"qtts-worker-{index}",
            args=(child, cancel, index, str(self.settings.model), self.settings.precision, env,
                  self.settings.warmup_frames, self.settings.max_frames,
                  self.settings.chunk_max_frames),
            daemon=True,
        )
        proc.start()
        child.close()  # only the worker holds its end: its death is our EOF
        w = WorkerHandle(index=index, process=proc, conn=parent, cancel=cancel)
        self._workers[index] = w
        threading.Thread(
            target=self._reader, args=(w,), name=f"qtts-reader-{index}", daemon=True
        ).start()
        log.info("worker %d starting (pid %s)", index, proc.pid)

    def _reader(self, w: WorkerHandle) -> None:
        """Thread: forward every message of one worker to the loop; EOF means it exited."""
        assert self._loop is not None
        while True:
            try:
                msg = w.conn.recv()
            except (EOFError, OSError):
                break
            except Exception as e:
                log.error("worker %d: unreadable message (%s)", w.index, e)
                break
            try:
                self._loop.call_soon_threadsafe(self._on_message, w, msg)
            except RuntimeError:
                return  # loop closed
        w.process.join(timeout=5)
        try:
            self._loop.call_soon_threadsafe(self._on_exit, w)
        except RuntimeError:
            pass

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop every worker: ask politely, then kill. In-flight tickets end as worker_died."""
        self.stopping = True
        self.draining = True
        if self._watchdog:
            self._watchdog.cancel()
        for t in list(self._waiting):
            t.push(("error", {"status": 503, "field": None, "message": "server shutting down"}))
        self._waiting.clear()
        workers = [w for w in self._workers if w is not None]
        for w in workers:
            try:
                if w.state == "busy":
                    w.cancel.value = w.ticket.job.id if w.ticket else -1
                w.conn.send(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        for w in workers:
            remaining = max(0.0, deadline - time.monotonic())
            await asyncio.to_thread(w.process.join, remaining)
            if w.process.is_alive():
                w.process.kill()
                await asyncio.to_thread(w.process.join, 2)
        self._update_gauges()

    # ---- requests --------------------------------------------------------------------------
    def new_job_id(self) -> int:
        return next(self._ids)

    def submit(self, job: Job) -> Ticket:
        """Queue a job; raises PoolDraining or PoolFull instead of waiting."""
        if self.draining:
            raise PoolDraining
        if self.last_fatal and not any(
            w is not None and w.state in ("idle", "busy") for w in self._workers
        ):
            raise PoolNotReady(self.last_fatal)
        idle = self._idle_worker()
        if idle is None and len(self._waiting) >= self.settings.queue_size:
            raise PoolFull
        t = Ticket(job=job)
        self._waiting.append(t)
        self._dispatch()
        self._update_gauges()
        return t

    def cancel(self, t: Ticket) -> None:
        """Stop a ticket's work: drop it from the queue, or tell its worker between chunks."""
        if t.state == "waiting":
            try:
                self._waiting.remove(t)
            except ValueError:
                pass
            t.state = "finished"
            t.finished_at = time.monotonic()
            self._update_gauges()
        elif t.state == "running" and t.worker is not None:
            if t.cancel_requested_at is None:
                t.cancel_requested_at = time.monotonic()
                t.worker.cancel.value = t.job.id

    def _idle_worker(self) -> WorkerHandle | None:
        for w in self._workers:
            if w is not None and w.state == "idle":
                return w
        return None

    def _dispatch(self) -> None:
        while self._waiting:
            w = self._idle_worker()
            if w is None:
                return
            t = self._waiting.popleft()
            t.state = "running"
            t.started_at = time.monotonic()
            t.worker = w
            w.state = "busy"
            w.ticket = t
            try:
                w.conn.send(("job", t.job))
            except (OSError, ValueError):
                # it died between its last message and now: the reader will report the exit
                pass
        self._update_gauges()

    # ---- worker messages -------------------------------------------------------------------
    def _on_message(self, w: WorkerHandle, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "ready":
            w.info = msg[1]
            w.state = "idle"
            self._start_failures[w.index] = 0
            self.last_fatal = None
            self.backend = self.backend or str(w.info.get("backend"))
            log.info(
                "worker %d ready (pid %s, backend %s, load %.2fs, warm-up %.2fs)",
                w.index, w.pid, w.info.get("backend"), w.info.get("load_seconds", 0),
                w.info.get("warmup_seconds", 0),
            )
            self._dispatch()
        elif kind == "fatal":
            self.last_fatal = str(msg[1])
            log.error("worker %d failed to start: %s", w.index, msg[1])
        elif kind in ("chunk", "done", "error"):
            t = w.ticket
            if t is None or t.job.id != msg[1]:
                return  # a late message of a ticket already given up
            if kind == "chunk":
                t.push(("chunk", msg[2], msg[3], msg[4]))
                return
            t.push((kind, msg[2]))
            t.state = "finished"
            t.finished_at = time.monotonic()
            w.ticket = None
            w.jobs_done += 1
            if not self.stopping:
                w.state = "idle"
                self._dispatch()
        self._update_gauges()

    def _on_exit(self, w: WorkerHandle) -> None:
        if self._workers[w.index] is not w:
            return
        was_ready = w.state in ("idle", "busy")
        w.state = "dead"
        code = w.process.exitcode
        t = w.ticket
        w.ticket = None
        if t is not None and t.state == "running":
            t.state = "finished"
            t.finished_at = time.monotonic()
            t.push(("worker_died", code))
        try:
            w.conn.close()
        except OSError:
            pass
        self._update_gauges()
        if self.stopping:
            return
        if code == 0 and self.draining:
            # asked to stop by a signal while we drain: not a crash; replace it only if
            # queued requests still need a worker
            log.info("worker %d (pid %s) exited while draining", w.index, w.pid)
            if self._waiting:
                assert self._loop is not None
                self._loop.call_soon(self._respawn, w.index, w)
            return
        log.error("worker %d (pid %s) exited with code %s", w.index, w.pid, code)
        self.metrics.worker_restarts.inc()
        if was_ready:
            delay = 0.0
        else:
            self._start_failures[w.index] += 1
            delay = min(30.0, 0.5 * 2 ** self._start_failures[w.index])
        assert self._loop is not None
        self._loop.call_later(delay, self._respawn, w.index, w)

    def _respawn(self, index: int, old: WorkerHandle) -> None:
        if self.stopping or self._workers[index] is not old:
            return
        self._spawn(index)
        self._update_gauges()

    async def _watch(self) -> None:
        """Kill workers stuck past a cancel's grace or past their start timeout."""
        s = self.settings
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for w in self._workers:
                if w is None or w.state == "dead":
                    continue
                t = w.ticket
                stuck_cancel = (
                    w.state == "busy" and t is not None and t.cancel_requested_at is not None
                    and now - t.cancel_requested_at > s.cancel_grace_seconds
                )
                stuck_start = w.state == "starting" and now - w.started_at > s.worker_start_timeout
                if (stuck_cancel or stuck_start) and w.process.is_alive():
                    log.error("worker %d (pid %s) unresponsive: killing it", w.index, w.pid)
                    try:
                        os.kill(w.pid, 9)  # type: ignore[arg-type]
                    except OSError:
                        pass

    # ---- state -----------------------------------------------------------------------------
    def _update_gauges(self) -> None:
        alive = sum(1 for w in self._workers if w is not None and w.state in ("idle", "busy"))
        busy = sum(1 for w in self._workers if w is not None and w.state == "busy")
        self.metrics.workers_alive.set(alive)
        self.metrics.running.set(busy)
        self.metrics.waiting.set(len(self._waiting))
        if self._idle_event is not None:
            if busy == 0 and not self._waiting:
                self._idle_event.set()
            else:
                self._idle_event.clear()

    @property
    def ready(self) -> bool:
        """Every worker loaded and warm (and not shutting down)."""
        return not self.draining and all(
            w is not None and w.state in ("idle", "busy") for w in self._workers
        )

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> int:
        return sum(1 for w in self._workers if w is not None and w.state == "busy")

    def describe(self) -> list[dict[str, Any]]:
        return [
            {"index": i, "pid": w.pid, "state": w.state, "jobs_done": w.jobs_done}
            if w is not None else {"index": i, "pid": None, "state": "absent", "jobs_done": 0}
            for i, w in enumerate(self._workers)
        ]

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request runs or waits (drain)."""
        assert self._idle_event is not None
        self._update_gauges()
        try:
            await asyncio.wait_for(self._idle_event.wait(), timeout)
            return True
        except TimeoutError:
            return False
