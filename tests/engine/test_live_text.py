"""Live text (engine/talker/live.py): stable tokens of a growing text, and
``Pipeline.stream_live``: text fed while generation runs gives the frames of the same text as a
streaming-text request, whatever the delta sizes and pauses."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine.backend import BackendSet
from engine.errors import InputError
from engine.gguf_model import open_model
from engine.pipeline import Pipeline, StreamInfo, SynthesisRequest
from engine.talker.live import LiveText, TextUpdate
from engine.talker.prompt import ROLE_TOKENS, TAIL_TOKENS, assistant_text
from tests.engine.live_feed import QueueFeed

TEXT = "Hello there, how are you today? I hope the weather is fine."


@pytest.fixture(scope="module")
def pipe(tiny_gguf: Path) -> Pipeline:
    backends = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "1"})
    return Pipeline(open_model(tiny_gguf), backends, precision="exact", kv_type="f32",
                    chunk_max_frames=4)


def whole_ids(pipe: Pipeline, text: str) -> list[int]:
    assert pipe.prompts is not None
    return pipe.prompts.encode(assistant_text(text))[ROLE_TOKENS:-TAIL_TOKENS]


def test_stable_ids_hold_back_the_word_being_written(pipe: Pipeline) -> None:
    assert pipe.prompts is not None
    live = LiveText(pipe.prompts)
    live.add(TextUpdate("Hello"))
    assert live.ids == []  # "Hello" may still become "Hellos"
    live.add(TextUpdate(" wor"))
    assert live.ids == whole_ids(pipe, "Hello")
    live.add(TextUpdate("ld"))
    assert live.ids == whole_ids(pipe, "Hello")
    live.add(TextUpdate("", flush=True))
    assert live.ids == whole_ids(pipe, "Hello world")
    live.add(TextUpdate("!", end=True))
    assert live.ended


def test_letters_one_by_one_give_the_whole_text_ids(pipe: Pipeline) -> None:
    assert pipe.prompts is not None
    live = LiveText(pipe.prompts)
    for ch in TEXT:
        before = list(live.ids)
        live.add(TextUpdate(ch))
        assert live.ids[: len(before)] == before  # stable ids never change
    live.add(TextUpdate("", end=True))
    assert live.ids == whole_ids(pipe, TEXT)


def test_start_policy(pipe: Pipeline) -> None:
    assert pipe.prompts is not None
    live = LiveText(pipe.prompts)
    live.add(TextUpdate("one two "))
    assert not live.text_ready(5)
    assert live.text_ready(1)
    live.add(TextUpdate("three, four "))
    assert live.text_ready(50)  # a punctuation mark in the stable text


def run_live(pipe: Pipeline, pieces: list[str], delays: list[float], seed: int,
             min_tokens: int = 1) -> tuple[StreamInfo, int]:
    feed = QueueFeed()

    def writer() -> None:
        for piece, delay in zip(pieces, delays, strict=True):
            time.sleep(delay)
            feed.q.put(TextUpdate(piece))
        feed.q.put(TextUpdate("", end=True))

    t = threading.Thread(target=writer)
    t.start()
    info = StreamInfo()
    req = SynthesisRequest(text="", voice="ryan", seed=seed)
    samples = sum(c.audio.shape[0] for c in pipe.stream_live(req, feed, None, info, min_tokens))
    t.join()
    return info, samples


def test_live_frames_equal_the_streaming_text_request(pipe: Pipeline) -> None:
    """Words at 5-50 ms, and a pause longer than the talker's buffer: the codes fed to the
    decoder are exactly those of the whole text in streaming-text mode with the same seed."""
    rng = np.random.default_rng(0)
    words = TEXT.split(" ")
    pieces = [words[0]] + [" " + w for w in words[1:]]
    delays = [float(x) for x in rng.uniform(0.005, 0.05, len(pieces))]
    delays[3] = 1.0  # the talker runs dry here: it must wait, not end the text
    info, samples = run_live(pipe, pieces, delays, seed=5)
    ref = StreamInfo()
    req = SynthesisRequest(text=TEXT, voice="ryan", seed=5, text_mode="stream")
    ref_samples = sum(c.audio.shape[0] for c in pipe.stream(req, None, ref))
    live_codes = np.concatenate(info.codes, axis=1)
    ref_codes = np.concatenate(ref.codes, axis=1)
    # it paused mid-speech: each pause decodes what it holds and restarts the ramp at 1 frame
    assert 1 in [c.shape[1] for c in info.codes[1:-1]]
    assert info.outcome == ref.outcome
    np.testing.assert_array_equal(live_codes, ref_codes)
    assert samples == ref_samples == 1920 * live_codes.shape[1]


def test_cancel_while_waiting_for_text(pipe: Pipeline) -> None:
    feed = QueueFeed()
    feed.q.put(TextUpdate("Some words that go on and on ", flush=True))
    stop = threading.Event()
    info = StreamInfo()
    gen = pipe.stream_live(SynthesisRequest(text="", voice="ryan", seed=1), feed, stop, info)
    threading.Timer(0.5, stop.set).start()
    list(gen)
    assert info.outcome in ("cancelled", "ok")  # the tiny model may end its speech first


def test_bad_voice_is_refused_before_any_text(pipe: Pipeline) -> None:
    with pytest.raises(InputError) as e:
        list(pipe.stream_live(SynthesisRequest(text="", voice="nobody"), QueueFeed()))
    assert e.value.field == "voice"
