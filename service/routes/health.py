"""Health, readiness, Prometheus metrics and the plain-text root page."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from service.state import VERSION, State, get_state

router = APIRouter()
StateDep = Annotated[State, Depends(get_state)]


@router.get("/healthz", tags=["health"], summary="Liveness: the process serves HTTP")
async def healthz(st: StateDep) -> dict[str, Any]:
    return {"status": "ok", "workers": st.pool.describe()}


@router.get("/readyz", tags=["health"],
            summary="Readiness: model loaded and every worker warm (503 before)")
async def readyz(st: StateDep) -> JSONResponse:
    ready = st.pool.ready
    body = {
        "status": "ready" if ready else ("draining" if st.pool.draining else "starting"),
        "workers": st.pool.describe(),
    }
    if st.pool.last_fatal and not ready:
        body["last_error"] = st.pool.last_fatal
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics", tags=["health"], summary="Prometheus metrics")
async def metrics(st: StateDep) -> Response:
    if st.pool.backend:
        st.metrics.set_build_info(VERSION, st.pool.backend, st.settings.model_name)
    return Response(st.metrics.render(), media_type=METRICS_CONTENT_TYPE)


@router.get("/", include_in_schema=False)
async def root() -> PlainTextResponse:
    return PlainTextResponse("qtts: POST /tts, POST /v1/audio/speech; docs at /docs; "
                             "try it in a browser at /playground\n")
