"""BatchRunner: several text streams on one Pipeline give each stream exactly its chunks alone."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from engine.backend import BackendSet
from engine.batching import BatchRunner, Finished
from engine.errors import InputError
from engine.gguf_model import open_model
from engine.pipeline import AudioChunk, CodesRequest, Pipeline, StreamInfo, SynthesisRequest
from engine.tools.make_model import make_model

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


def _alone(p: Pipeline, req: SynthesisRequest) -> tuple[list[AudioChunk], StreamInfo]:
    info = StreamInfo()
    chunks = list(p.stream(req, info=info))
    return chunks, info


def _run(p: Pipeline, reqs: list[SynthesisRequest], joins: list[int], max_batch: int,
         cancel_at: dict[int, int] | None = None
         ) -> tuple[list[list[AudioChunk]], list[StreamInfo], list[str]]:
    runner = BatchRunner(p, max_batch)
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
        runner.close()
    return chunks, infos, ends


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
