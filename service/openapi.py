"""The OpenAPI document tells the truth: every status a route answers, with the JSON error
schema, and the request fields as this server (its settings, its model) accepts them.

* ``ERRORS_SYNTH`` / ``ERRORS_GET``: the ``responses=`` of the routes (FastAPI would otherwise
  document only 200 and a 422 we never send: validation errors are 400s);
* ``install(app, ...)``: the document is built once per app with the loaded model's voices and
  languages as enums and the server caps as bounds (``max_text_chars``, ``max_seconds``,
  sampling caps), so a generated client (or a fuzzer) sends what can reach a worker.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from service.settings import Settings


class ErrorDetail(BaseModel):
    message: str = Field(description="what is wrong, starting with the field name")
    type: str = Field(description="OpenAI's error type (invalid_request_error, server_error, ...)")
    param: str | None = Field(description="the offending field (OpenAI's name for it)")
    field: str | None = Field(description="the offending field (same as param)")
    code: str | None = Field(description="a stable machine-readable reason")


class ErrorResponse(BaseModel):
    """Every error answer of the API."""

    error: ErrorDetail


def _err(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


Responses = dict[int | str, dict[str, Any]]
_AUTH: Responses = {401: _err("QTTS_API_KEY is set and the key is missing or wrong")}
BUG: Responses = {500: _err("an unexpected server error (a bug), with X-Request-Id")}
# (a POST or DELETE sent by a browser page of an origin the server does not allow)
ORIGIN: Responses = {403: _err("sent from a web page whose Origin is neither the server's nor "
                               "listed in QTTS_CORS_ORIGINS (origin_not_allowed)")}
BODY_TIMEOUT: Responses = {408: _err("the request body did not arrive within QTTS_BODY_TIMEOUT")}

ERRORS_SYNTH: Responses = {
    400: _err("a bad field (named in `field`): empty or too long text (characters or tokens), "
              "unknown voice or language, value out of range, malformed codes, unknown field, "
              "invalid JSON"),
    **_AUTH,
    **ORIGIN,
    **BODY_TIMEOUT,
    413: _err("the body is larger than QTTS_MAX_BODY_BYTES"),
    415: _err("the content type is not application/json (nor, for /tts, a multipart form)"),
    404: _err("`voice` names a stored voice id that does not exist (or is another owner's)"),
    409: _err("`voice` is a stored voice made for another model"),
    422: _err("text sent to a model without a talker (a decoder-only GGUF)"),
    **BUG,
    503: _err("queue full, shutting down, no worker, the worker died, or the voice store is "
              "unavailable (Retry-After)"),
    504: _err("the request timed out before any audio was sent"),
}
ERRORS_GET_API: Responses = {**_AUTH, **BUG}
ERRORS_GET: Responses = dict(BUG)


def install(app: FastAPI, settings: Settings, model: Callable[[], Any]) -> None:
    """Replace ``app.openapi`` with a builder that fills in ``model()``'s voices/languages
    (a ``ModelInfo``, or None when not loaded yet) and the settings' caps."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, description=app.description,
                          routes=app.routes)
        info = model()
        _apply(doc, settings, info)
        if info is not None:  # (before the model is known the document is not kept)
            app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def _apply(doc: dict[str, Any], s: Settings, info: Any) -> None:
    schemas = doc.get("components", {}).get("schemas", {})
    voices = list(info.voices) if info is not None else []
    languages = list(info.languages) if info is not None else []
    caps = {"temperature": s.max_temperature, "top_k": s.max_top_k,
            "repetition_penalty": s.max_repetition_penalty,
            "max_seconds": s.max_audio_seconds}
    for name, text_field, instruct_field in (("TTSRequest", "text", "instruct"),
                                             ("SpeechRequest", "input", "instructions")):
        props = schemas.get(name, {}).get("properties", {})
        for key in (text_field, instruct_field):
            if key in props:
                _string_bound(props[key], s.max_text_chars)
        if voices and "voice" in props:
            _enum_strings(props["voice"], voices)
        if languages and "language" in props:
            _enum_strings(props["language"], languages)
        for key, cap in caps.items():
            if key in props:
                _number_bound(props[key], cap)
        if "codes" in props and info is not None:
            _codes_shape(props["codes"], info.n_codebooks, info.codebook_size,
                         info.frames(s.max_audio_seconds))
        for key, prop in props.items():  # (service.schemas.Body: null is "not sent")
            if key not in schemas.get(name, {}).get("required", []):
                _nullable(prop)
    ref = schemas.get("VoiceRef", {}).get("properties", {})
    if voices and "id" in ref:
        _enum_strings(ref["id"], voices)
    if "TTSRequest" in schemas:
        _tts_form(doc, schemas)


def _tts_form(doc: dict[str, Any], schemas: dict[str, Any]) -> None:
    # POST /tts also takes a multipart form (service/voices/form.py turns it into the JSON
    # body): the same fields as text, the reference as a file; no codes (frames are JSON)
    props: dict[str, Any] = {}
    for name, prop in copy.deepcopy(schemas["TTSRequest"]["properties"]).items():
        if name == "codes":
            continue
        kept = [alt for alt in _alternatives(prop)
                if alt.get("type") not in ("null", "object", "array") and "$ref" not in alt]
        if kept:
            props[name] = {**{k: v for k, v in prop.items() if k != "anyOf"}, **kept[0]}
    props["ref_audio"] = {"type": "string", "format": "binary", "title": "Ref Audio",
                          "description": "reference audio file (one-shot cloning, Base models)"}
    schemas["TTSForm"] = {"type": "object", "title": "TTSForm", "properties": props,
                          "additionalProperties": False}
    body = doc.get("paths", {}).get("/tts", {}).get("post", {}).get("requestBody")
    if body is not None:
        body["content"]["multipart/form-data"] = {
            "schema": {"$ref": "#/components/schemas/TTSForm"}}


def _codes_shape(prop: dict[str, Any], rows: int, size: int, max_frames: int) -> None:
    # [codebooks][T]: that many rows of 1..max_frames ids in 0..size-1 (rows of equal length
    # cannot be said in JSON Schema)
    for alt in _alternatives(prop):
        if alt.get("type") == "array":
            alt.update(minItems=rows, maxItems=rows)
            alt["items"] = {"type": "array", "minItems": 1, "maxItems": max(1, max_frames),
                            "items": {"type": "integer", "minimum": 0, "maximum": size - 1}}


def _nullable(prop: dict[str, Any]) -> None:
    alts = prop.get("anyOf")
    if alts is None:
        alt = {k: prop.pop(k) for k in list(prop) if k not in ("title", "description", "default")}
        prop["anyOf"] = alts = [alt]
    if {"type": "null"} not in alts:
        alts.append({"type": "null"})


def _alternatives(prop: dict[str, Any]) -> list[dict[str, Any]]:
    return list(prop.get("anyOf", [prop]))


def _enum_strings(prop: dict[str, Any], values: list[str]) -> None:
    # the string alternative becomes an enum (names are case-insensitive; these are the
    # canonical spellings)
    for alt in _alternatives(prop):
        if alt.get("type") == "string":
            alt["enum"] = values


def _string_bound(prop: dict[str, Any], max_length: int) -> None:
    for alt in _alternatives(prop):
        if alt.get("type") == "string":
            alt["maxLength"] = max_length


def _number_bound(prop: dict[str, Any], maximum: float) -> None:
    for alt in _alternatives(prop):
        if alt.get("type") in ("number", "integer"):
            alt["maximum"] = maximum
