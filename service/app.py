"""The FastAPI app: routes, validation against the model, the streaming response, metrics, logs.

``create_app(settings)`` builds the app; its lifespan opens the model's metadata (the front
end never computes) and starts the worker pool. See docs/service.md for the API.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import importlib.util
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive, Scope, Send

from service.audio import (
    CONTENT_TYPES,
    Encoder,
    TimeStretch,
    encode_whole,
    make_encoder,
    stream_wanted,
)
from service.errors import ApiError, error_body
from service.logs import REQUEST_LOGGER, round_or_none
from service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from service.metrics import Metrics
from service.pool import PoolDraining, PoolFull, PoolNotReady, Ticket, WorkerPool
from service.schemas import Job, Sampling, SpeechRequest, TTSRequest
from service.settings import FRAME_RATE, SAMPLE_RATE, Settings

VERSION = "0.1.0"
SYNTH_ROUTES = ("/tts", "/v1/audio/speech")
API_PREFIXES = ("/tts", "/v1/")
log = logging.getLogger("qtts.app")
reqlog = logging.getLogger(REQUEST_LOGGER)
_REQ_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


@dataclass
class ModelInfo:
    """What the front end knows about the model (read once from the GGUF header)."""

    path: str
    parts: frozenset[str]
    synthetic: bool
    speakers: list[str]
    languages: list[str]
    model_type: str
    text_ready: bool  # the engine has a text pipeline for this model

    @classmethod
    def load(cls, path: str) -> ModelInfo:
        from engine.gguf_model import open_model

        m = open_model(path)
        try:
            parts = frozenset(m.parts)
            return cls(
                path=str(path),
                parts=parts,
                synthetic=bool(m.synthetic),
                speakers=sorted(m.speakers),
                languages=sorted(m.languages),
                model_type=str(getattr(m, "tts_model_type", "") or ""),
                text_ready="talker" in parts
                and importlib.util.find_spec("engine.pipeline") is not None,
            )
        finally:
            m.close()


@dataclass
class State:
    settings: Settings
    metrics: Metrics
    pool: WorkerPool
    model: ModelInfo


# ---- validation against settings and model ---------------------------------------------------


def _bad(field: str, message: str, status: int = 400, code: str = "invalid_value") -> ApiError:
    return ApiError(status, f"{field}: {message}", field=field, code=code)


def _check_sampling(s: Settings, req: Sampling) -> dict[str, Any]:
    caps = {"temperature": s.max_temperature, "top_k": s.max_top_k,
            "repetition_penalty": s.max_repetition_penalty}
    out: dict[str, Any] = {}
    for name in ("seed", "temperature", "top_k", "top_p", "repetition_penalty"):
        v = getattr(req, name)
        if v is None:
            continue
        cap = caps.get(name)
        if cap is not None and v > cap:
            raise _bad(name, f"{v} is above the server cap {cap}", code="out_of_range")
        out[name] = v
    return out


@dataclass
class Synthesis:
    """One validated request, before and while it runs."""

    route: str
    request_id: str
    job: Job
    fmt: str
    stream: bool
    sse: bool
    speed: float
    voice: str | None
    chars: int
    arrival: float
    # measured
    queue_seconds: float | None = None
    ttfa: float | None = None
    frames: int = 0
    audio_seconds_out: float = 0.0
    synth_seconds: float | None = None
    outcome: str = "ok"
    status: int = 200
    gaps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def build_synthesis(
    st: State, route: str, request_id: str, arrival: float, *,
    text: str | None, text_field: str, codes: list[list[int]] | None, voice: str | None,
    language: str | None, instruct: str | None, fmt: str, stream: bool, sse: bool,
    speed: float, max_seconds: float | None, sampling: dict[str, Any],
) -> Synthesis:
    s, m = st.settings, st.model
    if max_seconds is not None and max_seconds > s.max_audio_seconds:
        raise _bad("max_seconds", f"{max_seconds} is above the server limit "
                   f"{s.max_audio_seconds} s", code="out_of_range")
    limit_s = min(max_seconds or s.max_audio_seconds, s.max_audio_seconds)
    max_frames = max(1, int(limit_s * FRAME_RATE))
    if voice is not None and m.speakers:
        canonical = {v.lower(): v for v in m.speakers}.get(voice.lower())
        if canonical is None:
            raise _bad("voice", f"unknown voice {voice!r}; valid voices: "
                       f"{', '.join(m.speakers)}", code="unknown_voice")
        voice = canonical
    if language is not None and m.languages:
        if language.lower() not in [*m.languages, "auto"]:
            raise _bad("language", f"unknown language {language!r}; valid languages: auto, "
                       f"{', '.join(m.languages)}", code="unknown_language")
        language = language.lower()
    if codes is not None:
        if text:
            raise _bad(text_field, f"send either {text_field} or codes, not both")
        arr = np.asarray(codes, dtype=np.int32)
        if arr.shape[1] > s.max_frames:
            raise _bad("codes", f"{arr.shape[1]} frames ({arr.shape[1] / FRAME_RATE:g} s) exceed "
                       f"the server limit of {s.max_audio_seconds:g} s", code="too_long")
        job = Job(id=st.pool.new_job_id(), kind="codes", codes=arr, max_frames=max_frames,
                  chunk_max_frames=s.chunk_max_frames)
        chars = 0
    else:
        if text is None or not text.strip():
            raise _bad(text_field, "is empty: give text to speak (or codes [16][T])",
                       code="empty")
        if len(text) > s.max_text_chars:
            raise _bad(text_field, f"{len(text)} characters; the limit is {s.max_text_chars}",
                       code="too_long")
        if "talker" not in m.parts:
            raise _bad(text_field, "this model has no talker (decoder-only GGUF); send codes",
                       status=422, code="no_talker")
        if not m.text_ready:
            raise _bad(text_field, "text synthesis is not available in this build yet (the "
                       "engine has no text pipeline); send codes", status=422,
                       code="text_unavailable")
        job = Job(id=st.pool.new_job_id(), kind="text", text=text, voice=voice,
                  language=language, instruct=instruct, sampling=sampling,
                  max_frames=max_frames, chunk_max_frames=s.chunk_max_frames)
        chars = len(text)
    return Synthesis(route=route, request_id=request_id, job=job, fmt=fmt, stream=stream,
                     sse=sse, speed=speed, voice=voice, chars=chars, arrival=arrival)


# ---- the response --------------------------------------------------------------------------


class _Abort(Exception):
    """End a started stream without completing it: the client sees an incomplete transfer."""


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
        except (PoolFull, PoolDraining, PoolNotReady) as e:
            reason, msg = {
                PoolFull: ("queue_full", "all workers are busy and the queue is full; retry later"),
                PoolDraining: ("draining", "server is shutting down"),
                PoolNotReady: ("not_ready", f"no worker could start: {e}"),
            }[type(e)]
            st.metrics.rejections.labels(reason=reason).inc()
            err = ApiError(503, msg, code=reason,
                           headers={"Retry-After": str(st.settings.retry_after_seconds)})
            syn.outcome, syn.status = "rejected", 503
            await err.response(syn.request_id)(scope, receive, send)
            _finish_log(st, syn, admitted=False)
            return
        watcher = asyncio.create_task(self._watch_disconnect(receive))
        try:
            await self._run(scope, receive, send)
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
            if self.ticket is not None and self.ticket.state != "finished":
                st.pool.cancel(self.ticket)
            _finish_log(st, syn, admitted=True)

    async def _watch_disconnect(self, receive: Receive) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                self.client_gone = True
                if self.ticket is not None:
                    self.ticket.push(("client_gone",))
                    self.st.pool.cancel(self.ticket)
                return

    async def _next(self) -> tuple[Any, ...]:
        assert self.ticket is not None
        remaining = self.syn.arrival + self.st.settings.request_timeout - time.monotonic()
        if remaining <= 0:
            return ("timeout",)
        try:
            return await asyncio.wait_for(self.ticket.events.get(), remaining)
        except TimeoutError:
            return ("timeout",)

    def _head(self, content_type: str, length: int | None = None) -> list[tuple[bytes, bytes]]:
        syn = self.syn
        h = [
            (b"content-type", content_type.encode()),
            (b"x-request-id", syn.request_id.encode()),
            (b"x-sample-rate", str(SAMPLE_RATE).encode()),
            (b"x-audio-format", syn.fmt.encode()),
            (b"cache-control", b"no-cache"),
        ]
        if length is not None:
            h.append((b"content-length", str(length).encode()))
        else:
            h.append((b"x-accel-buffering", b"no"))
        return h

    async def _error_before_start(
        self, scope: Scope, receive: Receive, send: Send, ev: tuple[Any, ...]
    ) -> None:
        """An event that ends the request before any byte of the response went out."""
        syn = self.syn
        kind = ev[0]
        if kind == "client_gone":
            syn.outcome = "client_gone"
            return
        if kind == "timeout":
            syn.outcome, syn.status = "timeout", 504
            err = ApiError(504, f"request took longer than {self.st.settings.request_timeout:g} s",
                           code="timeout")
        elif kind == "worker_died":
            syn.outcome, syn.status = "worker_died", 503
            err = ApiError(503, "the worker synthesizing this request died; retry",
                           code="worker_died",
                           headers={"Retry-After": str(self.st.settings.retry_after_seconds)})
        else:  # ("error", info)
            info = ev[1]
            status = int(info.get("status", 500))
            syn.status = status
            syn.outcome = "rejected" if status < 500 else "error"
            if status < 500:
                self.st.metrics.rejections.labels(reason="invalid").inc()
            err = ApiError(status, str(info.get("message", "synthesis failed")),
                           field=info.get("field"),
                           code="invalid_value" if status < 500 else "synthesis_failed")
        await err.response(syn.request_id)(scope, receive, send)

    def _account(self, ev: tuple[Any, ...], t_arrive: float) -> np.ndarray[Any, Any]:
        """Observe a chunk event's stage timings; return its audio."""
        _, audio, timings, frames = ev
        self.st.metrics.observe_stages(timings, int(frames))
        self.syn.frames += int(frames)
        return np.asarray(audio, dtype=np.float32)

    async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
        st, syn = self.st, self.syn
        ticket = self.ticket
        assert ticket is not None
        ev = await self._next()
        syn.queue_seconds = ticket.queue_seconds
        if syn.queue_seconds is not None:
            st.metrics.queue_seconds.observe(syn.queue_seconds)
        if ev[0] not in ("chunk", "done"):
            await self._error_before_start(scope, receive, send, ev)
            return
        stretch = TimeStretch(syn.speed) if syn.speed != 1.0 else None
        if not syn.stream:
            await self._whole(scope, receive, send, ev, stretch)
            return

        encoder: Encoder = make_encoder(syn.fmt)
        content_type = "text/event-stream" if syn.sse else encoder.content_type
        await send({"type": "http.response.start", "status": 200,
                    "headers": self._head(content_type)})
        # playback model for stream gaps: audio starts playing when its first byte is sent
        play_start: float | None = None
        sent_audio = 0.0

        async def emit(audio: np.ndarray[Any, Any]) -> None:
            nonlocal play_start, sent_audio
            t0 = time.perf_counter()
            payload = encoder.encode(audio) if len(audio) else b""
            st.metrics.stage_seconds.labels(stage="encode").observe(time.perf_counter() - t0)
            dur = len(audio) / SAMPLE_RATE  # handed to the encoder: it plays once sent
            sent_audio += dur
            syn.audio_seconds_out += dur
            st.metrics.audio_seconds.inc(dur)
            if not payload:
                return
            if syn.sse:
                body = _sse({"type": "speech.audio.delta",
                             "audio": base64.b64encode(payload).decode()})
            else:
                body = payload
            await send({"type": "http.response.body", "body": body, "more_body": True})
            now = time.monotonic()
            if syn.ttfa is None:
                syn.ttfa = now - syn.arrival
                st.metrics.ttfa.observe(syn.ttfa)
                play_start = now

        try:
            while True:
                if ev[0] == "chunk":
                    now = time.monotonic()
                    if play_start is not None and now > play_start + sent_audio:
                        syn.gaps += 1
                        st.metrics.stream_gaps.inc()
                    audio = self._account(ev, now)
                    if stretch is not None:
                        audio = stretch.push(audio)
                    await emit(audio)
                elif ev[0] == "done":
                    info = ev[1]
                    fin_audio = (stretch.flush() if stretch is not None
                                 else np.zeros(0, np.float32))
                    t0 = time.perf_counter()
                    payload = (encoder.encode(fin_audio) if len(fin_audio) else b"")
                    payload += encoder.finish()
                    st.metrics.stage_seconds.labels(stage="encode").observe(
                        time.perf_counter() - t0)
                    syn.audio_seconds_out += len(fin_audio) / SAMPLE_RATE
                    st.metrics.audio_seconds.inc(len(fin_audio) / SAMPLE_RATE)
                    body = b""
                    if payload:
                        body = (_sse({"type": "speech.audio.delta",
                                      "audio": base64.b64encode(payload).decode()})
                                if syn.sse else payload)
                    if syn.sse:
                        body += _sse({"type": "speech.audio.done", "usage": {
                            "input_tokens": syn.chars, "output_tokens": syn.frames,
                            "total_tokens": syn.chars + syn.frames}})
                    self._finished(info)
                    if info.get("finish") == "cancelled":
                        raise _Abort
                    if syn.ttfa is None:
                        syn.ttfa = time.monotonic() - syn.arrival
                        st.metrics.ttfa.observe(syn.ttfa)
                    await send({"type": "http.response.body", "body": body, "more_body": False})
                    return
                else:
                    self._ended_mid_stream(ev)
                    raise _Abort
                ev = await self._next()
        finally:
            if hasattr(encoder, "close"):
                encoder.close()

    def _finished(self, info: dict[str, Any]) -> None:
        syn = self.syn
        syn.synth_seconds = float(info.get("seconds", 0.0)) or None
        finish = info.get("finish")
        if finish == "truncated_no_eos":
            syn.outcome = "truncated_no_eos"
        elif finish == "cancelled":
            syn.outcome = "client_gone" if self.client_gone else "timeout"

    def _ended_mid_stream(self, ev: tuple[Any, ...]) -> None:
        syn = self.syn
        kind = ev[0]
        if kind == "client_gone":
            syn.outcome = "client_gone"
        elif kind == "timeout":
            syn.outcome = "timeout"
        elif kind == "worker_died":
            syn.outcome = "worker_died"
        else:
            syn.outcome = "error"
        log.warning("request %s ended mid-stream: %s", syn.request_id, syn.outcome)

    async def _whole(self, scope: Scope, receive: Receive, send: Send, ev: tuple[Any, ...],
                     stretch: TimeStretch | None) -> None:
        st, syn = self.st, self.syn
        parts: list[np.ndarray[Any, Any]] = []
        while ev[0] == "chunk":
            parts.append(self._account(ev, time.monotonic()))
            ev = await self._next()
        if ev[0] != "done":
            await self._error_before_start(scope, receive, send, ev)
            return
        self._finished(ev[1])
        if syn.outcome in ("client_gone", "timeout"):
            if syn.outcome == "timeout":
                await self._error_before_start(scope, receive, send, ("timeout",))
            return
        audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        if stretch is not None:
            audio = np.concatenate([stretch.push(audio), stretch.flush()])
        t0 = time.perf_counter()
        data = await asyncio.to_thread(encode_whole, syn.fmt, audio)
        st.metrics.stage_seconds.labels(stage="encode").observe(time.perf_counter() - t0)
        ctype = CONTENT_TYPES[syn.fmt]
        if syn.sse:
            data = (_sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
                    + _sse({"type": "speech.audio.done", "usage": {
                        "input_tokens": syn.chars, "output_tokens": syn.frames,
                        "total_tokens": syn.chars + syn.frames}}))
            ctype = "text/event-stream"
        await send({"type": "http.response.start", "status": 200,
                    "headers": self._head(ctype, len(data))})
        await send({"type": "http.response.body", "body": data, "more_body": False})
        syn.ttfa = time.monotonic() - syn.arrival
        st.metrics.ttfa.observe(syn.ttfa)
        dur = len(audio) / SAMPLE_RATE
        syn.audio_seconds_out = dur
        st.metrics.audio_seconds.inc(dur)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _finish_log(st: State, syn: Synthesis, admitted: bool) -> None:
    m = st.metrics
    m.requests.labels(route=syn.route, outcome=syn.outcome).inc()
    now = time.monotonic()
    gen_seconds = syn.frames / FRAME_RATE
    rtf = None
    if syn.synth_seconds and gen_seconds > 0 and syn.outcome in ("ok", "truncated_no_eos"):
        rtf = syn.synth_seconds / gen_seconds
        m.rtf.observe(rtf)
    if admitted:
        m.duration.observe(now - syn.arrival)
    reqlog.info(
        "%s %s %s", syn.route, syn.outcome, syn.request_id,
        extra={
            "id": syn.request_id, "route": syn.route, "status": syn.status,
            "voice": syn.voice, "chars": syn.chars, "format": syn.fmt, "stream": syn.stream,
            "frames": syn.frames, "audio_seconds": round(syn.audio_seconds_out, 3),
            "queue_seconds": round_or_none(syn.queue_seconds),
            "ttfa_seconds": round_or_none(syn.ttfa), "rtf": round_or_none(rtf),
            "duration_seconds": round(now - syn.arrival, 4), "stream_gaps": syn.gaps,
            "outcome": syn.outcome,
        },
    )


