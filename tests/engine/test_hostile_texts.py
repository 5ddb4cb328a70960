"""Hostile and long texts through the Pipeline (tiny model): token caps, segments, steady memory.

Emoji, CJK and combining marks cost several tokens per character; what a request may cost is
bounded in tokens, long texts are spoken segment by segment, and what one large request grows
(talker cache, compute buffers) is given back when it ends.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path
from typing import Any

import pytest

from engine.backend import BackendSet
from engine.errors import InputError
from engine.gguf_model import open_model
from engine.pipeline import Pipeline, StreamInfo, SynthesisRequest
from engine.talker.segment import sentence_starts, split_segments

CHAR_CAP = 4096  # the service's default character cap
EMOJI = "\U0001f600"
COMBINING = "e\u0301"  # e + combining acute: NFC makes it one character of two bytes


@pytest.fixture(scope="module")
def model(tiny_gguf: Path) -> Any:
    return open_model(tiny_gguf)


@pytest.fixture(scope="module")
def pipe(model: Any) -> Pipeline:
    b = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "1"})
    p = Pipeline(model, b, kv_type="f16", chunk_max_frames=4, segment_tokens=40)
    p.warm_up()
    return p


def ntok(pipe: Pipeline, s: str) -> int:
    assert pipe.prompts is not None
    return len(pipe.prompts.offsets("text", s))


def run(pipe: Pipeline, **kw: Any) -> tuple[str, StreamInfo, int]:
    info = StreamInfo()
    gen = pipe.stream(SynthesisRequest(voice="ryan", language="english", seed=0, **kw),
                      info=info)
    samples = 0
    while True:
        try:
            samples += len(next(gen).audio)
        except StopIteration as stop:
            return str(stop.value), info, samples


# -- segments --------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "Hello there. How are you? Fine, thanks. " * 12,
    "一二三四五六七八九十\uff0c一二三四五六七八九十\u3002" * 8,
    EMOJI * 300,
    "一" * 300,
    COMBINING * 300,
    "word " * 200,
    "Ünïcödé, ça va? Ja! " * 30,
])
def test_segments_cover_the_text_within_the_budget(pipe: Pipeline, text: str) -> None:
    assert pipe.prompts is not None
    budget = 40
    segs = split_segments(text, pipe.prompts.offsets("text", text), budget)
    assert len(segs) > 1
    # (counted in the whole text; alone, a segment's first word may tokenise a little longer)
    assert all(0 < ntok(pipe, s) <= budget + 2 for s in segs)
    # nothing lost or reordered but the white space between segments
    squash = "".join(text.split())
    assert "".join("".join(s.split()) for s in segs) == squash
    # no segment starts or ends inside a character (a combining mark stays with its letter)
    for s in segs:
        assert unicodedata.category(s[0]) != "Mn"


def test_short_text_is_one_segment_as_sent(pipe: Pipeline) -> None:
    assert pipe.prompts is not None
    t = "  Hello there. How are you?  "
    assert split_segments(t, pipe.prompts.offsets("text", t), 40) == [t]


def test_sentences_end_at_punctuation_and_newlines() -> None:
    bang = "\uff01"  # fullwidth !
    t = f'He said "Stop." Then left.\nNew line\u3002\u6b21\u306e\u6587{bang}Last'
    starts = sentence_starts(t)
    assert [t[i:i + 4] for i in starts] == ["He s", "Then", "New ", f"\u6b21\u306e\u6587{bang}",
                                            "Last"]


# -- caps ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [EMOJI * CHAR_CAP, "一" * CHAR_CAP, COMBINING * (CHAR_CAP // 2)])
def test_token_cap_names_the_field_and_the_count(pipe: Pipeline, text: str) -> None:
    n = ntok(pipe, text)
    assert n > pipe.max_text_tokens  # several tokens per character on this tokenizer
    with pytest.raises(InputError) as err:
        run(pipe, text=text)
    assert err.value.field == "text"
    assert f"{n} tokens" in str(err.value) and str(pipe.max_text_tokens) in str(err.value)


@pytest.mark.parametrize("field", ["text", "instruct"])
def test_lone_surrogate_is_an_input_error(pipe: Pipeline, field: str) -> None:
    kw = {"text": "hello", field: "a\ud800b"}
    with pytest.raises(InputError) as err:
        run(pipe, **kw)
    assert err.value.field == field and "U+D800" in str(err.value)


def test_instruct_token_cap(model: Any) -> None:
    b = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "1"})
    p = Pipeline(model, b, max_instruct_tokens=8, ignore_unsupported_instruct=True)
    with pytest.raises(InputError) as err:
        run(p, text="hello", instruct="speak slowly and clearly, like a news reader")
    assert err.value.field == "instruct" and "the limit is 8 tokens" in str(err.value)
    p.close()


# -- long texts: one stream, per-segment budget, total cap -----------------------------------


def test_long_text_is_spoken_segment_by_segment(pipe: Pipeline) -> None:
    assert pipe.talker is not None
    text = "The cat sat on the mat. " * 12
    outcome, info, samples = run(pipe, text=text, max_frames=30)
    # each segment was its own prompt: the last prefill was one segment, not the whole text
    assert pipe.talker.last_prefill_positions < ntok(pipe, text)
    assert info.budget == 30 and 0 < info.frames <= 30
    assert samples == info.frames * 1920
    assert outcome in ("ok", "truncated_no_eos")


def at_cap(pipe: Pipeline, unit: str) -> str:
    """The most repeats of ``unit`` within the token cap."""
    lo, hi = 1, pipe.max_text_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ntok(pipe, unit * mid) <= pipe.max_text_tokens else (lo, mid - 1)
    return unit * lo


@pytest.mark.parametrize("unit", [EMOJI, "一", COMBINING, "Hi. "])
def test_hostile_text_at_the_token_cap_returns_to_steady_memory(pipe: Pipeline,
                                                                unit: str) -> None:
    """A text at the token cap (max_seconds 1 = 12 frames) is served, and the caches and
    compute buffers it grew are given back."""
    assert pipe.talker is not None and pipe.talker.cache is not None
    text = at_cap(pipe, unit)
    assert pipe.max_text_tokens - 8 < ntok(pipe, text) <= pipe.max_text_tokens
    run(pipe, text="Warm.", max_frames=12)
    steady_cache = pipe.talker.cache.n_ctx
    steady_compute = pipe.backends.compute_buffer_bytes()
    outcome, info, _ = run(pipe, text=text, max_frames=12)
    assert outcome in ("ok", "truncated_no_eos") and info.frames <= 12
    assert pipe.talker.cache.n_ctx == steady_cache
    assert pipe.backends.compute_buffer_bytes() <= steady_compute * 1.25 + (4 << 20)


def test_a_long_request_gives_its_cache_back(pipe: Pipeline) -> None:
    """A budget past the warm-up reservation grows the talker cache; the end of the request
    (here a cancel after a few frames) gives it back."""
    assert pipe.talker is not None and pipe.talker.cache is not None
    steady = pipe.talker.cache.n_ctx
    seen: list[int] = []

    def cancel() -> bool:
        assert pipe.talker is not None and pipe.talker.cache is not None
        seen.append(pipe.talker.cache.n_ctx)
        return len(seen) > 6

    gen = pipe.stream(SynthesisRequest(text="one two three", voice="ryan", seed=0,
                                       max_frames=steady + 100), cancel)
    with pytest.raises(StopIteration) as stop:
        while True:
            next(gen)
    assert stop.value.value == "cancelled"
    assert max(seen) > steady  # it did grow
    assert pipe.talker.cache.n_ctx == steady
