"""``POST /tts``: qtts's own synthesis route (text, or codes [codebooks][T] for decoder-only
use). A voice is a built-in name or a cloned voice's id; ``ref_audio`` clones one for this
request only (JSON, base64; or a multipart form, which the gate turns into the same JSON)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from service.audio import CONTENT_TYPES, stream_wanted
from service.openapi import ERRORS_SYNTH
from service.routes.context import request_context
from service.schemas import TTSRequest
from service.state import State, get_state
from service.streaming import SynthesisResponse
from service.validation import SynthesisInput, validate
from service.voices.api import clone_use
from service.voices.owners import request_owner

router = APIRouter()


@router.post(
    "/tts", tags=["synthesis"], response_class=Response,
    summary="Synthesize text, or decode codes [codebooks][T]; streamed by default",
    responses={200: {"content": {t: {} for t in CONTENT_TYPES.values()},
                     "description": "audio (chunked when stream=true)"}, **ERRORS_SYNTH},
)
async def tts(body: TTSRequest, request: Request,
              st: Annotated[State, Depends(get_state)]) -> Response:
    rid, arrival = request_context(request)
    voice = body.voice_name
    clone = await clone_use(st, request_owner(request), voice, body.ref_audio, body.ref_text,
                            body.x_vector_only)
    inp = SynthesisInput(
        route="/tts", request_id=rid, arrival=arrival, text=body.text, text_field="text",
        codes=body.codes, voice=voice, language=body.language, instruct=body.instruct,
        fmt=body.format,
        stream=stream_wanted(body.format, body.stream, "stream" in body.model_fields_set),
        sse=False, speed=body.speed,
        max_seconds=body.max_seconds, sampling=body, text_mode=body.text_mode, clone=clone,
    )
    return SynthesisResponse(st, validate(st, inp))
