"""Live text (engine/talker/live.py): stable tokens of a growing text, and
``Pipeline.stream_live``: text fed while generation runs gives the frames of the same text as a
streaming-text request, whatever the delta sizes and pauses."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine.backend import BackendSet
from engine.errors import ConversionError, InputError
from engine.gguf_model import open_model
from engine.pipeline import Pipeline, StreamInfo, SynthesisRequest
from engine.talker.live import LiveText, TextUpdate, splits
from engine.talker.prompt import ROLE_TOKENS, TAIL_TOKENS, PromptBuilder, assistant_text
from engine.tokenizer_gguf import build_tokenizer, read_hf_tokenizer
from engine.tools.make_model import write_tokenizer_files
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


class WholeRetokenising(LiveText):
    """What ``LiveText`` gives, by its definition: the whole stable text tokenised again at
    every delta (where that keeps the ids fed so far; else the new text apart)."""

    def _ids_of(self, stable: str) -> tuple[list[int], bool]:
        ids = self._encode(stable)
        if ids[: len(self.ids)] == self.ids:
            return ids, True
        return self.ids + self.prompts.encode(stable[len(self.stable):]), False

    def _move_cut(self, whole: bool) -> None:
        pass


# pieces of text where tokenisation is delicate: spaces in runs, newlines after marks (one
# pre-token ".\n\n"), combining accents (NFC), CJK, digits, contractions, an added token
# pieces of text where tokenisation is delicate: spaces in runs, newlines after marks (one
# pre-token ".\n\n"), combining accents (NFC), a letter NFC decomposes (a nukta letter ends on
# a mark), Hangul jamo NFC composes, CJK runs with their punctuation and no spaces, digits,
# contractions, an added token, control characters the split does not take as spaces
PIECES = ["word", "Hello", "the", "weather", "e\u0301t\u00e9", "na\u00efve", "\u4f60\u597d",
          "\u3002", "123", "3.14", "it's", "we'll", "I'M", ",", ".", "!", "...", "?!", "\u2014",
          "-", "(quoted)", "\"q\"", "\U0001f600", "<|im_end|>", "\u0301", "\u00a0",
          "\u4eca\u5929\u5929\u6c14\u5f88\u597d\uff0c",
          "\u6211\u4eec\u53bb\u516c\u56ed\u5427\u3002", "\u3053\u3093\u306b\u3061\u306f\u3001",
          "\u0958", "\u0915\u093c", "\u1100\u1161", "\u1100", "\u1161", "\x1c", "\u2126", "\u037e",
          "\U0001d15e", "x\u20e3"]
SPACES = [" ", " ", " ", " ", "  ", "\n", "\n\n", " \n", "\t", "\u3000", "", "", "\r\n"]


def random_updates(rng: np.random.Generator, chars: int, flushes: float = 0.08
                   ) -> list[TextUpdate]:
    text = ""
    while len(text) < chars:
        text += str(rng.choice(PIECES)) + str(rng.choice(SPACES))
    updates, at = [], 0
    while at < len(text):
        n = int(rng.integers(1, 40))
        updates.append(TextUpdate(text[at:at + n], flush=bool(rng.random() < flushes)))
        at += n
    return [*updates, TextUpdate("", end=True)]


@pytest.fixture(scope="module")
def qwen_prompts(pipe: Pipeline, tmp_path_factory: pytest.TempPathFactory) -> PromptBuilder:
    """The tiny model's prompts with the released Qwen2 vocabulary (its merges make words
    whole tokens, where the tiny model's few merges split them)."""
    folder = tmp_path_factory.mktemp("qwen_vocab")
    try:
        write_tokenizer_files(folder, 151936)
    except ConversionError as exc:  # offline and never fetched: say how to fetch it
        pytest.skip(f"QWEN2 VOCABULARY NOT AVAILABLE ({exc}): run `make vocab` once online")
    data = read_hf_tokenizer(folder, 151936)
    prompts = copy.copy(pipe.prompts)
    assert prompts is not None
    prompts.tokenizer = build_tokenizer(data.tokens, data.token_types, data.merges)
    assert prompts.encode(" Hello world") == [21927, 1879]
    return prompts


