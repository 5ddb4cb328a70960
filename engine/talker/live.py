"""Live text: speak a text while it is still being written (an LLM's answer, token by token).

The streaming-text prompt (``text_mode="stream"``) feeds one text token per generated frame.
Here those tokens arrive while generation runs: a ``TextFeed`` hands over text deltas, and
``LiveText`` turns the growing string into *stable* token ids, ids no later text can change.
BPE merges never cross a boundary of the Qwen2 pre-tokeniser, and some boundaries are sure as
soon as the two characters around them are written (``splits``: a letter or digit run ending,
a word's leading space, a newline run ending); the text up to the last of them is stable. The
word being written is held back until such a boundary, a flush or the end of the text follows
it: in English at the next space or mark, in Chinese or Japanese (no spaces) at the next
punctuation mark.

When the frame loop needs the next text token and none is stable yet, it *pauses*: it yields
``None`` (so the caller decodes the frames it holds) and blocks on the feed. It never feeds
``tts_pad`` before the end of the text, because PAD tells the model the text is over. After the
end, the trailing text gets ``tts_eos`` and then PAD, exactly as a whole-text streaming prompt.

Generation need not wait for the held-back word, though: the prompt's opening places only the
first id(s), and the word being written is most often complete as it stands (an LLM's deltas
are whole word pieces). So generation may start on a *guess* (``LiveText.tentative``), and the
caller checks the guess against the stable ids (``LiveText.confirms``) before any audio goes
out, starting over with the stable ids when the text proved it wrong. The rows the model is
fed after the opening are stable ids only.
"""

from __future__ import annotations

import time
import unicodedata
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import numpy.typing as npt

from engine.errors import InputError
from engine.talker.generate import Frame, FrameSampler, Result, frame_loop, is_cancelled
from engine.talker.model import PrefillOut, TalkerModel
from engine.talker.prompt import (
    ROLE_TOKENS,
    TAIL_TOKENS,
    Prompt,
    PromptBuilder,
    assistant_text,
    has_speech,
)
from engine.talker.sampling import SamplingParams
from engine.timings import StageTimings


def _space(ch: str) -> bool:
    # the split's \s, Unicode White_Space (str.isspace also takes \x1c-\x1f)
    return ch.isspace() and ch not in "\x1c\x1d\x1e\x1f"


def _kind(ch: str) -> str:
    # the class the split sees (after NFC, which may decompose: a nukta letter ends on a mark)
    return unicodedata.category(unicodedata.normalize("NFC", ch)[-1])[0]


def splits(prev: str, ch: str) -> bool:
    """Whether the Qwen2 tokeniser starts a pre-token at ``ch`` written after ``prev``, whatever
    comes before and after them (NFC included), so that the text before ``ch`` has ids no later
    text changes. Sure boundaries only, not every one there is; the split's rules
    (engine/tokenizer_gguf.py) that make each of them sure are named below."""
    first = unicodedata.category(unicodedata.normalize("NFC", ch)[0])[0]
    if first == "M":
        return False  # a combining mark may compose with ``prev`` (NFC) or join its run
    if first == "N":
        return True  # "\p{N}": every digit is a pre-token of its own
    kind = _kind(prev)
    if _space(ch):
        # a letter or digit run ends at any space; a mark or symbol run takes the newlines
        # after it ("." + "\n\n" is one pre-token: "[^\s\p{L}\p{N}]+[\r\n]*"), not a space
        return not _space(prev) and (ch not in "\r\n" or kind in "LN")
    if prev in "\r\n":
        return True  # a newline run ends before anything else ("\s*[\r\n]+")
    # a letter run ends at anything but a letter; a symbol or mark joins the letters after it
    # ("," + "今天" is one pre-token: "[^\r\n\p{L}\p{N}]?\p{L}+")
    return kind == "N" or (kind == "L" and first != "L")


# a mark that ends a phrase: with the default start policy, speech may start there
PUNCTUATION = frozenset(".,!?;:\u3002\uff0c\uff01\uff1f\u3001\uff1b\uff1a")


