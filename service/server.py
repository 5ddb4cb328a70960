"""The uvicorn server qtts runs: connection timeouts and a drain that a load balancer can see.

Timeouts (settings ``header_timeout``, ``keepalive_timeout``; the body timeout is the gate's):

* a connection must complete a request's headers within ``header_timeout`` seconds of opening
  or of its previous response: one that sends nothing, or headers a byte at a time, is closed
  (with ``408`` when it had sent part of a request). uvicorn has no such timer: its keep-alive
  timer only runs between requests and stops at the first byte received.
* after a response an idle keep-alive connection is closed after ``keepalive_timeout``.

Drain (SIGTERM or SIGINT): first ``/readyz`` answers 503 and new synthesis requests 503
``draining`` while the listener stays open, for at least ``shutdown_delay_seconds`` (so a load
balancer probing readiness takes the instance out) and until the in-flight requests finish, at
most ``drain_seconds`` in all; then the listener closes, idle connections are closed, the
workers stop. The process exits 0 after a clean drain, 1 when requests were still running at
the deadline. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import uuid
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.errors import error_body
from service.realtime_handshake import max_message_bytes
from service.settings import Settings

log = logging.getLogger("qtts.app")

_UNREADABLE = error_body(
    400, "request: not an HTTP/1.1 request this server can read (a malformed request line or "
    "header, or headers over h11's size limit)", code="bad_request")


def _closing_answer(status: int, reason: bytes, body: dict[str, Any]) -> bytes:
    """A whole response written straight to the transport where uvicorn has no request cycle
    to answer through: the JSON shape and request id of every other error, then close."""
    data = json.dumps(body, separators=(",", ":")).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nx-request-id: %s\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
            % (status, reason, uuid.uuid4().hex.encode(), len(data), data))


def timed_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for each request's headers."""

    class TimedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _got_bytes = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            self._got_bytes = self._got_bytes or bool(data)
            super().data_received(data)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            # a request's headers are complete, or they were a WebSocket upgrade (the
            # connection now belongs to the WebSocket protocol: no cycle, no response here)
            if self.cycle is not cycle or self.transport.get_protocol() is not self:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            idle = self.cycle is None or self.cycle.response_complete
            if idle and not self.transport.is_closing():
                self._got_bytes = False
                self._arm()

        def send_400_response(self, msg: str) -> None:
            # uvicorn answers bytes h11 cannot read as a request in plain text; every other
            # error of this server is JSON with a request id
            self._disarm()
            self.transport.write(_closing_answer(400, b"Bad Request", _UNREADABLE))
            self.transport.close()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout, self._on_header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self._got_bytes:  # part of a request: say why it ends (as the gate's body 408)
                self.transport.write(_closing_answer(408, b"Request Timeout", error_body(
                    408, f"request headers not received within {header_timeout:g} s",
                    field="headers", code="request_timeout")))
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
            self.transport.close()

    return TimedH11Protocol


# between the drain deadline and cutting the connections still streaming: enough for the
# sockets of finished responses to flush
CUT_GRACE_SECONDS = 1


class QttsServer(uvicorn.Server):
    """uvicorn's server with the drain of the module docstring."""

    def __init__(self, config: uvicorn.Config, settings: Settings, app: Any) -> None:
        super().__init__(config)
        self.settings = settings
        self.app = app
        self.drain_task: asyncio.Task[None] | None = None
        self.draining = False
        self.clean = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        st = getattr(self.app.state, "qtts", None)
        if not self.draining and st is not None and not self.should_exit:
            self.draining = True
            st.pool.draining = True
            log.info("signal %s: draining (readiness 503 now; the listener closes when the "
                     "in-flight requests are done, after %gs at least and %gs at most)",
                     sig, self.settings.shutdown_delay_seconds, self.settings.drain_seconds)
            # (a signal handler runs between two steps of the loop: hand it the task safely)
            loop = asyncio.get_event_loop()
            loop.call_soon_threadsafe(self._start_drain, st)
            return
        if self.draining and not self.should_exit:
            self.clean = False  # a second signal cuts the drain short
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signals it caught once it has stopped, which turns a clean
        # shutdown into exit status 143 (SIGTERM); our exit status says how the drain went
        self._captured_signals = [s for s in self._captured_signals
                                  if s not in (signal.SIGTERM, signal.SIGINT)]

    def _start_drain(self, st: Any) -> None:
        st.drain_begun.set()
        self.drain_task = asyncio.get_running_loop().create_task(self._drain(st))

    async def _drain(self, st: Any) -> None:
        s = self.settings
        t0 = time.monotonic()
        await asyncio.sleep(min(s.shutdown_delay_seconds, s.drain_seconds))
        left = max(0.0, s.drain_seconds - (time.monotonic() - t0))
        self.clean = await st.pool.wait_idle(left)
        if not self.clean:
            log.warning("drain: requests still running after %gs; stopping anyway",
                        s.drain_seconds)
            st.drain_over.set()
            # the sessions it wakes say why and close before uvicorn cuts their connections
            until = time.monotonic() + CUT_GRACE_SECONDS
            while st.sessions and time.monotonic() < until:
                await asyncio.sleep(0.02)
        self.should_exit = True


def make_server(app: Any, settings: Settings) -> QttsServer:
    """The configured server for ``app`` (``create_app(settings)``)."""
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_config=None, access_log=False,
        lifespan="on", http=timed_protocol(settings.header_timeout),
        timeout_keep_alive=settings.keepalive_timeout, ws_max_size=max_message_bytes(settings),
        # once the drain is over, requests past the deadline are cut: uvicorn cancels them
        # after this grace (a stream at its deadline must not run on for seconds)
        timeout_graceful_shutdown=CUT_GRACE_SECONDS,
    )
    return QttsServer(config, settings, app)
