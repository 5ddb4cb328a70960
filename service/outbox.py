"""A realtime session's output: its events and audio in order, sent by one task, with the audio
that waits behind the socket counted in seconds so a client that stops reading is found."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import WebSocket


@dataclass(frozen=True)
class Audio:
    """Encoded audio with the event that announces it (sent or dropped together)."""

    announce: str | None
    data: bytes
    seconds: float
    utterance: int | None = None  # whose audio: ``drop_audio`` forgets one utterance's
    frames: int = 0
    samples: int = 0


Item = str | Audio | None  # an event, audio, or the end


class Outbox:
    """What a session sends, queued; ``run`` hands it to the socket in order."""

    def __init__(self, ws: WebSocket, max_waiting_seconds: float,
                 sent: Callable[[float], None]) -> None:
        self.ws = ws
        self.sent = sent  # told the seconds of audio handed to the socket (a counter)
        self.max_waiting = max_waiting_seconds
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.seconds = 0.0  # audio queued, not yet handed to the socket
        self.too_slow = False

    def event(self, event: dict[str, Any]) -> None:
        self.queue.put_nowait(json.dumps(event))

    def audio(self, data: bytes, seconds: float, announce: dict[str, Any] | None = None,
              utterance: int | None = None, frames: int = 0, samples: int = 0) -> None:
        # Counted in seconds (an Opus byte holds ~12x the audio of a PCM one) and judged when
        # more audio arrives, on what still waits behind the socket: one chunk over the cap (16
        # frames are 1.28 s) is not a slow client; audio not handed over since the last one is.
        if self.seconds > self.max_waiting:
            self.too_slow = True
        self.seconds += seconds
        self.queue.put_nowait(Audio(json.dumps(announce) if announce is not None else None,
                                    data, seconds, utterance, frames, samples))

    def drop(self) -> None:
        """Forget what the client has not been sent (it stopped reading)."""
        while not self.queue.empty():
            self.queue.get_nowait()
        self.seconds = 0.0

    def drop_audio(self, utterance: int) -> list[Audio]:
        """Forget the audio of ``utterance`` not yet handed to the socket (its listener
        interrupted it), keeping every other item in order; returns what went."""
        kept: list[Item] = []
        dropped: list[Audio] = []
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, Audio) and item.utterance == utterance:
                self.seconds -= item.seconds
                dropped.append(item)
            else:
                kept.append(item)
        for item in kept:
            self.queue.put_nowait(item)
        return dropped

    def close(self) -> None:
        """``run`` returns once what is queued before this is sent."""
        self.queue.put_nowait(None)

    async def run(self) -> None:
        while True:
            item = await self.queue.get()
            if item is None:
                return
            if isinstance(item, Audio):
                # handed to the socket: uvicorn's send waits while its transport buffer is
                # full, so what a client does not read piles up in the queue
                self.seconds -= item.seconds
                if item.announce is not None:
                    await self.ws.send_text(item.announce)
                await self.ws.send_bytes(item.data)
                self.sent(item.seconds)
            else:
                await self.ws.send_text(item)
