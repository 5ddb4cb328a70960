"""The front end's records of one request in the pool (``Ticket``) and of one worker process
(``WorkerHandle``). The pool's event loop is the only writer of both."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from service.protocol import Job, Ready, TicketEvent, TicketState, WorkerState


@dataclass(eq=False)
class Ticket:
    """One request's life in the pool."""

    job: Job
    enqueued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    finished_at: float | None = None
    worker: WorkerHandle | None = None
    state: TicketState = TicketState.WAITING
    cancel_requested_at: float | None = None
    events: asyncio.Queue[TicketEvent] = field(default_factory=asyncio.Queue)

    @property
    def queue_seconds(self) -> float | None:
        return None if self.started_at is None else self.started_at - self.enqueued_at

    def push(self, event: TicketEvent) -> None:
        self.events.put_nowait(event)


@dataclass(eq=False)
class WorkerHandle:
    """One worker process, its pipe end and its shared cancel word."""

    index: int
    process: Any
    conn: Any
    cancel: Any  # multiprocessing.Value('q'): id of the job to cancel
    state: WorkerState = WorkerState.STARTING
    ticket: Ticket | None = None
    info: Ready | None = None
    started_at: float = field(default_factory=time.monotonic)
    jobs_done: int = 0

    @property
    def pid(self) -> int | None:
        return self.process.pid  # type: ignore[no-any-return]
