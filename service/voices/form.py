"""Multipart forms: ``read_form`` reads one with its errors named (both forms use it), and
``POST /tts`` as a multipart form (a one-shot reference uploaded as a file) is turned into the
JSON body the route takes, so one set of checks (the pydantic body, then validation) serves
both. Form values are text; the fields that are numbers or booleans in JSON are converted
here, and a value that is neither is a 400 naming the field.
"""

from __future__ import annotations

import base64
import codecs
import json
from typing import Any

from python_multipart.multipart import parse_options_header
from starlette.datastructures import FormData, UploadFile
from starlette.requests import Request
from starlette.types import Message, Scope

from service.errors import ApiError

BOOLS = ("stream", "x_vector_only")
FLOATS = ("speed", "max_seconds", "temperature", "top_p", "repetition_penalty")
INTS = ("seed", "top_k")
FILES = ("ref_audio",)


async def read_form(request: Request, max_files: int, max_fields: int,
                    max_part_size: int) -> FormData:
    """The request's multipart form; a 400 naming the problem when it cannot be read, when a
    part without a filename (a text field to the parser) is over ``max_part_size``, or when a
    field comes twice, or when a text field was not UTF-8 (``_check_utf8``)."""
    raw = await request.body()  # (in memory already: the gate read it; the parser reads this)
    try:
        form = await request.form(max_files=max_files, max_fields=max_fields,
                                  max_part_size=max_part_size)
    except Exception as exc:  # starlette's MultiPartException and the parser's own errors
        if "exceeded maximum size" in str(exc):
            raise ApiError(400, f"body: a form field is over {max_part_size // 1024} KB: text "
                           "fields must be shorter, and a file must be sent as a file part "
                           "(with a filename in its Content-Disposition)", field="body",
                           code="invalid_form") from None
        if "Too many files" in str(exc):  # (a second file, or a text field sent as a file)
            raise ApiError(400, f"body: the form has more than {max_files} file part(s): send "
                           "the reference audio as the one file, and every other field as "
                           "text (no filename in its Content-Disposition)", field="body",
                           code="invalid_form") from None
        raise ApiError(400, f"body: not a readable multipart form ({exc})", field="body",
                       code="invalid_form") from None
    for key in form:
        if len(form.getlist(key)) > 1:
            await form.close()
            raise ApiError(400, f"{key[:64]}: sent twice", field=key[:64],
                           code="invalid_value")
    try:
        _check_utf8(form, raw, request.headers.get("content-type", ""))
    except ApiError:
        await form.close()
        raise
    return form


def _check_utf8(form: FormData, raw: bytes, content_type: str) -> None:
    """A 400 naming the first text field that is not UTF-8. Starlette decodes a text part in
    the charset the form's Content-Type names (UTF-8 when it names none) and, where that
    fails or the charset is unknown, as Latin-1 without a word: the text would be spoken as
    mojibake. A field decoded as UTF-8 is its own bytes in the body again; one that fell back
    is not."""
    raw_charset = parse_options_header(content_type)[1].get(b"charset")  # as the parser reads it
    named = raw_charset.decode("latin-1") if raw_charset is not None else None
    unknown = False
    try:
        if named is not None and codecs.lookup(named).name != "utf-8":
            return  # a charset the client named and the parser applied
    except LookupError:
        unknown = True  # the parser read it as Latin-1
    for key, value in form.multi_items():
        if isinstance(value, str) and not value.isascii() and value.encode("utf-8") not in raw:
            why = (f"the form's charset {str(named)[:40]!r} is not one known here" if unknown else
                   "it is not UTF-8 text")
            raise ApiError(400, f"{key[:64]}: cannot be read: {why}; send the form's text "
                           "fields in UTF-8 (or name their charset in the Content-Type)",
                           field=key[:64], code="invalid_value")


async def form_to_json(scope: Scope, body: bytes, max_text: int) -> bytes:
    """The JSON body equal to the multipart ``body`` of a ``/tts`` request."""
    sent = [False]

    async def receive() -> Message:
        if sent[0]:
            return {"type": "http.disconnect"}
        sent[0] = True
        return {"type": "http.request", "body": body, "more_body": False}

    form = await read_form(Request(scope, receive), max_files=1, max_fields=32,
                           max_part_size=max_text * 4 + 1024)
    out: dict[str, Any] = {}
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            if key not in FILES:
                raise ApiError(400, f"{key}: must be text, not a file", field=key,
                               code="invalid_value")
            out[key] = base64.b64encode(await value.read()).decode()
            continue
        out[key] = _convert(key, value)
    await form.close()
    return json.dumps(out).encode()


def _convert(key: str, v: str) -> Any:
    if key in FILES:
        return v  # base64 text in a form field: the route checks it
    try:
        if key in BOOLS:
            low = v.strip().lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if key in FLOATS:
            return float(v)
        if key in INTS:
            return int(v)
    except ValueError:
        kind = "true or false" if key in BOOLS else "a number"
        raise ApiError(400, f"{key}: must be {kind}, got {v[:20]!r}", field=key,
                       code="invalid_value") from None
    return v
