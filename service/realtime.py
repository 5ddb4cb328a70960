"""The realtime session protocol: client messages, their validation, the session settings and
the utterance's bookkeeping (what ``WS /v1/tts/realtime`` in service/routes/realtime.py speaks).

Client -> server, one JSON object per text message (docs/service.md, Realtime)::

    {"type": "session", "voice": ..., "language": ..., "instruct": ..., "format": "pcm",
     "seed": ..., "temperature": ..., "top_k": ..., "top_p": ..., "repetition_penalty": ...,
     "start": "immediate" | "auto" | N}
    {"type": "text", "text": "..."}      a delta of any size
    {"type": "flush"}                    speak what is buffered now
    {"type": "end"}                      end of this utterance's text
    {"type": "cancel"}                   stop this utterance now

A message that is not one of these is a ``ProtocolError``: the route answers an ``error`` event
naming the field and closes with 1008 (or 1003 for a binary message); a ``session`` message
while text is being written is only refused (``session_busy``: the session goes on).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import WebSocket
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from starlette.websockets import WebSocketState

from engine.errors import quoted
from service.errors import ApiError
from service.fields import field_path, long_number
from service.playback import PlaybackClock
from service.schemas import Body, Sampling, Text, Voice, VoiceRef, check_unicode

CLOSE_UNSUPPORTED = 1003  # a binary message: the protocol is JSON text
CLOSE_POLICY = 1008  # a malformed or unknown message, a bad key, a limit
CLOSE_TRY_AGAIN = 1013  # every worker busy and the queue full
ENCODING = {"encoding": "pcm_s16le", "sample_rate": 24000, "channels": 1}
# the audio of format "opus": one Ogg Opus stream per utterance (the model's 24 kHz, mono)
OPUS_ENCODING = {"encoding": "ogg_opus", "sample_rate": 24000, "channels": 1}
FLUSH_SECONDS = 5.0  # a closing session's last events, then its close frame, wait this long each
MAX_START_TOKENS = 2048  # a start later than a whole text's tokens would wait for its end


class ProtocolError(Exception):
    """A client message the session cannot take: the error event's code, field, message, and
    the close code the session ends with (0: only this message is refused, the session and
    its utterance go on)."""

    def __init__(self, code: str, field: str | None, message: str,
                 close: int = CLOSE_POLICY) -> None:
        super().__init__(message)
        self.code, self.field, self.message, self.close = code, field, message, close

    def event(self) -> dict[str, Any]:
        return {"type": "error", "code": self.code, "field": self.field, "message": self.message}

    @classmethod
    def of(cls, e: ApiError) -> ProtocolError:
        """An HTTP route's refusal as the session's: the server's own trouble (a 5xx: a voice
        store that is down) closes "try again later", the client's closes 1008."""
        return cls(e.code or "invalid_value", e.field, e.message,
                   close=CLOSE_TRY_AGAIN if e.status >= 500 else CLOSE_POLICY)


def _start_form(v: object) -> object:
    # one error that names every form (a union reports only its first member's complaint)
    if v in ("immediate", "auto") or (
            type(v) is int and 1 <= v <= MAX_START_TOKENS):  # (not a bool: True == 1)
        return v
    raise ValueError(f'must be "immediate", "auto" or a number of tokens 1..{MAX_START_TOKENS}')


class SessionSettings(Sampling):
    """A ``session`` message: the settings of the utterances that follow it."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["session"]
    voice: Voice = None  # a name, or {"id": ...} as the HTTP routes take it
    language: Text | None = None
    instruct: Text | None = None
    format: Literal["pcm", "opus"] = Field(
        default="pcm", description="pcm: s16le 24 kHz mono; opus: one Ogg Opus stream per "
        "utterance, its pages as they are encoded")
    start: Annotated[Literal["immediate", "auto"] | int, BeforeValidator(_start_form)] = Field(
        default="auto", description="immediate: speak from the first stable token; auto: the "
        f"server's default (N tokens or a punctuation mark); N (1..{MAX_START_TOKENS}): after "
        "N tokens")

    @property
    def voice_name(self) -> str | None:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice

    @property
    def audio(self) -> dict[str, Any]:
        """The audio these settings send, as ``session.started`` and ``session.updated`` say."""
        return OPUS_ENCODING if self.format == "opus" else ENCODING


class TextDelta(Body):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str  # (its Unicode is checked by the session's ``PairJoiner``: halves may come apart)


class Control(Body):
    model_config = ConfigDict(extra="forbid")
    type: Literal["flush", "end", "cancel"]


Message = SessionSettings | TextDelta | Control
_KINDS: dict[str, type[BaseModel]] = {
    "session": SessionSettings, "text": TextDelta, "flush": Control, "end": Control,
    "cancel": Control,
}


# the messages of the error events the server sends of its own accord (no field: nothing the
# client sent is wrong)
_SERVER_ERRORS = {
    "draining": "the server is restarting and its drain limit (QTTS_DRAIN_SECONDS) passed "
                "before this utterance was done",
    "idle_timeout": "session idle too long",
    "session_limit": "session reached its time limit",
    "worker_died": "the worker synthesizing this utterance died",
}


def server_error(code: str, message: str | None = None) -> dict[str, Any]:
    """An ``error`` event of the server's own (``message``: where it is not a fixed one)."""
    return {"type": "error", "code": code, "field": None,
            "message": message or _SERVER_ERRORS[code]}


