"""Service tests: a real ``qtts serve`` (``python -m cli serve``) on 127.0.0.1 at a free port,
real worker processes on the tiny stress model, real HTTP clients (httpx, openai)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.service.helpers import Server, server_starter, serving


@pytest.fixture(scope="session")
def service_model(stress_gguf: Path) -> Path:
    """The model the servers load: ``$QTTS_TEST_MODEL``, else the session's stress model
    (tests/conftest.py): its audio is O(0.3) and unclipped and its talker's peaked logits
    depend on every layer, so what a server sends shows a broken stage (the default recipe
    clips most samples at full scale). Its talker, like the default one, rarely samples
    end-of-speech (with the seeds the tests use, none of their requests ends early), so
    budgets, truncation and cancellation mid-stream stay testable."""
    given = os.environ.get("QTTS_TEST_MODEL")
    return Path(given) if given else stress_gguf


@pytest.fixture
def make_server(service_model: Path, tmp_path: Path) -> Iterator[Any]:
    yield from server_starter(service_model, tmp_path)


@pytest.fixture(scope="module")
def server(service_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A shared server: 2 workers, small body cap, JSON logs."""
    yield from serving(service_model, tmp_path_factory.mktemp("server"), workers=2,
                       max_body_bytes=300_000, queue_size=16)




@pytest.fixture(scope="session")
def postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real PostgreSQL server for the session (tests/postgres.py)."""
    from tests.postgres import Postgres

    pg = Postgres(tmp_path_factory.mktemp("postgres"))
    try:
        yield pg
    finally:
        pg.close()


@pytest.fixture(scope="session")
def base_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Base model (clones voices): its ``model.gguf``."""
    from engine.tools.make_model import make_model

    folder = tmp_path_factory.mktemp("tiny_base")
    make_model(folder, "tiny", seed=21, variant="base", progress=False)
    return folder / "model.gguf"
