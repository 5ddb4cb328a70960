"""Shared fixtures: a session-wide tiny synthetic model, the qtts cache folder, CPU backends."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.backend import BackendSet
from engine.tools.make_model import make_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight checkpoint (HF layout) with its ``model.gguf`` (f32), made once."""
    folder = tmp_path_factory.mktemp("tiny_model")
    make_model(folder, size="tiny", seed=0, progress=False, keep_checkpoint=True)
    return folder


@pytest.fixture(scope="session")
def tiny_gguf(tiny_model_dir: Path) -> Path:
    """Path of the tiny model's ``model.gguf``."""
    return tiny_model_dir / "model.gguf"


@pytest.fixture(scope="session")
def qtts_cache_dir() -> Path:
    """The qtts cache folder: ``$QTTS_CACHE_DIR`` or ``~/.cache/qtts`` (created if missing)."""
    folder = Path(os.environ.get("QTTS_CACHE_DIR") or "~/.cache/qtts").expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def cpu2() -> BackendSet:
    """The CPU backend with 2 threads (the kernels' thread-split cases)."""
    return BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2"})


@pytest.fixture(scope="session")
def cpu1() -> BackendSet:
    """The CPU backend with 1 thread."""
    return BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "1"})
