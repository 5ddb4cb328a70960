"""The frame loop for several utterances at once: ``generate_frames`` over a batch.

``FrameScheduler`` holds up to ``max_batch`` utterances, each with its own talker cache
(``TalkerModel.new_cache``), sampler and position. One ``iterate()``:

1. at most one prefill chunk of one joining utterance (a long prompt is several chunks, so the
   running utterances wait one chunk at most, never a whole prompt); or, where several live
   ones joined since the last round and none has begun (or, while nothing streams, two whole
   texts), their whole prompts in one graph (``joint_prefill``: one read of the weights for
   all of them, each one's results those of its prefill alone);
2. codebook 0 of every utterance with logits (``generate.decide``: EOS, budget, cancel), then one
   batched code-predictor pass over those that go on: their frames are complete;
3. one batched talker step for every utterance whose frame was not its last.

A live-text utterance (``LiveRows``: text still being written) sits out of steps 2 and 3 while
its next frame or text row waits for text, exactly where ``generate_live_frames`` would block,
and joins again once the text is there; the rest of the batch goes on meanwhile.

It returns what happened: ``Frame``s, ``Paused`` (a live utterance began to wait: its caller
decodes the frames it holds) and ``Ended`` results, per utterance. An utterance that ends
(EOS, budget, cancel) leaves at once and its cache is freed; so does one whose own work raises
(its live text, its sampling, its prefill), its ``Result.error`` saying why, while the others
go on (an error in a batched pass goes to the caller). The per-utterance order of sampling
decisions and checks is exactly ``generate_frames``', so an utterance's codes are those it gets
alone (engine/talker/batch.py says why the graphs keep that true).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from engine.errors import InputError
from engine.talker.batch import BatchedTalker, StepRow
from engine.talker.generate import Frame, FrameSampler, Result, decide, is_cancelled
from engine.talker.joint_prefill import Joiner, int8_rows, joiner, prefill_joint
from engine.talker.live import LiveRows
from engine.talker.model import PrefillOut, TalkerModel
from engine.talker.prompt import Prompt
from engine.talker.qwen3 import KVCache
from engine.timings import StageTimings

F32 = npt.NDArray[np.float32]
LIVE_CACHE_FRAMES = 256  # frames a live utterance's cache holds at first (20 s; then it doubles)
RESERVED_PROMPT = 64  # prompt positions a reserved cache leaves room for, beside LIVE_CACHE_FRAMES


@dataclass
class Utterance:
    """One prompt being spoken inside a ``FrameScheduler``."""

    uid: int
    prompt: Prompt
    sampler: FrameSampler
    budget: int
    cancel: Callable[[], bool] | None
    cache: KVCache | None = None
    chunks: Generator[int, None, PrefillOut] | None = None
    pre: PrefillOut | None = None
    logits: F32 | None = None
    hidden: F32 | None = None
    k: int = 0  # frames generated
    pending: StageTimings = field(default_factory=StageTimings)
    result: Result = field(default_factory=Result)
    text: LiveRows | None = None  # live text (None: the prompt's trailing rows, then PAD)
    held: npt.NDArray[np.int32] | None = None  # a frame's codes whose step waits for text
    waiting: bool = False  # a live utterance waiting for text (``Paused`` was said)
    prefilling: bool = False  # its prefill alone has begun (no joint prefill takes it then)

    def at_budget(self) -> bool:
        return self.text.at_budget(self.k) if self.text is not None else self.k >= self.budget


@dataclass
class Ended:
    """An utterance left the batch: its ``Result`` (outcome, frames, leftover timings)."""

    uid: int
    result: Result


@dataclass
class Emitted:
    """A frame of utterance ``uid``."""

    uid: int
    frame: Frame


@dataclass
class Paused:
    """Live utterance ``uid`` waits for text (said once per wait, as ``generate_live_frames``
    yields None)."""

    uid: int


Event = Emitted | Ended | Paused


@dataclass
class StepStats:
    """What the last ``iterate`` did: rows of the batched passes and their seconds."""

    batch: int = 0  # utterances in the talker step (0: no step ran)
    cp_rows: int = 0
    talker_s: float = 0.0
    code_predictor_s: float = 0.0
    prefill_s: float = 0.0


# whole texts that prefill in one graph when they join while nothing streams (a burst)
BURST_WHOLE_TEXTS = 2


class FrameScheduler:
    """Up to ``max_batch`` utterances generating frames together (module docstring)."""

    def __init__(self, talker: TalkerModel, max_batch: int,
                 batched: BatchedTalker | None = None, joint_prefill: str = "live") -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if joint_prefill not in ("live", "all"):
            raise ValueError(f"joint_prefill must be 'live' or 'all', got {joint_prefill!r}")
        self.talker = talker
        self.max_batch = max_batch
        # Which joiners prefill together: live text by default. A live utterance's first
        # audio waits for the text that confirms its opening anyway (engine/batching.py), so
        # waiting for the others' rows costs it little; a whole text's first audio pays for
        # the others' prefills in full (docs/performance.md, "Session 18"). Whole texts of a
        # burst (nothing streaming yet) prefill BURST_WHOLE_TEXTS at a time: the later ones
        # then wait half the rounds, the first pair one prefill more (Session 20). "all":
        # every joiner, always.
        self.joint_prefill = joint_prefill
        self.batched = batched if batched is not None else BatchedTalker(talker)
        self._uids = itertools.count(1)
        self._live: dict[int, Utterance] = {}  # in arrival order
        self._lent: KVCache | None = None  # the model's own cache, while a session uses it
        self._reserved: list[KVCache] = []  # ``reserve``'s caches: every one of them
        self._spare: list[KVCache] = []  # the reserved caches no session holds now
        self.last = StepStats()

    def __len__(self) -> int:
        return len(self._live)

    @property
    def free(self) -> int:
        """Slots left."""
        return self.max_batch - len(self._live)

    def add(self, prompt: Prompt, sampler: FrameSampler, budget: int,
            cancel: Callable[[], bool] | None = None, text: LiveRows | None = None) -> int:
        """Admit an utterance (its cache is allocated now; its prefill runs in ``iterate``);
        returns its id. ``RuntimeError`` when the batch is full. ``text``: live text, whose
        frame budget grows with the text (``budget``: the most it may reach)."""
        if budget < 1:
            raise InputError("max_frames", f"must be >= 1, got {budget}")
        if not self.free:
            raise RuntimeError("the batch is full")
        u = Utterance(next(self._uids), prompt, sampler, budget, cancel, text=text)
        # live text may reach the server's cap of frames, or stop early: its cache starts at
        # LIVE_CACHE_FRAMES and grows as it speaks (``_step_row``)
        frames = budget if text is None else min(budget, LIVE_CACHE_FRAMES)
        u.cache = self._take_cache(prompt.length + frames + 1)
        u.chunks = self.talker.prefill_chunks(prompt, cache=u.cache)
        self._live[u.uid] = u
        return u.uid

    def reserve(self, n_caches: int) -> None:
        """Allocate ``n_caches`` talker caches now, each long enough for a live utterance's
        first cache (``LIVE_CACHE_FRAMES`` after a prompt of up to ``RESERVED_PROMPT``
        positions) or a shorter text, and keep them for the sessions to come. A fresh cache
        is zeroed, and where the kernel must find fresh pages for it that costs more than a
        decoder push (docs/performance.md, "Session 19"): with these, the sessions that join
        beside the one on the model's own cache allocate nothing."""
        n = min(RESERVED_PROMPT + LIVE_CACHE_FRAMES + 1,
                int(self.talker.cfg.max_position_embeddings))
        while len(self._reserved) < n_caches:
            cache = self.talker.new_cache(n)
            self._reserved.append(cache)
            self._spare.append(cache)

    def _take_cache(self, n_positions: int) -> KVCache:
        # The model's own talker cache (reserved at warm-up, idle while the worker batches)
        # serves one session, so a worker alone allocates nothing per request, as without
        # batching; then the reserved caches (``reserve``); any other session gets a cache of
        # its own, freed when it ends. (Stale rows of an earlier session are finite and
        # masked, as for the model's own loop.)
        own = self.talker.cache
        if self._lent is None and own is not None and own.n_ctx >= n_positions:
            self._lent = own
            return own
        for cache in self._spare:
            if cache.n_ctx >= n_positions:
                self._spare.remove(cache)
                return cache
        return self.talker.new_cache(n_positions)

    def _give_back(self, cache: KVCache) -> None:
        # a session is done with ``cache``: the model's own and the reserved ones are kept
        if cache is self._lent:
            self._lent = None  # the model's own cache (the worker's steady state)
        elif any(cache is c for c in self._reserved):
            self._spare.append(cache)
        else:
            cache.close()  # a session's own cache: its memory goes back now

    def cancel(self, uid: int) -> Ended | None:
        """Remove an utterance now (its result says "cancelled"); None if it is not here."""
        u = self._live.get(uid)
        if u is None:
            return None
        u.result.outcome = "cancelled"
        return self._end(u)

    def _end(self, u: Utterance) -> Ended:
        self._live.pop(u.uid, None)
        if u.chunks is not None:
            u.chunks.close()
            u.chunks = None
        self.batched.drop_step_graph()  # it refers to the cache about to be freed
        if u.cache is not None:
            self._give_back(u.cache)
            u.cache = None
        u.result.leftover = u.pending
        return Ended(u.uid, u.result)

    def iterate(self, before_step: Callable[[list[Event]], None] | None = None) -> list[Event]:
        """One round (module docstring); returns its events in order. ``before_step(events)``
        runs after the code-predictor pass, before the talker step: the caller decodes the
        frames that are due there, so a chunk does not wait for the step (a joining stream's
        first audio the least). It may cancel utterances: they leave before the step."""
        events: list[Event] = []
        stats = self.last = StepStats()
        self._prefill_one(events, stats)
        rows: list[StepRow] = []
        stepping: list[Utterance] = []
        go: list[tuple[Utterance, int]] = []
        for u in list(self._live.values()):
            try:
                self._decide(u, events, rows, stepping, go)
            except Exception as e:  # its own text or sampling: it alone ends (``Result.error``)
                events.append(self._fail(u, e))
        if go:
            self._predict(go, events, stats, rows, stepping)
        if before_step is not None:
            before_step(events)
            keep = [i for i, u in enumerate(stepping) if u.uid in self._live]
            rows, stepping = [rows[i] for i in keep], [stepping[i] for i in keep]
        if rows:
            t2 = time.perf_counter()
            logits, hidden_out = self.batched.step(rows)
            stats.talker_s = time.perf_counter() - t2
            stats.batch = len(rows)
            for i, u in enumerate(stepping):
                u.logits, u.hidden = logits[i], hidden_out[i]
                u.pending.talker_step += stats.talker_s
        return events

    def _decide(self, u: Utterance, events: list[Event], rows: list[StepRow],
                stepping: list[Utterance], go: list[tuple[Utterance, int]]) -> None:
        # utterance ``u``'s part of the round before the code-predictor pass: its live text,
        # then its step row (a frame that waited for text) or its codebook-0 decision
        if u.text is not None:
            u.text.poll()
        if u.held is not None:  # a frame made earlier whose text row has come
            if is_cancelled(u.cancel):
                u.result.outcome = "cancelled"
                events.append(self._end(u))
            elif (row := self._text_row(u, events)) is not None:
                rows.append(self._step_row(u, u.held, row))
                stepping.append(u)
                u.held = None
            return
        if u.logits is None:
            return
        if u.text is not None and u.text.frame_waits(u.k):
            if is_cancelled(u.cancel):
                u.result.outcome = "cancelled"
                events.append(self._end(u))
            else:
                self._wait(u, events)
            return
        c0 = decide(u.sampler, u.logits, u.at_budget(), u.cancel)
        u.logits = None
        u.waiting = False
        if isinstance(c0, str):
            u.result.outcome = c0
            events.append(self._end(u))
        else:
            go.append((u, c0))

    def _fail(self, u: Utterance, e: Exception) -> Ended:
        # its own work raised: it ends alone (module docstring)
        u.result.error = e
        return self._end(u)

    def _wait(self, u: Utterance, events: list[Event]) -> None:
        if not u.waiting:
            u.waiting = True
            events.append(Paused(u.uid))

    def _text_row(self, u: Utterance, events: list[Event]) -> F32 | None:
        # the text row after frame k-1: live text's when known (else the utterance waits)
        pre = u.pre
        assert pre is not None
        if u.text is not None:
            row = u.text.row(u.k - 1, pre)
            if row is None:
                self._wait(u, events)
            else:
                u.waiting = False
            return row
        return pre.trailing[u.k - 1] if u.k - 1 < pre.trailing.shape[0] else pre.pad

    def _step_row(self, u: Utterance, codes: npt.NDArray[np.int32], text_add: F32) -> StepRow:
        assert u.cache is not None
        pos = u.prompt.length + u.k - 1
        if pos >= u.cache.n_ctx:
            self._grow(u, pos + 1)
        return StepRow(u.cache, codes, text_add, pos)

    def _grow(self, u: Utterance, n_positions: int) -> None:
        # a longer cache for a live utterance: twice the length (within its budget), its rows
        # copied over; the old one is freed, or given back if it was the model's own or a
        # reserved one
        assert u.cache is not None
        cap = u.prompt.length + u.budget + 1
        new = self.talker.new_cache(max(n_positions, min(2 * u.cache.n_ctx, cap)))
        u.cache.copy_into(new)
        self.batched.drop_step_graph()  # it refers to the old cache
        self._give_back(u.cache)
        u.cache = new

    def _predict(self, go: list[tuple[Utterance, int]], events: list[Event], stats: StepStats,
                 rows: list[StepRow], stepping: list[Utterance]) -> None:
        # the batched code-predictor pass: frames complete, then each utterance's step row
        t1 = time.perf_counter()
        hidden = np.stack([np.asarray(u.hidden, dtype=np.float32) for u, _ in go])
        rest = self.batched.predict(hidden, [c0 for _, c0 in go],
                                    [u.sampler.sub for u, _ in go])
        stats.code_predictor_s = time.perf_counter() - t1
        stats.cp_rows = len(go)
        for (u, c0), r in zip(go, rest, strict=True):
            u.pending.code_predictor += stats.code_predictor_s
            codes = np.concatenate([np.asarray([c0], dtype=np.int32), r])
            events.append(Emitted(u.uid, Frame(u.k, codes, u.pending)))
            u.k += 1
            u.result.frames = u.k
            u.pending = StageTimings()
            if is_cancelled(u.cancel):
                u.result.outcome = "cancelled"
                events.append(self._end(u))
                continue
            try:
                row = self._text_row(u, events)
                if row is None:
                    u.held = codes  # its step waits for the text row
                    continue
                rows.append(self._step_row(u, codes, row))
            except Exception as e:  # as in ``iterate``: it alone ends
                events.append(self._fail(u, e))
                continue
            stepping.append(u)

    def _prefill_one(self, events: list[Event], stats: StepStats) -> None:
        # one chunk of the first utterance still prefilling, or, where several (live ones, by
        # default) joined since the last round, their prefills in one graph
        if self._prefill_joint(stats):
            return
        for u in self._live.values():
            if u.chunks is None:
                continue
            if is_cancelled(u.cancel):
                u.result.outcome = "cancelled"
                events.append(self._end(u))
                return
            t0 = time.perf_counter()
            u.prefilling = True
            try:
                next(u.chunks)
            except StopIteration as stop:
                self._prefilled(u, stop.value)
            except Exception as e:  # its own prompt's prefill: it alone ends
                events.append(self._fail(u, e))
            dt = time.perf_counter() - t0
            u.pending.prefill += dt
            stats.prefill_s = dt
            return

    def _prefilled(self, u: Utterance, pre: PrefillOut) -> None:
        u.pre = pre
        u.chunks = None
        u.logits, u.hidden = pre.logits, pre.hidden

    def _prefill_joint(self, stats: StepStats) -> bool:
        # engine/talker/joint_prefill.py: joiners not cancelled, none begun alone, in groups
        # alike in their rows' products; False: none ran (then one chunk runs alone)
        # a burst: nothing streams yet, so no one's audio waits for the joint graph
        burst = all(u.chunks is not None for u in self._live.values())
        fresh = [u for u in self._live.values()
                 if u.chunks is not None and not u.prefilling and not is_cancelled(u.cancel)
                 and (u.text is not None or self.joint_prefill == "all" or burst)]
        if burst and self.joint_prefill == "live":
            whole = [u for u in fresh if u.text is None][:BURST_WHOLE_TEXTS]
            fresh = [u for u in fresh if u.text is not None] + whole
        if len(fresh) < 2:
            return False
        groups: dict[bool, list[tuple[Utterance, Joiner]]] = {}
        for u in fresh:
            assert u.cache is not None
            j = joiner(self.talker, u.prompt, u.cache)
            if j is not None:
                groups.setdefault(int8_rows(j), []).append((u, j))
        ran = False
        for group in groups.values():
            if len(group) < 2:
                continue
            t0 = time.perf_counter()
            outs = prefill_joint(self.talker, [j for _, j in group])
            dt = time.perf_counter() - t0
            for (u, _), pre in zip(group, outs, strict=True):
                assert u.chunks is not None
                u.chunks.close()
                self._prefilled(u, pre)
                u.pending.prefill += dt
            stats.prefill_s += dt
            ran = True
        return ran

    def close(self) -> None:
        """End every utterance (cancelled) and free the batched graphs and reserved caches."""
        for u in list(self._live.values()):
            u.result.outcome = "cancelled"
            self._end(u)
        self.batched.close()
        for cache in self._reserved:
            cache.close()
        self._reserved.clear()
        self._spare.clear()
