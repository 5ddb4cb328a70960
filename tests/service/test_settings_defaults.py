"""Out-of-the-box settings: how many threads a worker computes with."""

from __future__ import annotations

import os

import pytest

from service.settings import Settings


def test_one_worker_computes_on_every_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QTTS_THREADS", raising=False)
    cpus = len(os.sched_getaffinity(0))
    assert Settings(workers=1).threads_for_workers() == cpus
    assert Settings(workers=2).threads_for_workers() == max(1, cpus // 2)
    assert Settings(workers=cpus + 1).threads_for_workers() == 1  # never below one


def test_a_machine_of_many_cpus_gives_a_worker_at_most_256(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """QTTS_THREADS's cap (engine.options.MAX_THREADS): a share of 384 CPUs was handed to the
    worker as a QTTS_THREADS that the start check refuses, naming a variable never set."""
    from engine.backend import check_backend_settings, default_threads
    from engine.options import MAX_THREADS, EngineOptions

    monkeypatch.delenv("QTTS_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(384)))
    env = Settings(workers=1).worker_env()
    assert env["QTTS_THREADS"] == str(MAX_THREADS) and default_threads() == MAX_THREADS
    check_backend_settings(EngineOptions.from_env({**os.environ, **env}))
    assert Settings(workers=2).threads_for_workers() == 192


def test_explicit_threads_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QTTS_THREADS", "3")
    assert Settings(workers=1).threads_for_workers() == 3
    assert Settings(workers=1, threads_per_worker=5).threads_for_workers() == 5
    assert Settings(workers=1, threads_per_worker=5).worker_env()["QTTS_THREADS"] == "5"


def test_workers_batch_and_ramp_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of the box a worker speaks up to four text requests at once, each on the ``auto``
    ramp (gentle alone, doubling in a batch: engine.pipeline.Ramp); explicit choices win."""
    monkeypatch.delenv("QTTS_MAX_BATCH", raising=False)
    monkeypatch.delenv("QTTS_CHUNK_RAMP", raising=False)
    opts = Settings().worker_options(0, 100)
    assert (opts.max_batch, opts.chunk_ramp) == (4, "auto")
    assert Settings(max_batch=1, chunk_ramp="double").worker_options(0, 100).chunk_ramp == "double"
    assert Settings(chunk_ramp="gentle").worker_options(0, 100).chunk_ramp == "gentle"


def test_the_first_chunk_reaches_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QTTS_FIRST_CHUNK_FRAMES", raising=False)
    assert Settings().worker_options(0, 100).first_chunk_frames == 1
    monkeypatch.setenv("QTTS_FIRST_CHUNK_FRAMES", "2")
    assert Settings().worker_options(0, 100).first_chunk_frames == 2
    monkeypatch.setenv("QTTS_FIRST_CHUNK_FRAMES", "0")
    with pytest.raises(ValueError, match="first_chunk_frames"):
        Settings()
