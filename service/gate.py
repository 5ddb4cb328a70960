"""The gate in front of the API routes: API key (401) and its owner, content type (415), body
size (413), body time (408) and the request id, checked before FastAPI parses anything.

Synthesis routes take JSON (``/tts`` also a multipart form carrying a one-shot reference, whose
cap is the body cap plus the reference cap); ``POST /v1/audio/voices`` takes a multipart upload
capped at the reference cap (plus room for the form's other fields).

Health, metrics and docs stay open (probes and scrapers carry no key). The body is read here,
within the cap, and replayed to the route, so an oversized upload is refused without buffering
it whole.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.errors import clipped
from service.errors import ApiError
from service.metrics import ROUTES
from service.origins import foreign_origin
from service.request_log import log_rejected
from service.state import State
from service.voices.form import form_to_json
from service.voices.owners import header_key, owner_of

API_PREFIXES = ("/tts", "/v1/")
VOICES = "/v1/audio/voices"
FORM_SLACK = 64 * 1024  # a form's own fields and boundaries around the uploaded file
_REQ_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


def request_id(given: str) -> str:
    """A request's id: the client's ``X-Request-Id`` when it is a plain token of at most 64
    characters, else a new one."""
    return given if _REQ_ID.match(given) else uuid.uuid4().hex


class GateMiddleware:
    """For API routes: API key (401), JSON content type (415), body size (413), request id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if len(scope["path"]) > 1 and scope["path"].endswith("/"):
            # a trailing slash names the same route (Starlette answered a bare 307 to the path
            # without it, built from the client's Host header)
            scope["path"] = scope["path"].rstrip("/") or "/"
            if isinstance(raw := scope.get("raw_path"), bytes):
                scope["raw_path"] = raw.rstrip(b"/") or b"/"
        path: str = scope["path"]
        st: State | None = getattr(scope["app"].state, "qtts", None)
        if st is None or not path.startswith(API_PREFIXES):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = request_id(headers.get("x-request-id", ""))
        scope.setdefault("state", {})["request_id"] = rid
        scope["state"]["arrival"] = time.monotonic()
        gate = _Gate(st, scope, receive, send, rid)
        owner = _owner(st, headers)
        if owner is None:
            await gate.reject(ApiError(
                401, "missing or invalid API key (Authorization: Bearer KEY)",
                field="authorization", code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"}), "unauthorized")
            return
        scope["state"]["owner"] = owner
        foreign = foreign_origin(headers, st.settings.allowed_origins)
        if foreign is not None and scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            await gate.reject(foreign, "unauthorized")
            return
        upload = scope["method"] == "POST" and path == VOICES
        if scope["method"] != "POST" or (gate.route is None and not upload):
            # (a POST to a GET-only route goes on to the router: 405, not a body check)
            await self.app(scope, receive, send)
            return
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        s = st.settings
        if upload:
            allowed, limit = ("multipart/form-data",), s.max_reference_bytes + FORM_SLACK
        elif path == "/tts" and ctype == "multipart/form-data":
            allowed, limit = ("multipart/form-data",), s.max_body_bytes + s.max_reference_bytes
        else:
            allowed, limit = ("application/json",), s.max_body_bytes
        err = _check_content_type(ctype, allowed) or _check_encoding(
            headers.get("content-encoding", ""))
        if err is not None:
            await gate.reject(err, "invalid")
            return
        body = await gate.read_body(headers.get("content-length"), limit,
                                    "file" if upload else "body", s.max_reference_bytes)
        if body is None:
            return
        if path == "/tts" and ctype == "multipart/form-data":
            try:
                body = await form_to_json(scope, body, s.max_text_chars)
            except ApiError as form_err:
                await gate.reject(form_err, "invalid")
                return
            scope["headers"] = [(k, v) for k, v in scope["headers"]
                                if k.lower() not in (b"content-type", b"content-length")]
            scope["headers"] += [(b"content-type", b"application/json"),
                                 (b"content-length", str(len(body)).encode())]
        replay: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay_receive() -> Message:
            if replay:
                return replay.pop()
            return await receive()

        await self.app(scope, replay_receive, send)


def _owner(st: State, headers: dict[str, str]) -> str | None:
    """Who the request is (service/voices/owners.py), or None: a missing or unknown key."""
    return owner_of(st.owners, header_key(headers))


def _check_content_type(ctype: str, allowed: tuple[str, ...]) -> ApiError | None:
    if ctype in allowed:
        return None
    return ApiError(415, f"content-type must be {' or '.join(allowed)}, got {ctype or 'none'!r}",
                    field="content-type", code="unsupported_media_type")


def _check_encoding(encoding: str) -> ApiError | None:
    # a compressed body was read as JSON and answered "not valid JSON"; a body labelled as
    # compressed but plain was taken as it came
    if encoding.strip().lower() in ("", "identity"):
        return None
    return ApiError(415, f"content-encoding {clipped(encoding)!r} is not accepted: send the "
                    "body uncompressed", field="content-encoding", code="unsupported_media_type")


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

    async def read_body(self, declared: str | None, limit: int, field: str = "body",
                        file_cap: int = 0) -> bytes | None:  # fmt: skip
        """The whole body, or None when it was refused (413, 408) or the client left."""
        what = (f"request body is larger than {limit} bytes" if field == "body" else
                f"the upload is larger than the reference cap ({file_cap} bytes, "
                "QTTS_MAX_REFERENCE_BYTES)")
        too_big = ApiError(413, f"{field}: {what}", field=field, code="body_too_large")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self.reject(too_big, "invalid")
            return None
        chunks: list[bytes] = []
        size = 0
        # the whole body within body_timeout: a client that trickles or stalls is let go
        timeout = self.st.settings.body_timeout
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = await asyncio.wait_for(self.receive(),
                                             max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                await self.reject(ApiError(408, f"request body not received within {timeout:g} s",
                                           field="body", code="request_timeout",
                                           headers={"Connection": "close"}), "invalid")
                return None
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
