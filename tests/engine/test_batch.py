"""Batched talker steps and code-predictor passes: a session's results do not depend on who
shares its batch (engine/talker/batch.py, engine/talker/scheduler.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.backend import BackendSet
from engine.ggml import custom_ops as co
from engine.gguf_model import open_model
from engine.gguf_schema import GGML_F16
from engine.talker import (
    PromptBuilder,
    SamplingParams,
    TalkerModel,
    Trace,
    generate_frames,
    make_rng,
)
from engine.talker.generate import FrameSampler, Result
from engine.talker.scheduler import Emitted, Ended, FrameScheduler
from engine.tools.make_model import make_model


@dataclass(frozen=True)
class Job:
    text: str
    voice: int  # index into the model's voices
    greedy: bool
    seed: int
    budget: int
    mode: str
    join: int  # scheduler iteration at which it joins


@dataclass
class Run:
    codes: list[np.ndarray] = field(default_factory=list)
    trace: Trace = field(default_factory=Trace)
    result: Result | None = None


JOBS = [
    Job("Hello world.", 0, True, 0, 12, "full", 0),
    Job("A much longer sentence, and it goes on for a while.", 0, False, 5, 20, "stream", 2),
    Job("Third one!", -1, False, 9, 7, "full", 5),
    Job("Late and greedy.", 1, True, 3, 9, "stream", 11),
]


@pytest.fixture(scope="module")
def backends() -> BackendSet:
    return BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2"})


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_q4")
    make_model(folder, size="tiny", seed=1, progress=False, dtype="q4_0")
    return folder / "model.gguf"


@pytest.fixture(scope="module")
def q4_fallback_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Q4_0 model with a matrix the converter keeps at F16 (its rows of 5 heads x 16 = 80
    inputs are not a multiple of the 32-value block): the code predictor's attention output."""
    folder = tmp_path_factory.mktemp("tiny_q4_fallback")
    make_model(folder, size="tiny", seed=1, progress=False, dtype="q4_0", overrides={"cp": {
        "num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 16, "hidden_size": 64,
        "intermediate_size": 160}})
    return folder / "model.gguf"


def _params(model: Any, job: Job) -> SamplingParams:
    params = SamplingParams.from_defaults(model.generation_defaults)
    return params.greedy() if job.greedy else params


def _talker(model: Any, backends: BackendSet, kv_type: str) -> TalkerModel:
    # every voice's prompt prefix computed once and kept, as a warmed-up worker has them
    talker = TalkerModel(model, backends, kv_type=kv_type)
    pb = PromptBuilder(model)
    talker.pin_prefixes([pb.build(".", v, "english") for v in pb.voices])
    return talker


def _alone(talker: TalkerModel, model: Any, job: Job) -> Run:
    pb = PromptBuilder(model)
    prompt = pb.build(job.text, pb.voices[job.voice], "english", text_mode=job.mode)
    run = Run()
    gen = generate_frames(talker, prompt, _params(model, job), job.budget,
                          make_rng(job.seed)[0], trace=run.trace)
    while True:
        try:
            run.codes.append(next(gen).codes)
        except StopIteration as stop:
            run.result = stop.value
            return run


def _batched(talker: TalkerModel, model: Any, jobs: list[Job], max_batch: int,
             cancel_at: dict[int, int] | None = None, joint_prefill: str = "live") -> list[Run]:
    """Run ``jobs`` through one scheduler; ``cancel_at``: job index -> iteration to cancel."""
    pb = PromptBuilder(model)
    sched = FrameScheduler(talker, max_batch, joint_prefill=joint_prefill)
    runs = [Run() for _ in jobs]
    flags = [threading.Event() for _ in jobs]
    uid_job: dict[int, int] = {}
    it = 0
    try:
        while it < 500:
            for i, job in enumerate(jobs):
                if job.join == it:
                    prompt = pb.build(job.text, pb.voices[job.voice], "english",
                                      text_mode=job.mode)
                    sampler = FrameSampler(int(talker.cfg.vocab_size), talker.eos_id,
                                           _params(model, job), make_rng(job.seed)[0],
                                           runs[i].trace)
                    uid_job[sched.add(prompt, sampler, job.budget, flags[i].is_set)] = i
            for i, at in (cancel_at or {}).items():
                if at == it:
                    flags[i].set()
            for ev in sched.iterate():
                if isinstance(ev, Emitted):
                    runs[uid_job[ev.uid]].codes.append(ev.frame.codes)
                else:
                    assert isinstance(ev, Ended)
                    runs[uid_job[ev.uid]].result = ev.result
            it += 1
            if it > max(j.join for j in jobs) and len(sched) == 0:
                break
    finally:
        sched.close()
    return runs


