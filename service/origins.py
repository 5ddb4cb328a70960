"""Which browser pages may use the API: the server's own (the playground) and the origins
``QTTS_CORS_ORIGINS`` lists.

A browser sends a cross-site form (``multipart/form-data``) without asking the server first,
with the page's ``Origin``; without a check, any web page its user opened could create voices
on, or make speech with, a server that has no API key (one on ``127.0.0.1`` included). So a
POST or DELETE whose ``Origin`` is neither the server's nor a listed one is refused (403). So
is a WebSocket handshake (the realtime route): browsers open WebSockets to any origin without
CORS, with the page's ``Origin``.
Clients that are not browsers send no ``Origin`` and are not concerned. The listed origins also
get CORS answers (``service.app``), so a web app elsewhere can call the JSON API.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

from engine.errors import clipped
from service.errors import ApiError

_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def parse_origins(text: str) -> tuple[str, ...]:
    """``a, b`` -> the origins, each ``scheme://host[:port]`` (or ``*``); ValueError naming a
    malformed one."""
    out = []
    for raw in (p.strip() for p in text.split(",")):
        if not raw:
            continue
        if raw != "*":
            u = urlsplit(raw)
            if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/") \
                    or u.query or u.fragment:
                raise ValueError(f"{raw!r} is not an origin: give scheme://host[:port] "
                                 "(http or https, no path), or *")
            raw = raw.rstrip("/").lower()
        out.append(raw)
    return tuple(out)


def _netloc(host: str, scheme: str) -> str:
    """``host[:port]`` without the scheme's default port, lower case."""
    host = host.strip().lower()
    default = _DEFAULT_PORTS.get(scheme)
    if default is not None and host.endswith(f":{default}") and not host.endswith("]"):
        host = host[: -len(f":{default}")]
    return host


def origin_allowed(origin: str, headers: Mapping[str, str], allowed: tuple[str, ...]
                   ) -> bool:
    """Whether a page of ``origin`` may send a state-changing request: the server's own origin
    (the ``Host`` the browser addressed, or the ``X-Forwarded-Host`` a proxy passed on), or
    one ``allowed`` lists."""
    o = origin.strip().lower()
    if "*" in allowed or o in allowed:
        return True
    u = urlsplit(o)
    if not u.scheme or not u.netloc:
        return False  # "null" (a file or a sandboxed frame) and the like
    mine = _netloc(u.netloc, u.scheme)
    hosts = [headers.get("host", ""), headers.get("x-forwarded-host", "").split(",")[0]]
    return any(h and _netloc(h, u.scheme) == mine for h in hosts)


def foreign_origin(headers: Mapping[str, str], allowed: tuple[str, ...]) -> ApiError | None:
    """The 403 for a request from a page whose ``Origin`` may not use the API (``headers``
    with lower-case names), or None: no ``Origin`` (not a browser), or an allowed one."""
    origin = headers.get("origin")
    if origin is None or origin_allowed(origin, headers, allowed):
        return None
    return origin_refused(origin, 403)


def origin_refused(origin: str, status: int) -> ApiError:
    """The error for a page of ``origin`` that may not use the API: 403 for its request, 400
    for its CORS preflight."""
    return ApiError(status, f"origin: a page from {clipped(origin)} may not use this API "
                    "(QTTS_CORS_ORIGINS lists the origins that may)", field="origin",
                    code="origin_not_allowed")
