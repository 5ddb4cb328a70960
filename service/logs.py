"""Logging: plain text or one JSON object per line (``QTTS_LOG_FORMAT=json``).

Each synthesis request ends with exactly one line on the ``qtts.request`` logger carrying its
fields (id, route, voice, chars, audio seconds, queue wait, time to first audio, RTF, outcome).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from typing import Any

from engine.debug_out import route

REQUEST_LOGGER = "qtts.request"
_STD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "color_message", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in _STD and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)  # (ensure_ascii: every value escaped)


def escape(s: str) -> str:
    """``s`` with every character that is not printable (newlines, other controls, lone
    surrogates, ...) written as a Python escape: one log record stays one line."""
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace")
                   .decode("ascii") for c in s)


_BARE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:/+-@")


def logfmt_value(v: Any) -> str:
    """A field value for the text format: numbers, None and booleans as they print, any other
    value a bare word when it is one (``[A-Za-z0-9._:/+-@]+``), else a JSON string (quoted,
    escaped), so no value can end its field or its line early."""
    if v is None or isinstance(v, bool | int | float):
        return str(v)
    text = str(v)
    if text and set(text) <= _BARE:
        return text
    return json.dumps(text)  # ensure_ascii: controls, quotes, surrogates all escaped


class TextFormatter(logging.Formatter):
    """``time level logger: message key=value ...``: one line per record. The message has its
    non-printable characters escaped, values are bare words or JSON strings
    (``logfmt_value``), and a traceback's lines are indented under the record."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        return "\n".join("    " + escape(line) for line in
                         super().formatException(ei).splitlines())

    def formatStack(self, stack_info: str) -> str:
        return "\n".join("    " + escape(line) for line in stack_info.splitlines())

    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        fields = {k: v for k, v in vars(record).items() if k not in _STD and not k.startswith("_")}
        if fields:
            extra = " ".join(f"{k}={logfmt_value(v)}" for k, v in fields.items())
            head, sep, tail = base.partition("\n")  # the fields stay on the record's line
            base = f"{head} {extra}{sep}{tail}"
        return base


class _DropIncompleteResponse(logging.Filter):
    """uvicorn reports a response we abort on purpose (worker died mid-stream) as an error;
    our own request line already says what happened."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "returned without completing response" not in record.getMessage()


class _ExpectedErrors(logging.Filter):
    """uvicorn logs with a traceback two errors that are no bug of ours: a WebSocket text frame
    that is not UTF-8 (the client's mistake, answered with close code 1007) and a request
    still running at the drain's deadline (cut on purpose; its request line says timeout).
    Each becomes one warning line."""

    FRAME = "Invalid UTF-8 sequence received from client."

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info:
            return True
        exc = record.exc_info[1]
        if record.getMessage() == self.FRAME:
            said = self.FRAME + " (closed with 1007)"
        elif isinstance(exc, asyncio.CancelledError) and "graceful shutdown" in str(exc):
            said = "a request still running at the drain's deadline was cut"
        else:
            return True
        record.exc_info, record.exc_text = None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.msg, record.args = said, None
        return True


def setup_logging(fmt: str = "text", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    # a Python warning (numpy's floating-point ones too) is a record on "py.warnings", not two
    # raw lines on stderr between the JSON ones
    logging.captureWarnings(True)
    # so are the engine's debug lines (QTTS_PROFILE, QTTS_DEBUG_BACKEND, QTTS_OP_LOG): records on
    # "qtts.debug", at info
    route(logging.getLogger("qtts.debug").info)
    logging.getLogger("uvicorn.error").addFilter(_DropIncompleteResponse())
    logging.getLogger("uvicorn.error").addFilter(_ExpectedErrors())


def round_or_none(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)
