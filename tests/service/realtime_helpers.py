"""The realtime route's client side for tests: the URL, one utterance's events and audio."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from tests.service.helpers import Server


def ws_url(server: Server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/tts/realtime"


async def collect(ws: ClientConnection) -> tuple[list[dict[str, Any]], bytes]:
    """Every event and the audio of one utterance, up to and with its done (or an error that
    closes the session)."""
    events: list[dict[str, Any]] = []
    audio = b""
    async for msg in ws:
        if isinstance(msg, bytes):
            audio += msg
            continue
        ev = json.loads(msg)
        events.append(ev)
        if ev["type"] == "done":
            break
    return events, audio


async def events_until_closed(ws: ClientConnection) -> list[dict[str, Any]]:
    """Every event up to the close the server sends (``ConnectionClosed`` is expected: an
    error if the server never closes within 30 s of its last message)."""
    from websockets.exceptions import ConnectionClosed

    events: list[dict[str, Any]] = []
    try:
        while True:
            msg = await asyncio.wait_for(ws.recv(), 30)
            if isinstance(msg, str):
                events.append(json.loads(msg))
    except ConnectionClosed:
        return events


async def first_audio(ws: ClientConnection) -> None:
    """Read up to the first audio message."""
    async for msg in ws:
        if isinstance(msg, bytes):
            return


async def error_event(ws: ClientConnection) -> dict[str, Any]:
    """Read up to the next error event and return it."""
    async for msg in ws:
        if isinstance(msg, str) and json.loads(msg)["type"] == "error":
            return dict(json.loads(msg))
    raise AssertionError("closed without an error event")


async def send(ws: ClientConnection, **msg: Any) -> None:
    await ws.send(json.dumps(msg))


async def open_session(ws: ClientConnection, **settings: Any) -> dict[str, Any]:
    """Read the session's start, send its settings, return the ``session.updated`` event."""
    await ws.recv()
    await send(ws, type="session", **settings)
    return dict(json.loads(await ws.recv()))


async def speak(server: Server, text: str, **settings: Any
                ) -> tuple[list[dict[str, Any]], bytes]:
    """A session of its own with ``settings`` speaks ``text`` sent whole, then its end: the
    utterance's events and audio."""
    async with connect(ws_url(server)) as ws:
        await open_session(ws, **settings)
        await send(ws, type="text", text=text)
        await send(ws, type="end")
        return await collect(ws)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def words(text: str) -> list[str]:
    parts = text.split(" ")
    return [parts[0]] + [" " + p for p in parts[1:]]
