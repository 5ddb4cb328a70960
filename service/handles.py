"""The front end's records of one request in the pool (``Ticket``) and of one worker process
(``WorkerHandle``). The pool's event loop is the only writer of both."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from service.protocol import (
    Job,
    Ready,
    TextIn,
    TicketEvent,
    TicketState,
    WorkerState,
    batchable,
)


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
    outbox: list[TextIn] = field(default_factory=list)  # live text sent while it waited

    @property
    def queue_seconds(self) -> float | None:
        return None if self.started_at is None else self.started_at - self.enqueued_at

    def push(self, event: TicketEvent) -> None:
        self.events.put_nowait(event)

    def hold(self, msg: TextIn) -> None:
        """Keep live text sent while the job waits, merged where its worker sees no difference:
        text joins the text before it until a flush or end, and a message that adds nothing (no
        text, or a flush right after a flush) is dropped. A client's flood then costs at most
        one entry per flushed piece of its text (which the session caps)."""
        last = self.outbox[-1] if self.outbox else None
        if not msg.text and not msg.end and (not msg.flush or (last is not None and last.flush)):
            return
        if last is not None and not (last.flush or last.end):
            self.outbox[-1] = TextIn(msg.job_id, last.text + msg.text, msg.flush, msg.end)
            return
        self.outbox.append(msg)


@dataclass(eq=False)
class WorkerHandle:
    """One worker process, its pipe end and its shared cancel word."""

    index: int
    process: Any
    conn: Any
    cancel: Any  # multiprocessing.Value('q'): id of the job to cancel
    slots: int = 1  # text jobs it runs at once (settings.max_batch)
    state: WorkerState = WorkerState.STARTING
    tickets: dict[int, Ticket] = field(default_factory=dict)  # running jobs by id
    info: Ready | None = None
    started_at: float = field(default_factory=time.monotonic)
    jobs_done: int = 0
    idle_since: float = 0.0  # when it last became idle (dispatch picks the longest idle)

    def takes(self, job: Job) -> bool:
        """Whether it may start ``job`` now: a free slot, and a job that must run alone (codes,
        a one-shot reference: the batch loop runs them to their end) only on an empty worker,
        and nothing beside one."""
        if self.state not in (WorkerState.IDLE, WorkerState.BUSY):
            return False
        if not self.tickets:
            return True
        alone = any(not batchable(t.job) for t in self.tickets.values())
        return not alone and batchable(job) and len(self.tickets) < self.slots

    @property
    def pid(self) -> int | None:
        return self.process.pid  # type: ignore[no-any-return]
