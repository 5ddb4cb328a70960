"""The listening socket, bound before anything slow starts: a port in use is an error at once,
not after a worker has loaded the model."""

from __future__ import annotations

import socket


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``OSError`` when the address is taken or wrong);
    uvicorn listens on it."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # like uvicorn: a restarted server may bind while old connections sit in TIME_WAIT
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock
