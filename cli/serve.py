"""``qtts serve``: run the HTTP service with uvicorn.

Settings come from ``QTTS_*`` environment variables (service/settings.py); the flags below
override them. SIGTERM/SIGINT drain: new requests get 503, in-flight ones may finish for
``QTTS_DRAIN_SECONDS``, then workers stop.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from pydantic import ValidationError

_FLAGS: list[tuple[str, str, type, str]] = [
    ("--model", "model", str, "GGUF model path (QTTS_MODEL)"),
    ("--host", "host", str, "listen address (QTTS_HOST, default 127.0.0.1)"),
    ("--port", "port", int, "TCP port (QTTS_PORT, default 8000)"),
    ("--workers", "workers", int, "worker processes (QTTS_WORKERS, default 1)"),
    ("--threads", "threads_per_worker", int, "CPU threads per worker (QTTS_THREADS_PER_WORKER)"),
    ("--queue-size", "queue_size", int, "requests that may wait (QTTS_QUEUE_SIZE, default 8)"),
    ("--log-format", "log_format", str, "text | json (QTTS_LOG_FORMAT)"),
]


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to an argparse subparsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="run the HTTP service (POST /tts, /v1/audio/speech, /metrics)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag, dest, typ, help_ in _FLAGS:
        p.add_argument(flag, dest=dest, type=typ, default=None, help=help_)
    p.set_defaults(func=run_serve)
    return p


def run_serve(args: argparse.Namespace) -> int:
    """Start uvicorn with the settings; returns the process exit code."""
    import uvicorn

    from service.app import ModelInfo, create_app
    from service.listen import bind
    from service.logs import setup_logging
    from service.settings import Settings

    overrides = {dest: getattr(args, dest) for _, dest, _, _ in _FLAGS
                 if getattr(args, dest, None) is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as e:
        for err in e.errors():
            name = "QTTS_" + "_".join(str(x) for x in err["loc"]).upper()
            print(f"qtts serve: {name}: {err['msg']}", file=sys.stderr)
        return 2
    setup_logging(settings.log_format, settings.log_level)
    try:
        from engine.errors import QttsError

        info = ModelInfo.load(str(settings.model))  # fail fast, with the loader's one-line message
    except QttsError as e:
        print(f"qtts serve: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"qtts serve: {settings.model}: {e.strerror or e}", file=sys.stderr)
        return 2
    try:  # before any worker loads the model: a taken port fails now, not after the load
        sock = bind(settings.host, settings.port)
    except OSError as e:
        print(f"qtts serve: cannot listen on {settings.host}:{settings.port}: "
              f"{e.strerror or e} (QTTS_HOST / QTTS_PORT)", file=sys.stderr)
        return 2

    app = create_app(settings, info)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_config=None, access_log=False,
        lifespan="on", timeout_graceful_shutdown=int(max(1, settings.drain_seconds)),
        timeout_keep_alive=5,
    )

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            st = getattr(app.state, "qtts", None)
            if st is not None and not st.pool.draining:
                st.pool.draining = True
                logging.getLogger("qtts.app").info(
                    "signal %s: draining (no new requests; up to %gs for in-flight ones)",
                    sig, settings.drain_seconds)
            super().handle_exit(sig, frame)

    server = DrainingServer(config)
    server.run(sockets=[sock])
    return 0 if server.started else 1
