"""BatchRunner: several text streams on one Pipeline give each stream exactly its chunks alone."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from engine import pipeline as pipeline_module
from engine.backend import BackendSet
from engine.batching import WARM_FRAMES, WARM_INSTRUCT, BatchRunner, Finished, Rejected
from engine.decoder import StreamingDecoder, streaming
from engine.decoder.streaming import JOIN_MAX_FRAMES
from engine.errors import InputError
from engine.gguf_model import open_model
from engine.pipeline import AudioChunk, CodesRequest, Pipeline, StreamInfo, SynthesisRequest
from engine.talker.live import TextUpdate
from engine.tools.make_model import make_model
from tests.engine.live_feed import QueueFeed

REQUESTS = [
    SynthesisRequest("Hello there.", voice="ryan", seed=1, max_frames=9),
    # several segments (segment_tokens below): the next segment joins when one ends
    SynthesisRequest("First sentence here. Then a second one follows it. And a third.",
                     voice="ryan", seed=2, text_mode="stream", max_frames=30),
    SynthesisRequest("Greedy words.", voice="ryan", greedy=True, max_frames=7,
                     chunk_max_frames=2),
]
JOIN = [0, 3, 6]  # the step at which each request is submitted


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    # Q4_0 talker: batched rows are bit for bit what they are alone (engine/talker/batch.py)
    folder = tmp_path_factory.mktemp("tiny_q4_batching")
    make_model(folder, size="tiny", seed=2, progress=False, dtype="q4_0")
    backends = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2"})
    p = Pipeline(open_model(folder / "model.gguf"), backends, segment_tokens=8)
    p.warm_up(pin_prefixes=True)
    yield p
    p.close()


def _pushed_alone(p: Pipeline, info: StreamInfo) -> np.ndarray[Any, Any]:
    """A stream's codes pushed through a decoder of its own in the stream's own chunks."""
    sd = StreamingDecoder(p.decoder)
    return np.concatenate([sd.push(block)[0] for block in info.codes])


def _alone(p: Pipeline, req: SynthesisRequest) -> tuple[list[AudioChunk], StreamInfo]:
    info = StreamInfo()
    chunks = list(p.stream(req, info=info))
    return chunks, info


def _run(p: Pipeline, reqs: list[SynthesisRequest], joins: list[int], max_batch: int,
         cancel_at: dict[int, int] | None = None, runner: BatchRunner | None = None
         ) -> tuple[list[list[AudioChunk]], list[StreamInfo], list[str]]:
    own = runner is None
    runner = BatchRunner(p, max_batch) if runner is None else runner
    chunks: list[list[AudioChunk]] = [[] for _ in reqs]
    infos = [StreamInfo() for _ in reqs]
    ends = ["" for _ in reqs]
    flags = [threading.Event() for _ in reqs]
    sid_req: dict[int, int] = {}
    try:
        for it in range(1000):
            for i, at in enumerate(joins):
                if at == it:
                    sid_req[runner.submit(reqs[i], flags[i], infos[i])] = i
            for i, at in (cancel_at or {}).items():
                if at == it:
                    flags[i].set()
            for sid, item in runner.step():
                if isinstance(item, Finished):
                    ends[sid_req[sid]] = item.outcome
                else:
                    chunks[sid_req[sid]].append(item)
            if it > max(joins) and not len(runner):
                break
    finally:
        if own:
            runner.close()
    return chunks, infos, ends


@contextlib.contextmanager
def joint_pushes() -> Iterator[list[int]]:
    """The streams of every decoder push graph made while the block runs, in order."""
    seen: list[int] = []
    real = streaming._push_group

    def counting(decoders: list[StreamingDecoder], cs: list[Any]) -> Any:
        seen.append(len(decoders))
        return real(decoders, cs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(streaming, "_push_group", counting)
        yield seen


def test_streams_batched_equal_alone(pipeline: Pipeline) -> None:
    alone = [_alone(pipeline, r) for r in REQUESTS]
    assert len(alone[1][1].codes) > 1  # (several segments, several chunks)
    chunks, infos, ends = _run(pipeline, REQUESTS, JOIN, max_batch=3)
    for req, (a_chunks, a_info), b_chunks, b_info, end in zip(REQUESTS, alone, chunks, infos,
                                                             ends, strict=True):
        assert end == a_info.outcome
        assert [c.frames for c in b_chunks] == [c.frames for c in a_chunks]
        np.testing.assert_array_equal(np.concatenate(b_info.codes, 1),
                                      np.concatenate(a_info.codes, 1))
        for x, y in zip(a_chunks, b_chunks, strict=True):
            np.testing.assert_array_equal(x.audio, y.audio)
        assert b_info.budget == a_info.budget
        if req.seed is not None:
            assert b_info.seed == a_info.seed == req.seed


@pytest.mark.parametrize("text_mode", ["stream", "full"])
def test_a_voices_first_request_sounds_as_its_repeats(pipeline: Pipeline,
                                                      text_mode: str) -> None:
    """Without pinned prefixes, a voice and language's first request computes its prompt
    prefix (kept for the next): its codes and audio are those of the repeats that find it
    kept. (A streaming-text opening is one row past the prefix: joined to the prefix in one
    graph it took the int8 GEMM, alone the stored Q4_0 weights, so the first request of a
    voice sounded unlike its repeats.)"""
    p = Pipeline(pipeline.model, pipeline.backends, pipeline.decoder, segment_tokens=8)
    try:
        p.warm_up(pin_prefixes=False)
        assert p.talker is not None and p.talker.pinned_prefixes == 0
        req = SynthesisRequest("Hello there, my friend.", "serena", "italian", seed=11,
                               text_mode=text_mode, max_frames=12)
        (first, first_info), *repeats = [_alone(p, req) for _ in range(3)]
        for chunks, info in repeats:
            np.testing.assert_array_equal(np.concatenate(info.codes, 1),
                                          np.concatenate(first_info.codes, 1))
            np.testing.assert_array_equal(np.concatenate([c.audio for c in chunks]),
                                          np.concatenate([c.audio for c in first]))
    finally:
        p.close()


def test_pinned_prefixes_change_no_audio(pipeline: Pipeline) -> None:
    """A worker that pins every voice's prompt prefix at warm-up (QTTS_PIN_PREFIXES=1) speaks
    the codes and audio of one that computes each prefix on its first request (=0), for every
    seed: a pinned prefix has the bits a request keeps."""
    runs = []
    for pin in (True, False):
        p = Pipeline(pipeline.model, pipeline.backends, pipeline.decoder, segment_tokens=8)
        try:
            p.warm_up(pin_prefixes=pin)
            assert p.talker is not None and (p.talker.pinned_prefixes > 0) == pin
            runs.append([_alone(p, SynthesisRequest(text, voice, lang, seed=seed, max_frames=12))
                         for seed, (text, voice, lang) in enumerate([
                             ("Hello there, my friend.", "serena", "italian"),
                             ("A second voice speaks.", "ryan", "english"),
                             ("Hello there, my friend.", "serena", "italian")])])
        finally:
            p.close()
    for (a_chunks, a_info), (b_chunks, b_info) in zip(*runs, strict=True):
        np.testing.assert_array_equal(np.concatenate(a_info.codes, 1),
                                      np.concatenate(b_info.codes, 1))
        np.testing.assert_array_equal(np.concatenate([c.audio for c in a_chunks]),
                                      np.concatenate([c.audio for c in b_chunks]))


def test_auto_ramp_doubles_in_company_and_keeps_each_streams_audio(pipeline: Pipeline) -> None:
    """With the ``auto`` ramp a stream alone takes the gentle sizes (those of an unbatched
    pipeline) and streams sharing the batch double theirs; a stream's codes stay its own, and
    so does its audio: the same bits where the decoder is chunking-invariant (qtts's CPU
    kernels without Winograd), else those of its own chunks pushed alone (a Winograd tile
    starts where a chunk starts: on this saturated decoder, whose clamp makes a rounding at a
    zero crossing a jump, another chunking differs by more than rounding)."""
    auto = Pipeline(pipeline.model, pipeline.backends, pipeline.decoder, segment_tokens=8,
                    chunk_ramp="auto")
    try:
        reqs = [SynthesisRequest(t, "ryan", "english", seed=40 + i, max_frames=24)
                for i, t in enumerate(("One stream alone first.", "Then two more join it.",
                                       "And a third one."))]
        alone = [_alone(auto, r) for r in reqs]
        assert [c.frames for c in alone[0][0]][:5] == [1, 1, 1, 2, 2]
        with joint_pushes() as joint:
            chunks, infos, _ = _run(auto, reqs, [0, 0, 0], max_batch=3)
        # the two that prefill together push in the same rounds: as one graph (chunks up to
        # JOIN_MAX_FRAMES) where the decoder's audio does not depend on how it is pushed
        assert joint[:4] == ([2, 1] * 2 if pipeline.decoder.chunk_invariant else [1] * 4)
        for (a_chunks, a_info), b_chunks, b_info in zip(alone, chunks, infos, strict=True):
            assert [c.frames for c in b_chunks][:4] == [1, 2, 4, 8]
            np.testing.assert_array_equal(np.concatenate(b_info.codes, 1),
                                          np.concatenate(a_info.codes, 1))
            a = np.concatenate([c.audio for c in a_chunks])
            b = np.concatenate([c.audio for c in b_chunks])
            np.testing.assert_array_equal(
                b, a if pipeline.decoder.chunk_invariant else _pushed_alone(auto, b_info))
    finally:
        auto.close()


def test_warm_up_builds_and_reserves_for_every_slot_and_changes_nothing(
        pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker warms its runner before it is ready: the code-predictor graphs of every
    batch size are built then, and a talker cache is reserved for each slot the model's own
    cache does not serve. Streams that join then build no code-predictor graph and allocate no
    cache, the reserved caches are free again when they end, and the streams are as alone."""
    assert pipeline.talker is not None
    alone = [_alone(pipeline, r) for r in REQUESTS]
    runner = BatchRunner(pipeline, 3)
    steps: list[int] = []
    step = runner.step
    monkeypatch.setattr(runner, "step", lambda *a, **k: (steps.append(len(runner)),
                                                          step(*a, **k))[1])
    assert runner.warm_up() > 0
    # ... and every slot spoke a short text at once, to its end
    assert max(steps) == 3 and len(steps) >= WARM_FRAMES and len(runner) == 0
    monkeypatch.setattr(runner, "step", step)
    built = {n: [id(g) for g in graphs] for n, (_, graphs) in runner.batched._cp.items()}
    assert sorted(built) == [1, 2, 3]
    reserved = list(runner.frames._reserved)
    assert len(reserved) == 2 and all(c.buffer is not None for c in reserved)
    allocated: list[int] = []
    new_cache = type(pipeline.talker).new_cache
    monkeypatch.setattr(type(pipeline.talker), "new_cache",
                        lambda self, n: (allocated.append(n), new_cache(self, n))[1])
    try:
        _, infos, ends = _run(pipeline, REQUESTS, [0, 0, 0], 3, runner=runner)
        after = {n: [id(g) for g in graphs] for n, (_, graphs) in runner.batched._cp.items()}
        spare = list(runner.frames._spare)
    finally:
        runner.close()
    assert after == built
    assert allocated == []
    assert sorted(map(id, spare)) == sorted(map(id, reserved))
    assert all(c.buffer is None for c in reserved)  # close() frees them
    for (_, a_info), b_info, end in zip(alone, infos, ends, strict=True):
        assert end == a_info.outcome
        np.testing.assert_array_equal(np.concatenate(b_info.codes, 1),
                                      np.concatenate(a_info.codes, 1))


