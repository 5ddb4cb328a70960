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
from service.gate import GateMiddleware
from service.metrics import Metrics
from service.model_info import ModelInfo
from service.pool import WorkerPool
from service.routes import ROUTERS
from service.settings import Settings
from service.state import VERSION, State

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
        app.state.qtts = State(settings=settings, metrics=metrics, pool=pool, model=info)
        await pool.start()
        try:
            yield
        finally:
            pool.draining = True
            await pool.stop()

    app = FastAPI(
        title="qtts",
        version=VERSION,
        description="Streaming Qwen3-TTS on ggml. See docs/service.md.",
        lifespan=lifespan,
        docs_url=None,  # served offline by service/routes/docs.py
        redoc_url=None,
    )
    app.add_middleware(GateMiddleware)
    handlers.install(app)
    for router in ROUTERS:
        app.include_router(router)
    return app
