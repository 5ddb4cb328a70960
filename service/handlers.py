"""Exception handlers: every error is answered in our one JSON shape (service/errors.py), never a
traceback; refused synthesis requests are counted and logged. Unexpected exceptions pass on to
``service.guard.ErrorGuard``."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, WebSocketRoute

from engine.errors import clipped
from service.errors import ApiError
from service.fields import field_path, long_number
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
    loc = field_path(e.get("loc", ()))  # (the log formats quote and escape it too)
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


# FastAPI's answer to a body its JSON reader raised on (bytes that are not UTF-8, nesting too
# deep for the parser), where pydantic's json_invalid names no field
BODY_UNREADABLE = "There was an error parsing the body"


def _unreadable_body(cause: BaseException | None) -> str:
    # FastAPI answers a ValueError of the JSON reader as it answers bytes that are not UTF-8
    number = long_number(cause)
    if number is not None:
        return f"body: {number}, more than any field takes"
    return "body: is not valid JSON (not UTF-8 text, or nested too deep)"


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    """The router's own answers (no route, a method the route does not take) and FastAPI's
    unreadable body, in our shape with the route named and a request id, as every other error."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400 and exc.detail == BODY_UNREADABLE:
        err = ApiError(400, _unreadable_body(exc.__cause__), field="body", code="invalid_value")
        return await api_error(request, err)
    state = request.scope.setdefault("state", {})
    rid = state.setdefault("request_id", uuid.uuid4().hex)
    headers = dict(exc.headers or {})
    # (escaped and clipped: a path is the client's text, echoed into the answer)
    where = clipped(request.url.path.encode("utf-8", "backslashreplace").decode("utf-8"))
    if exc.status_code == 404 and exc.detail == "Not Found" and _routes(request, "websocket"):
        err = ApiError(426, f"{where} is a WebSocket route: open it with a WebSocket handshake "
                       "(docs/service.md, Realtime)", code="upgrade_required",
                       headers={**headers, "Upgrade": "websocket", "Connection": "Upgrade"})
    elif exc.status_code == 404 and exc.detail == "Not Found":
        err = ApiError(404, f"{where}: not found (the API is described at /docs)", code="not_found",
                       headers=headers)
    elif exc.status_code == 405:
        allowed = allowed_methods(request)
        headers = {k: v for k, v in headers.items() if k.lower() != "allow"} | {"Allow": allowed}
        err = ApiError(405, f"{request.method} is not allowed on {where}"
                            + (f" (allowed: {allowed})" if allowed else ""),
                       code="method_not_allowed", headers=headers)
    else:
        err = ApiError(exc.status_code, str(exc.detail), headers=headers)
    return err.response(rid)


def _routes(request: Request, kind: str) -> list[Any]:
    """The app's routes of ``kind`` ("http", "websocket") whose path is the request's."""
    found, routes = [], list(request.app.router.routes)
    scope = {**request.scope, "type": kind, "method": "GET"}
    while routes:
        route = routes.pop()
        # (FastAPI keeps an included router whole: its routes, ours all without a prefix)
        if (inner := getattr(route, "original_router", None)) is not None:
            routes += inner.routes
        elif (isinstance(route, WebSocketRoute) if kind == "websocket"
              else bool(getattr(route, "methods", None))) and route.matches(scope)[0] != Match.NONE:
            found.append(route)
    return found


def allowed_methods(request: Request) -> str:
    """Every method some route takes at the request's path (Starlette's 405 names only the
    first route that matched the path: GET alone where POST and DELETE routes share it), and
    HEAD where GET is (the app answers HEAD as GET)."""
    methods = {m for route in _routes(request, "http") for m in getattr(route, "methods", ())}
    if "GET" in methods:
        methods.add("HEAD")
    return ", ".join(sorted(methods))


def install(app: FastAPI) -> None:
    """Register every handler on ``app``."""
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    # (an unexpected exception: service/guard.py's ErrorGuard answers it, as the outermost
    # middleware, with the request id, the request line and the counter)
