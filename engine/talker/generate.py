"""The frame loop: prefill, then per frame sample codebook 0, run the code predictor, step.

Order of one utterance (docs/architecture.md, Generation loop)::

    logits, h = prefill(prompt)
    k = 0
    loop:
        c0 = sample(logits)                    # penalty, EOS mask, suppression, warpers
        if c0 == EOS:          -> outcome "ok" (the EOS frame makes no audio)
        if k == frame budget:  -> outcome "truncated_no_eos"
        c1..c15 = code predictor(h, c0)        # frame k complete: yield it
        k += 1
        logits, h = step(C(c0) + sum cp_embd(c_j) + trailing_text[k-1] or PAD)

So with a budget of F frames the talker samples at most F+1 tokens, like the reference with
``max_new_tokens = F + 1``; a request that hits the budget without EOS ends
``truncated_no_eos`` (reported, never silent). Cancellation is checked between prefill chunks,
before every talker step and every code-predictor run: work stops within one frame (or one
prefill chunk).

Frame budget (documented in docs/talker.md): ``budget = 40 + 12 * n_text_tokens`` frames
(3.2 s plus ~1 s per text token; speech runs at ~3-5 frames per token in every supported
language, so this is a runaway guard, not a length limit), replaced by the request's
``max_frames`` when given (at most the server cap), and never above the hard cap
``min(server cap, generation max_new_tokens - 1, the request's frame_limit)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import numpy as np
import numpy.typing as npt

from engine.errors import InputError
from engine.talker.model import PrefillCancelled, PrefillOut, TalkerModel
from engine.talker.prompt import Prompt
from engine.talker.sampling import SamplingParams, choose, suppress_mask, talker_scores
from engine.timings import StageTimings

Outcome = Literal["ok", "truncated_no_eos", "cancelled"]
OUTCOMES: tuple[str, ...] = ("ok", "truncated_no_eos", "cancelled")

BUDGET_BASE_FRAMES = 40
BUDGET_FRAMES_PER_TOKEN = 12
DEFAULT_MAX_FRAMES_CAP = 4096  # server cap: 327.7 s of audio

P = TypeVar("P")  # what a frame loop yields while it waits (live text: None)


def frame_budget(n_text_tokens: int, requested: int | None, server_cap: int,
                 max_new_tokens: int, limit: int | None = None) -> int:
    """Frames a request may generate (see the module docstring); ``InputError`` if over cap.
    ``limit`` (a client's longest audio) lowers the budget and never raises it."""
    hard_cap = max(1, min(server_cap, max_new_tokens - 1))
    if limit is not None and limit > 0:
        hard_cap = min(hard_cap, limit)
    if requested is not None and requested != 0:
        if requested < 0:
            raise InputError("max_frames", f"must be >= 1, got {requested}")
        if requested > server_cap:
            raise InputError("max_frames", f"{requested} is over the server cap of {server_cap}")
        return min(requested, hard_cap)
    return min(BUDGET_BASE_FRAMES + BUDGET_FRAMES_PER_TOKEN * n_text_tokens, hard_cap)


@dataclass
class Frame:
    """One generated frame: its 16 codes and the talker time spent on it."""

    index: int
    codes: npt.NDArray[np.int32]  # [16]: codebook 0 .. 15
    timings: StageTimings


@dataclass
class Trace:
    """Raw float32 logits of every sampling decision (for parity tests and diagnostics)."""

    talker: list[npt.NDArray[np.float32]] = field(default_factory=list)
    code_predictor: list[list[npt.NDArray[np.float32]]] = field(default_factory=list)


@dataclass
class Result:
    """How generation ended, plus the talker time not attributed to a frame (the last step)."""

    outcome: Outcome = "ok"
    frames: int = 0
    leftover: StageTimings = field(default_factory=StageTimings)
    # what ended it, where a batch's utterance failed alone (its text, its sampling)
    error: Exception | None = None


def is_cancelled(cancel: Callable[[], bool] | None) -> bool:
    """Evaluate a cancellation flag (a callable; ``threading.Event.is_set`` works)."""
    return bool(cancel is not None and cancel())


class FrameSampler:
    """One utterance's sampling state: its parameters, RNG, the codebook-0 ids so far (for the
    repetition penalty) and an optional trace. Shared by every frame loop (whole text, live
    text, the batched scheduler), so each session draws exactly the same way in all of them."""

    def __init__(self, vocab_size: int, eos: int, params: SamplingParams,
                 rng: np.random.Generator, trace: Trace | None = None) -> None:
        self.eos = eos
        self.params = params
        self.rng = rng
        self.trace = trace
        self.suppressed = suppress_mask(vocab_size, eos)
        self.generated: list[int] = []

    def first(self, logits: npt.NDArray[np.float32]) -> int:
        """Sample codebook 0 from the talker's logits (and remember it)."""
        p = self.params
        if self.trace is not None:
            self.trace.talker.append(logits)
        scores = talker_scores(logits, self.generated, p.repetition_penalty, p.min_new_tokens,
                               self.eos, self.suppressed)
        c0 = choose(scores, p.do_sample, p.temperature, p.top_k, p.top_p, self.rng)
        self.generated.append(c0)
        return c0

    def start_frame(self) -> None:
        """A frame goes to the code predictor (its logits start a new trace row)."""
        if self.trace is not None:
            self.trace.code_predictor.append([])

    def sub(self, logits: npt.NDArray[np.float32], j: int) -> int:
        """Sample codebook j+1 from code-predictor pass j."""
        if self.trace is not None:
            self.trace.code_predictor[-1].append(logits)
        p = self.params
        return choose(logits, p.subtalker_do_sample, p.subtalker_temperature,
                      p.subtalker_top_k, p.subtalker_top_p, self.rng)


def decide(sampler: FrameSampler, logits: npt.NDArray[np.float32], at_budget: bool,
           cancel: Callable[[], bool] | None) -> int | Outcome:
    """Codebook 0 of the next frame, or how the utterance ends: EOS ("ok"), the frame budget
    reached ("truncated_no_eos") or a cancellation. The order of the checks is the reference's
    (an EOS drawn at the budget is "ok")."""
    c0 = sampler.first(logits)
    if c0 == sampler.eos:
        return "ok"
    if at_budget:
        return "truncated_no_eos"
    if is_cancelled(cancel):
        return "cancelled"
    sampler.start_frame()
    return c0


def next_frame(talker: TalkerModel, sampler: FrameSampler, logits: npt.NDArray[np.float32],
               hidden: npt.NDArray[np.float32], k: int, at_budget: bool,
               cancel: Callable[[], bool] | None, pending: StageTimings) -> Frame | Outcome:
    """The per-frame core of every unbatched loop: codebook 0 (``decide``), then the code
    predictor fills the other 15; ``pending`` (the talker time so far) goes with the frame."""
    c0 = decide(sampler, logits, at_budget, cancel)
    if isinstance(c0, str):
        return c0
    t1 = time.perf_counter()
    rest = talker.predict(hidden, c0, sampler.sub)
    pending.code_predictor += time.perf_counter() - t1
    return Frame(k, np.concatenate([np.asarray([c0], dtype=np.int32), rest]), pending)


def generate_frames(
    talker: TalkerModel,
    prompt: Prompt,
    params: SamplingParams,
    budget: int,
    rng: np.random.Generator,
    cancel: Callable[[], bool] | None = None,
    trace: Trace | None = None,
) -> Generator[Frame, None, Result]:
    """Yield frames as they complete; the generator's return value is the :class:`Result`."""
    if budget < 1:
        raise InputError("max_frames", f"must be >= 1, got {budget}")
    result = Result()
    if is_cancelled(cancel):
        result.outcome = "cancelled"
        return result
    sampler = FrameSampler(int(talker.cfg.vocab_size), talker.eos_id, params, rng, trace)
    talker.reserve(prompt.length + budget)
    t0 = time.perf_counter()
    try:
        pre = talker.prefill(prompt, cancel=cancel)
    except PrefillCancelled:
        result.outcome = "cancelled"
        return result
    pending = StageTimings(prefill=time.perf_counter() - t0)
    n_trailing = pre.trailing.shape[0]
    return (yield from frame_loop(
        talker, sampler, pre, prompt.length, pending, cancel,
        at_budget=lambda k: k >= budget,
        text_row=lambda i: pre.trailing[i] if i < n_trailing else pre.pad,
    ))


def frame_loop(
    talker: TalkerModel,
    sampler: FrameSampler,
    pre: PrefillOut,
    length: int,
    pending: StageTimings,
    cancel: Callable[[], bool] | None,
    at_budget: Callable[[int], bool],
    text_row: Callable[[int], npt.NDArray[np.float32]],
    wait_frame: Callable[[int], Generator[P, None, bool]] | None = None,
    wait_text: Callable[[int], Generator[P, None, bool]] | None = None,
) -> Generator[Frame | P, None, Result]:
    """The frames after a prefill of ``length`` positions, for every unbatched loop (whole
    text here, live text in engine/talker/live.py).

    ``at_budget(k)``: frame k may not be generated (the budget is reached). ``text_row(i)``:
    the text row added to the talker input after frame i. ``wait_frame(k)`` runs before frame k
    is sampled and ``wait_text(i)`` before ``text_row(i)`` is read: generators that may yield
    pause items (passed through) while they wait, and return False when cancelled meanwhile.
    ``pending`` is the talker time so far (the prefill); the last step's goes to the result.
    """
    result = Result()
    logits, hidden = pre.logits, pre.hidden
    k = 0
    while True:
        if wait_frame is not None and not (yield from wait_frame(k)):
            result.outcome = "cancelled"
            break
        frame = next_frame(talker, sampler, logits, hidden, k, at_budget(k), cancel, pending)
        if isinstance(frame, str):
            result.outcome = frame
            break
        yield frame
        k += 1
        result.frames = k
        pending = StageTimings()
        if is_cancelled(cancel):
            result.outcome = "cancelled"
            break
        if wait_text is not None and not (yield from wait_text(k - 1)):
            result.outcome = "cancelled"
            break
        text_add = text_row(k - 1)
        t2 = time.perf_counter()
        logits, hidden = talker.step(frame.codes, text_add, length + k - 1)
        pending.talker_step += time.perf_counter() - t2
    result.leftover = pending
    return result
