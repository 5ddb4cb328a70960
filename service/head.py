"""HEAD answered as GET without the body (RFC 9110 9.3.2).

FastAPI's routes answer GET only, so a HEAD got 405; probes and load balancers that check with
HEAD (uptime monitors, some proxies' health checks) then see a down server. Here a HEAD runs
the GET route and passes its status and headers on, ``Content-Length`` included, with no body.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HeadAsGet:
    """The outermost middleware: a HEAD request runs as GET, its body is dropped."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def send_head(message: Message) -> None:
            if message["type"] != "http.response.body":
                await send(message)
            elif not message.get("more_body", False):
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        await self.app({**scope, "method": "GET"}, receive, send_head)
