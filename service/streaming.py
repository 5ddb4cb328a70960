"""The response of a synthesis route: queue the job, relay the worker's chunks, encode, account.

``SynthesisResponse`` is an ASGI response that submits its job when the server starts to answer,
so a refusal by the pool (full, draining, no worker) is still a clean 503 JSON. A streamed answer
sends each chunk as it arrives (raw audio, or OpenAI's SSE events); a whole-file answer collects
the chunks and sends one body with ``Content-Length``. Errors before the first byte are JSON;
after it, the only honest signal left is an incomplete transfer.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from typing import Any

import numpy as np
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from service.audio import CONTENT_TYPES, Encoder, TimeStretch, encode_whole, make_encoder
from service.errors import ApiError
from service.fields import api_field
from service.guard import TrackedSend
from service.handles import Ticket
from service.logs import round_or_none
from service.playback import PlaybackClock
from service.protocol import (
    Chunk,
    ClientGone,
    Done,
    Failed,
    Finish,
    TicketEvent,
    TicketState,
    TimedOut,
    WorkerDied,
)
from service.refusals import PoolDraining, PoolFull, PoolRefused
from service.request_log import finish_log
from service.state import State
from service.validation import Synthesis

log = logging.getLogger("qtts.app")
SSE_CONTENT_TYPE = "text/event-stream"
# nginx's code for "client closed the request before any response": what the request line says
# when the client left before the status line went out
CLIENT_CLOSED = 499


class _Abort(Exception):
    """End a started stream without completing it: the client sees an incomplete transfer."""


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def sse_delta(payload: bytes) -> bytes:
    """OpenAI's ``speech.audio.delta`` event carrying encoded audio."""
    return _sse({"type": "speech.audio.delta", "audio": base64.b64encode(payload).decode()})


def sse_done(syn: Synthesis, frame_rate: float) -> bytes:
    """OpenAI's closing ``speech.audio.done`` event: text tokens in, codec frames out; and under
    ``qtts`` this request's own numbers (queue, first audio, synthesis time, real-time factor,
    seconds per engine stage), which the playground page shows."""
    gen_seconds = syn.frames / frame_rate
    rtf = syn.synth_seconds / gen_seconds if syn.synth_seconds and gen_seconds > 0 else None
    return _sse({
        "type": "speech.audio.done",
        "usage": {"input_tokens": syn.text_tokens, "output_tokens": syn.frames,
                  "total_tokens": syn.text_tokens + syn.frames},
        "qtts": {
            "request_id": syn.request_id, "frames": syn.frames,
            "audio_seconds": round(syn.audio_seconds_out, 4),
            "queue_seconds": round_or_none(syn.queue_seconds),
            "ttfa_seconds": round_or_none(syn.ttfa),
            "synth_seconds": round_or_none(syn.synth_seconds),
            "rtf": round_or_none(rtf),
            "stages": {k: round(v, 6) for k, v in sorted(syn.stages.items())},
        },
    })