def _log_rejected(st: State, route: str, request_id: str, err: ApiError) -> None:
    reqlog.info(
        "%s rejected %s", route, request_id,
        extra={"id": request_id, "route": route, "status": err.status, "voice": None,
               "chars": 0, "audio_seconds": 0.0, "queue_seconds": None, "ttfa_seconds": None,
               "rtf": None, "outcome": "rejected", "field": err.field},
    )


# ---- middleware: auth, content type, body size -----------------------------------------------


class GateMiddleware:
    """For API routes: API key (401), JSON content type (415), body size (413), request id."""

    def __init__(self, app: Any, state_getter: Callable[[], State | None]) -> None:
        self.app = app
        self.state = state_getter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        st = self.state()
        if st is None or not path.startswith(API_PREFIXES):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = headers.get("x-request-id", "")
        if not _REQ_ID.match(rid):
            rid = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        scope["state"]["arrival"] = time.monotonic()
        route = path if path in SYNTH_ROUTES else None

        async def reject(err: ApiError, reason: str) -> None:
            assert st is not None
            st.metrics.rejections.labels(reason=reason).inc()
            if route is not None:
                st.metrics.requests.labels(route=route, outcome="rejected").inc()
                _log_rejected(st, route, rid, err)
            await err.response(rid)(scope, receive, send)

        key = st.settings.api_key
        if key:
            given = headers.get("authorization", "")
            token = given[7:].strip() if given[:7].lower() == "bearer " else ""
            token = token or headers.get("x-api-key", "")
            if not hmac.compare_digest(token.encode(), key.encode()):
                err = ApiError(401, "missing or invalid API key (Authorization: Bearer KEY)",
                               field="authorization", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
                await reject(err, "unauthorized")
                return
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            await reject(ApiError(415, f"content-type must be application/json, got "
                                  f"{ctype or 'none'!r}", field="content-type",
                                  code="unsupported_media_type"), "invalid")
            return
        limit = st.settings.max_body_bytes
        too_big = ApiError(413, f"request body is larger than {limit} bytes", field="body",
                           code="body_too_large")
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await reject(too_big, "invalid")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > limit:
                await reject(too_big, "invalid")
                return
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks),
                                  "more_body": False}]

        async def replay_receive() -> Message:
            if replay:
                return replay.pop()
            return await receive()

        await self.app(scope, replay_receive, send)


