"""Voices: ``GET /v1/audio/voices`` (the model's built-in voices and the caller's cloned ones),
``POST /v1/audio/voices`` (clone one from an uploaded reference; OpenAI's custom-voice form,
with ElevenLabs' ``files`` accepted too), ``GET`` / ``DELETE /v1/audio/voices/{voice_id}``.

Each owner (service/voices/owners.py) sees, uses and deletes only its own voices: another
owner's id is a 404, as an unknown one is. Form checks are here; the reference itself (decoding,
length, silence, transcript) is checked by the worker that clones it.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from starlette.datastructures import UploadFile

from engine.errors import quoted
from service.errors import ApiError
from service.openapi import BODY_TIMEOUT, BUG, ERRORS_GET_API, ORIGIN, Responses, _err
from service.routes.context import request_context
from service.state import State, get_state
from service.voices.api import (
    Reference,
    call_store,
    create_voice,
    delete_voice,
    stored_voice,
    voice_object,
)
from service.voices.form import read_form
from service.voices.owners import request_owner

router = APIRouter(tags=["voices"])
StateDep = Annotated[State, Depends(get_state)]
FILE_FIELDS = ("audio_sample", "file", "files", "files[]")  # OpenAI's, ours, ElevenLabs'
TEXT_FIELDS = ("name", "transcript", "ref_text", "x_vector_only", "consent", "type")
# what a reference may be sent as (the part's Content-Type); the worker decodes whatever
# libsndfile or FFmpeg reads, so this refuses only what is plainly not audio (a JSON, text or
# image part)
AUDIO_TYPES = re.compile(r"^(audio/[\w.+-]+|video/(mp4|webm|ogg)|application/(ogg|octet-stream))$")
# C0/C1 controls and the bidirectional controls (a name that reads differently than it sorts)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
ERRORS_CREATE: Responses = {
    400: _err("a bad form field (named in `field`): no file, empty or too long name, "
              "undecodable, silent, too short or too long reference, empty transcript"),
    401: _err("a key is required and was missing or wrong"),
    **ORIGIN,
    **BODY_TIMEOUT,
    409: _err("the caller already has a voice of that name"),
    413: _err("the reference is larger than QTTS_MAX_REFERENCE_BYTES"),
    415: _err("not a multipart form, or the file part is not audio"),
    422: _err("the served model does not clone voices (not a Base model)"),
    **BUG,
    503: _err("the voice store is unreachable, or no worker is free (Retry-After)"),
}
ERRORS_ONE: Responses = {**ERRORS_GET_API, 404: _err("no such voice (or another owner's)"),
                         503: _err("the voice store is unreachable (Retry-After)")}


@router.get("/v1/audio/voices", summary="Built-in voices of the model and the caller's cloned "
            "voices, languages and dialects", responses=ERRORS_ONE)
async def list_voices(request: Request, st: StateDep) -> dict[str, Any]:
    """A built-in voice or language not listed here is a 400. A dialect is spoken by its voice
    when the language is chinese or auto; it is not a language itself. Cloned voices (Base
    models) follow the built-in ones, oldest first."""
    m = st.model
    data: list[dict[str, Any]] = [{"id": v, "name": v, "object": "voice"} for v in m.voices]
    if m.clones:
        owner = request_owner(request)
        data += [voice_object(v) for v in await call_store(st, lambda s: s.list(owner))]
    return {"object": "list", "data": data, "voices": m.voices, "languages": m.languages,
            "dialects": m.dialects}


_FORM = {
    "type": "object", "required": ["audio_sample", "name"],
    "properties": {
        "audio_sample": {"type": "string", "format": "binary",
                         "description": "the reference audio (also accepted as `file`, `files`)"},
        "name": {"type": "string", "description": "the voice's name, unique per owner"},
        "transcript": {"type": "string", "description": "what the reference says (in-context "
                       "cloning); without it the voice is x-vector only"},
        "x_vector_only": {"type": "boolean", "description": "ignore the transcript"},
        "consent": {"type": "string", "description": "OpenAI's consent id: accepted, not used"},
        "type": {"type": "string", "enum": ["audio_sample"]},
    },
}
# (the path parameter is read from the request, so FastAPI adds no 422 of its own: a bad id is
# a 404 like an unknown one)
_ID_PARAM = {"parameters": [{"name": "voice_id", "in": "path", "required": True,
                             "schema": {"type": "string"}}]}


@router.post("/v1/audio/voices", summary="Clone a voice from reference audio (multipart form)",
             responses=ERRORS_CREATE, openapi_extra={"requestBody": {
                 "required": True, "content": {"multipart/form-data": {"schema": _FORM}}}})
async def create(request: Request, st: StateDep) -> dict[str, Any]:
    """Form fields: the reference as ``audio_sample`` (OpenAI; also ``file`` or ElevenLabs'
    ``files``), ``name``, optional ``transcript`` of the reference (in-context cloning, the
    closest; without it the voice is x-vector only), ``x_vector_only`` (true: ignore the
    transcript). OpenAI's ``consent`` and ``type=audio_sample`` are accepted and not used."""
    rid, _ = request_context(request)
    m, s = st.model, st.settings
    if not m.clones:
        raise ApiError(422, f"file: this model ({m.model_type or 'custom_voice'}) does not clone "
                       "voices; serve a Base model", field="file", code="cloning_unavailable")
    if "speaker_encoder" not in m.parts:
        raise ApiError(422, "file: this model file has no speaker encoder (converted without "
                       "it): it cannot clone", field="file", code="cloning_unavailable")
    form = await read_form(request, max_files=1, max_fields=len(TEXT_FIELDS) + 1,
                           max_part_size=max(s.max_text_chars * 4, 1024 * 64))
    if (kind := form.get("type")) not in (None, "audio_sample"):
        raise ApiError(400, f"type: {str(kind)[:40]!r}: voices here are cloned from a recording "
                       "(audio_sample); a voice from a text prompt is not made (a VoiceDesign "
                       "model takes the description as `instructions` on each request)",
                       field="type", code="invalid_value")
    unknown = [k for k in form if k not in FILE_FIELDS + TEXT_FIELDS]
    if unknown:
        raise ApiError(400, f"{unknown[0]}: is not a known field", field=unknown[0],
                       code="invalid_value")
    files = [(k, form[k]) for k in FILE_FIELDS if k in form]
    if not files:
        raise ApiError(400, "file: missing: send the reference audio as `audio_sample` (or "
                       "`file`)", field="file", code="missing")
    field, upload = files[0]
    if not isinstance(upload, UploadFile):
        raise ApiError(400, f"{field}: must be a file part, not text", field=field,
                       code="invalid_value")
    ctype = (upload.content_type or "application/octet-stream").split(";")[0].strip().lower()
    if not AUDIO_TYPES.match(ctype):
        raise ApiError(415, f"{field}: content type {ctype!r} is not audio", field=field,
                       code="unsupported_media_type")
    audio = await upload.read(s.max_reference_bytes + 1)
    if len(audio) > s.max_reference_bytes:
        raise ApiError(413, f"{field}: the reference is larger than {s.max_reference_bytes} "
                       "bytes (QTTS_MAX_REFERENCE_BYTES)", field=field, code="too_large")
    if not audio:
        raise ApiError(400, f"{field}: is empty", field=field, code="empty")
    name = _text(form, "name")
    # one spelling per name (NFC: "café" composed or not is one name); nothing but spaces and
    # invisible format characters (zero-width space, ...) is no name
    name = unicodedata.normalize("NFC", name).strip() if name is not None else ""
    if all(unicodedata.category(c) in ("Cf", "Zs", "Zl", "Zp") for c in name):
        raise ApiError(400, "name: is empty: give the voice a name", field="name", code="empty")
    if len(name) > s.voice_name_max_chars:
        raise ApiError(400, f"name: {len(name)} characters; the limit is "
                       f"{s.voice_name_max_chars}", field="name", code="too_long")
    if _CONTROL.search(name):
        raise ApiError(400, "name: has control characters (C0, C1 or bidirectional)",
                       field="name", code="invalid_value")
    transcript = _text(form, "transcript") or _text(form, "ref_text")
    if transcript is not None and len(transcript) > s.max_text_chars:
        raise ApiError(400, f"transcript: {len(transcript)} characters; the limit is "
                       f"{s.max_text_chars}", field="transcript", code="too_long")
    x_only = _flag(form, "x_vector_only")
    kind = _text(form, "type")
    if kind not in (None, "audio_sample"):
        raise ApiError(400, "type: only audio_sample voices are made here", field="type",
                       code="invalid_value")
    if transcript is None or not transcript.strip():
        x_only, transcript = True, None  # no transcript: the x-vector is all there is
    ref = Reference(audio=audio, transcript=None if x_only else transcript, x_vector_only=x_only,
                    field=field)
    voice = await create_voice(st, request_owner(request), name, ref, rid)
    return voice_object(voice)


