"""``WS /v1/tts/realtime``: speak text while it is still being written (an LLM's answer).

One WebSocket is a session of utterances. Text deltas go to a worker as they arrive (a live
job: service/protocol.py ``TextIn``); the engine feeds them to the talker one token per frame
and pauses when the text runs dry (engine/talker/live.py). Audio goes back as binary frames of
s16le 24 kHz mono PCM, each announced by an ``audio`` event with its timings. Messages and
events: service/realtime.py and docs/service.md (Realtime).

The gate middleware lets WebSocket connections through, so the handshake is checked here
(service/realtime_handshake.py): the key as a bearer ``Authorization`` header, or a
``bearer.KEY`` entry of ``Sec-WebSocket-Protocol`` (what a browser can set), never the URL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

import numpy as np
from fastapi import APIRouter, WebSocket
from starlette.websockets import WebSocketDisconnect

from engine.talker.prompt import has_speech
from service import realtime_handshake as handshake
from service.audio import Encoder, make_encoder
from service.errors import ApiError
from service.gate import request_id
from service.handles import Ticket
from service.metrics import REALTIME_ROUTE
from service.outbox import Outbox
from service.protocol import Chunk, Done, Failed, Finish, TextIn, TimedOut, WorkerDied
from service.realtime import (
    CLOSE_POLICY,
    CLOSE_TRY_AGAIN,
    CLOSE_UNSUPPORTED,
    Backlog,
    Control,
    NextSettings,
    PairJoiner,
    ProtocolError,
    SessionSettings,
    TextDelta,
    Utterance,
    close_session,
    cut_short,
    lost_connection,
    min_tokens,
    parse,
    server_error,
    session_busy,
)
from service.refusals import PoolRefused
from service.request_log import finish_utterance, refuse_utterance
from service.state import State
from service.validation import SynthesisInput, validate
from service.voices.api import CloneUse, clone_use
from service.voices.owners import owner_of

router = APIRouter()
log = logging.getLogger("qtts.realtime")
CLOSE_RESTART = 1012  # the server is restarting: reconnect


@router.websocket(REALTIME_ROUTE)
async def realtime(ws: WebSocket) -> None:
    st: State = ws.app.state.qtts
    rid = request_id(ws.headers.get("x-request-id", ""))
    owner = owner_of(st.owners, handshake.bearer_token(ws.headers) if st.owners else "")
    refusal = handshake.refusal(owner is not None, ws.headers, st.settings, st.pool.draining)
    if refusal is not None:  # no key or a wrong one, a page of a foreign origin, a drain
        st.metrics.rejections.labels(reason=refusal[0]).inc()
        await handshake.refuse(ws, refusal[1], rid)
        return
    assert owner is not None  # (refused above)
    await ws.accept(subprotocol=handshake.subprotocol(ws.headers))
    st.metrics.realtime_sessions.inc()
    session = Session(st, ws, owner, rid)
    st.sessions.add(session)
    try:
        await session.run()
    finally:
        st.sessions.discard(session)
        st.metrics.realtime_sessions.dec()


class Session:
    """One connection: its settings, its current utterance, its output (``Outbox``)."""

    def __init__(self, st: State, ws: WebSocket, owner: str, rid: str) -> None:
        self.st, self.ws, self.owner, self.id = st, ws, owner, rid  # id: its log lines
        self.settings = SessionSettings(type="session")
        self.clone: CloneUse | None = None  # the cloned voice the settings name (by id)
        self.opened = time.monotonic()
        self.chars = 0
        self.pairs = PairJoiner()  # text deltas cut inside a surrogate pair (JavaScript)
        self.utt: Utterance | None = None
        self.ticket: Ticket | None = None
        self.backlog = Backlog()  # the next utterance's messages
        self.sample_rate = st.model.sample_rate
        self.out = Outbox(ws, st.settings.realtime_max_buffered_seconds,
                          st.metrics.audio_seconds.inc)
        self.encoder: Encoder = make_encoder("pcm", self.sample_rate)

    # ---- the session -------------------------------------------------------------------------
    async def run(self) -> None:
        s = self.st.settings
        self.out.event({"type": "session.started", "id": self.id, "audio": self.settings.audio,
                        "start_default_tokens": s.realtime_min_tokens})
        sender = asyncio.create_task(self.out.run())
        recv: asyncio.Task[Any] | None = None
        event: asyncio.Task[Any] | None = None
        # between utterances a drain closes the session at once (it would otherwise wait for
        # the client's next text, which a draining pool refuses)
        drain = asyncio.ensure_future(self.st.drain_begun.wait())
        drain_over = asyncio.ensure_future(self.st.drain_over.wait())
        close: tuple[int, str] = (1000, "")
        lost: str | None = None  # why the connection ended under the session, for the log
        try:
            while True:
                if sender.done():  # the client went away while we were sending
                    close = (1000, "")
                    lost = lost_connection(None, sender, self.ticket is not None)
                    break
                if recv is None:
                    recv = asyncio.ensure_future(self.ws.receive())
                if event is None and self.ticket is not None:
                    event = asyncio.ensure_future(self.ticket.events.get())
                if self.ticket is None and self.st.pool.draining:
                    close = (CLOSE_RESTART, "server draining")
                    break
                waits: set[asyncio.Future[Any]] = {recv, sender, drain_over}
                if event is not None:
                    waits.add(event)
                if self.ticket is None:
                    waits.add(drain)
                idle = s.realtime_idle_seconds if self.ticket is None else None
                left = s.realtime_max_seconds - (time.monotonic() - self.opened)
                timeout = min(x for x in (idle, left) if x is not None)
                done, _ = await asyncio.wait(waits, timeout=max(0.0, timeout),
                                             return_when=asyncio.FIRST_COMPLETED)
                if self.st.drain_over.is_set():  # (its waiter above wakes the wait)
                    self.out.event(server_error("draining"))
                    self._cancel()
                    close = (CLOSE_RESTART, "drain_limit")
                    break
                if not done:
                    code = "idle_timeout" if idle is not None and idle <= left else "session_limit"
                    self.out.event(server_error(code))
                    self._cancel()
                    close = (1000, code)
                    break
                if event in done:
                    assert event is not None
                    self._on_event(event.result())
                    event = None
                    if self.ticket is None and self.st.pool.draining:
                        close = (CLOSE_RESTART, "server draining")
                        break
                if recv in done:
                    msg = recv.result()
                    recv = None
                    if msg["type"] == "websocket.disconnect":
                        self._cancel()
                        close = (0, "")
                        lost = lost_connection(msg.get("code"), None, self.ticket is not None)
                        break
                    try:
                        await self._on_client(msg)
                    except ProtocolError as e:
                        self._refuse(e)
                if self.out.too_slow:
                    self._cancel()
                    self.out.drop()  # what the client did not read
                    self.out.event(server_error("client_too_slow", "the client did not read its "
                                   f"audio: more than {s.realtime_max_buffered_seconds:g} s were "
                                   "waiting"))
                    close = (CLOSE_POLICY, "client reads too slowly")
                    log.warning("realtime session closed: the client reads too slowly (more "
                                "than %g s of audio waiting)", s.realtime_max_buffered_seconds)
                    break
        except ProtocolError as e:
            self.out.event(e.event())
            self._cancel()
            close = (e.close, e.code)
        except WebSocketDisconnect:
            self._cancel()
            close = (0, "")
        finally:
            for task in (recv, event, drain, drain_over):
                if task is not None:
                    task.cancel()
        if lost is not None:
            log.warning("realtime session ended: %s", lost)
        if self.utt is not None:  # cut short with the session: it sends no done
            self._log(cut_short(close, lost is not None or self.out.too_slow))
        self.out.close()
        await close_session(self.ws, sender, close)

    # ---- client messages -----------------------------------------------------------------------
    async def _on_client(self, msg: dict[str, Any]) -> None:
        if msg.get("bytes") is not None:
            raise ProtocolError("binary_message", None, "messages are JSON text; audio is only "
                                "sent by the server", close=CLOSE_UNSUPPORTED)
        m = parse(msg.get("text") or "")
        if isinstance(m, SessionSettings):
            if self.utt is not None and not (self.utt.ended or self.utt.cancelled):
                raise session_busy()
            try:  # a stored voice's id: the caller's own, made for this model
                clone = await clone_use(self.st, self.owner, m.voice_name)
            except ApiError as e:
                raise ProtocolError.of(e) from None
            self._job(m, "x", clone)
            if self.utt is not None:  # the one before is still spoken: the next one's
                self.backlog.add(NextSettings(m, clone))
            else:
                self._apply(NextSettings(m, clone))
            return
        if isinstance(m, TextDelta):
            m = TextDelta(type="text", text=self.pairs.take(m.text))
            self._count(m.text)
        else:
            self.pairs.finish(check=m.type != "cancel")
        if self.utt is not None and (self.utt.ended or self.utt.cancelled):
            if isinstance(m, Control) and m.type == "cancel" and not self.backlog.has_text():
                self._apply(m)  # no next utterance yet: it stops the one still speaking
                return
            self.backlog.add(m)  # belongs to the next utterance
            return
        self._apply(m)

    def _refuse(self, e: ProtocolError) -> None:
        """One message refused, the session going on; an error that ends it goes up."""
        if e.close:
            raise e
        self.out.event(e.event())

    def _apply(self, m: TextDelta | Control | NextSettings) -> None:
        if isinstance(m, TextDelta):
            self._text(m.text)
            return
        if isinstance(m, NextSettings):
            if self.utt is not None:  # (the next utterance's text came before it)
                raise session_busy()
            self.settings, self.clone = m.settings, m.clone
            self.out.event({"type": "session.updated", "audio": m.settings.audio,
                            "settings": m.settings.model_dump(exclude={"type"})})
            return
        if self.utt is None or self.ticket is None:
            # nothing to flush, end or cancel: no text yet, or the model already finished
            # speaking (its done event may cross the client's end on the wire)
            return
        if m.type == "cancel":
            self.utt.cancelled = True
            self.utt.end_at = time.monotonic()
            self.st.pool.cancel(self.ticket)
            if self.settings.format == "pcm":  # (Ogg pages are numbered: a stream keeps them)
                for gone in self.out.drop_audio(self.utt.job_id):
                    self.utt.frames -= gone.frames
                    self.utt.samples -= gone.samples
                    self.utt.dropped += 1
            return
        if m.type == "end":
            self.utt.ended = True
            self.utt.end_at = time.monotonic()
        elif self.utt.flushed:
            return  # a flush after a flush: nothing new to speak (a flood stays here)
        self.utt.flushed = m.type == "flush"
        self.st.pool.send_text(self.ticket, TextIn(self.utt.job_id, flush=m.type == "flush",
                                                   end=m.type == "end"))

    def _count(self, text: str) -> None:
        # the session's text cap, counted as text comes (held for a next utterance too)
        self.chars += len(text)
        if self.chars > (cap := self.st.settings.realtime_max_chars):
            raise ProtocolError("too_long", "text", f"the session sent more than {cap} "
                                "characters")

    def _text(self, text: str) -> None:
        if self.ticket is None:
            self._start(text)
        elif text:  # (an empty delta adds nothing: a flood of them stays here)
            assert self.utt is not None
            self.utt.flushed = False
            self.st.pool.send_text(self.ticket, TextIn(self.utt.job_id, text=text))
        assert self.utt is not None
        self.utt.chars += len(text)

    def _job(self, m: SessionSettings, text: str, clone: CloneUse | None) -> Any:
        inp = SynthesisInput(
            # (a first delta only starts the text, often with whitespace: the end tells)
            route=REALTIME_ROUTE, request_id="", arrival=time.monotonic(),
            text=text if has_speech(text) else "x",
            text_field="text", codes=None, voice=m.voice_name, language=m.language,
            instruct=m.instruct, fmt="pcm", stream=True, sse=False, speed=1.0, max_seconds=None,
            sampling=m, text_mode="stream", clone=clone)
        try:
            return validate(self.st, inp).job
        except ApiError as e:
            raise ProtocolError.of(e) from None

    def _start(self, text: str) -> None:
        s = self.st.settings
        job = replace(self._job(self.settings, text, self.clone), text=text, live=True,
                      min_tokens=min_tokens(self.settings.start, s.realtime_min_tokens))
        try:
            self.ticket = self.st.pool.submit(job)
        except PoolRefused as e:
            refuse_utterance(self.st, self.id, e.reason)
            raise ProtocolError(e.reason, None, "no worker free for a realtime session; retry "
                                "later", close=CLOSE_TRY_AGAIN) from None
        self.utt = Utterance(job_id=job.id)
        self.encoder = make_encoder(self.settings.format, self.sample_rate)
        self.out.event({"type": "utterance.started", "id": job.id})

    def _log(self, outcome: str) -> None:
        assert self.utt is not None
        finish_utterance(self.st, self.id, self.utt, outcome, self.settings.format,
                         self.settings.voice_name)

    def _cancel(self) -> None:
        if self.ticket is not None:
            self.st.pool.cancel(self.ticket)

    # ---- worker events -------------------------------------------------------------------------
    def _on_event(self, ev: Any) -> None:
        utt = self.utt
        assert utt is not None
        match ev:
            case Chunk(audio=audio, timings=timings, frames=frames):
                self.st.metrics.observe_stages(timings, frames)
                if utt.cancelled:  # made before the worker saw the cancel: not for a listener
                    utt.dropped += 1  # who interrupted
                    return
                now = time.monotonic()
                if utt.first_audio_at is None:
                    utt.first_audio_at = now
                    ttfa = now - utt.first_text_at
                    self.st.metrics.realtime_ttfa.observe(ttfa)
                    self.out.event({"type": "audio.first", "id": utt.job_id,
                                    "text_to_first_audio_ms": round(ttfa * 1000, 1)})
                utt.last_audio_at = now
                self.st.metrics.count_stall(utt.stall(now))
                utt.player.hand_over(now, audio.shape[0] / self.sample_rate)
                utt.frames += frames
                utt.samples += int(audio.shape[0])
                utt.chunks += 1
                announce = {"type": "audio", "id": utt.job_id, "seq": utt.chunks - 1,
                            "frames": frames, "samples": int(audio.shape[0]),
                            "timings_ms": {k: round(v * 1000, 2) for k, v in timings.items()}}
                data = self.encoder.encode(np.asarray(audio, dtype=np.float32))
                utt.held += audio.shape[0] / self.sample_rate
                if data:
                    self.out.audio(data, utt.held, announce, utt.job_id, frames,
                                   int(audio.shape[0]))
                    utt.held = 0.0
                else:  # an encoder that holds the audio back (Ogg pages)
                    self.out.event(announce)
                return
            case Done(finish=finish, guessed=guessed, refuted=refuted):
                if guessed:
                    self.st.metrics.realtime_guesses.labels("made").inc(guessed)
                if refuted:
                    self.st.metrics.realtime_guesses.labels("refuted").inc(refuted)
                # a cancel that came after the whole utterance was sent stopped nothing
                cut = utt.cancelled and (utt.dropped or finish == Finish.CANCELLED)
                outcome = "cancelled" if cut else str(finish)
                self._end(outcome)
            case Failed(field=fld, message=message, code=code):
                self.out.event({"type": "error", "code": code or "synthesis_failed", "field": fld,
                                "message": message})
                self._end("error")
            case WorkerDied() | TimedOut():
                self.out.event(server_error("worker_died"))
                # (counted and logged as the HTTP routes count it; its done says error)
                self._end("worker_died", said="error")

    def _end(self, outcome: str, said: str | None = None) -> None:
        utt = self.utt
        assert utt is not None
        tail = self.encoder.finish()
        if tail:
            self.out.audio(tail, utt.held)
        self._log(outcome)
        self.out.event({"type": "done", "id": utt.job_id,
                        "usage": utt.usage(self.sample_rate, said or outcome)})
        self.utt, self.ticket = None, None
        backlog, self.backlog = self.backlog, Backlog()
        for m in backlog:
            if self.utt is not None and (self.utt.ended or self.utt.cancelled):
                self.backlog.append(m)
            else:
                try:
                    self._apply(m)
                except ProtocolError as e:
                    self._refuse(e)