@dataclass(frozen=True)
class TextUpdate:
    """What a feed delivered since it was last asked: new text, a flush, the end."""

    text: str = ""
    flush: bool = False
    end: bool = False


class TextFeed(Protocol):
    def take(self, timeout: float) -> TextUpdate | None:
        """New text (waiting at most ``timeout`` seconds for some; 0: do not wait), or None."""


class LiveText:
    """The text written so far and its stable token ids (module docstring)."""

    def __init__(self, prompts: PromptBuilder) -> None:
        self.prompts = prompts
        self.text = ""
        self.ended = False
        self._flushed_upto = 0  # a flush makes the text up to here stable
        self.ids: list[int] = []  # stable ids of the target text
        self.stable = ""  # the text those ids spell
        # pairs of adjacent characters in an added token ("<|im_end|>"): the tokeniser takes
        # such a token whole before the split, so no boundary between them is sure
        self._joined = frozenset(
            t.content[i:i + 2] for t in prompts.tokenizer.get_added_tokens_decoder().values()
            for i in range(len(t.content) - 1))
        self._split = 0  # the last sure pre-token boundary in ``text`` (``splits``)
        self._scanned = 1  # ``text`` is scanned for boundaries up to here
        # A sure boundary in ``stable``: the text before it is never tokenised again, so a
        # text of n characters costs O(n), not one whole re-tokenisation per delta.
        self._cut = 0  # characters of ``stable`` before the cut
        self._cut_ids = 0  # ids of ``stable[:_cut]``

    def _encode(self, text: str) -> list[int]:
        return self.prompts.encode(assistant_text(text))[ROLE_TOKENS:-TAIL_TOKENS]

    def text_ready(self, min_tokens: int, tentative: bool = False) -> bool:
        """Whether generation may start: ``min_tokens`` stable ids, a punctuation mark in the
        stable text, a flush, or the end. ``tentative``: counting the word being written as
        if it were complete (the ids of ``tentative()``)."""
        flushed = self._flushed_upto == len(self.text) and bool(self.ids)
        if self.ended or flushed:
            return bool(self.ids) or self.ended
        ids, stable = self.tentative() if tentative else (self.ids, self.stable)
        if len(ids) >= max(1, min_tokens):
            return True
        return bool(ids) and any(ch in PUNCTUATION for ch in stable)

    def _stable_text(self, whole: bool) -> str:
        # the text no later delta can change (``whole``: all of it, as a flush would make it)
        if whole or self.ended:
            return self.text if self.ended else self.text.rstrip()
        text = self.text
        for i in range(self._scanned, len(text)):
            if splits(text[i - 1], text[i]) and text[i - 1:i + 1] not in self._joined:
                self._split = i
        self._scanned = max(1, len(text))
        if self._flushed_upto > self._split:
            return text[: self._flushed_upto].rstrip()  # a space belongs to the word after it
        return text[: self._split]

    def _ids_of(self, stable: str) -> tuple[list[int], bool]:
        # the ids of ``stable`` (a longer text than ``self.stable``) and whether they are its
        # own tokenisation (False: what was fed stays, and the new text is tokenised apart)
        tail = stable[self._cut:]
        ids = self.prompts.encode(tail) if self._cut else self._encode(tail)
        if ids[: len(self.ids) - self._cut_ids] == self.ids[self._cut_ids:]:
            return self.ids[: self._cut_ids] + ids, True
        # a flush mid-word split a word the longer text merges: what was fed stays, and the
        # new text is tokenised on its own (not after the prompt's "assistant\n", which would
        # swallow a newline it starts with)
        return self.ids + self.prompts.encode(stable[len(self.stable):]), False

    def _move_cut(self, whole: bool) -> None:
        # After ids that are the stable text's own tokenisation (``whole``), the cut moves to
        # its last sure boundary, most often its end. After ids tokenised apart, the cut is its
        # end: what comes next is tokenised on its own, as in a whole re-tokenisation then.
        at = len(self.stable) if not whole else min(self._split, len(self.stable))
        if at <= self._cut:
            return
        if at == len(self.stable):
            n = len(self.ids)
        else:  # a flush made text past the boundary stable
            head = self.stable[self._cut:at]
            n = self._cut_ids + len(self.prompts.encode(head) if self._cut else self._encode(head))
        self._cut, self._cut_ids = at, n

    def tentative(self) -> tuple[list[int], str]:
        """The ids and text there would be if the word being written were complete (a guess:
        the next delta may continue the word); the stable ones when there is no such word."""
        stable = self._stable_text(whole=True)
        if not has_speech(stable) or len(stable) <= len(self.stable):
            return list(self.ids), self.stable
        return self._ids_of(stable)[0], stable

    def confirms(self, placed: list[int]) -> bool | None:
        """Whether the stable ids begin with ``placed`` (ids a prompt was laid out with before
        they were stable): True or False once enough ids are stable or the text ended, None
        while that is not known yet."""
        if len(self.ids) >= len(placed):
            return self.ids[: len(placed)] == placed
        return False if self.ended else None

    def add(self, update: TextUpdate) -> int:
        """Take an update; return how many new stable ids it made."""
        self.text += update.text
        self.ended = self.ended or update.end
        if update.flush:
            self._flushed_upto = len(self.text)
        stable = self._stable_text(whole=False)
        if not has_speech(stable) or len(stable) <= len(self.stable):
            return 0
        ids, whole = self._ids_of(stable)
        self.stable = stable
        new = len(ids) - len(self.ids)
        self.ids = ids
        self._move_cut(whole)
        return max(0, new)


