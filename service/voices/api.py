"""What the voice routes and the synthesis routes share: calling the store from the event loop
(503 with Retry-After when it is unreachable), creating a voice through a worker, finding the
voice a synthesis request names, the voice object, the audit line and the stored-voice gauge.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
import re
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.errors import quoted
from service.errors import ApiError
from service.protocol import Cloned, Failed, Job, TimedOut, WorkerDied
from service.refusals import PoolRefused
from service.state import State
from service.voices.store import DuplicateName, StoredVoice, StoreUnavailable, VoiceStore

log = logging.getLogger("qtts.voices")
audit = logging.getLogger("qtts.audit")
T = TypeVar("T")
ID_PREFIX = "voice_"
COUNT_EVERY = 30.0  # seconds between refreshes of the stored-voice gauge (other replicas write)
# the store's own threads: calls a frozen database holds wait here, not in the event loop's
# default pool, which whole-file encoding and the worker pool's joins also use
_STORE_THREADS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="qtts-store")


async def _in_store_thread(store: VoiceStore, op: Callable[[VoiceStore], T]) -> T:
    """``op(store)``, or TimeoutError after the store's ``answer_seconds`` (the thread waits
    on for the database, and rolls back what it wrote once it answers: ``VoiceStore.call``)."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + store.answer_seconds
    return await asyncio.wait_for(
        loop.run_in_executor(_STORE_THREADS, store.call, op, deadline), store.answer_seconds)


def retry_after(st: State) -> dict[str, str]:
    return {"Retry-After": str(st.settings.retry_after_seconds)}


async def call_store(st: State, op: Callable[[VoiceStore], T]) -> T:
    """Run ``op`` on the store in a thread; an unreachable database is a 503 (never a 500)."""
    store = st.store
    if store is None:
        raise ApiError(503, "voice store not configured", code="store_unavailable",
                       headers=retry_after(st))
    try:
        return await _in_store_thread(store, op)
    except (StoreUnavailable, TimeoutError) as exc:
        st.metrics.voice_store_errors.inc()
        log.error("voice store unavailable: %s", exc or f"no answer within "
                  f"{store.answer_seconds:g} s")
        raise ApiError(503, "the voice store is unavailable; retry later (built-in voices still "
                       "work)", code="store_unavailable", headers=retry_after(st)) from None


def voice_object(v: StoredVoice) -> dict[str, Any]:
    """A cloned voice as the API shows it (OpenAI's ``audio.voice`` plus qtts's fields)."""
    return {
        "id": v.id, "object": "audio.voice", "name": v.name, "created_at": int(v.created),
        "type": "audio_sample", "mode": v.mode, "reference_seconds": round(v.ref_seconds, 3),
        "reference_sha256": v.ref_sha256, "model": v.model,
    }


def looks_like_id(voice: str | None) -> bool:
    return voice is not None and voice.startswith(ID_PREFIX)


def new_id() -> str:
    return ID_PREFIX + secrets.token_hex(12)


def _can_exist(voice_id: str) -> bool:
    """Whether ``new_id`` could have made ``voice_id``: any other id is unknown without asking
    the store (whose driver may refuse it outright: PostgreSQL takes no NUL in text)."""
    return re.fullmatch(re.escape(ID_PREFIX) + "[0-9a-f]{24}", voice_id) is not None


def _unknown(field: str, voice_id: str) -> ApiError:
    return ApiError(404, f"{field}: no voice {quoted(voice_id)}", field=field,
                    code="voice_not_found")


def check_model(st: State, v: StoredVoice) -> None:
    """409 when ``v`` was made for another model than the one served (naming both)."""
    mine = st.model.voice_fingerprint or ""
    if v.fingerprint != mine:
        raise ApiError(409, f"voice: {v.id} was made for model {v.model!r} (fingerprint "
                       f"{v.fingerprint[:12]}); this server serves model "
                       f"{st.settings.model_name!r} (fingerprint {mine[:12] or 'none'}): "
                       "clone the voice again with this model (under another name, or "
                       f"delete {v.id} first: names are unique)", field="voice",
                       code="voice_model_mismatch")


