"""Why the worker pool takes no job: each refusal carries its code, which the routes answer
(503 with it) and count as the rejection metric's label."""

from __future__ import annotations


class PoolRefused(Exception):
    """The pool took no job: ``reason`` is the refusal's code and its rejection metric's label."""

    reason = ""


class PoolFull(PoolRefused):
    """Every worker is busy and the queue is full."""

    reason = "queue_full"


class PoolDraining(PoolRefused):
    """The server is shutting down and takes no new work."""

    reason = "draining"


class PoolNotReady(PoolRefused):
    """No worker is alive and the last start failed: waiting would not help."""

    reason = "not_ready"