class SynthesisResponse(Response):
    """Runs one synthesis: queue, worker events, encoding, chunked or whole-file answer."""

    def __init__(self, st: State, syn: Synthesis) -> None:
        super().__init__()
        self.st = st
        self.syn = syn
        self.ticket: Ticket | None = None
        self.client_gone = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        st, syn = self.st, self.syn
        try:
            self.ticket = st.pool.submit(syn.job)
        except PoolRefused as e:
            await self._refused(e, scope, receive, send)
            return
        watcher = asyncio.create_task(self._watch_disconnect(receive))
        send_tracked = TrackedSend(send)
        try:
            await self._run(scope, receive, send_tracked)
        except _Abort:
            pass  # returning without the final empty chunk makes uvicorn drop the connection
        except OSError:  # the client went away while we were writing
            if syn.outcome == "ok":
                syn.outcome = "client_gone"
        except asyncio.CancelledError:  # shutdown deadline passed with this request running
            if syn.outcome == "ok":
                syn.outcome = "timeout"
            raise
        finally:
            watcher.cancel()
            if self.ticket is not None and self.ticket.state is not TicketState.FINISHED:
                st.pool.cancel(self.ticket)
            if syn.outcome == "client_gone" and not send_tracked.started:
                syn.status = CLIENT_CLOSED  # no status line ever went out: never log a 200
            finish_log(st, syn, admitted=True)

    async def _refused(self, e: PoolRefused, scope: Scope, receive: Receive, send: Send) -> None:
        st, syn = self.st, self.syn
        reason = e.reason
        msg = {PoolFull: "all workers are busy and the queue is full; retry later",
               PoolDraining: "server is shutting down"}.get(type(e), f"no worker could start: {e}")
        st.metrics.rejections.labels(reason=reason).inc()
        err = ApiError(503, msg, code=reason,
                       headers={"Retry-After": str(st.settings.retry_after_seconds)})
        syn.outcome, syn.status = "rejected", 503
        await err.response(syn.request_id)(scope, receive, send)
        finish_log(st, syn, admitted=False)

    async def _watch_disconnect(self, receive: Receive) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                self.client_gone = True
                if self.ticket is not None:
                    self.ticket.push(ClientGone())
                    self.st.pool.cancel(self.ticket)
                return

    async def _next(self) -> TicketEvent:
        assert self.ticket is not None
        remaining = self.syn.arrival + self.st.settings.request_timeout - time.monotonic()
        if remaining <= 0:
            return TimedOut()
        try:
            return await asyncio.wait_for(self.ticket.events.get(), remaining)
        except TimeoutError:
            return TimedOut()

    def _head(self, content_type: str, length: int | None = None) -> list[tuple[bytes, bytes]]:
        syn = self.syn
        h = [
            (b"content-type", content_type.encode()),
            (b"x-request-id", syn.request_id.encode()),
            (b"x-sample-rate", str(self.st.model.sample_rate).encode()),
            (b"x-audio-format", syn.fmt.encode()),
            (b"cache-control", b"no-cache"),
        ]
        if length is not None:
            h.append((b"content-length", str(length).encode()))
        else:
            h.append((b"x-accel-buffering", b"no"))
        return h

    async def _error_before_start(
        self, scope: Scope, receive: Receive, send: Send, ev: TicketEvent
    ) -> None:
        """An event that ends the request before any byte of the response went out."""
        syn = self.syn
        match ev:
            case TimedOut():
                syn.outcome, syn.status = "timeout", 504
                err = ApiError(504, f"request took longer than "
                               f"{self.st.settings.request_timeout:g} s", code="timeout")
            case WorkerDied():
                syn.outcome, syn.status = "worker_died", 503
                err = ApiError(503, "the worker synthesizing this request died; retry",
                               code="worker_died",
                               headers={"Retry-After": str(self.st.settings.retry_after_seconds)})
            case Failed():
                syn.status = ev.status
                syn.outcome = "rejected" if ev.status < 500 else "error"
                if ev.status < 500:
                    self.st.metrics.rejections.labels(reason="invalid").inc()
                code = ev.code or ("invalid_value" if ev.status < 500 else "synthesis_failed")
                # (the engine names text/instruct; the OpenAI route's client sent input/...)
                field, message = api_field(syn.route, ev.field, ev.message)
                err = ApiError(ev.status, message, field=field, code=code)
            case _:  # the client left: nobody to answer
                syn.outcome = "client_gone"
                return
        await err.response(syn.request_id)(scope, receive, send)

    def _account(self, ev: Chunk) -> np.ndarray[Any, Any]:
        """Observe a chunk's stage timings; return its audio."""
        self.st.metrics.observe_stages(ev.timings, ev.frames)
        self.syn.frames += ev.frames
        for stage, seconds in ev.timings.items():
            if seconds >= 0:
                self.syn.stages[stage] = self.syn.stages.get(stage, 0.0) + float(seconds)
        return np.asarray(ev.audio, dtype=np.float32)

    def _encode(self, encoder: Encoder, audio: np.ndarray[Any, Any], final: bool) -> bytes:
        """Encode (and count as sent) one piece of audio; ``final`` flushes the encoder."""
        t0 = time.perf_counter()
        payload = encoder.encode(audio) if len(audio) else b""
        if final:
            payload += encoder.finish()
        self.st.metrics.stage_seconds.labels(stage="encode").observe(time.perf_counter() - t0)
        dur = len(audio) / self.st.model.sample_rate  # handed to the encoder: plays once sent
        self.syn.audio_seconds_out += dur
        self.st.metrics.audio_seconds.inc(dur)
        return payload

    def _first_audio(self) -> None:
        syn = self.syn
        if syn.ttfa is None:
            syn.ttfa = time.monotonic() - syn.arrival
            self.st.metrics.ttfa.observe(syn.ttfa)

    async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
        st, syn = self.st, self.syn
        assert self.ticket is not None
        ev = await self._next()
        syn.queue_seconds = self.ticket.queue_seconds
        if syn.queue_seconds is not None:
            st.metrics.queue_seconds.observe(syn.queue_seconds)
        if not isinstance(ev, Chunk | Done):
            await self._error_before_start(scope, receive, send, ev)
            return
        rate = st.model.sample_rate
        stretch = TimeStretch(syn.speed, rate) if syn.speed != 1.0 else None
        if syn.stream:
            await self._stream(send, ev, stretch)
        else:
            await self._whole(scope, receive, send, ev, stretch)

    async def _stream(self, send: Send, ev: TicketEvent, stretch: TimeStretch | None) -> None:
        st, syn = self.st, self.syn
        encoder: Encoder = make_encoder(syn.fmt, st.model.sample_rate)
        content_type = SSE_CONTENT_TYPE if syn.sse else encoder.content_type
        await send({"type": "http.response.start", "status": 200,
                    "headers": self._head(content_type)})
        player = PlaybackClock()  # the stream-gap count: a client playing as it receives
        try:
            while isinstance(ev, Chunk):
                waited = player.wait(time.monotonic())
                if waited > 0.0:
                    syn.gaps += 1
                    syn.gap_seconds += waited
                    st.metrics.count_stall(waited)
                audio = self._account(ev)
                if stretch is not None:
                    audio = stretch.push(audio)
                payload = self._encode(encoder, audio, final=False)
                if payload:
                    body = sse_delta(payload) if syn.sse else payload
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    if not player.started:
                        self._first_audio()
                if payload or player.started:
                    player.hand_over(time.monotonic(), len(audio) / st.model.sample_rate)
                ev = await self._next()
            if not isinstance(ev, Done):
                self._ended_mid_stream(ev)
                raise _Abort
            tail = stretch.flush() if stretch is not None else np.zeros(0, np.float32)
            payload = self._encode(encoder, tail, final=True)
            body = sse_delta(payload) if syn.sse and payload else payload
            self._finished(ev)
            if syn.sse:
                body += sse_done(syn, st.model.frame_rate)
            if ev.finish is Finish.CANCELLED:
                raise _Abort
            self._first_audio()
            await send({"type": "http.response.body", "body": body, "more_body": False})
        finally:
            if hasattr(encoder, "close"):
                encoder.close()

    async def _whole(self, scope: Scope, receive: Receive, send: Send, ev: TicketEvent,
                     stretch: TimeStretch | None) -> None:
        st, syn = self.st, self.syn
        parts: list[np.ndarray[Any, Any]] = []
        while isinstance(ev, Chunk):
            parts.append(self._account(ev))
            ev = await self._next()
        if not isinstance(ev, Done):
            await self._error_before_start(scope, receive, send, ev)
            return
        self._finished(ev)
        if syn.outcome in ("client_gone", "timeout"):
            if syn.outcome == "timeout":
                await self._error_before_start(scope, receive, send, TimedOut())
            return
        audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        if stretch is not None:
            audio = np.concatenate([stretch.push(audio), stretch.flush()])
        t0 = time.perf_counter()
        data = await asyncio.to_thread(encode_whole, syn.fmt, audio, st.model.sample_rate)
        st.metrics.stage_seconds.labels(stage="encode").observe(time.perf_counter() - t0)
        ctype = CONTENT_TYPES[syn.fmt]
        self._first_audio()  # (before the done event, which reports it)
        if syn.sse:
            syn.audio_seconds_out = len(audio) / st.model.sample_rate
            data = sse_delta(data) + sse_done(syn, st.model.frame_rate)
            ctype = SSE_CONTENT_TYPE
        await send({"type": "http.response.start", "status": 200,
                    "headers": self._head(ctype, len(data))})
        await send({"type": "http.response.body", "body": data, "more_body": False})
        dur = len(audio) / st.model.sample_rate
        syn.audio_seconds_out = dur
        st.metrics.audio_seconds.inc(dur)

    def _finished(self, done: Done) -> None:
        syn = self.syn
        syn.synth_seconds = done.seconds or None
        syn.text_tokens = done.text_tokens
        if done.finish is Finish.TRUNCATED_NO_EOS:
            syn.outcome = "truncated_no_eos"
        elif done.finish is Finish.CANCELLED:
            syn.outcome = "client_gone" if self.client_gone else "timeout"

    def _ended_mid_stream(self, ev: TicketEvent) -> None:
        syn = self.syn
        match ev:
            case ClientGone():
                syn.outcome = "client_gone"
            case TimedOut():
                syn.outcome = "timeout"
            case WorkerDied():
                syn.outcome = "worker_died"
            case _:
                syn.outcome = "error"
        log.warning("request %s ended mid-stream: %s", syn.request_id, syn.outcome)