def opening_prompt(prompts: PromptBuilder, voice: str | None, language: str | None,
                   instruct: str | None) -> Callable[[list[int]], Prompt]:
    """The opening of a live prompt in a built-in voice: the layout of a one-token streaming
    prompt (``"."`` is one token) with the live text's first id in its last position; the
    rest of the known ids trail."""
    base = prompts.build(".", voice, language, instruct, "stream")

    def opening(ids: list[int]) -> Prompt:
        return replace(base, text_ids=np.concatenate(
            [base.text_ids[:-1], np.asarray(ids[:1], dtype=np.int32)]),
            trailing_ids=np.asarray(ids[1:], dtype=np.int32))
    return opening


class LiveRows:
    """The talker's text rows of a live utterance: the opening prompt's trailing rows, then one
    row per stable id as the feed delivers them, EOS once the text has ended, then PAD.

    ``row(i)`` is None while row ``i`` is not known yet (the text ran dry): the frame loop
    waits then, whether alone (``generate_live_frames``) or in a batch
    (engine/talker/scheduler.py), so both feed the same rows in the same order."""

    def __init__(self, talker: TalkerModel, prompts: PromptBuilder, live: LiveText,
                 feed: TextFeed, budget_fn: Callable[[int], int], placed: int | None = None
                 ) -> None:
        self.talker = talker
        self.live = live
        self.feed = feed
        self.budget_fn = budget_fn
        self._tts_eos = prompts.special.tts_eos_token_id
        # ids the opening prompt laid out (placed or trailing): the stable ids when it started,
        # or a guess of them (``LivePlan.start``); the rows here are those of the ids after
        self._fed = len(live.ids) if placed is None else placed
        self._later: list[npt.NDArray[np.float32]] = []
        self._eos: npt.NDArray[np.float32] | None = None

    def absorb(self, update: TextUpdate | None) -> None:
        """Take a feed update: its new stable ids become rows."""
        if update is not None:
            self.live.add(update)
        self._sync()

    def _sync(self) -> None:
        # rows for the stable ids not turned into rows yet, whoever gave them to ``live``
        n = len(self.live.ids)
        if n > self._fed:
            self._later.extend(self.talker.project_text(self.live.ids[self._fed:]))
            self._fed = n
        if self.live.ended and self._eos is None:
            self._eos = self.talker.project_text([self._tts_eos])[0]

    def poll(self) -> None:
        """Take what the feed holds now, without waiting."""
        self.absorb(self.feed.take(0))

    def at_budget(self, k: int) -> bool:
        """Frame ``k`` is over the budget of the text known so far."""
        return k >= self.budget_fn(max(len(self.live.ids), self._fed))

    def frame_waits(self, k: int) -> bool:
        """Frame ``k`` must wait for more text: the budget of the known text is spent and more
        text will come (at the end of the text the budget ends the utterance instead)."""
        return not self.live.ended and self.at_budget(k)

    def row(self, i: int, pre: PrefillOut) -> npt.NDArray[np.float32] | None:
        """The text row added after frame ``i`` (``pre``: the opening's prefill), or None while
        it is not known: more text will come, never PAD before the end of the text."""
        self._sync()
        n0 = int(pre.trailing.shape[0])
        if i < n0:
            first: npt.NDArray[np.float32] = pre.trailing[i]
            return first
        j = i - n0
        if j < len(self._later):
            return self._later[j]
        if not self.live.ended:
            return None
        if j == len(self._later) and self._eos is not None:
            return self._eos
        return pre.pad