def _same(a: Run, b: Run, exact: bool = True) -> None:
    """Same outcome and codes; logits bit for bit (``exact``) or to float rounding."""
    assert a.result is not None and b.result is not None
    assert (a.result.outcome, a.result.frames) == (b.result.outcome, b.result.frames)
    np.testing.assert_array_equal(np.stack(a.codes), np.stack(b.codes))
    pairs = list(zip(a.trace.talker, b.trace.talker, strict=True))
    for xs, ys in zip(a.trace.code_predictor, b.trace.code_predictor, strict=True):
        pairs.extend(zip(xs, ys, strict=True))
    for x, y in pairs:
        if exact:
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-4)


# Q4_0 (what a worker serves): gemv_q4 (and ggml's Q4_0 kernels without it) give one row exactly
# what they give it among several, so the logits are equal bit for bit. F32 weights: ggml
# multiplies one row with its dot product and several with its tiled GEMM, which round
# differently (engine/talker/batch.py).
@pytest.mark.parametrize(("weights", "kv_type", "ops"), [
    ("f32", "f32", True), ("f32", "f16", True), ("q4_0", "f16", True), ("q4_0", "f32", True),
    ("q4_0", "f16", False),  # ggml's attention nodes (an accelerator's cache, QTTS_CUSTOM_OPS=0)
    ("q4_0+f16", "f16", True),  # a matrix kept at F16 among the Q4_0 ones: one column at a time
])
def test_batched_equals_alone(weights: str, kv_type: str, ops: bool, tiny_gguf: Path,
                              q4_gguf: Path, q4_fallback_gguf: Path, backends: BackendSet
                              ) -> None:
    """Sessions joining and leaving at different frames, with different voices, lengths, text
    modes, greedy and seeded sampling: each one's codes and logits are its codes and logits
    alone."""
    model = open_model({"f32": tiny_gguf, "q4_0": q4_gguf, "q4_0+f16": q4_fallback_gguf}[weights])
    if weights == "q4_0+f16":
        assert model.tensor_info("cp.blk.0.attn_out.weight").ggml_type == GGML_F16
    if not ops:
        backends = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2",
                                        "QTTS_CUSTOM_OPS": "0"})
    talker = _talker(model, backends, kv_type)
    try:
        alone = [_alone(talker, model, j) for j in JOBS]
        # the step graphs take qtts's fused attention (custom_ops.attn_step) or ggml's nodes
        assert talker.cache is not None and talker.cache.native == (ops and co.available())
        assert len({len(r.codes) for r in alone}) > 2  # they leave at different frames
        for a, b in zip(alone, _batched(talker, model, JOBS, max_batch=4), strict=True):
            _same(a, b, exact=weights != "f32")
    finally:
        talker.close()


# four join in the same round, with different voices, text modes and lengths: the two whole
# texts prefill in one graph (several new rows each: the int8 GEMM where the layers have int8
# copies), the two streaming-text openings (one new row each) in another
# (engine/talker/joint_prefill.py); a fifth joins later, alone
JOBS_TOGETHER = [
    Job("Hello world.", 0, True, 0, 12, "full", 0),
    Job("A much longer sentence, and it goes on for a while.", 1, False, 5, 20, "stream", 0),
    Job("Third one!", -1, False, 9, 7, "full", 0),
    Job("Streaming as well.", 0, True, 7, 10, "stream", 0),
    Job("Late and greedy.", 1, True, 3, 9, "stream", 4),
]


@pytest.mark.parametrize(("weights", "kv_type"), [("f32", "f32"), ("q4_0", "f16"),
                                                  ("q4_0", "f32")])
