"""CORS answers for the web apps of the origins ``QTTS_CORS_ORIGINS`` lists (``service.app``
installs it outermost, so preflights are answered before the gate); which pages may send
state-changing requests at all is ``service.origins``."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from engine.errors import clipped
from service.errors import ApiError
from service.gate import request_id
from service.origins import origin_refused

# what a listed origin's page may read; it may send any header it asks for: the official
# openai JS client sends seven X-Stainless-* headers with every request, and the origin is
# trusted already (the key, where there is one, is checked as for anyone)
CORS_EXPOSED = ["X-Request-Id", "X-Sample-Rate", "X-Audio-Format", "Retry-After"]


class Cors(CORSMiddleware):
    """Starlette's CORS answers, with a refused preflight in the API's JSON error shape and a
    request id (Starlette's is a line of plain text)."""

    def preflight_response(self, request_headers: Headers) -> Response:
        answer = super().preflight_response(request_headers)
        if answer.status_code != 400:
            return answer
        origin = request_headers.get("origin", "")
        method = request_headers.get("access-control-request-method", "")
        # Starlette's text names what failed: "Disallowed CORS origin, method, ..."
        failed = bytes(answer.body).decode().removeprefix("Disallowed CORS ").split(", ")
        if "origin" in failed:
            err = origin_refused(origin, 400)
        elif "method" in failed:
            err = ApiError(400, f"access-control-request-method: {clipped(method)} is not one "
                           f"of {', '.join(sorted(self.allow_methods))}",
                           field="access-control-request-method", code="method_not_allowed")
        else:  # (headers and private network are allowed: a Starlette that checks more)
            field = f"access-control-request-{failed[0]}"
            err = ApiError(400, f"{field}: refused by the CORS policy", field=field,
                           code="cors_refused")
        out = err.response(request_id(request_headers.get("x-request-id", "")))
        for name, value in answer.headers.items():
            if name.lower().startswith("access-control-") or name.lower() == "vary":
                out.headers[name] = value
        return out