def generate_live_frames(
    talker: TalkerModel,
    prompts: PromptBuilder,
    live: LiveText,
    feed: TextFeed,
    opening: Callable[[list[int]], Prompt],
    params: SamplingParams,
    budget_fn: Callable[[int], int],
    rng: np.random.Generator,
    cancel: Callable[[], bool] | None = None,
    poll_seconds: float = 0.02,
    start: list[int] | None = None,
) -> Generator[Frame | None, None, Result]:
    """Like ``generate_frames`` with the trailing text growing as ``feed`` delivers it.

    Yields ``Frame`` items, and ``None`` right before it blocks for text. ``live`` already holds
    at least one stable id. ``budget_fn(n_text_tokens)`` is the frame budget for the text known
    so far: before the end of the text, reaching it pauses for more text instead of ending.
    ``opening(ids)`` lays out the prompt for the stable ids known at the start: its trailing
    ids are those it did not place, without EOS (the end of the text is not known yet).
    ``start``: the ids to open with (``LivePlan.start``: a guess of ids not yet stable, which
    the caller confirms before it lets audio out); by default the stable ids.
    """
    result = Result()
    ids = list(live.ids) if start is None else list(start)
    if not ids:
        raise InputError("text", "is empty")
    if is_cancelled(cancel):
        result.outcome = "cancelled"
        return result
    sampler = FrameSampler(int(talker.cfg.vocab_size), talker.eos_id, params, rng)
    prompt = opening(ids)
    text = LiveRows(talker, prompts, live, feed, budget_fn, placed=len(ids))
    cap = budget_fn(1 << 30)
    talker.reserve(prompt.length + cap + 1)
    t0 = time.perf_counter()
    pre = talker.prefill(prompt)
    pending = StageTimings(prefill=time.perf_counter() - t0)

    def wait(hungry: Callable[[], bool]) -> Generator[None, None, bool]:
        """Take what the feed holds; while ``hungry()`` and more text will come, yield None
        (once: the caller decodes the frames it holds) and block on the feed. False when
        cancelled meanwhile."""
        text.poll()
        waited = False
        while not live.ended and hungry():
            if is_cancelled(cancel):
                return False
            if not waited:
                waited = True
                yield None
            text.absorb(feed.take(poll_seconds))
        return True

    def text_row(i: int) -> npt.NDArray[np.float32]:
        row = text.row(i, pre)
        return pre.pad if row is None else row

    # pause while the model has spoken every known token (or its budget) and more will come;
    # when the text runs dry, wait for the next token rather than feed PAD
    return (yield from frame_loop(
        talker, sampler, pre, prompt.length, pending, cancel, text.at_budget, text_row,
        wait_frame=lambda k: wait(lambda: text.at_budget(k)),
        wait_text=lambda i: wait(lambda: text.row(i, pre) is None),
    ))