def test_the_warm_up_burst_takes_an_instruction_or_is_skipped(
        pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that speaks only to an instruction (VoiceDesign) gets one in its warm-up burst;
    one that needs a request's own voice (a Base model's clone) skips the burst, and the
    runner is ready and empty either way."""
    submitted: list[str | None] = []
    submit = BatchRunner.submit

    def wants_instruct(self: BatchRunner, request: Any, *a: Any, **k: Any) -> int:
        submitted.append(request.instruct)
        if request.instruct is None:
            raise InputError("instruct", "this model speaks to an instruction")
        return submit(self, replace(request, instruct=None), *a, **k)  # (this one has none)

    monkeypatch.setattr(BatchRunner, "submit", wants_instruct)
    runner = BatchRunner(pipeline, 2)
    try:
        runner.warm_up()
        assert submitted == [None, WARM_INSTRUCT, WARM_INSTRUCT] and len(runner) == 0
    finally:
        runner.close()

    def refuses(self: BatchRunner, request: Any, *a: Any, **k: Any) -> int:
        raise InputError("voice", "this model clones: a request needs its voice")

    monkeypatch.setattr(BatchRunner, "submit", refuses)
    runner = BatchRunner(pipeline, 2)
    try:
        assert runner.warm_up() > 0 and len(runner) == 0 and runner.free == 2
    finally:
        runner.close()


def test_reserved_caches_fit_a_talker_with_few_positions(pipeline: Pipeline,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A talker whose positions end before a reserved cache's length gets caches of all its
    positions: the worker's warm-up must not refuse the model."""
    assert pipeline.talker is not None
    monkeypatch.setattr(pipeline.talker, "cfg",
                        replace(pipeline.talker.cfg, max_position_embeddings=200))
    runner = BatchRunner(pipeline, 2)
    try:
        runner.warm_up()
        assert [c.n_ctx for c in runner.frames._reserved] == [256]  # 200, to the 64 bucket
    finally:
        runner.close()