class PairJoiner:
    """Text deltas as JavaScript cuts strings: ``s.slice()`` and ``s[i]`` count UTF-16 units, so
    a delta may end inside a surrogate pair (an emoji) and the next begin with its second half.
    A delta's trailing high surrogate waits for the next one and the halves are joined; any
    other lone surrogate is refused, as the HTTP routes refuse it."""

    def __init__(self) -> None:
        self.high = ""

    def take(self, text: str) -> str:
        text = self.high + text
        self.high = text[-1] if text and "\ud800" <= text[-1] <= "\udbff" else ""
        text = text[:len(text) - len(self.high)]
        with contextlib.suppress(UnicodeDecodeError):  # (a lone one stays, and is named below)
            text = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le")
        return self._checked(text)

    def finish(self, check: bool = True) -> None:
        """At a flush or an end (``check``: a first half still waiting has no second), or a
        cancel (the half goes with its text)."""
        high, self.high = self.high, ""
        if check:
            self._checked(high)

    @staticmethod
    def _checked(text: str) -> str:
        try:
            check_unicode(text)
            return text
        except ValueError as e:
            raise ProtocolError("invalid_value", "text", f"text: {e}") from None


def parse(raw: str) -> Message:
    """One client text message, or a ``ProtocolError`` naming what is wrong."""
    try:
        obj = json.loads(raw)
    except ValueError as e:
        number = long_number(e)
        if number is not None:
            raise ProtocolError("invalid_value", None, f"the message {number}") from None
        raise ProtocolError("invalid_json", None, f"not JSON: {e}") from None
    except RecursionError:
        raise ProtocolError("invalid_json", None, "not JSON: nested too deep") from None
    if not isinstance(obj, dict):
        raise ProtocolError("invalid_message", None, "a message must be a JSON object")
    kind = obj.get("type")
    model = _KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ProtocolError("unknown_type", "type",
                            f"unknown message type {quoted(kind)}; one of {', '.join(_KINDS)}")
    try:
        return model.model_validate(obj)  # type: ignore[return-value]
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(field_path(err["loc"])) or None
        msg = str(err["msg"]).removeprefix("Value error, ")
        raise ProtocolError("invalid_value", where, f"{where}: {msg}") from None


@dataclass(frozen=True)
class NextSettings:
    """A ``session`` message sent after an utterance's ``end``, checked when it came (its
    stored voice looked up): it applies once that utterance is done, in order with the text
    around it, as text after an ``end`` starts the next utterance."""

    settings: SessionSettings
    clone: Any  # the stored voice it names (service.voices.api.CloneUse), or None


# messages a session may hold for its next utterance while one is spoken (``Backlog``)
MAX_BACKLOG = 256


class Backlog(list[TextDelta | Control | NextSettings]):
    """The next utterance's messages, sent after an utterance's ``end`` while it is still
    spoken, in order. Kept compact, so that a client cannot grow the session's memory by
    flooding it: adjacent text is merged, a control repeating the one before it is dropped
    (a second flush, end or cancel in a row says nothing more), and text, flush, text, flush
    is text, flush (replayed at once, the worker takes them as one update); past
    ``MAX_BACKLOG`` entries the session is refused."""

    def add(self, m: TextDelta | Control | NextSettings) -> None:
        last = self[-1] if self else None
        if isinstance(m, TextDelta) and isinstance(last, TextDelta):
            self[-1] = TextDelta.model_construct(type="text", text=last.text + m.text)
            return
        if isinstance(m, Control) and isinstance(last, Control) and m.type == last.type:
            return
        if (isinstance(m, Control) and m.type == "flush" and len(self) >= 3
                and isinstance(last, TextDelta) and self[-2] == m
                and isinstance(self[-3], TextDelta)):
            self[-3:] = [TextDelta.model_construct(type="text", text=self[-3].text + last.text),
                         m]
            return
        if len(self) >= MAX_BACKLOG:
            raise ProtocolError("too_many_messages", None, f"more than {MAX_BACKLOG} messages "
                                "wait for the utterance being spoken to end")
        self.append(m)

    def has_text(self) -> bool:
        return any(isinstance(m, TextDelta) for m in self)


