"""Exception handlers: every error, whatever raised it, is answered in our one JSON shape
(service/errors.py), never a traceback; refused synthesis requests are counted and logged."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.errors import ApiError, error_body
from service.metrics import ROUTES
from service.request_log import log_rejected

log = logging.getLogger("qtts.app")


async def api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    rid = request.scope.get("state", {}).get("request_id")
    st = getattr(request.app.state, "qtts", None)
    if st is not None and request.url.path in ROUTES:
        st.metrics.rejections.labels(reason="invalid").inc()
        st.metrics.requests.labels(route=request.url.path, outcome=exc.outcome).inc()
        log_rejected(request.url.path, rid or "-", exc)
    return exc.response(rid)


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    """pydantic's first complaint about the body, as a 400 naming the field."""
    assert isinstance(exc, RequestValidationError)
    errs = exc.errors()
    e: dict[str, Any] = dict(errs[0]) if errs else {"loc": ("body",), "msg": "invalid"}
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    field_name = loc[0] if loc else "body"
    where = ".".join(loc) or "body"
    msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
    if e.get("type") == "json_invalid":
        field_name, where, msg = "body", "body", "is not valid JSON"
    elif e.get("type") == "extra_forbidden":
        msg = "is not a known field"
    elif e.get("type") == "literal_error" and "ctx" in e:
        msg = f"must be one of {e['ctx'].get('expected')}"
    err = ApiError(400, f"{where}: {msg}", field=field_name, code="invalid_value")
    return await api_error(request, err)


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return JSONResponse(error_body(exc.status_code, str(exc.detail)),
                        status_code=exc.status_code, headers=exc.headers)


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    return JSONResponse(error_body(500, "internal server error"), status_code=500)


def install(app: FastAPI) -> None:
    """Register every handler on ``app``."""
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
