"""Checks of one synthesis request against the server settings and the model, before queueing.

The pydantic bodies (service/schemas.py) check types and ranges; a route turns its body into a
``SynthesisInput`` and ``validate`` checks what needs the settings or the model (caps, voices,
languages, the talker) and returns the ``Synthesis`` the streaming response runs. A refusal is
an ``ApiError`` naming the field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from engine.errors import InputError
from engine.talker.prompt import NOTHING_TO_SPEAK, has_speech
from service.errors import ApiError
from service.model_info import ModelInfo
from service.protocol import Job
from service.schemas import Sampling
from service.settings import Settings
from service.state import State
from service.voices.api import CloneUse

T = TypeVar("T")


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
    instruct_field: str = "instruct"  # the body's name of the instruction
    text_mode: str | None = None  # "full" | "stream"; None: the engine's default_text_mode
    clone: CloneUse | None = None  # a cloned voice (stored, or a one-shot reference)


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
    text_tokens: int = 0  # the worker's count, when it finished
    audio_seconds_out: float = 0.0
    synth_seconds: float | None = None
    outcome: str = "ok"
    status: int = 200
    gaps: int = 0
    gap_seconds: float = 0.0  # how long a listener waited in those gaps, summed
    stages: dict[str, float] = field(default_factory=dict)  # seconds per engine stage, summed
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
    """The request as a ``Synthesis`` ready to queue, or an ``ApiError`` naming the field.

    Everything the model's metadata decides is checked here, so such a request never waits
    in the queue for a worker to refuse it."""
    s = st.settings
    sampling = check_sampling(s, inp.sampling)
    if inp.max_seconds is not None and inp.max_seconds > s.max_audio_seconds:
        raise bad("max_seconds", f"{inp.max_seconds} is above the server limit "
                  f"{s.max_audio_seconds} s", code="out_of_range")
    shortest = 1 / (st.model.frame_rate * inp.speed)  # one frame, after the tempo change
    if inp.max_seconds is not None and inp.max_seconds < shortest:
        # (a request makes at least one frame: it was made, and sent over the cap)
        raise bad("max_seconds", f"{inp.max_seconds} s is shorter than one codec frame "
                  f"({shortest:g} s at speed {inp.speed:g}), the least audio a request makes",
                  code="out_of_range")
    if inp.codes is not None:
        if inp.clone is not None:
            raise bad("codes", "codes are decoded as they are: a cloned voice does not apply")
        job, chars = _codes_job(st, inp), 0
    else:
        job, chars = _text_job(st, inp, sampling), len(inp.text or "")
    voice = job.voice if inp.clone is None else inp.clone.label
    return Synthesis(route=inp.route, request_id=inp.request_id, job=job, fmt=inp.fmt,
                     stream=inp.stream, sse=inp.sse, speed=inp.speed, voice=voice,
                     chars=chars, arrival=inp.arrival)


def check_codes(codes: list[list[int]], n_codebooks: int, codebook_size: int) -> None:
    """``codes`` must be [n_codebooks][T >= 1] with ids in 0 .. codebook_size - 1."""
    if len(codes) != n_codebooks:
        raise bad("codes", f"expected {n_codebooks} rows (one per codebook), got {len(codes)}")
    n = len(codes[0])
    if n == 0:
        raise bad("codes", "no frames: each row must hold at least one code")
    for i, row in enumerate(codes):
        if len(row) != n:
            raise bad("codes", f"row {i} has {len(row)} codes, row 0 has {n}: rows must be equal")
        # the range in Python ints, before numpy: an id past int64 (2**63) is a 400 like any
        # other, not numpy's OverflowError
        if min(row) < 0 or max(row) >= codebook_size:
            j, c = next((j, c) for j, c in enumerate(row) if not 0 <= c < codebook_size)
            raise bad("codes", f"code {c} at [{i}][{j}] is outside 0..{codebook_size - 1}")


def _codes_job(st: State, inp: SynthesisInput) -> Job:
    s, m = st.settings, st.model
    assert inp.codes is not None
    if inp.text:
        raise bad(inp.text_field, f"send either {inp.text_field} or codes, not both")
    check_codes(inp.codes, m.n_codebooks, m.codebook_size)
    voice = _known_voice(m, inp.voice)
    if inp.language is not None and m.has_talker:
        _resolve(m.catalog.resolve_language, inp.language)
    if inp.instruct is not None and m.has_talker:
        _resolve(m.catalog.resolve_instruct, inp.instruct, inp.instruct_field)
    arr = np.asarray(inp.codes, dtype=np.int32)
    if arr.shape[1] > m.frames(s.max_audio_seconds):
        raise bad("codes", f"{arr.shape[1]} frames ({arr.shape[1] / m.frame_rate:g} s) exceed "
                  f"the server limit of {s.max_audio_seconds:g} s", code="too_long")
    limit_s = generated_limit(s, inp) or s.max_audio_seconds
    return Job(id=st.pool.new_job_id(), kind="codes", codes=arr, voice=voice,
               max_frames=max(1, m.frames(limit_s)), chunk_max_frames=s.chunk_max_frames)


def generated_limit(s: Settings, inp: SynthesisInput) -> float | None:
    """Seconds of audio the engine may make so that what the client receives after the tempo
    change (``speed``) stays within ``max_seconds`` and the server cap; None: the cap alone.
    The engine never makes more than the cap (its cost), whatever the speed."""
    out = min(inp.max_seconds or s.max_audio_seconds, s.max_audio_seconds)
    made = out * inp.speed
    return None if inp.max_seconds is None and made >= s.max_audio_seconds else min(
        made, s.max_audio_seconds)


def _text_job(st: State, inp: SynthesisInput, sampling: dict[str, Any]) -> Job:
    s, m = st.settings, st.model
    text, text_field = inp.text, inp.text_field
    if text is None or not text.strip():
        raise bad(text_field, f"is empty: give text to speak (or codes [{m.n_codebooks}][T])",
                  code="empty")
    if not has_speech(text):
        raise bad(text_field, NOTHING_TO_SPEAK, code="empty")
    if len(text) > s.max_text_chars:
        raise bad(text_field, f"{len(text)} characters; the limit is {s.max_text_chars}",
                  code="too_long")
    if not m.has_talker:
        raise bad(text_field, "this model has no talker (decoder-only GGUF); send codes",
                  status=422, code="no_talker")
    if not m.text_ready:
        raise bad(text_field, "text synthesis is not available in this build yet (the "
                  "engine has no text pipeline); send codes", status=422,
                  code="text_unavailable")
    _check_tokens(m, text_field, text, s.max_text_tokens)
    cat = m.catalog
    # a named voice first, then the language and instruction, and a missing voice last: the
    # error names the field the client got wrong rather than the one it left out
    clone = inp.clone
    voice = _known_voice(m, inp.voice) if clone is None else None
    language = _resolve(cat.resolve_language, inp.language)
    instruct = _resolve(cat.resolve_instruct, inp.instruct, inp.instruct_field)
    if instruct:  # (one the model ignores is not spoken, so not counted)
        _check_tokens(m, inp.instruct_field, instruct, s.max_instruct_tokens)
    if clone is None:
        voice = _resolve(cat.resolve_voice, voice)
    # the engine's text-length budget applies; a client's max_seconds (or a slowed tempo) can
    # only lower it
    made = generated_limit(s, inp)
    limit = max(1, m.frames(made)) if made is not None else None
    return Job(id=st.pool.new_job_id(), kind="text", text=text, voice=voice,
               language=None if inp.language is None else language, instruct=instruct,
               sampling=sampling, frame_limit=limit, chunk_max_frames=s.chunk_max_frames,
               text_mode=inp.text_mode,
               voice_prompt=clone.prompt if clone else None,
               ref_audio=clone.ref_audio if clone else None,
               ref_text=clone.ref_text if clone else None,
               x_vector_only=clone.x_vector_only if clone else False,
               max_ref_seconds=s.max_reference_seconds)


def _check_tokens(m: ModelInfo, field: str, text: str, cap: int) -> None:
    """The worker's token cap on ``text``, here, so a text over it never waits in the queue."""
    try:
        n = m.count_tokens(field, text)
    except InputError as e:
        raise bad(e.field, e.problem, code=e.code) from None
    if n > cap:
        raise bad(field, f"{n} tokens; the limit is {cap} tokens", code="too_long")


def _known_voice(m: ModelInfo, voice: str | None) -> str | None:
    """A named voice the model has (lower case), checked when the model names voices."""
    if voice is None or not m.voices:
        return voice
    try:
        return m.catalog.named_voice(voice)
    except InputError as e:
        raise bad(e.field, e.problem, code=e.code) from None


def _resolve(rule: Callable[[str | None], T], value: str | None, field: str | None = None) -> T:
    """Apply one of the engine's request rules; its ``InputError`` becomes a 400 naming
    ``field`` (the body's name for it) or the engine's name."""
    try:
        return rule(value)
    except InputError as e:
        raise bad(field or e.field, e.problem, code=e.code) from None
