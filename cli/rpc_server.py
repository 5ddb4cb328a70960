"""`python -m cli.rpc_server`: serve this machine's CPU backend over ggml's RPC protocol.

A BackendSet with ``QTTS_BACKEND=rpc`` and ``QTTS_RPC_SERVERS=host:port`` then offloads graphs
to it. On CPU-only machines this is the second backend with a buffer type of its own, which is
how the tests exercise the scheduler's split and op-filter paths like a real accelerator's.
Only bind it to loopback or a trusted network: the protocol has no authentication.
"""

from __future__ import annotations

import argparse

from engine.backend import list_devices, rpc_function
from engine.ggml import ffi


def main() -> None:
    """Serve until killed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    cpu = [d.handle for d in list_devices() if d.backend == "cpu"]
    devices = ffi.new("ggml_backend_dev_t[]", cpu)
    endpoint = f"{args.host}:{args.port}".encode()
    print(f"rpc server on {endpoint.decode()}", flush=True)
    start_server = rpc_function(
        "ggml_backend_rpc_start_server",
        "void (*)(const char *, const char *, size_t, size_t, ggml_backend_dev_t *)",
    )
    start_server(endpoint, ffi.NULL, args.threads, len(cpu), devices)


if __name__ == "__main__":
    main()
