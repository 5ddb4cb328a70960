"""Test-only fault injection in the worker processes: ``QTTS_TEST_FAULT``.

The fault tests need a worker that really raises, hangs, exits or is slow, so that the front
end's real handling (500s, incomplete transfers, start backoff, the watchdog, drain limits) is
exercised without mocks. Never set this in production: it breaks requests on purpose.

Syntax ``ACTION@POINT``:

* ACTION: ``raise`` (a RuntimeError), ``exit`` (``os._exit(3)``), ``hang`` (sleeps forever,
  deaf to cancels), ``sleep=SECONDS`` (a slow worker);
* POINT: ``start`` (while the worker loads), ``chunk=N`` (before sending chunk N of a job,
  counted from 0), ``chunk`` (before every chunk; meant for ``sleep``), ``done`` (after a
  job's last chunk, before its end is sent), ``clone`` (a clone job's voice is made, before it
  is sent), ``text=N`` (a batching worker takes the text of its live job N, counted from 0: a
  fault of that session's own, inside the batch).

Examples: ``raise@start``, ``raise@chunk=0``, ``hang@chunk=2``, ``sleep=0.2@chunk``,
``sleep=2@done``, ``raise@text=1``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

ENV = "QTTS_TEST_FAULT"
ACTIONS = ("raise", "exit", "hang", "sleep")


class InjectedFault(RuntimeError):
    """The error a ``raise`` fault throws."""


@dataclass(frozen=True)
class Fault:
    action: str
    point: str  # "start", "chunk", "done", "clone" or "text"
    chunk: int | None = None  # the chunk or live job; None: every one
    seconds: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> Fault:
        action, sep, point = spec.strip().partition("@")
        if not sep:
            raise ValueError(f"{ENV}={spec!r}: expected ACTION@POINT")
        seconds = 0.0
        if action.startswith("sleep="):
            action, seconds = "sleep", float(action.split("=", 1)[1])
        if action not in ACTIONS:
            raise ValueError(f"{ENV}={spec!r}: action must be one of {', '.join(ACTIONS)}")
        chunk: int | None = None
        if point.startswith(("chunk=", "text=")):
            point, n = point.split("=", 1)
            chunk = int(n)
        if point not in ("start", "chunk", "done", "clone", "text"):
            raise ValueError(
                f"{ENV}={spec!r}: point must be start, chunk, chunk=N, done, clone or text=N")
        return cls(action, point, chunk, seconds)

    def hit(self, point: str, chunk: int | None = None) -> None:
        """Act if this fault is set for ``point`` (and chunk index)."""
        if point != self.point or (self.chunk is not None and chunk != self.chunk):
            return
        if self.action == "raise":
            raise InjectedFault(f"{ENV}: injected failure at {point} {chunk}")
        if self.action == "exit":
            os._exit(3)
        if self.action == "sleep":
            time.sleep(self.seconds)
            return
        while True:  # hang
            time.sleep(3600)


def from_env() -> Fault | None:
    """The fault named by ``QTTS_TEST_FAULT``, or None (the normal case)."""
    spec = os.environ.get(ENV, "")
    return Fault.parse(spec) if spec else None