@pytest.mark.parametrize("vocab", ["tiny", "qwen2"])
@pytest.mark.parametrize("seed", range(6))
def test_deltas_give_the_ids_of_the_whole_text_tokenised_again(
        pipe: Pipeline, request: pytest.FixtureRequest, vocab: str, seed: int) -> None:
    """The cut that spares re-tokenising the text before it changes no id: after every delta
    of a random text, the stable ids and the guess are those of tokenising it all again."""
    prompts = pipe.prompts if vocab == "tiny" else request.getfixturevalue("qwen_prompts")
    assert prompts is not None
    live, whole = LiveText(prompts), WholeRetokenising(prompts)
    cuts = set()
    for u in random_updates(np.random.default_rng(seed), 1500):
        assert live.add(u) == whole.add(u)
        assert live.ids == whole.ids
        assert live.tentative() == whole.tentative()
        cuts.add(live._cut)
    assert len(cuts) > 20  # the cut moved along the text


@pytest.mark.parametrize("vocab", ["tiny", "qwen2"])
@pytest.mark.parametrize("seed", range(6))
def test_stable_ids_are_those_of_the_whole_text(pipe: Pipeline, request: pytest.FixtureRequest,
                                               vocab: str, seed: int) -> None:
    """Without flushes, the stable ids after every delta of a random text begin the whole
    text's own ids, and are all of them at its end: what is stable never differs from the
    tokenisation of the text it grows into (a mark before newlines, CJK, NFC)."""
    prompts = pipe.prompts if vocab == "tiny" else request.getfixturevalue("qwen_prompts")
    assert prompts is not None
    updates = random_updates(np.random.default_rng(100 + seed), 600, flushes=0)
    text = "".join(u.text for u in updates)
    want = prompts.encode(assistant_text(text))[ROLE_TOKENS:-TAIL_TOKENS]
    live = LiveText(prompts)
    for u in updates:
        live.add(u)
        assert live.ids == want[: len(live.ids)], (live.stable, u)
    assert live.ids == want


@pytest.mark.parametrize(("prev", "ch", "sure"), [
    ("o", ",", True), ("o", " ", True), ("o", "\n", True), ("1", "2", True), ("a", "1", True),
    ("\n", "W", True), ("\u754c", "\u3002", True), (",", " ", True),
    (",", "\u4eca", False),  # a mark leads the letters after it: one pre-token
    (".", "\n", False),  # a mark run takes the newlines after it
    (" ", "w", False), ("o", "r", False), ("\n", "\n", False), ("\r", "\n", False),
    ("e", "\u0301", False),  # NFC composes them
    ("\u1100", "\u1161", False),  # Hangul jamo: NFC composes them
    ("\u0958", ",", False),  # NFC decomposes the letter: it ends on a nukta, a mark
    ("\u0915", ",", True),
])
def test_sure_boundaries(prev: str, ch: str, sure: bool) -> None:
    assert splits(prev, ch) is sure


def test_chinese_is_stable_at_its_punctuation(request: pytest.FixtureRequest) -> None:
    """A text with no spaces (Chinese) becomes stable clause by clause, one character a delta:
    before each mark, with no flush and before the end, as the whole text tokenises it."""
    prompts = request.getfixturevalue("qwen_prompts")
    text = ("\u4f60\u597d\u4e16\u754c\u3002\u4eca\u5929\u5929\u6c14\u5f88\u597d\uff0c"
            "\u6211\u4eec\u53bb\u516c\u56ed\u5427\u3002")
    live = LiveText(prompts)
    stable_at = {}
    for i, ch in enumerate(text):
        live.add(TextUpdate(ch))
        stable_at.setdefault(live.stable, i)
    # "\u3002" and the letters after it are one pre-token: the clause before it is stable
    # once the mark is written
    assert stable_at["\u4f60\u597d\u4e16\u754c"] == 4
    assert stable_at["\u4f60\u597d\u4e16\u754c\u3002\u4eca\u5929\u5929\u6c14\u5f88\u597d"] == 11
    assert live.ids == prompts.encode(text[:18])
    live.add(TextUpdate("", end=True))
    assert live.ids == prompts.encode(assistant_text(text))[ROLE_TOKENS:-TAIL_TOKENS]


