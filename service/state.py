"""What every route shares: the settings, the metrics, the worker pool and the model's facts.

``ModelInfo`` (model_info.py) is read once from the GGUF header at start; the app keeps one
``State`` on ``app.state.qtts`` and routes reach it through ``get_state``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from service.metrics import Metrics
from service.model_info import ModelInfo
from service.pool import WorkerPool
from service.settings import Settings
from service.voices.store import VoiceStore

VERSION = "0.1.0"


@dataclass
class State:
    settings: Settings
    metrics: Metrics
    pool: WorkerPool
    model: ModelInfo
    store: VoiceStore | None = None  # cloned voices (None: the app was made without one)
    owners: dict[str, str] = field(default_factory=dict)  # API key -> owner
    # set when a drain begins (on the loop: a signal handler only sets ``pool.draining``); a
    # realtime session between utterances closes then
    drain_begun: asyncio.Event = field(default_factory=asyncio.Event)
    # set when the drain's time is up with work still running: a realtime session still
    # speaking says so and closes before the server cuts its connection
    drain_over: asyncio.Event = field(default_factory=asyncio.Event)
    sessions: set[Any] = field(default_factory=set)  # the realtime sessions open


def get_state(request: Request) -> State:
    """FastAPI dependency: the app's one ``State`` (set by the lifespan before any request)."""
    st: State = request.app.state.qtts
    return st