async def stored_voice(st: State, owner: str, voice_id: str, field: str = "voice"
                       ) -> StoredVoice:  # fmt: skip
    """The owner's voice ``voice_id`` with its prompt; 404 for an unknown id or another
    owner's (the same answer: ids cannot be probed)."""
    if not _can_exist(voice_id):
        raise _unknown(field, voice_id)
    v = await call_store(st, lambda s: s.get(owner, voice_id))
    if v is None:
        raise _unknown(field, voice_id)
    return v


@dataclass(frozen=True)
class Reference:
    """An uploaded reference and how to clone it."""

    audio: bytes
    transcript: str | None
    x_vector_only: bool
    field: str = "file"  # the form's name of the audio (errors name what the client sent)


async def run_clone(st: State, ref: Reference, request_id: str) -> Cloned:
    """Make a voice's prompt in a worker (the front end never computes it)."""
    job = Job(id=st.pool.new_job_id(), kind="clone", ref_audio=ref.audio,
              ref_text=ref.transcript, x_vector_only=ref.x_vector_only,
              max_ref_seconds=st.settings.max_reference_seconds)
    try:
        ticket = st.pool.submit(job)
    except PoolRefused as e:
        reason = e.reason
        st.metrics.rejections.labels(reason=reason).inc()
        raise ApiError(503, f"no worker can clone now ({reason}); retry later", code=reason,
                       headers=retry_after(st)) from None
    try:
        ev = await asyncio.wait_for(ticket.events.get(), st.settings.request_timeout)
    except TimeoutError:
        ev = TimedOut()
    finally:
        st.pool.cancel(ticket)
    match ev:
        case Cloned():
            return ev
        case Failed():
            # (the engine's names for the reference's fields -> the upload form's)
            field = {"ref_audio": ref.field, "ref_text": "transcript"}.get(ev.field or "",
                                                                          ev.field)
            message = ev.message
            if ev.field and message.startswith(ev.field) and field != ev.field:
                message = f"{field}{message[len(ev.field):]}"
            elif ev.field and not message.startswith(f"{field}:") and field:
                message = f"{field}: {message}"
            raise ApiError(ev.status if ev.status < 500 else 500, message, field=field,
                           code=ev.code or ("invalid_value" if ev.status < 500
                                            else "clone_failed"))
        case WorkerDied():
            raise ApiError(503, "the worker cloning this voice died; nothing was stored; retry",
                           code="worker_died", headers=retry_after(st))
        case _:
            raise ApiError(504, f"cloning took longer than {st.settings.request_timeout:g} s",
                           code="timeout")


async def create_voice(st: State, owner: str, name: str, ref: Reference,
                       request_id: str) -> StoredVoice:  # fmt: skip
    """Clone, then store in one insert: a failure anywhere leaves no voice behind."""
    t0 = time.perf_counter()
    existing = await call_store(st, lambda s: s.list(owner))
    if any(v.name == name for v in existing):
        raise _duplicate(name)
    cloned = await run_clone(st, ref, request_id)
    voice = StoredVoice(
        id=new_id(), owner=owner, name=name, mode=cloned.mode, model=st.settings.model_name,
        fingerprint=st.model.voice_fingerprint or "", ref_sha256=hashlib.sha256(
            ref.audio).hexdigest(), ref_seconds=cloned.ref_seconds, created=time.time(),
        prompt=cloned.prompt, ref_audio=ref.audio if st.settings.keep_reference_audio else None)
    t1 = time.perf_counter()
    try:
        await call_store(st, lambda s: s.create(voice))
    except DuplicateName:
        raise _duplicate(name) from None
    t2 = time.perf_counter()
    m = st.metrics.voice_clone_seconds
    for stage, sec in cloned.stages.items():
        m.labels(stage=stage).observe(sec)
    m.labels(stage="store").observe(t2 - t1)
    m.labels(stage="total").observe(t2 - t0)
    st.metrics.voices_stored.inc()
    audit.info("voice created", extra={"event": "voice.create", "owner": owner,
                                       "voice_id": voice.id, "ref_sha256": voice.ref_sha256,
                                       "mode": voice.mode, "request_id": request_id})
    return voice