def test_a_long_text_is_tokenised_about_once(pipe: Pipeline,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A 20,000-character answer a word at a time: the characters tokenised stay within a few
    times the text's length (tokenising the whole text at each delta: ~2,000 times)."""
    prompts = pipe.prompts
    assert prompts is not None
    seen = [0]
    encode = prompts.encode

    def counting(s: str) -> list[int]:
        seen[0] += len(s)
        return encode(s)

    monkeypatch.setattr(prompts, "encode", counting)
    live = LiveText(prompts)
    words = (TEXT + " ") * 340
    for w in words.split(" "):
        live.add(TextUpdate(w + " "))
        live.tentative()
    live.add(TextUpdate("", end=True))
    assert len(words) > 20_000
    assert seen[0] < 5 * len(words)
    monkeypatch.undo()
    assert live.ids == whole_ids(pipe, live.text)


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


def test_a_guess_counts_the_word_being_written(pipe: Pipeline) -> None:
    assert pipe.prompts is not None
    live = LiveText(pipe.prompts)
    live.add(TextUpdate("Hello"))
    hello = whole_ids(pipe, "Hello")
    assert live.ids == [] and live.tentative() == (hello, "Hello")
    assert not live.text_ready(1) and live.text_ready(1, tentative=True)
    assert live.confirms(hello[:1]) is None  # "Hello" may still become "Hellos"
    live.add(TextUpdate(" wor"))
    assert live.confirms(hello[:1]) is True
    assert live.tentative()[0] == whole_ids(pipe, "Hello wor")
    assert live.ids == hello  # a guess changes nothing stable

    refuted = LiveText(pipe.prompts)
    refuted.add(TextUpdate("Th"))
    guess = refuted.tentative()[0][:1]
    assert guess != whole_ids(pipe, "The")[:1]  # (in the tiny models' vocabulary)
    refuted.add(TextUpdate("e weather"))
    assert refuted.confirms(guess) is False

    short = LiveText(pipe.prompts)
    short.add(TextUpdate("Hi"))
    assert short.confirms([*short.tentative()[0], 11]) is None
    short.add(TextUpdate("", end=True))  # the text ended shorter than the guess
    assert short.confirms([*whole_ids(pipe, "Hi"), 11]) is False


def speak_late(pipe: Pipeline, first: str, rest: str, seed: int
               ) -> tuple[StreamInfo, list[int], bool]:
    """``first``, then ``rest`` (and the end) 0.5 s later: the info, the chunks' sample counts,
    and whether ``rest`` had been sent when the first chunk came out."""
    feed = QueueFeed()
    sent = threading.Event()

    def writer() -> None:
        feed.q.put(TextUpdate(first))
        time.sleep(0.5)
        sent.set()
        feed.q.put(TextUpdate(rest, end=True))

    t = threading.Thread(target=writer)
    t.start()
    info = StreamInfo()
    gen = pipe.stream_live(SynthesisRequest(text="", voice="ryan", seed=seed), feed, None, info)
    sizes = [next(gen).audio.shape[0]]
    rest_was_sent = sent.is_set()
    sizes += [c.audio.shape[0] for c in gen]
    t.join()
    return info, sizes, rest_was_sent


def whole_text_stream(pipe: Pipeline, text: str, seed: int) -> tuple[StreamInfo, int]:
    ref = StreamInfo()
    req = SynthesisRequest(text=text, voice="ryan", seed=seed, text_mode="stream")
    return ref, sum(c.audio.shape[0] for c in pipe.stream(req, None, ref))


@pytest.mark.parametrize(("first", "rest", "refuted"), [
    ("Hello", " there, how are you?", 0),
    # "Th" does not begin as "The" does: the opening laid out on it is dropped
    ("Th", "e weather is fine today.", 1),
])
def test_speech_starts_on_a_guess_that_the_text_confirms_or_refutes(
        pipe: Pipeline, first: str, rest: str, refuted: int) -> None:
    """The first word alone, the next delta late: generation starts on the word as it stands,
    its audio goes out only once the text has settled the guess, and the utterance speaks the
    codes and samples of the whole text with the same seed (a refuted guess starting over)."""
    info, sizes, rest_was_sent = speak_late(pipe, first, rest, seed=3 + refuted)
    assert (info.guessed, info.refuted) == (1, refuted)
    assert rest_was_sent
    ref, ref_samples = whole_text_stream(pipe, first + rest, seed=3 + refuted)
    np.testing.assert_array_equal(np.concatenate(info.codes, axis=1),
                                  np.concatenate(ref.codes, axis=1))
    assert sum(sizes) == ref_samples


def test_cancel_while_a_guess_waits_for_the_text(pipe: Pipeline) -> None:
    feed = QueueFeed()
    feed.q.put(TextUpdate("Hello"))
    stop = threading.Event()
    info = StreamInfo()
    gen = pipe.stream_live(SynthesisRequest(text="", voice="ryan", seed=1), feed, stop, info)
    threading.Timer(0.5, stop.set).start()
    assert list(gen) == []  # the guess was never confirmed: no audio
    assert info.outcome == "cancelled" and info.guessed == 1


LONG = "One sentence comes first here. Then another one follows it. And a third ends it."


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_a_long_text_then_its_end_is_the_whole_text_request(pipe: Pipeline,
                                                            batched: bool) -> None:
    """A text of several segments sent at once, its end a moment later (two messages, as a
    client's text and end): the start waits for the end (``LivePlan.holds``), so the request
    is the whole text's, segments and budget alike, both unbatched (``stream_live``) and in a
    batching worker's runner."""
    from engine.batching import BatchRunner, Finished

    seg = Pipeline(pipe.model, pipe.backends, pipe.decoder, kv_type="f32", chunk_max_frames=4,
                   segment_tokens=24)
    assert seg.prompts is not None and len(seg._segments(SynthesisRequest(LONG))) > 1
    ref = StreamInfo()
    list(seg.stream(SynthesisRequest(LONG, "ryan", seed=3, text_mode="stream"), None, ref))
    feed = QueueFeed()
    feed.q.put(TextUpdate(LONG))
    threading.Timer(0.01, lambda: feed.q.put(TextUpdate("", end=True))).start()
    info = StreamInfo()
    req = SynthesisRequest("", voice="ryan", seed=3)
    if batched:
        runner = BatchRunner(seg, 2)
        try:
            runner.submit_live(req, feed, info=info)
            ends = []
            while not ends:
                ends = [item for _sid, item in runner.step() if isinstance(item, Finished)]
                time.sleep(0.001)
        finally:
            runner.close()
    else:
        list(seg.stream_live(req, feed, info=info))
    assert info.outcome == ref.outcome
    np.testing.assert_array_equal(np.concatenate(info.codes, 1), np.concatenate(ref.codes, 1))


def test_only_a_text_of_several_segments_holds_its_start(pipe: Pipeline) -> None:
    """One segment: a live start goes at once (the live and whole-text requests are alike);
    several: it waits for the end up to ``END_GRACE_S`` from when it was first allowed."""
    from engine.pipeline import END_GRACE_S

    seg = Pipeline(pipe.model, pipe.backends, pipe.decoder, kv_type="f32", segment_tokens=24)
    short = seg.plan_live(SynthesisRequest("Hello there, you.", "ryan"))
    assert short.start() is not None and not short.holds(0.0)
    long = seg.plan_live(SynthesisRequest(LONG, "ryan"))
    assert long.start() is not None
    assert long.holds(10.0) and long.holds(10.0 + END_GRACE_S / 2)
    assert not long.holds(10.0 + END_GRACE_S)
    ended = seg.plan_live(SynthesisRequest(LONG, "ryan"))
    ended.live.add(TextUpdate("", end=True))
    assert not ended.holds(0.0)
