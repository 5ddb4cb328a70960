"""What the gate middleware learnt about a request, for the routes."""

from __future__ import annotations

import time
import uuid

from fastapi import Request


def request_context(request: Request) -> tuple[str, float]:
    """The request id and arrival time the gate set (fresh ones when it did not run)."""
    sc = request.scope.get("state", {})
    return sc.get("request_id") or uuid.uuid4().hex, sc.get("arrival") or time.monotonic()
