"""The engine names request fields as ``SynthesisRequest`` does (``text``, ``instruct``); the
OpenAI route names two of them differently (``input``, ``instructions``). Errors a worker
reports are renamed here so that a 400 names the field the client sent."""

from __future__ import annotations

_SPEECH = {"text": "input", "instruct": "instructions"}
ROUTE_FIELDS: dict[str, dict[str, str]] = {"/v1/audio/speech": _SPEECH}


def api_field(route: str, field: str | None, message: str) -> tuple[str | None, str]:
    """``(field, message)`` as the client of ``route`` knows them (the message starts with the
    field name when the engine wrote it)."""
    names = ROUTE_FIELDS.get(route, {})
    if field is None or field not in names:
        return field, message
    new = names[field]
    if message.startswith(field + ":"):
        message = new + message[len(field):]
    return new, message
