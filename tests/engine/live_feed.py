"""A ``TextFeed`` for live-text tests: another thread fills it, as the worker's pipe does."""

from __future__ import annotations

import queue

from engine.talker.live import TextUpdate


class QueueFeed:
    """A TextFeed over a queue another thread fills (like the worker's pipe)."""

    def __init__(self) -> None:
        self.q: queue.Queue[TextUpdate] = queue.Queue()

    def take(self, timeout: float) -> TextUpdate | None:
        try:
            first = self.q.get(timeout=timeout) if timeout > 0 else self.q.get_nowait()
        except queue.Empty:
            return None
        text, flush, end = first.text, first.flush, first.end
        while True:
            try:
                u = self.q.get_nowait()
            except queue.Empty:
                return TextUpdate(text, flush, end)
            text, flush, end = text + u.text, flush or u.flush, end or u.end
