"""The worker pool of the front end: processes, a bounded queue, cancellation, restarts, drain.

One asyncio event loop owns all pool state. Each worker process has a duplex pipe and a reader
thread that forwards its messages (service/protocol.py) to the loop. A request is a
``Ticket``: it waits in the queue (at most ``queue_size`` wait; one more is refused at once),
runs on one worker, and receives its job's ``Chunk`` / ``Done`` / ``Failed`` messages as events
on its own asyncio queue. The HTTP side adds ``ClientGone`` and ``TimedOut`` itself. A worker
that dies (even SIGKILL) closes its pipe: the reader sees EOF, the ticket gets ``WorkerDied``,
and a replacement starts. A worker that neither finishes nor dies within
``cancel_grace_seconds`` of a cancel is killed. Tickets and worker handles: service/handles.py.
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
from typing import Any

from service.capacity import capacity
from service.handles import Ticket, WorkerHandle
from service.metrics import Metrics
from service.protocol import (
    CancelJob,
    Chunk,
    Cloned,
    Done,
    Failed,
    Fatal,
    Finish,
    FromWorker,
    Job,
    Ready,
    RunJob,
    StepDone,
    StopWorker,
    TextIn,
    TicketState,
    WorkerDied,
    WorkerState,
)
from service.refusals import PoolDraining, PoolFull, PoolNotReady
from service.settings import Settings
from service.worker import worker_main

log = logging.getLogger("qtts.pool")
_ALIVE = (WorkerState.IDLE, WorkerState.BUSY)


class WorkerPool:
    """``settings.workers`` processes behind a queue of ``settings.queue_size``;
    ``max_frames_cap`` is the server's longest audio in the model's frames."""

    def __init__(self, settings: Settings, metrics: Metrics, max_frames_cap: int) -> None:
        self.settings = settings
        self.max_frames_cap = max_frames_cap
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
        opts = self.settings.worker_options(index, self.max_frames_cap)
        proc = self._ctx.Process(target=worker_main, name=f"qtts-worker-{index}",
                                 args=(child, cancel, opts), daemon=True)
        proc.start()
        child.close()  # only the worker holds its end: its death is our EOF
        w = WorkerHandle(index=index, process=proc, conn=parent, cancel=cancel,
                         slots=self.settings.max_batch)
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
            t.push(Failed(t.job.id, 503, None, "server shutting down"))
        self._waiting.clear()
        workers = [w for w in self._workers if w is not None]
        for w in workers:
            try:
                if w.state is WorkerState.BUSY:
                    w.cancel.value = next(iter(w.tickets), -1)
                    if w.slots > 1:
                        for job_id in w.tickets:
                            w.conn.send(CancelJob(job_id))
                w.conn.send(StopWorker())
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
            w is not None and w.state in _ALIVE for w in self._workers
        ):
            raise PoolNotReady(self.last_fatal)
        free = self._free_worker(job)
        if free is None and len(self._waiting) >= self.settings.queue_size:
            raise PoolFull
        t = Ticket(job=job)
        self._waiting.append(t)
        self._dispatch()
        self._update_gauges()
        return t

    def cancel(self, t: Ticket) -> None:
        """Stop a ticket's work: drop it from the queue (its events get a cancelled ``Done``:
        no worker will answer it), or tell its worker between chunks."""
        if t.state is TicketState.WAITING:
            if t in self._waiting:
                self._waiting.remove(t)
            t.state = TicketState.FINISHED
            t.finished_at = time.monotonic()
            t.push(Done(t.job.id, Finish.CANCELLED, 0, 0.0))  # no worker will answer it
            self._update_gauges()
        elif t.state is TicketState.RUNNING and t.worker is not None:
            if t.cancel_requested_at is None:
                t.cancel_requested_at = time.monotonic()
                t.worker.cancel.value = t.job.id
                if t.worker.slots > 1:  # a batching worker reads its pipe between steps
                    try:
                        t.worker.conn.send(CancelJob(t.job.id))
                    except (OSError, ValueError):
                        pass  # it died: the reader reports the exit to the ticket

    def send_text(self, t: Ticket, msg: TextIn) -> None:
        """More text for a live job: to its worker now, or when it leaves the queue."""
        if t.state is TicketState.WAITING:
            t.hold(msg)
        elif t.state is TicketState.RUNNING and t.worker is not None:
            try:
                t.worker.conn.send(msg)
            except (OSError, ValueError):
                pass  # it died: the reader reports the exit to the ticket

    def _free_worker(self, job: Job) -> WorkerHandle | None:
        # The worker with the fewest jobs that may take this one (WorkerHandle.takes); among
        # idle ones the one that has waited longest: sequential requests go round the workers,
        # so every one stays warm (its pages, caches and graphs in use) instead of the first
        # taking all the work while the others go cold. Any warm worker answers as fast.
        free = [w for w in self._workers if w is not None and w.takes(job)]
        return min(free, key=lambda w: (len(w.tickets), w.idle_since)) if free else None

    def _dispatch(self) -> None:
        while self._waiting:
            # first come, first served: a job that must run alone waits for an empty worker,
            # and the jobs behind it wait with it
            w = self._free_worker(self._waiting[0].job)
            if w is None:
                return
            t = self._waiting.popleft()
            t.state = TicketState.RUNNING
            t.started_at = time.monotonic()
            t.worker = w
            w.state = WorkerState.BUSY
            w.tickets[t.job.id] = t
            try:
                w.conn.send(RunJob(t.job))
                for msg in t.outbox:
                    w.conn.send(msg)
                t.outbox.clear()
            except (OSError, ValueError):
                # it died between its last message and now: the reader will report the exit
                pass
        self._update_gauges()

    # ---- worker messages -------------------------------------------------------------------
    def _on_message(self, w: WorkerHandle, msg: FromWorker) -> None:
        match msg:
            case Ready():
                self._on_ready(w, msg)
            case Fatal(message=message):
                self.last_fatal = message
                log.error("worker %d failed to start: %s", w.index, message)
            case Chunk() | Done() | Failed() | Cloned():
                self._on_job_message(w, msg)
            case StepDone():
                self.metrics.observe_step(msg.batch, msg.talker, msg.code_predictor,
                                          msg.decoder)
                return
        self._update_gauges()

    def _on_ready(self, w: WorkerHandle, msg: Ready) -> None:
        w.info = msg
        w.state = WorkerState.IDLE
        w.idle_since = time.monotonic()
        self._start_failures[w.index] = 0
        self.last_fatal = None
        self.backend = self.backend or msg.backend
        log.info("worker %d ready (pid %s, backend %s, load %.2fs, warm-up %.2fs)",
                 w.index, w.pid, msg.backend, msg.load_seconds, msg.warmup_seconds)
        self._dispatch()

    def _on_job_message(self, w: WorkerHandle, msg: Chunk | Done | Failed | Cloned) -> None:
        t = w.tickets.get(msg.job_id)
        if t is None:
            return  # a late message of a ticket already given up
        t.push(msg)
        if isinstance(msg, Chunk):
            return
        t.state = TicketState.FINISHED
        t.finished_at = time.monotonic()
        del w.tickets[msg.job_id]
        w.jobs_done += 1
        if not self.stopping:
            if not w.tickets:
                w.state = WorkerState.IDLE
                w.idle_since = time.monotonic()
            self._dispatch()

    def _on_exit(self, w: WorkerHandle) -> None:
        if self._workers[w.index] is not w:
            return
        was_ready = w.state in _ALIVE
        w.state = WorkerState.DEAD
        code = w.process.exitcode
        tickets = list(w.tickets.values())
        w.tickets.clear()
        for t in tickets:  # every job of a dead worker ends as an error
            if t.state is TicketState.RUNNING:
                t.state = TicketState.FINISHED
                t.finished_at = time.monotonic()
                t.push(WorkerDied(code))
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
                if w is None or w.state is WorkerState.DEAD:
                    continue
                stuck_cancel = w.state is WorkerState.BUSY and any(
                    t.cancel_requested_at is not None
                    and now - t.cancel_requested_at > s.cancel_grace_seconds
                    for t in w.tickets.values())
                stuck_start = (w.state is WorkerState.STARTING
                               and now - w.started_at > s.worker_start_timeout)
                if (stuck_cancel or stuck_start) and w.process.is_alive():
                    log.error("worker %d (pid %s) unresponsive: killing it", w.index, w.pid)
                    try:
                        os.kill(w.pid, 9)  # type: ignore[arg-type]
                    except OSError:
                        pass

    # ---- state -----------------------------------------------------------------------------
    def _update_gauges(self) -> None:
        alive = sum(1 for w in self._workers if w is not None and w.state in _ALIVE)
        busy = self.busy
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
            w is not None and w.state in _ALIVE for w in self._workers
        )

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> int:
        """Requests running on the workers now."""
        return sum(len(w.tickets) for w in self._workers if w is not None)

    def describe(self) -> list[dict[str, Any]]:
        return [
            {"index": i, "pid": w.pid, "state": str(w.state), "jobs_done": w.jobs_done,
             "running": len(w.tickets), "decoder_snr_db": w.info and w.info.decoder_snr_db}
            if w is not None else {"index": i, "pid": None, "state": "absent", "jobs_done": 0,
                                   "running": 0, "decoder_snr_db": None}
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
