"""The realtime route's handshake: the key it carries, why one is refused (as the HTTP routes
refuse a request), the subprotocol the server answers, and the largest message a session
reads (service/routes/realtime.py accepts or refuses with these; the session protocol itself is
service/realtime.py)."""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import WebSocket

from service.errors import ApiError
from service.origins import foreign_origin
from service.realtime import CLOSE_POLICY
from service.settings import Settings
from service.voices.owners import header_key

SUBPROTOCOL = "qtts.v1"
_BEARER = "bearer."


def refusal(key_ok: bool, headers: Mapping[str, str], settings: Settings,
            draining: bool) -> tuple[str, ApiError] | None:
    """Why a handshake is refused, as the HTTP routes would refuse it (the rejection reason and
    the HTTP error), or None. ``headers``: the handshake's, read by lower-case name (Starlette's
    are case-insensitive). A missing or wrong key (not ``key_ok``), a page of an origin that
    may not use the API (service/origins.py), subprotocols offered without ``qtts.v1`` (a
    client that offers any closes a connection answered with none: browsers and Node's ws do,
    as 1006, with no reason), a server draining (its session would only be closed 1012 before
    its first utterance)."""
    if not key_ok:
        return "unauthorized", ApiError(
            401, "missing or invalid API key (Authorization: Bearer KEY, or a bearer.KEY entry "
            "of Sec-WebSocket-Protocol)", field="authorization", code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"})
    foreign = foreign_origin(headers, settings.allowed_origins)
    if foreign is not None:
        return "unauthorized", foreign
    if _offered(headers) and subprotocol(headers) is None:
        return "invalid", ApiError(
            400, f"sec-websocket-protocol: offer {SUBPROTOCOL} too (e.g. new WebSocket(url, "
            f'["{SUBPROTOCOL}", "bearer." + key])): the server answers {SUBPROTOCOL}, and a '
            "client that offered subprotocols closes a connection answered with none",
            field="sec-websocket-protocol", code="unsupported_subprotocol")
    if draining:
        return "draining", ApiError(503, "server is shutting down", code="draining",
                                    headers={"Retry-After": str(settings.retry_after_seconds)})
    return None


def max_message_bytes(settings: Settings) -> int:
    """The largest client message a session reads (the WebSocket layer closes 1009 on a larger
    one, before it is read whole or parsed): a text delta of the whole session's characters and
    a ``session`` message with texts at the HTTP routes' length, every character escaped the
    longest way JSON allows (a surrogate pair, 12 bytes), and room for the rest. A message past
    that cannot be valid; without the bound each one could make the front end read and parse
    16 MB (uvicorn's default)."""
    return 12 * (settings.realtime_max_chars + 2 * settings.max_text_chars) + 64 * 1024


def _offered(headers: Mapping[str, str]) -> list[str]:
    """The subprotocols the handshake offers (``Sec-WebSocket-Protocol``, a comma list)."""
    return [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",") if p.strip()]


def subprotocol(headers: Mapping[str, str]) -> str | None:
    """The subprotocol the server answers: ``qtts.v1`` where the client offered it."""
    return SUBPROTOCOL if SUBPROTOCOL in _offered(headers) else None


async def refuse(ws: WebSocket, err: ApiError, request_id: str) -> None:
    """Refuse a handshake with ``err``'s status and JSON body where the server can send an HTTP
    answer to a WebSocket request (uvicorn's ``websocket.http.response``), else with close
    ``CLOSE_POLICY`` before the accept (a bare 403)."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(err.response(request_id))
    else:
        await ws.close(code=CLOSE_POLICY, reason=err.message[:120])


def bearer_token(headers: Mapping[str, str]) -> str:
    """The API key a WebSocket handshake carries: a bearer ``Authorization`` header, an
    ``X-API-Key`` header, or a ``bearer.KEY`` entry of ``Sec-WebSocket-Protocol`` (what a
    browser can set); "" if none."""
    key = header_key(headers)  # as the HTTP routes take it
    if key:
        return key
    for entry in _offered(headers):
        if entry.startswith(_BEARER):
            return entry[len(_BEARER):]
    return ""
