"""A real ggml RPC server process on loopback, for tests that need a second backend."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def rpc_server(threads: int = 1) -> Iterator[str]:
    """Start ``python -m cli.rpc_server`` and yield its ``host:port`` once it accepts."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.rpc_server", "--port", str(port), "--threads",
         str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"rpc server exited with {proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("rpc server did not start") from None
                time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(timeout=10)
