"""Shared fixtures: a session-wide tiny synthetic model, the qtts cache folder, CPU backends."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
def tiny_q4_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny model converted to Q4_0 talker weights (the type a worker serves), opened."""
    from engine.gguf_model import open_model
    from engine.tools.convert import convert

    out = tmp_path_factory.mktemp("q4") / "q4.gguf"
    convert(tiny_model_dir, out, dtype="q4_0", progress=False)
    return open_model(out)


@pytest.fixture(scope="session")
def qtts_cache_dir() -> Path:
    """The qtts cache folder: ``$QTTS_CACHE_DIR`` or ``~/.cache/qtts`` (created if missing)."""
    folder = Path(os.environ.get("QTTS_CACHE_DIR") or "~/.cache/qtts").expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def pytest_report_header(config: pytest.Config) -> str:
    """Free disk where the run writes (its temp folder, and the cache that a cold run fills
    with fixtures and models; docs/testing.md): a full disk otherwise shows only as failed
    writes deep in the log."""
    import shutil
    import tempfile

    cache = Path(os.environ.get("QTTS_CACHE_DIR") or "~/.cache/qtts").expanduser().absolute()
    while not cache.exists():  # not made yet: the disk it will be on
        cache = cache.parent
    where = [Path(tempfile.gettempdir()), cache]
    return "disk free: " + ", ".join(
        f"{shutil.disk_usage(p).free / 2**30:.1f} GiB at {p}" for p in where)


@pytest.fixture(scope="session")
def cpu2() -> BackendSet:
    """The CPU backend with 2 threads (the kernels' thread-split cases)."""
    return BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2"})


@pytest.fixture(scope="session")
def bf16_cpu2(cpu2: BackendSet) -> BackendSet:
    """2 threads on which the decoder's fast mode really rounds to BF16: qtts's BF16 conv kernel
    where this CPU has it, else ggml's BF16 mul_mats (qtts's ops off). On such a CPU with the
    ops on, fast mode runs F32 Winograd convs, or exact mode's (test_decoder_precision)."""
    from engine.decoder.weights import rounds_to_bf16

    if rounds_to_bf16(cpu2):
        return cpu2
    return BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2",
                                "QTTS_CUSTOM_OPS": "0"})


@pytest.fixture(scope="session")
def cpu1() -> BackendSet:
    """The CPU backend with 1 thread."""
    return BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "1"})


# ---------------------------------------------------------------------------------------------
# Skips: under `make test` (QTTS_STRICT_SKIPS=1) or CI, a skip not in tests/allowed_skips.py
# fails the session, so a missing dependency or a native library that did not load cannot turn
# hundreds of tests into silent skips.

_SKIPS: list[tuple[str, str]] = []


def _strict_skips() -> bool:
    flag = os.environ.get("QTTS_STRICT_SKIPS")
    if flag is not None:
        return flag not in ("", "0")
    return bool(os.environ.get("CI"))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        _SKIPS.append((report.nodeid, reason.removeprefix("Skipped: ")))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tests.allowed_skips import unlisted

    bad = unlisted(_SKIPS)
    if not bad or not _strict_skips():
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{len(bad)} test(s) skipped that tests/allowed_skips.py does not allow "
             "(QTTS_STRICT_SKIPS / CI): install what they need, or list them with a reason"]
    lines += [f"  {nodeid}: {reason}" for nodeid, reason in bad]
    if reporter is not None:
        reporter.write_sep("=", "UNLISTED SKIPS", red=True)
        for line in lines:
            reporter.write_line(line)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def native_ops() -> object:
    """The native ops library (native/ops): it is part of the repository, so failing to load
    it is a failure of the build, never a reason to skip."""
    from engine.ggml import ops

    if ops is None:
        pytest.fail("libqtts_ops did not load: run `make native` (python native/build.py)")
    return ops


# Model seeds of the stress model that the audio-checking tests run on (``stress_gguf_seeded``):
# two different sets of weights, so a check that holds on one by luck shows on the other.
STRESS_SEEDS = (0, 1)


@pytest.fixture(scope="session")
def stress_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """``seed -> folder`` of a tiny model on the ``stress`` weight recipe
    (engine/tools/make_model.py), each made once per session: every stage O(1), the waveform
    O(0.3) and unclipped, the talker's logits peaked, so a broken stage changes the audio (the
    default recipe's decoder clips and its pre-transformer is about the identity). Checkpoint
    kept (the reference loads it)."""
    made: dict[int, Path] = {}

    def get(seed: int) -> Path:
        if seed not in made:
            folder = tmp_path_factory.mktemp(f"stress_model_seed{seed}")
            make_model(folder, size="tiny", seed=seed, progress=False, keep_checkpoint=True,
                       recipe="stress")
            made[seed] = folder
        return made[seed]

    return get


@pytest.fixture(scope="session")
def stress_model_dir(stress_models: Callable[[int], Path]) -> Path:
    """The stress model of seed 0 (``stress_models``)."""
    return stress_models(0)


@pytest.fixture(scope="session")
def stress_gguf(stress_model_dir: Path) -> Path:
    """Path of the stress model's ``model.gguf`` (seed 0)."""
    return stress_model_dir / "model.gguf"


@pytest.fixture(scope="session", params=STRESS_SEEDS, ids=lambda s: f"model_seed{s}")
def stress_gguf_seeded(request: pytest.FixtureRequest,
                       stress_models: Callable[[int], Path]) -> Path:
    """The stress model's ``model.gguf`` for each of ``STRESS_SEEDS``: a test using it runs
    once per model seed."""
    return stress_models(int(request.param)) / "model.gguf"