async def delete_voice(st: State, owner: str, voice_id: str, request_id: str) -> StoredVoice:
    if not _can_exist(voice_id):
        raise _unknown("voice_id", voice_id)
    gone = await call_store(st, lambda s: s.delete(owner, voice_id))
    if gone is None:
        raise _unknown("voice_id", voice_id)
    st.metrics.voices_stored.dec()
    audit.info("voice deleted", extra={"event": "voice.delete", "owner": owner,
                                       "voice_id": gone.id, "ref_sha256": gone.ref_sha256,
                                       "request_id": request_id})
    return gone


def _duplicate(name: str) -> ApiError:
    return ApiError(409, f"name: you already have a voice named {name!r} (names are unique "
                    "per owner: delete it or pick another name)", field="name",
                    code="duplicate_name")


async def count_voices(st: State) -> None:
    """Keep the stored-voice gauge current (other replicas create and delete too)."""
    while True:
        try:
            if st.store is not None:
                st.metrics.voices_stored.set(await _in_store_thread(st.store,
                                                                    lambda s: s.count()))
        except (StoreUnavailable, TimeoutError) as exc:
            st.metrics.voice_store_errors.inc()
            log.warning("voice store unavailable: %s", exc or "no answer")
        await asyncio.sleep(COUNT_EVERY)


@dataclass(frozen=True)
class CloneUse:
    """The cloned voice a synthesis request speaks in: a stored voice's prompt, or a one-shot
    reference (cloned by the worker, cached there by the audio's hash)."""

    label: str  # what the request log says the voice was
    prompt: bytes | None = None
    ref_audio: bytes | None = None
    ref_text: str | None = None
    x_vector_only: bool = False


_DATA_URL = re.compile(r"data:[\w.+/-]*(;[\w.+-]+=[\w.+-]+)*;base64,", re.ASCII)


def _base64_payload(ref_audio: str) -> str:
    # a browser's FileReader.readAsDataURL gives "data:audio/wav;base64,...": take its payload
    m = _DATA_URL.match(ref_audio)
    return ref_audio[m.end():] if m else ref_audio


async def clone_use(st: State, owner: str, voice: str | None, ref_audio: str | None = None,
                    ref_text: str | None = None, x_vector_only: bool = False
                    ) -> CloneUse | None:  # fmt: skip
    """The cloned voice ``voice`` (an id) or ``ref_audio`` (base64) names, or None for a
    built-in voice. 404: not the caller's voice; 409: a voice of another model."""
    if ref_audio is not None:
        if voice:
            raise ApiError(400, "ref_audio: send either voice or ref_audio, not both",
                           field="ref_audio", code="invalid_value")
        if not st.model.clones:
            raise ApiError(422, f"ref_audio: this model ({st.model.model_type or 'custom_voice'})"
                           " does not clone voices; serve a Base model", field="ref_audio",
                           code="cloning_unavailable")
        try:
            audio = base64.b64decode(_base64_payload(ref_audio), validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "ref_audio: is not base64 (or a data: URL of base64)",
                           field="ref_audio", code="invalid_value") from None
        cap = st.settings.max_reference_bytes
        if len(audio) > cap:
            raise ApiError(413, f"ref_audio: the reference is larger than {cap} bytes "
                           "(QTTS_MAX_REFERENCE_BYTES)", field="ref_audio", code="too_large")
        if not audio:
            raise ApiError(400, "ref_audio: is empty", field="ref_audio", code="empty")
        x_only = x_vector_only or not (ref_text or "").strip()
        return CloneUse(label="ref_audio", ref_audio=audio,
                        ref_text=None if x_only else ref_text, x_vector_only=x_only)
    if voice is None or not looks_like_id(voice) or not st.model.clones:
        return None
    v = await stored_voice(st, owner, voice)
    check_model(st, v)
    return CloneUse(label=v.id, prompt=v.prompt)