def lost_connection(code: int | None, sender: asyncio.Task[None] | None, speaking: bool
                    ) -> str | None:
    """What the log says of a session whose connection ended under it: a close frame with an
    abnormal ``code`` or none (1006), or a send that failed (``sender``'s exception: a client
    that stopped reading is cut by the WebSocket keepalive, 20 s without a pong); None for a
    client that closed normally between utterances."""
    error = None if sender is None or sender.cancelled() else sender.exception()
    if error is not None:
        return f"the connection failed while audio was sent ({type(error).__name__}: {error})"
    if code in (1000, 1001) and not speaking:
        return None
    if code == 1009:  # (the WebSocket layer's close: ``max_message_bytes``)
        return "a client message was over the size limit (close 1009)"
    return (f"the client's connection closed (code {code})"
            + (" while an utterance was spoken" if speaking else ""))


async def close_session(ws: WebSocket, sender: asyncio.Task[None], close: tuple[int, str]
                        ) -> None:
    """The end of a session whose output queue has its end mark: its last events go out (the
    sender ends), then the close frame (``close``: code and reason; code 0: the connection is
    gone), each waiting at most ``FLUSH_SECONDS`` for a client that does not read: such a client
    cannot hold the session (then the socket just closes)."""
    if close[0] and not sender.done():
        with contextlib.suppress(asyncio.TimeoutError, Exception):
            await asyncio.wait_for(sender, FLUSH_SECONDS)
    sender.cancel()
    if close[0] and ws.client_state is WebSocketState.CONNECTED:
        with contextlib.suppress(asyncio.TimeoutError, Exception):
            await asyncio.wait_for(ws.close(code=close[0], reason=close[1]), FLUSH_SECONDS)


def cut_short(close: tuple[int, str], lost: bool) -> str:
    """The outcome of an utterance the session's end cut short (``close``: the session's close
    code and reason, 0 where the connection was already gone): ``client_gone`` where the client
    left or did not read its audio (``lost``), ``timeout`` at the session's time limit or the
    drain's, else ``cancelled`` (the client broke the protocol)."""
    if lost or close[0] == 0:
        return "client_gone"
    return "timeout" if close[1] in ("session_limit", "drain_limit") else "cancelled"


def session_busy() -> ProtocolError:
    """A ``session`` message while an utterance's text is still being written: refused, the
    utterance goes on."""
    return ProtocolError("session_busy", "type", "session settings may change only between "
                         "utterances (after an utterance's end); these were not taken",
                         close=0)


def min_tokens(start: Literal["immediate", "auto"] | int, default: int) -> int:
    """The start policy as the engine's ``min_tokens``."""
    if start == "immediate":
        return 1
    if start == "auto":
        return default
    return max(1, int(start))


@dataclass
class Utterance:
    """One utterance of a session, from its first text delta to its ``done``."""

    job_id: int
    first_text_at: float = field(default_factory=time.monotonic)
    end_at: float | None = None  # when the client's end (or cancel) arrived
    chars: int = 0
    frames: int = 0
    samples: int = 0
    chunks: int = 0
    held: float = 0.0  # seconds of audio the encoder holds back (Ogg pages), not yet queued
    dropped: int = 0  # chunks not sent: made, or waiting for the socket, when it was cancelled
    first_audio_at: float | None = None
    last_audio_at: float | None = None
    ended: bool = False  # the client sent end: later text is the next utterance's
    cancelled: bool = False
    flushed: bool = False  # the last message to the worker was a flush (another adds nothing)
    player: PlaybackClock = field(default_factory=PlaybackClock)
    gaps: int = 0  # stalls once all the text had arrived (see ``stall``)
    gap_seconds: float = 0.0  # how long the listener waited in them

    def stall(self, now: float) -> float:
        """How long the listener waited for a chunk that comes at ``now``, counted here when
        that stall is the server's (else 0.0): the client's audio ran out after its whole text
        had arrived. Before the end of the text a stall may be the text's (the session waits
        for more of it), so it is not counted."""
        waited = self.player.wait(now)
        if (waited > 0.0 and not self.cancelled and self.end_at is not None
                and self.end_at <= now - waited):
            self.gaps += 1
            self.gap_seconds += waited
            return waited
        return 0.0

    def usage(self, sample_rate: int, outcome: str) -> dict[str, Any]:
        return {"characters": self.chars, "frames": self.frames,
                "audio_seconds": round(self.samples / sample_rate, 4), "stream_gaps": self.gaps,
                "stream_gap_seconds": round(self.gap_seconds, 4), "outcome": outcome}
