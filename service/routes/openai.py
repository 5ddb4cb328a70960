"""The OpenAI-compatible surface: ``/v1/models``, ``/v1/audio/speech`` (``/v1/audio/voices``:
service/routes/voices.py)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from engine.errors import quoted
from service.audio import CONTENT_TYPES, stream_wanted
from service.errors import ApiError
from service.openapi import ERRORS_GET_API, ERRORS_SYNTH, _err
from service.routes.context import request_context
from service.schemas import SpeechRequest
from service.state import State, get_state
from service.streaming import SSE_CONTENT_TYPE, SynthesisResponse
from service.validation import SynthesisInput, validate
from service.voices.api import clone_use
from service.voices.owners import request_owner

router = APIRouter(tags=["openai"])
StateDep = Annotated[State, Depends(get_state)]


def _model_object(st: State) -> dict[str, Any]:
    return {
        "id": st.settings.model_name, "object": "model", "created": 0, "owned_by": "qtts",
        "parts": sorted(st.model.parts), "synthetic": st.model.synthetic,
        "model_type": st.model.model_type, "text": st.model.text_ready,
    }


@router.get("/v1/models", summary="The served model (OpenAI list shape)",
            responses=ERRORS_GET_API)
async def models(st: StateDep) -> dict[str, Any]:
    return {"object": "list", "data": [_model_object(st)]}


# (the path parameter is read from the request, so FastAPI adds no 422 of its own)
@router.get("/v1/models/{model_id}", summary="The served model by its id (OpenAI retrieve)",
            responses={**ERRORS_GET_API, 404: _err("no model of that id is served here")},
            openapi_extra={"parameters": [{"name": "model_id", "in": "path", "required": True,
                                           "schema": {"type": "string"}}]})
async def model(request: Request, st: StateDep) -> dict[str, Any]:
    model_id = str(request.path_params["model_id"])
    if model_id != st.settings.model_name:
        raise ApiError(404, f"model: no model {quoted(model_id)}; this server serves "
                       f"{st.settings.model_name!r}", field="model", code="model_not_found")
    return _model_object(st)


@router.post(
    "/v1/audio/speech", response_class=Response,
    summary="OpenAI-compatible speech (stream_format audio | sse)",
    responses={200: {"content": {**{t: {} for t in CONTENT_TYPES.values()},
                                 SSE_CONTENT_TYPE: {}},
                     "description": "audio, or server-sent events (stream_format sse)"},
               **ERRORS_SYNTH},
)
async def speech(body: SpeechRequest, request: Request, st: StateDep) -> Response:
    rid, arrival = request_context(request)
    if body.voice is None and body.ref_audio is None:
        raise ApiError(400, "voice: is required (a voice name or id; or ref_audio, to clone "
                       "a voice for this request)", field="voice", code="voice_required")
    clone = await clone_use(st, request_owner(request), body.voice_name, body.ref_audio,
                            body.ref_text, body.x_vector_only)
    inp = SynthesisInput(
        route="/v1/audio/speech", request_id=rid, arrival=arrival, text=body.input,
        text_field="input", codes=body.codes, voice=body.voice_name, language=body.language,
        instruct=body.instructions, fmt=body.response_format,
        stream=stream_wanted(body.response_format, body.stream, "stream" in body.model_fields_set),
        sse=body.stream_format == "sse", speed=body.speed, max_seconds=body.max_seconds,
        sampling=body, instruct_field="instructions", clone=clone,
    )
    return SynthesisResponse(st, validate(st, inp))
