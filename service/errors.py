"""HTTP errors of the service, one JSON shape for every route.

The body is OpenAI's error shape with our ``field`` beside OpenAI's ``param``::

    {"error": {"message": "...", "type": "invalid_request_error",
               "param": "voice", "field": "voice", "code": "unknown_voice"}}
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

# HTTP status -> OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_overloaded",
    504: "timeout_error",
}


class ApiError(Exception):
    """An error answered as JSON with ``status``; ``field`` names the bad request field."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        field: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        outcome: str = "rejected",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.code = code
        self.headers = headers or {}
        self.outcome = outcome

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, field=self.field, code=self.code)

    def response(self, request_id: str | None = None) -> JSONResponse:
        headers = dict(self.headers)
        if request_id:
            headers["X-Request-Id"] = request_id
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(
    status: int, message: str, *, field: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": field,
            "field": field,
            "code": code,
        }
    }
