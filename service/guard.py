"""The outer error middleware (only ``HeadAsGet`` wraps it): an error nothing else answered still
gets a proper answer.

Starlette answers an unhandled exception with a 500 and then re-raises it to the server, which
logs the traceback a second time and drops the keep-alive connection; the 500 itself carries no
request id, and no request line or counter records it. Here the exception stops: the client
gets our JSON error body with ``X-Request-Id`` (when no byte of the response went out yet;
after that only closing the connection can say it), the log gets one traceback and, for the
synthesis routes, the usual request line (outcome ``error``, status 500), and
``qtts_internal_errors_total`` (plus ``qtts_requests_total{outcome="error"}`` for synthesis
routes) counts it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import ApiError
from service.logs import REQUEST_LOGGER

log = logging.getLogger("qtts.app")
reqlog = logging.getLogger(REQUEST_LOGGER)



class TrackedSend:
    """An ASGI ``send`` that remembers whether the response has started (after that an error
    can only cut the transfer, not answer with a status)."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self.send(message)

class ErrorGuard:
    """Catch what the app raised (see the module docstring). ``metrics()`` returns the
    server's ``Metrics`` (None before startup); ``synth_routes`` get a request line."""

    def __init__(self, app: ASGIApp, metrics: Callable[[], Any],
                 synth_routes: tuple[str, ...] = ()) -> None:
        self.app = app
        self.metrics = metrics
        self.synth_routes = synth_routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrival = time.monotonic()
        send_tracked = TrackedSend(send)
        try:
            await self.app(scope, receive, send_tracked)
        except Exception:
            path = str(scope.get("path", ""))
            state = scope.setdefault("state", {})
            rid = str(state.get("request_id") or uuid.uuid4().hex)
            log.exception("unhandled error on %s %s (request %s)", scope.get("method"), path,
                          rid)
            m = self.metrics()
            if m is not None:
                m.internal_errors.labels(route=path if path in self.synth_routes
                                         else "other").inc()
            if path in self.synth_routes:
                if m is not None:
                    m.requests.labels(route=path, outcome="error").inc()
                reqlog.info(
                    "%s error %s", path, rid,
                    extra={"id": rid, "route": path, "status": 500, "outcome": "error",
                           "duration_seconds": round(time.monotonic() - arrival, 4),
                           "response_started": send_tracked.started},
                )
            if not send_tracked.started:
                err = ApiError(500, "internal server error", code="internal_error")
                await err.response(rid)(scope, receive, send)
