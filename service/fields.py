"""The engine names request fields as ``SynthesisRequest`` does (``text``, ``instruct``); the
OpenAI route names two of them differently (``input``, ``instructions``). Errors a worker
reports are renamed here so that a 400 names the field the client sent; pydantic's error
locations are cut down here to the path the client wrote."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from engine.errors import clipped

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


def field_path(loc: Sequence[int | str]) -> list[str]:
    """A pydantic error location as the client wrote it: the field, then list indices and
    nested fields, without pydantic's names for a union's members (``function-after[...]``,
    ``literal['a','b']``, ``VoiceRef``) or the ``body`` root. Text is escaped so that a lone
    surrogate in an unknown field's name cannot break a UTF-8 answer."""
    parts = [clipped(str(x).encode("utf-8", "backslashreplace").decode("utf-8"))
             for x in loc if x != "body"]
    return parts[:1] + [x for x in parts[1:]
                        if (x.isidentifier() and x.islower()) or x.isdigit()]


def long_number(e: BaseException | None) -> str | None:
    """What is wrong with JSON whose reader raised ``e``, when it is a number longer than
    Python's integer conversion limit (a guard against quadratic parsing, raised as a
    ValueError like text that is not JSON): the JSON is valid, so say that instead."""
    if (isinstance(e, ValueError) and not isinstance(e, UnicodeDecodeError)
            and "integer string conversion" in str(e)):
        return f"has a number of more than {sys.get_int_max_str_digits()} digits"
    return None