@router.get("/v1/audio/voices/{voice_id}", summary="One of the caller's cloned voices",
            responses=ERRORS_ONE, openapi_extra=_ID_PARAM)
async def get_voice(request: Request, st: StateDep) -> dict[str, Any]:
    voice_id = _voice_id(request, st)
    return voice_object(await stored_voice(st, request_owner(request), voice_id, "voice_id"))


@router.delete("/v1/audio/voices/{voice_id}", summary="Delete one of the caller's cloned voices",
               responses={**ERRORS_ONE, **ORIGIN}, openapi_extra=_ID_PARAM)
async def delete(request: Request, st: StateDep) -> dict[str, Any]:
    rid, _ = request_context(request)
    gone = await delete_voice(st, request_owner(request), _voice_id(request, st), rid)
    return {"id": gone.id, "object": "audio.voice.deleted", "deleted": True}


def _voice_id(request: Request, st: State) -> str:
    """The path's id; on a model that does not clone there are no stored voices to look at."""
    voice_id = str(request.path_params["voice_id"])
    if not st.model.clones:
        raise ApiError(404, f"voice_id: no voice {quoted(voice_id)} (this model does not clone)",
                       field="voice_id", code="voice_not_found")
    return voice_id


def _text(form: Any, key: str) -> str | None:
    v = form.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise ApiError(400, f"{key}: must be text, not a file", field=key, code="invalid_value")
    return v


def _flag(form: Any, key: str) -> bool:
    v = _text(form, key)
    if v is None:
        return False
    low = v.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off", ""):
        return False
    raise ApiError(400, f"{key}: must be true or false, got {v[:20]!r}", field=key,
                   code="invalid_value")
