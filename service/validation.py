"""Checks of one synthesis request against the server settings and the model, before queueing.

The pydantic bodies (service/schemas.py) check types and ranges; a route turns its body into a
``SynthesisInput`` and ``validate`` checks what needs the settings or the model (caps, voices,
languages, the talker) and returns the ``Synthesis`` the streaming response runs. A refusal is
an ``ApiError`` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.errors import ApiError
from service.protocol import Job
from service.schemas import Sampling
from service.settings import FRAME_RATE, Settings
from service.state import State


@dataclass(frozen=True)
class SynthesisInput:
    """One request as every route sees it, whatever its body looked like."""

    route: str
    request_id: str
    arrival: float
    text: str | None
    text_field: str  # the body's name of the text ("text" for /tts, "input" for OpenAI)
    codes: list[list[int]] | None
    voice: str | None
    language: str | None
    instruct: str | None
    fmt: str
    stream: bool
    sse: bool
    speed: float
    max_seconds: float | None
    sampling: Sampling


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


def bad(field: str, message: str, status: int = 400, code: str = "invalid_value") -> ApiError:
    return ApiError(status, f"{field}: {message}", field=field, code=code)


def check_sampling(s: Settings, req: Sampling) -> dict[str, Any]:
    """The sampling overrides a request gave, each within the server's cap."""
    caps = {"temperature": s.max_temperature, "top_k": s.max_top_k,
            "repetition_penalty": s.max_repetition_penalty}
    out: dict[str, Any] = {}
    for name in ("seed", "temperature", "top_k", "top_p", "repetition_penalty"):
        v = getattr(req, name)
        if v is None:
            continue
        cap = caps.get(name)
        if cap is not None and v > cap:
            raise bad(name, f"{v} is above the server cap {cap}", code="out_of_range")
        out[name] = v
    return out


def validate(st: State, inp: SynthesisInput) -> Synthesis:
    """The request as a ``Synthesis`` ready to queue, or an ``ApiError`` naming the field."""
    s, m = st.settings, st.model
    sampling = check_sampling(s, inp.sampling)
    max_seconds = inp.max_seconds
    if max_seconds is not None and max_seconds > s.max_audio_seconds:
        raise bad("max_seconds", f"{max_seconds} is above the server limit "
                  f"{s.max_audio_seconds} s", code="out_of_range")
    limit_s = min(max_seconds or s.max_audio_seconds, s.max_audio_seconds)
    max_frames = max(1, int(limit_s * FRAME_RATE))
    voice, language = inp.voice, inp.language
    if voice is not None and m.speakers:
        canonical = {v.lower(): v for v in m.speakers}.get(voice.lower())
        if canonical is None:
            raise bad("voice", f"unknown voice {voice!r}; valid voices: "
                      f"{', '.join(m.speakers)}", code="unknown_voice")
        voice = canonical
    if language is not None and m.languages:
        if language.lower() not in [*m.languages, "auto"]:
            raise bad("language", f"unknown language {language!r}; valid languages: auto, "
                      f"{', '.join(m.languages)}", code="unknown_language")
        language = language.lower()
    text, text_field = inp.text, inp.text_field
    if inp.codes is not None:
        if text:
            raise bad(text_field, f"send either {text_field} or codes, not both")
        arr = np.asarray(inp.codes, dtype=np.int32)
        if arr.shape[1] > s.max_frames:
            raise bad("codes", f"{arr.shape[1]} frames ({arr.shape[1] / FRAME_RATE:g} s) exceed "
                      f"the server limit of {s.max_audio_seconds:g} s", code="too_long")
        job = Job(id=st.pool.new_job_id(), kind="codes", codes=arr, max_frames=max_frames,
                  chunk_max_frames=s.chunk_max_frames)
        chars = 0
    else:
        if text is None or not text.strip():
            raise bad(text_field, "is empty: give text to speak (or codes [16][T])",
                      code="empty")
        if len(text) > s.max_text_chars:
            raise bad(text_field, f"{len(text)} characters; the limit is {s.max_text_chars}",
                      code="too_long")
        if "talker" not in m.parts:
            raise bad(text_field, "this model has no talker (decoder-only GGUF); send codes",
                      status=422, code="no_talker")
        if not m.text_ready:
            raise bad(text_field, "text synthesis is not available in this build yet (the "
                      "engine has no text pipeline); send codes", status=422,
                      code="text_unavailable")
        job = Job(id=st.pool.new_job_id(), kind="text", text=text, voice=voice,
                  language=language, instruct=inp.instruct, sampling=sampling,
                  max_frames=max_frames, chunk_max_frames=s.chunk_max_frames)
        chars = len(text)
    return Synthesis(route=inp.route, request_id=inp.request_id, job=job, fmt=inp.fmt,
                     stream=inp.stream, sse=inp.sse, speed=inp.speed, voice=voice, chars=chars,
                     arrival=inp.arrival)
