"""What every route shares: the settings, the metrics, the worker pool and the model's facts.

``ModelInfo`` is read once from the GGUF header at start (the front end never computes); the
app keeps one ``State`` on ``app.state.qtts`` and routes reach it through ``get_state``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from fastapi import Request

from service.metrics import Metrics
from service.pool import WorkerPool
from service.settings import Settings

VERSION = "0.1.0"


@dataclass
class ModelInfo:
    """What the front end knows about the model (read once from the GGUF header)."""

    path: str
    parts: frozenset[str]
    synthetic: bool
    speakers: list[str]
    languages: list[str]
    model_type: str
    text_ready: bool  # the engine has a text pipeline for this model

    @classmethod
    def load(cls, path: str) -> ModelInfo:
        from engine.gguf_model import open_model

        m = open_model(path)
        try:
            parts = frozenset(m.parts)
            return cls(
                path=str(path),
                parts=parts,
                synthetic=bool(m.synthetic),
                speakers=sorted(m.speakers),
                languages=sorted(m.languages),
                model_type=str(getattr(m, "tts_model_type", "") or ""),
                text_ready="talker" in parts
                and importlib.util.find_spec("engine.pipeline") is not None,
            )
        finally:
            m.close()


@dataclass
class State:
    settings: Settings
    metrics: Metrics
    pool: WorkerPool
    model: ModelInfo


def get_state(request: Request) -> State:
    """FastAPI dependency: the app's one ``State`` (set by the lifespan before any request)."""
    st: State = request.app.state.qtts
    return st
