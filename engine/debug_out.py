"""Where the engine's debug switches write (``QTTS_PROFILE``, ``QTTS_DEBUG_BACKEND``,
``QTTS_OP_LOG``): plain lines on stderr, unless the process keeps a log of its own (the
service: text or JSON lines) and routes them there with ``route``, so that they do not break
it."""

from __future__ import annotations

import sys
from collections.abc import Callable


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


_sink: Callable[[str], None] = _stderr


def debug_line(line: str) -> None:
    """Write one debug line (or report) where ``route`` said."""
    _sink(line)


def route(sink: Callable[[str], None] | None) -> None:
    """Send the debug lines to ``sink`` (None: back to stderr)."""
    global _sink
    _sink = sink if sink is not None else _stderr
