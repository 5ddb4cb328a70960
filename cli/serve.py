"""``qtts serve``: run the HTTP service with uvicorn.

Settings come from ``QTTS_*`` environment variables (service/settings.py); the flags below
override them. SIGTERM/SIGINT drain (``service/server.py``): readiness and new requests 503
first, in-flight ones may finish for ``QTTS_DRAIN_SECONDS``, then the listener closes and the
workers stop; exit status 0 after a clean drain.
"""

from __future__ import annotations

import argparse
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

    from service.app import ModelInfo, create_app
    from service.listen import bind
    from service.logs import setup_logging
    from service.server import make_server
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
    from engine.errors import QttsError

    try:
        _check_engine_settings(settings)
    except QttsError as e:
        print(f"qtts serve: {e}", file=sys.stderr)
        return 2
    try:
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
    server = make_server(app, settings)
    server.run(sockets=[sock])
    if not server.started:
        return 1
    return 0 if server.clean else 1


def _check_engine_settings(settings: Any) -> None:
    """The engine's ``QTTS_*`` variables, as set and as a worker will get them: a worker that
    cannot start on them would be restarted again and again while the server answered 503."""
    import os

    from engine.backend import check_backend_settings
    from engine.options import EngineOptions

    for env in (os.environ, {**os.environ, **settings.worker_env()}):
        check_backend_settings(EngineOptions.from_env(env))