# ---- the app -------------------------------------------------------------------------------


def create_app(settings: Settings | None = None, model: ModelInfo | None = None) -> FastAPI:
    """The app; ``model`` (the GGUF's metadata) is read at startup when not given."""
    settings = settings or Settings()
    holder: dict[str, State] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        info: ModelInfo = (
            model if model is not None
            else await asyncio.to_thread(ModelInfo.load, str(settings.model))
        )
        metrics = Metrics()
        pool = WorkerPool(settings, metrics)
        st = State(settings=settings, metrics=metrics, pool=pool, model=info)
        holder["st"] = st
        app.state.qtts = st
        await pool.start()
        try:
            yield
        finally:
            pool.draining = True
            await pool.stop()

    app = FastAPI(
        title="qtts",
        version=VERSION,
        description="Streaming Qwen3-TTS on ggml. See docs/service.md.",
        lifespan=lifespan,
    )
    app.add_middleware(GateMiddleware, state_getter=lambda: holder.get("st"))

    def state() -> State:
        return holder["st"]

    # -- errors: always our JSON shape, never a traceback --
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        rid = request.scope.get("state", {}).get("request_id")
        st = holder.get("st")
        if st is not None and request.url.path in SYNTH_ROUTES:
            st.metrics.rejections.labels(reason="invalid").inc()
            st.metrics.requests.labels(route=request.url.path, outcome=exc.outcome).inc()
            _log_rejected(st, request.url.path, rid or "-", exc)
        return exc.response(rid)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        e: dict[str, Any] = dict(errs[0]) if errs else {"loc": ("body",), "msg": "invalid"}
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        field_name = loc[0] if loc else "body"
        where = ".".join(loc) or "body"
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        if e.get("type") == "json_invalid":
            field_name, where, msg = "body", "body", "is not valid JSON"
        elif e.get("type") == "extra_forbidden":
            msg = "is not a known field"
        elif e.get("type") == "literal_error" and "ctx" in e:
            msg = f"must be one of {e['ctx'].get('expected')}"
        err = ApiError(400, f"{where}: {msg}", field=field_name, code="invalid_value")
        return await _api_error(request, err)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, "internal server error"), status_code=500)

    # -- health and metadata --
    @app.get("/healthz", tags=["health"], summary="Liveness: the process serves HTTP")
    async def healthz() -> dict[str, Any]:
        st = state()
        return {"status": "ok", "workers": st.pool.describe()}

    @app.get("/readyz", tags=["health"],
             summary="Readiness: model loaded and every worker warm (503 before)")
    async def readyz() -> JSONResponse:
        st = state()
        ready = st.pool.ready
        body = {
            "status": "ready" if ready else ("draining" if st.pool.draining else "starting"),
            "workers": st.pool.describe(),
        }
        if st.pool.last_fatal and not ready:
            body["last_error"] = st.pool.last_fatal
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics", tags=["health"], summary="Prometheus metrics")
    async def metrics() -> Response:
        st = state()
        if st.pool.backend:
            st.metrics.set_build_info(VERSION, st.pool.backend, st.settings.model_name)
        return Response(st.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models", tags=["openai"], summary="The served model (OpenAI list shape)")
    async def models() -> dict[str, Any]:
        st = state()
        return {"object": "list", "data": [{
            "id": st.settings.model_name, "object": "model", "created": 0, "owned_by": "qtts",
            "parts": sorted(st.model.parts), "synthetic": st.model.synthetic,
            "model_type": st.model.model_type, "text": st.model.text_ready,
        }]}

    @app.get("/v1/audio/voices", tags=["openai"], summary="Voices and languages of the model")
    async def voices() -> dict[str, Any]:
        st = state()
        return {
            "object": "list",
            "data": [{"id": v, "name": v, "object": "voice"} for v in st.model.speakers],
            "voices": st.model.speakers,
            "languages": st.model.languages,
        }

    # -- synthesis --
    def ctx(request: Request) -> tuple[str, float]:
        sc = request.scope.get("state", {})
        return sc.get("request_id") or uuid.uuid4().hex, sc.get("arrival") or time.monotonic()

    @app.post(
        "/tts", tags=["synthesis"], response_class=Response,
        summary="Synthesize text, or decode codes [16][T]; streamed by default",
        responses={200: {"content": {t: {} for t in CONTENT_TYPES.values()},
                         "description": "audio (chunked when stream=true)"}},
    )
    async def tts(body: TTSRequest, request: Request) -> Response:
        st = state()
        rid, arrival = ctx(request)
        sampling = _check_sampling(st.settings, body)
        syn = build_synthesis(
            st, "/tts", rid, arrival, text=body.text, text_field="text", codes=body.codes,
            voice=body.voice, language=body.language, instruct=body.instruct, fmt=body.format,
            stream=stream_wanted(body.format, body.stream, "stream" in body.model_fields_set),
            sse=False, speed=body.speed, max_seconds=body.max_seconds,
            sampling=sampling,
        )
        return SynthesisResponse(st, syn)

    @app.post(
        "/v1/audio/speech", tags=["openai"], response_class=Response,
        summary="OpenAI-compatible speech (stream_format audio | sse)",
        responses={200: {"content": {**{t: {} for t in CONTENT_TYPES.values()},
                                     "text/event-stream": {}}}},
    )
    async def speech(body: SpeechRequest, request: Request) -> Response:
        st = state()
        rid, arrival = ctx(request)
        sampling = _check_sampling(st.settings, body)
        syn = build_synthesis(
            st, "/v1/audio/speech", rid, arrival, text=body.input, text_field="input",
            codes=body.codes, voice=body.voice_name, language=body.language,
            instruct=body.instructions, fmt=body.response_format,
            stream=stream_wanted(body.response_format, body.stream,
                                 "stream" in body.model_fields_set),
            sse=body.stream_format == "sse", speed=body.speed, max_seconds=body.max_seconds,
            sampling=sampling,
        )
        return SynthesisResponse(st, syn)

    @app.get("/", include_in_schema=False)
    async def root() -> PlainTextResponse:
        return PlainTextResponse("qtts: POST /tts, POST /v1/audio/speech; docs at /docs\n")

    return app