def test_joiners_prefilled_together_equal_alone(weights: str, kv_type: str, tiny_gguf: Path,
                                                q4_gguf: Path, backends: BackendSet,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Utterances that join in the same round prefill in one graph (whole texts too with
    ``joint_prefill="all"``; by default live text, and whole texts only in pairs in a burst),
    and each one's codes and logits are its codes and logits alone (bit for bit with Q4_0
    weights)."""
    from engine.talker import scheduler

    joint: list[int] = []
    real = scheduler.prefill_joint

    def counted(talker: TalkerModel, joiners: list[Any]) -> Any:
        joint.append(len(joiners))
        return real(talker, joiners)

    monkeypatch.setattr(scheduler, "prefill_joint", counted)
    model = open_model(tiny_gguf if weights == "f32" else q4_gguf)
    talker = _talker(model, backends, kv_type)
    try:
        if weights == "q4_0":
            assert all(lw.i8 is not None for lw in talker.weights.layers)
        alone = [_alone(talker, model, j) for j in JOBS_TOGETHER]
        assert _batched(talker, model, JOBS_TOGETHER[:3], max_batch=5) and joint == []
        batched = _batched(talker, model, JOBS_TOGETHER, max_batch=5, joint_prefill="all")
        assert sorted(joint) == [2, 2]
        for a, b in zip(alone, batched, strict=True):
            _same(a, b, exact=weights == "q4_0")
    finally:
        talker.close()


def test_whole_texts_of_a_burst_prefill_in_pairs(q4_gguf: Path, backends: BackendSet,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole texts that join while nothing streams (a burst) prefill two at a time in one
    graph; two that join while another streams prefill one a round (its audio would wait for
    their joint graph). Each one's codes and logits are its own, bit for bit."""
    from engine.talker import scheduler

    joint: list[int] = []
    real = scheduler.prefill_joint
    monkeypatch.setattr(scheduler, "prefill_joint",
                        lambda talker, js: joint.append(len(js)) or real(talker, js))
    model = open_model(q4_gguf)
    talker = _talker(model, backends, "f16")
    burst = [Job("Hello world, once more.", 0, True, 0, 8, "full", 0),
             Job("A much longer sentence, and it goes on.", 1, False, 5, 9, "full", 0),
             Job("Third one, a full text!", -1, True, 9, 7, "full", 0)]
    later = [Job("Hello world.", 0, True, 0, 12, "full", 0),
             Job("Two join while one speaks.", 1, True, 5, 6, "full", 4),
             Job("And a third one here.", -1, False, 9, 6, "full", 4)]
    try:
        for jobs, want in ((burst, [2]), (later, [])):
            joint.clear()
            alone = [_alone(talker, model, j) for j in jobs]
            joint.clear()
            batched = _batched(talker, model, jobs, max_batch=3)
            assert joint == want
            for a, b in zip(alone, batched, strict=True):
                _same(a, b)
        joint.clear()
        _batched(talker, model, later, max_batch=3, joint_prefill="all")
        assert joint == [2]
    finally:
        talker.close()


def test_cancel_leaves_at_once_others_unchanged(tiny_gguf: Path, backends: BackendSet
                                                ) -> None:
    model = open_model(tiny_gguf)
    talker = _talker(model, backends, "f32")
    try:
        alone = [_alone(talker, model, j) for j in JOBS[:3]]
        runs = _batched(talker, model, JOBS[:3], max_batch=3, cancel_at={1: 6})
        r = runs[1].result
        assert r is not None and r.outcome == "cancelled"
        # joins at iteration 2 (prefill, then its first frame), frames at 2, 3, 4, 5; the flag
        # set before iteration 6 stops it before another frame
        assert r.frames == len(runs[1].codes) == 4
        np.testing.assert_array_equal(np.stack(runs[1].codes), np.stack(alone[1].codes[:4]))
        _same(alone[0], runs[0], exact=False)
        _same(alone[2], runs[2], exact=False)
    finally:
        talker.close()


def test_full_batch_refuses_and_slot_is_reused(tiny_gguf: Path, backends: BackendSet) -> None:
    model = open_model(tiny_gguf)
    talker = _talker(model, backends, "f32")
    pb = PromptBuilder(model)
    sched = FrameScheduler(talker, 1)
    params = SamplingParams.from_defaults(model.generation_defaults).greedy()
    try:
        prompt = pb.build("Hi.", pb.voices[0], "english")

        def sampler() -> FrameSampler:
            return FrameSampler(int(talker.cfg.vocab_size), talker.eos_id, params,
                                make_rng(0)[0])

        uid = sched.add(prompt, sampler(), 3)
        with pytest.raises(RuntimeError, match="full"):
            sched.add(prompt, sampler(), 3)
        ended = sched.cancel(uid)
        assert ended is not None and ended.result.outcome == "cancelled" and sched.free == 1
        sched.add(prompt, sampler(), 3)
        events = []
        while len(sched):
            events.extend(sched.iterate())
        assert sum(isinstance(e, Emitted) for e in events) == 3
    finally:
        sched.close()
        talker.close()
