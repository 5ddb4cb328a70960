"""A realtime session's output: its events and audio in order, sent by one task, with the audio
that waits behind the socket counted in seconds so a client that stops reading is found."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import WebSocket

# an event, audio with the event that announces it (dropped together), or the end
Item = str | tuple[str | None, bytes, float] | None


class Outbox:
    """What a session sends, queued; ``run`` hands it to the socket in order."""

    def __init__(self, ws: WebSocket, max_waiting_seconds: float) -> None:
        self.ws = ws
        self.max_waiting = max_waiting_seconds
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.seconds = 0.0  # audio queued, not yet handed to the socket
        self.too_slow = False

    def event(self, event: dict[str, Any]) -> None:
        self.queue.put_nowait(json.dumps(event))

    def audio(self, data: bytes, seconds: float, announce: dict[str, Any] | None = None) -> None:
        # Counted in seconds (an Opus byte holds ~12x the audio of a PCM one) and judged when
        # more audio arrives, on what still waits behind the socket: one chunk over the cap (16
        # frames are 1.28 s) is not a slow client; audio not handed over since the last one is.
        if self.seconds > self.max_waiting:
            self.too_slow = True
        self.seconds += seconds
        self.queue.put_nowait((json.dumps(announce) if announce is not None else None, data,
                               seconds))

    def drop(self) -> None:
        """Forget what the client has not been sent (it stopped reading)."""
        while not self.queue.empty():
            self.queue.get_nowait()
        self.seconds = 0.0

    def close(self) -> None:
        """``run`` returns once what is queued before this is sent."""
        self.queue.put_nowait(None)

    async def run(self) -> None:
        while True:
            item = await self.queue.get()
            if item is None:
                return
            if isinstance(item, tuple):
                # handed to the socket: uvicorn's send waits while its transport buffer is
                # full, so what a client does not read piles up in the queue
                announce, data, seconds = item
                self.seconds -= seconds
                if announce is not None:
                    await self.ws.send_text(announce)
                await self.ws.send_bytes(data)
            else:
                await self.ws.send_text(item)
