"""The gate in front of the API routes: API key (401), JSON content type (415), body size
(413) and the request id, checked before FastAPI parses anything.

Health, metrics and docs stay open (probes and scrapers carry no key). The body is read here,
within the cap, and replayed to the route, so an oversized upload is refused without buffering
it whole.
"""

from __future__ import annotations

import hmac
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import ApiError
from service.metrics import ROUTES
from service.request_log import log_rejected
from service.state import State

API_PREFIXES = ("/tts", "/v1/")
_REQ_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


class GateMiddleware:
    """For API routes: API key (401), JSON content type (415), body size (413), request id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        st: State | None = getattr(scope["app"].state, "qtts", None)
        if st is None or not path.startswith(API_PREFIXES):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = headers.get("x-request-id", "")
        if not _REQ_ID.match(rid):
            rid = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        scope["state"]["arrival"] = time.monotonic()
        gate = _Gate(st, scope, receive, send, rid)
        err = _check_key(st, headers)
        if err is not None:
            await gate.reject(err, "unauthorized")
            return
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        err = _check_content_type(headers)
        if err is not None:
            await gate.reject(err, "invalid")
            return
        body = await gate.read_body(headers.get("content-length"))
        if body is None:
            return
        replay: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay_receive() -> Message:
            if replay:
                return replay.pop()
            return await receive()

        await self.app(scope, replay_receive, send)


def _check_key(st: State, headers: dict[str, str]) -> ApiError | None:
    key = st.settings.api_key
    if not key:
        return None
    given = headers.get("authorization", "")
    token = given[7:].strip() if given[:7].lower() == "bearer " else ""
    token = token or headers.get("x-api-key", "")
    if hmac.compare_digest(token.encode(), key.encode()):
        return None
    return ApiError(401, "missing or invalid API key (Authorization: Bearer KEY)",
                    field="authorization", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def _check_content_type(headers: dict[str, str]) -> ApiError | None:
    ctype = headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "application/json":
        return None
    return ApiError(415, f"content-type must be application/json, got {ctype or 'none'!r}",
                    field="content-type", code="unsupported_media_type")


class _Gate:
    """One request at the gate: its refusal, and its body read within the cap."""

    def __init__(self, st: State, scope: Scope, receive: Receive, send: Send, rid: str) -> None:
        self.st, self.scope, self.receive, self.send, self.rid = st, scope, receive, send, rid
        path: str = scope["path"]
        self.route = path if path in ROUTES else None

    async def reject(self, err: ApiError, reason: str) -> None:
        self.st.metrics.rejections.labels(reason=reason).inc()
        if self.route is not None:
            self.st.metrics.requests.labels(route=self.route, outcome="rejected").inc()
            log_rejected(self.route, self.rid, err)
        await err.response(self.rid)(self.scope, self.receive, self.send)

    async def read_body(self, declared: str | None) -> bytes | None:
        """The whole body, or None when it was refused (413) or the client left."""
        limit = self.st.settings.max_body_bytes
        too_big = ApiError(413, f"request body is larger than {limit} bytes", field="body",
                           code="body_too_large")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self.reject(too_big, "invalid")
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await self.receive()
            if msg["type"] == "http.disconnect":
                return None
            body = msg.get("body", b"")
            size += len(body)
            if size > limit:
                await self.reject(too_big, "invalid")
                return None
            chunks.append(body)
            if not msg.get("more_body", False):
                return b"".join(chunks)