def test_reserved_caches_stop_at_the_cap(pipeline: Pipeline,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``RESERVED_SLOTS`` a joining stream allocates its own cache again, and frees it."""
    import engine.batching as batching

    assert pipeline.talker is not None
    monkeypatch.setattr(batching, "RESERVED_SLOTS", 1)
    runner = BatchRunner(pipeline, 3)
    runner.warm_up()
    assert len(runner.frames._reserved) == 1
    made: list[Any] = []
    new_cache = type(pipeline.talker).new_cache
    monkeypatch.setattr(type(pipeline.talker), "new_cache",
                        lambda self, n: (made.append(new_cache(self, n)), made[-1])[1])
    try:
        _, _, ends = _run(pipeline, REQUESTS, [0, 0, 0], 3, runner=runner)
    finally:
        runner.close()
    assert all(ends)  # every stream ended
    assert len(made) == 1 and made[0].buffer is None  # the third stream's, freed at its end


def test_cancelled_stream_ends_others_unchanged(pipeline: Pipeline) -> None:
    alone = [_alone(pipeline, r) for r in REQUESTS]
    _, infos, ends = _run(pipeline, REQUESTS, JOIN, max_batch=2, cancel_at={0: 4})
    assert ends[0] == "cancelled"
    got = np.concatenate(infos[0].codes, 1)
    np.testing.assert_array_equal(got, np.concatenate(alone[0][1].codes, 1)[:, : got.shape[1]])
    for i in (1, 2):  # request 2 takes the slot the cancelled stream left (max_batch=2)
        assert ends[i] == alone[i][1].outcome
        np.testing.assert_array_equal(np.concatenate(infos[i].codes, 1),
                                      np.concatenate(alone[i][1].codes, 1))




def test_admission_errors(pipeline: Pipeline) -> None:
    runner = BatchRunner(pipeline, 1)
    try:
        with pytest.raises(InputError) as e:
            runner.submit(SynthesisRequest("Hi.", voice="nobody"))
        assert e.value.field == "voice"
        with pytest.raises(InputError):
            runner.submit(CodesRequest(np.zeros((16, 3), np.int32)))
        assert runner.free == 1  # a refused request takes no slot
        sid = runner.submit(REQUESTS[0])
        with pytest.raises(RuntimeError, match="full"):
            runner.submit(REQUESTS[2])
        assert runner.cancel(sid) and runner.free == 1
        assert not runner.cancel(sid)
    finally:
        runner.close()


LIVE_TEXT = "Hello there, how are you today? I hope the weather is fine."


class StepFeed:
    """A live text scripted by the runner's steps: word i is there from step ``at[i]`` on, and
    the end of the text with the last word."""

    def __init__(self, text: str, at: list[int]) -> None:
        words = text.split(" ")
        self.pieces = [words[0]] + [" " + w for w in words[1:]]
        assert len(at) == len(self.pieces)
        self.at, self.step, self.given = at, 0, 0

    def take(self, timeout: float) -> TextUpdate | None:
        n = sum(1 for a in self.at if a <= self.step)
        if n == self.given:
            return None
        text, self.given = "".join(self.pieces[self.given:n]), n
        return TextUpdate(text, end=n == len(self.pieces))


def _run_live(p: Pipeline, feeds: dict[int, StepFeed], reqs: dict[int, SynthesisRequest],
              max_batch: int, cancel_at: dict[int, int] | None = None, warm: bool = False,
              ) -> tuple[dict[int, list[AudioChunk]], dict[int, StreamInfo], dict[int, object]]:
    """Live streams (``feeds``, submitted at step 0) and whole-text ones (``reqs``: submitted
    at the step given) in one batch; their chunks, infos and last events by key. ``warm``:
    the runner warmed up first, as the worker's (its caches reserved). The feeds deliver by
    step, not in time, so a start does not wait in time for their end (``LivePlan.holds``,
    tested in test_live_text.py): with this fixture's short segments it would, and the steps
    meanwhile would bring more text."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline_module, "END_GRACE_S", 0.0)
        return _run_live_steps(p, feeds, reqs, max_batch, cancel_at, warm)


def _run_live_steps(p: Pipeline, feeds: dict[int, StepFeed], reqs: dict[int, SynthesisRequest],
                    max_batch: int, cancel_at: dict[int, int] | None, warm: bool,
                    ) -> tuple[dict[int, list[AudioChunk]], dict[int, StreamInfo],
                               dict[int, object]]:
    runner = BatchRunner(p, max_batch)
    if warm:
        runner.warm_up()
    chunks: dict[int, list[AudioChunk]] = {k: [] for k in [*feeds, *reqs]}
    infos = {k: StreamInfo() for k in chunks}
    ends: dict[int, object] = {}
    flags = {k: threading.Event() for k in chunks}
    key_of: dict[int, int] = {}
    try:
        for k, feed in feeds.items():
            key_of[runner.submit_live(SynthesisRequest("", voice="ryan", seed=5 + k), feed,
                                      flags[k], infos[k])] = k
        for it in range(2000):
            for feed in feeds.values():
                feed.step = it
            for k, at in reqs.items():
                if at == it:
                    key_of[runner.submit(REQUESTS[k], flags[k], infos[k])] = k
            for k, at in (cancel_at or {}).items():
                if at == it:
                    flags[k].set()
            for sid, item in runner.step():
                if isinstance(item, AudioChunk):
                    chunks[key_of[sid]].append(item)
                else:
                    ends[key_of[sid]] = item
            if len(ends) == len(chunks):
                break
    finally:
        runner.close()
    return chunks, infos, ends


def _live_alone(p: Pipeline, text: str, seed: int, info: StreamInfo) -> list[AudioChunk]:
    # unbatched: the first words, then (once it speaks) the rest and the end
    feed = QueueFeed()
    words = text.split(" ")
    feed.q.put(TextUpdate(" ".join(words[:4])))
    chunks = []
    for c in p.stream_live(SynthesisRequest("", voice="ryan", seed=seed), feed, info=info):
        if not chunks:
            feed.q.put(TextUpdate(" " + " ".join(words[4:]), end=True))
        chunks.append(c)
    return chunks


def test_live_streams_that_pause_together_push_together(pipeline: Pipeline) -> None:
    """Two live texts written at the same pace start, run dry and resume in the same rounds:
    each round's chunks of both, those a pause for text flushes included, are one decoder
    graph where the decoder's audio does not depend on how it is pushed; each stream's codes
    and audio are those it gets alone (the audio of its own chunks, where it does depend)."""
    n = len(LIVE_TEXT.split(" "))
    at = [0, 0, 0] + [6 + 9 * i for i in range(n - 3)]  # dry for ~9 frames at a time
    feeds = {10: StepFeed(LIVE_TEXT, at), 11: StepFeed(LIVE_TEXT, at)}
    with joint_pushes() as joint:
        chunks, infos, ends = _run_live(pipeline, feeds, {}, max_batch=2)
    sizes = [c.frames for c in chunks[10]]
    assert sizes == [c.frames for c in chunks[11]]  # (the same pace: the same chunks)
    short = next(i for i, n in enumerate(sizes) if n > JOIN_MAX_FRAMES)
    assert short >= 10 and any(b < a for a, b in itertools.pairwise(sizes[:short])), (
        "no pause flushed a chunk")
    if pipeline.decoder.chunk_invariant:
        assert joint[:short] == [2] * short
    else:
        assert set(joint) == {1}
    for k in feeds:
        ref = StreamInfo()
        ref_chunks = _live_alone(pipeline, LIVE_TEXT, 5 + k, ref)
        assert isinstance(ends[k], Finished)
        np.testing.assert_array_equal(np.concatenate(infos[k].codes, 1),
                                      np.concatenate(ref.codes, 1))
        got = np.concatenate([c.audio for c in chunks[k]])
        # (where Winograd tiles make the audio depend on the chunking: its own chunks alone)
        want = (np.concatenate([c.audio for c in ref_chunks]) if pipeline.decoder.chunk_invariant
                else _pushed_alone(pipeline, infos[k]))
        np.testing.assert_array_equal(got, want)

@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_live_streams_share_the_batch(pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch,
                                      warm: bool) -> None:
    """Two live texts that run dry mid-speech and a whole text joining later, in one batch:
    each live stream's codes are those it gets alone (``stream_live``) with the same seed, it
    paused (a one-frame chunk after its first), and the whole text gets its
    chunks alone, sample for sample. The live caches start at 16 frames, so they grow (their
    rows copied) several times on the way; ``warm``: from the runner's reserved caches."""
    import engine.talker.scheduler as sched

    monkeypatch.setattr(sched, "LIVE_CACHE_FRAMES", 16)
    grown: list[int] = []
    grow = sched.FrameScheduler._grow
    monkeypatch.setattr(sched.FrameScheduler, "_grow", lambda self, u, n: (
        grown.append(n), grow(self, u, n))[1])
    n = len(LIVE_TEXT.split(" "))
    feeds = {10: StepFeed(LIVE_TEXT, [0, 0, 1, 2] + [40] * (n - 4)),
             11: StepFeed(LIVE_TEXT, [0, 5] + [25 + i for i in range(n - 2)])}
    chunks, infos, ends = _run_live(pipeline, feeds, {0: 3}, max_batch=3, warm=warm)
    for k in feeds:
        ref = StreamInfo()
        ref_chunks = _live_alone(pipeline, LIVE_TEXT, 5 + k, ref)
        end = ends[k]
        assert isinstance(end, Finished) and end.outcome == ref.outcome
        np.testing.assert_array_equal(np.concatenate(infos[k].codes, 1),
                                      np.concatenate(ref.codes, 1))
        assert infos[k].text_tokens == ref.text_tokens
        got = sum(c.audio.shape[0] for c in chunks[k])
        assert got == sum(c.audio.shape[0] for c in ref_chunks) == 1920 * sum(
            c.frames for c in chunks[k])
        assert 1 in [c.frames for c in chunks[k][1:]], "it never paused for text"
    # (the first stream may hold the model's own, long cache; warm, the other starts on a
    # reserved cache of 128 positions and grows once, giving it back)
    assert len(grown) >= (1 if warm else 2)
    alone, _ = _alone(pipeline, REQUESTS[0])
    assert [c.frames for c in chunks[0]] == [c.frames for c in alone]
    for x, y in zip(alone, chunks[0], strict=True):
        np.testing.assert_array_equal(x.audio, y.audio)


def test_live_stream_start_cancel_and_empty_text(pipeline: Pipeline) -> None:
    """A live text whose end comes before its start is the streaming-text request exactly; a
    live stream cancelled while it waits for text, or before its first word, ends
    "cancelled"; one that ends with no words is rejected naming the text."""
    whole = StepFeed(LIVE_TEXT, [0] * len(LIVE_TEXT.split(" ")))
    waiting = StepFeed("Never finished words", [0, 0, 10**6])
    chunks, _, ends = _run_live(pipeline, {0: whole, 1: waiting}, {}, max_batch=2,
                                    cancel_at={1: 30})
    ref = StreamInfo()
    ref_chunks = list(pipeline.stream(SynthesisRequest(LIVE_TEXT, voice="ryan", seed=5,
                                                       text_mode="stream"), info=ref))
    for x, y in zip(ref_chunks, chunks[0], strict=True):
        np.testing.assert_array_equal(x.audio, y.audio)
    assert isinstance(ends[1], Finished) and ends[1].outcome == "cancelled"
    # cancelled before its start: no word ever came
    _, _, ends = _run_live(pipeline, {0: StepFeed("silence", [10**6])}, {}, max_batch=1,
                           cancel_at={0: 5})
    assert isinstance(ends[0], Finished) and ends[0].outcome == "cancelled"
    empty = StepFeed(" ", [3, 3])
    _, _, ends = _run_live(pipeline, {0: empty}, {}, max_batch=1)
    assert isinstance(ends[0], Rejected) and ends[0].error.field == "text"


class BrokenFeed(StepFeed):
    """A live text whose feed raises from step ``breaks`` on: a fault of the stream's own (its
    text, where the worker's pipe or the tokeniser could raise)."""

    def __init__(self, text: str, at: list[int], breaks: int) -> None:
        super().__init__(text, at)
        self.breaks = breaks

    def take(self, timeout: float) -> TextUpdate | None:
        if self.step >= self.breaks:
            raise RuntimeError("the feed broke")
        return super().take(timeout)


LIVE_AT = [0] + [12 + i for i in range(len(LIVE_TEXT.split(" ")) - 1)]


def _beside(p: Pipeline, broken: BrokenFeed | None,
            ) -> tuple[dict[int, StreamInfo], dict[int, object]]:
    # a live stream (0) and a whole text (2), with the broken live stream (1) or without
    feeds = {0: StepFeed(LIVE_TEXT, LIVE_AT)}
    if broken is not None:
        feeds[1] = broken
    _, infos, ends = _run_live(p, feeds, {2: 0}, max_batch=3)
    return infos, ends


@pytest.fixture(scope="module")
def alone_beside(pipeline: Pipeline) -> tuple[dict[int, StreamInfo], dict[int, object]]:
    return _beside(pipeline, None)


@pytest.mark.parametrize("breaks", [0, 6, 16], ids=["before-start", "on-a-guess", "speaking"])
def test_a_stream_whose_own_work_fails_ends_alone(
        pipeline: Pipeline, alone_beside: tuple[dict[int, StreamInfo], dict[int, object]],
        breaks: int) -> None:
    """A live stream whose text raises (before it starts, while its opening guess waits for
    the text, while it speaks) ends alone with its error; a live and a whole-text stream
    beside it speak the codes they speak without it."""
    infos, ends = _beside(pipeline, BrokenFeed(LIVE_TEXT, LIVE_AT, breaks))
    err = ends[1]
    assert isinstance(err, Rejected) and isinstance(err.error, RuntimeError)
    assert infos[1].outcome == "error"
    ref_infos, ref_ends = alone_beside
    for k in (0, 2):
        assert isinstance(ends[k], Finished) and ends[k] == ref_ends[k]
        np.testing.assert_array_equal(np.concatenate(infos[k].codes, 1),
                                      np.concatenate(ref_infos[k].codes, 1))


def test_each_chunk_is_delivered_as_made_most_urgent_first(pipeline: Pipeline) -> None:
    """``step(deliver)`` hands every event over before it returns, in the returned order, and
    before the round's talker step; a stream's first chunk is decoded before another stream's
    push of the same step (A pushes at its frames 1, 3, 7, ...: B joins at A's seventh
    frame)."""
    runner = BatchRunner(pipeline, 2)
    a = runner.submit(REQUESTS[1])
    seen: list[tuple[int, object]] = []
    rows_stepped: list[int] = []  # the round's talker-step rows when each chunk came
    both_steps = 0

    def deliver(sid: int, item: object) -> None:
        seen.append((sid, item))
        rows_stepped.append(runner.last.batch)

    try:
        for it in range(60):
            if it == 6:
                b = runner.submit(REQUESTS[0])
            seen.clear()
            out = runner.step(deliver)
            assert seen == out
            pushed = [sid for sid, item in out if isinstance(item, AudioChunk)]
            if it == 6:
                assert pushed == [b, a]  # without the ordering: [a, b]
                both_steps += 1
            if not len(runner):
                break
    finally:
        runner.close()
    assert both_steps == 1
    assert rows_stepped and not any(rows_stepped)  # no chunk waited for a talker step


def test_a_stream_opened_on_a_guess_holds_its_audio_until_the_text_settles(
        pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two live streams whose first word comes alone, the next delta 12 steps later: one word
    complete as it stands ("Hello": the guess holds), one cut ("Th", then "e": the guess is
    refuted, as "The" begins with another token, and the stream starts over). Neither sends
    audio before that delta; both speak the codes and samples they get alone with the same
    seed. Both open in the first step, so their openings prefill in one graph."""
    from engine.talker import scheduler

    joint: list[int] = []
    real = scheduler.prefill_joint
    monkeypatch.setattr(scheduler, "prefill_joint",
                        lambda talker, js: joint.append(len(js)) or real(talker, js))
    texts = {0: LIVE_TEXT, 1: "The weather is fine, I hope you are well today."}
    right = StepFeed(texts[0], [0] + [12 + i for i in range(len(texts[0].split(" ")) - 1)])
    n = len(texts[1].split(" "))
    wrong = StepFeed(texts[1], [0] * n)
    wrong.pieces = ["Th", "e", *wrong.pieces[1:]]
    wrong.at = [0, 12] + [13 + i for i in range(n - 1)]
    feeds = {0: right, 1: wrong}
    runner = BatchRunner(pipeline, 2)
    infos = {k: StreamInfo() for k in feeds}
    chunks: dict[int, list[AudioChunk]] = {k: [] for k in feeds}
    first_at: dict[int, int] = {}
    ends: dict[int, object] = {}
    try:
        key_of = {runner.submit_live(SynthesisRequest("", voice="ryan", seed=5 + k), feed,
                                     None, infos[k]): k for k, feed in feeds.items()}
        for it in range(2000):
            for feed in feeds.values():
                feed.step = it
            for sid, item in runner.step():
                k = key_of[sid]
                if isinstance(item, AudioChunk):
                    first_at.setdefault(k, it)
                    chunks[k].append(item)
                else:
                    ends[k] = item
            if len(ends) == len(feeds):
                break
    finally:
        runner.close()
    assert [(infos[k].guessed, infos[k].refuted) for k in feeds] == [(1, 0), (1, 1)]
    assert joint and joint[0] == 2
    assert min(first_at.values()) >= 12
    for k in feeds:
        ref = StreamInfo()
        ref_chunks = _live_alone(pipeline, texts[k], 5 + k, ref)
        end = ends[k]
        assert isinstance(end, Finished) and end.outcome == ref.outcome
        np.testing.assert_array_equal(np.concatenate(infos[k].codes, 1),
                                      np.concatenate(ref.codes, 1))
        assert sum(c.audio.shape[0] for c in chunks[k]) == sum(
            c.audio.shape[0] for c in ref_chunks)


def test_a_held_chunk_goes_out_in_its_step_once_the_pumped_text_confirms_it(
        pipeline: Pipeline) -> None:
    """A live stream opened on a guess ("Hello", the rest not there yet): when the text that
    confirms the guess comes during the step that made its first chunk (``pump``, as the
    worker reads its pipe between pushes), that chunk goes out in that step, not after the
    round's talker step and the next step's start."""
    n = len(LIVE_TEXT.split(" "))
    feed = StepFeed(LIVE_TEXT, [0] + [10**9] * (n - 1))
    pumped: list[int] = []
    it = 0

    def pump() -> None:
        pumped.append(it)
        feed.at = [0] * n  # the rest of the text has come meanwhile

    runner = BatchRunner(pipeline, 2)
    info = StreamInfo()
    first_at = None
    try:
        runner.submit_live(SynthesisRequest("", voice="ryan", seed=5), feed, None, info)
        for it in range(500):
            events = runner.step(pump=pump)
            if first_at is None and any(isinstance(x, AudioChunk) for _, x in events):
                first_at = it
            if any(isinstance(x, Finished) for _, x in events):
                break
    finally:
        runner.close()
    assert (info.guessed, info.refuted) == (1, 0)
    assert pumped and first_at == pumped[0]
    ref = StreamInfo()
    _live_alone(pipeline, LIVE_TEXT, 5, ref)
    np.testing.assert_array_equal(np.concatenate(info.codes, 1), np.concatenate(ref.codes, 1))
