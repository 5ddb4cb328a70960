"""The FastAPI app: lifespan, gate middleware, error handlers and the routers.

``create_app(settings)`` builds the app; its lifespan opens the model's metadata (the front
end never computes) and starts the worker pool. Where things live (docs/service.md, "Layout"):
routes in service/routes/, request checks in validation.py, the streaming answer in
streaming.py, the gate in gate.py, the worker messages in protocol.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from service import handlers
from service.cors import CORS_EXPOSED, Cors
from service.gate import GateMiddleware
from service.guard import ErrorGuard
from service.head import HeadAsGet
from service.metrics import ROUTES, Metrics
from service.model_info import ModelInfo
from service.openapi import install as install_openapi
from service.pool import WorkerPool
from service.routes import ROUTERS
from service.settings import Settings
from service.state import VERSION, State
from service.voices.api import count_voices
from service.voices.store import open_store

__all__ = ["VERSION", "ModelInfo", "create_app"]


def create_app(settings: Settings | None = None, model: ModelInfo | None = None) -> FastAPI:
    """The app; ``model`` (the GGUF's metadata) is read at startup when not given."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        info: ModelInfo = (
            model if model is not None
            else await asyncio.to_thread(ModelInfo.load, str(settings.model))
        )
        metrics = Metrics()
        pool = WorkerPool(settings, metrics, max_frames_cap=info.frames(settings.max_audio_seconds))
        store = open_store(settings.voice_db, settings.data_dir, settings.voice_db_timeout)
        st = State(settings=settings, metrics=metrics, pool=pool, model=info, store=store,
                   owners=settings.key_owners())
        app.state.qtts = st
        counter = None
        try:
            # (in the try: workers started before a failing spawn are stopped, since they
            # ignore SIGTERM and would hold the exit)
            await pool.start()
            # (a model that cannot clone never touches the store: no file, no connection)
            counter = asyncio.create_task(count_voices(st)) if info.clones else None
            yield
        finally:
            if counter is not None:
                counter.cancel()
            pool.draining = True
            st.drain_begun.set()
            await pool.stop()
            store.close()

    app = FastAPI(
        title="qtts",
        version=VERSION,
        description="Streaming Qwen3-TTS on ggml. See docs/service.md.",
        lifespan=lifespan,
        docs_url=None,  # served offline by service/routes/docs.py
        redoc_url=None,
    )
    app.add_middleware(GateMiddleware)
    # errors nothing answered still get our JSON 500, request id, log line, counter
    app.add_middleware(ErrorGuard, metrics=lambda: st.metrics
                       if (st := getattr(app.state, "qtts", None)) is not None else None,
                       synth_routes=ROUTES)
    app.add_middleware(HeadAsGet)  # a HEAD is a GET to everything inside
    if settings.allowed_origins:  # outermost: preflights are answered before the gate
        app.add_middleware(Cors, allow_origins=list(settings.allowed_origins),
                           allow_methods=["GET", "POST", "DELETE"], allow_headers=["*"],
                           expose_headers=CORS_EXPOSED, max_age=600,
                           # a listed page on the internet calling a server on localhost or the
                           # LAN: Chrome's Private Network Access asks for this in the preflight
                           allow_private_network=True)
    handlers.install(app)
    for router in ROUTERS:
        app.include_router(router)
    # the OpenAPI document with the model's voices and languages and the server's caps
    install_openapi(app, settings, lambda: st.model
                    if (st := getattr(app.state, "qtts", None)) is not None else model)
    return app
