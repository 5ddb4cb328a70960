"""Several text streams on one worker: ``Pipeline.stream`` for up to ``max_batch`` requests at once.

``BatchRunner.submit`` plans a request (``Pipeline.plan_text``: segments, sampling, budget; a bad
request raises ``InputError`` here) and admits its first segment to the ``FrameScheduler``.
Each ``BatchRunner.step()`` is one scheduler iteration (a prefill chunk of a joining stream, or
the prefills of live streams that joined together; one batched code-predictor pass, one
batched talker step) followed by the decoder pushes that are
due: every stream keeps its own ``StreamingDecoder`` and chunk ramp, exactly as
``Pipeline.stream``, so a stream's chunks (sizes, codes, audio) are those it gets alone (with
the ``auto`` ramp, only while it is alone: sharing the batch, its chunks double). A
segment that ends flushes its last frames and the stream's next segment joins at once (its
slot is free); a cancelled stream leaves at the next step, before any more work for it.

Live text (``submit_live``: text still being written, ``Pipeline.stream_live``'s requests)
shares the batch too: a live stream waits outside the scheduler until its start policy is met,
then its utterance sits out of the steps whenever its text runs dry (engine/talker/scheduler.py);
its frames, pauses and chunks are those ``stream_live`` makes. Like ``stream_live`` it may start
on a guess of its first ids (engine/talker/live.py): its chunks and end are held until the text
confirms the guess, and it starts over, nothing sent, when the text refutes it. Codes requests
run on the unbatched ``Pipeline.stream``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from engine.errors import InputError
from engine.pipeline import (
    AudioChunk,
    Cancel,
    LivePlan,
    Pipeline,
    StreamInfo,
    SynthesisRequest,
    TextPlan,
    _cancel_fn,
    as_request,
)
from engine.talker.batch import BatchedTalker
from engine.talker.generate import FrameSampler, is_cancelled
from engine.talker.live import LiveRows, TextFeed
from engine.talker.scheduler import Emitted, Ended, FrameScheduler, Paused, StepStats
from engine.timings import StageTimings


@dataclass
class Finished:
    """A stream ended: "ok", "truncated_no_eos" or "cancelled" (as ``Pipeline.stream``)."""

    outcome: str


@dataclass
class Rejected:
    """A stream ended on an error of its own: a bad request found after its submit (live text
    that ended empty: an ``InputError``), or its own work raised (its live text, its sampling,
    its prefill). The other streams of the batch go on."""

    error: Exception


@dataclass
class _Live:
    """A live stream's text side: its plan until it starts, then its rows; while the ids its
    opening was laid out with are a guess the text has not confirmed, its events wait."""

    plan: LivePlan
    feed: TextFeed
    rows: LiveRows | None = None
    guess: list[int] | None = None
    held: list[AudioChunk | Finished] = field(default_factory=list)


@dataclass
class _Stream:
    sid: int
    plan: TextPlan | None  # None: a live stream that has not started
    cancel: Callable[[], bool] | None
    info: StreamInfo
    live: _Live | None = None
    segment: int = 0
    done: int = 0  # frames of the finished segments
    outcome: str = "ok"
    uid: int = 0  # the current segment's id in the scheduler
    pending: list[npt.NDArray[np.int32]] = field(default_factory=list)
    acc: StageTimings = field(default_factory=StageTimings)
    first_t: float | None = None  # when its first chunk was made
    audio_s: float = 0.0  # audio made so far

    def take(self, ev: Emitted) -> None:
        """Hold the frame ``ev`` brings for the stream's next chunk."""
        self.pending.append(ev.frame.codes)
        self.acc = self.acc + ev.frame.timings

    def ahead(self, now: float) -> float:
        """Seconds of audio made beyond what a listener who started at the first chunk has
        heard by ``now`` (-inf before the first chunk: nothing to play yet)."""
        return -np.inf if self.first_t is None else self.audio_s - (now - self.first_t)


# Talker caches a warmed-up runner keeps beside the model's own (~44 MB each at F16): a batch
# of up to 8 allocates nothing when streams join; past that, the memory an idle worker holds
# stays bounded and the other slots allocate as they fill.
RESERVED_SLOTS = 7

Event = tuple[int, AudioChunk | Finished | Rejected]
Deliver = Callable[[int, AudioChunk | Finished | Rejected], None]


class _Out(list[Event]):
    """A step's events, each also handed to ``deliver`` the moment it is made."""

    def __init__(self, deliver: Deliver | None) -> None:
        super().__init__()
        self.deliver = deliver

    def append(self, ev: Event) -> None:
        super().append(ev)
        if self.deliver is not None:
            self.deliver(*ev)


# the warm-up burst (``BatchRunner.warm_up``): past the ramp's largest chunk (16 frames)
WARM_TEXT = "Warming up every slot of the batch at once."
WARM_INSTRUCT = "A calm, clear voice."  # for models that speak only to an instruction
WARM_FRAMES = 36


class BatchRunner:
    """Up to ``max_batch`` text streams of one ``Pipeline`` (module docstring)."""

    def __init__(self, pipeline: Pipeline, max_batch: int) -> None:
        if pipeline.talker is None:
            raise InputError("text", "this model file has no talker: it cannot speak text")
        self.pipeline = pipeline
        self.talker = pipeline.talker
        self.batched = BatchedTalker(pipeline.talker)
        self.frames = FrameScheduler(pipeline.talker, max_batch, self.batched)
        self._sids = itertools.count(1)
        self._streams: dict[int, _Stream] = {}
        self._by_uid: dict[int, _Stream] = {}
        self._starting: list[_Stream] = []  # live streams waiting for their start
        self.decoder_s = 0.0  # decoder seconds of the last step
        self._pump: Callable[[], None] | None = None  # the step's (``step``)
        self.idle = False  # the last step did nothing: every stream waits for text

    @property
    def max_batch(self) -> int:
        return self.frames.max_batch

    def warm_up(self) -> float:
        """Build the batched code-predictor graphs of every batch size and reserve a talker
        cache for every slot but the one the model's own cache serves, up to
        ``RESERVED_SLOTS`` (``FrameScheduler.reserve``), then speak a short text in every slot
        at once (``WARM_FRAMES`` frames each, greedy), so that the streams that join do not pay
        for the graphs, the caches or their memory's first touch (seconds)."""
        t0 = time.perf_counter()
        self.batched.warm_up(self.max_batch)
        self.frames.reserve(min(self.max_batch - 1, RESERVED_SLOTS))
        self._warm_burst()
        return time.perf_counter() - t0

    def _warm_burst(self) -> None:
        # Every slot speaks a short text at once, as a burst of requests right after start
        # would: the joint prefills, the steps of each batch size and the decoder pushes of
        # each ramp size touch their memory here, not in the first clients' first audio (a
        # fresh 4 KB page cost 1.5-11 us on a measured VM; docs/performance.md, Session 20).
        # Skipped where a request needs a voice of its own (a Base model's clone).
        voice = next(iter(self.pipeline.voices), None)
        sids: list[int] = []
        for instruct in (None, WARM_INSTRUCT):
            try:
                for i in range(self.max_batch):
                    sids.append(self.submit(SynthesisRequest(
                        WARM_TEXT, voice=voice, instruct=instruct, seed=i, greedy=True,
                        max_frames=min(WARM_FRAMES, self.pipeline.max_frames_cap))))
                break
            except InputError:
                for sid in sids:
                    self.cancel(sid)
                sids = []
                while self._streams:
                    self.step()
        while self._streams:
            self.step()

    @property
    def starting(self) -> frozenset[int]:
        """The live streams that wait for their start policy (their text decides when)."""
        return frozenset(st.sid for st in self._starting)

    @property
    def free(self) -> int:
        """Streams that may still be submitted."""
        return self.max_batch - len(self._streams)

    def __len__(self) -> int:
        return len(self._streams)

    @property
    def last(self) -> StepStats:
        """What the talker side of the last ``step`` did (rows, seconds)."""
        return self.frames.last

    def submit(self, request: object, cancel: Cancel = None,
               info: StreamInfo | None = None) -> int:
        """Plan and admit a text request; returns its stream id. ``InputError`` for a bad
        request, ``RuntimeError`` when every slot is taken."""
        req = as_request(request)
        if not isinstance(req, SynthesisRequest):
            raise InputError("text", "the batch runs text requests only")
        if not self.free:
            raise RuntimeError("the batch is full")
        st = _Stream(next(self._sids), None, _cancel_fn(cancel),
                     info if info is not None else StreamInfo())
        self._start_text(st, req)
        self._streams[st.sid] = st
        return st.sid

    def submit_live(self, request: object, feed: TextFeed, cancel: Cancel = None,
                    info: StreamInfo | None = None, min_tokens: int = 1) -> int:
        """Admit a live-text request (``Pipeline.stream_live``'s arguments); returns its stream
        id. ``InputError`` for a bad request, ``RuntimeError`` when every slot is taken. It
        starts in a later ``step`` once its start policy is met."""
        if not self.free:
            raise RuntimeError("the batch is full")
        plan = self.pipeline.plan_live(request, min_tokens)
        st = _Stream(next(self._sids), None, _cancel_fn(cancel),
                     info if info is not None else StreamInfo(), live=_Live(plan, feed))
        self._streams[st.sid] = st
        self._starting.append(st)
        return st.sid

    def _start_text(self, st: _Stream, req: SynthesisRequest) -> None:
        plan = st.plan = self.pipeline.plan_text(req)
        st.info.seed, st.info.budget = plan.seed, plan.total
        st.info.text_tokens = sum(p.n_text_tokens for p in plan.prompts)
        self._admit(st)

    def _start_live(self, out: list[Event]) -> None:
        # live streams whose start policy is met (or whose text ended) join the scheduler
        for st in list(self._starting):
            lv = st.live
            assert lv is not None
            if is_cancelled(st.cancel):
                self._starting.remove(st)
                self._finish(st, "cancelled", out)
                continue
            try:
                self._try_start(st, lv)
            except Exception as e:
                self._reject(st, e, out)

    def _try_start(self, st: _Stream, lv: _Live) -> None:
        # a live stream joins the scheduler if its start policy is met
        lv.plan.poll(lv.feed, 0)
        start = lv.plan.start()
        if start is None or lv.plan.holds(time.perf_counter()):
            return
        self._starting.remove(st)
        live = lv.plan.live
        lv.plan.refuse_empty()
        if live.ended:  # the whole text came first: a streaming-text request
            st.live = None
            self._start_text(st, lv.plan.whole())
            return
        st.plan, budget = self.pipeline.live_text_plan(lv.plan)
        st.plan.prompts = [lv.plan.opening(start)]
        st.info.seed, st.info.budget = st.plan.seed, st.plan.total
        assert self.pipeline.prompts is not None
        lv.rows = LiveRows(self.talker, self.pipeline.prompts, live, lv.feed, budget,
                           placed=len(start))
        if live.ids[: len(start)] != start:
            lv.guess = start
            st.info.guessed += 1
        self._admit(st)

    def _reject(self, st: _Stream, e: Exception, out: list[Event]) -> None:
        # the stream ends on its own error (``Rejected``), nothing it holds sent
        self.cancel(st.sid)
        st.info.outcome = "rejected" if isinstance(e, InputError) else "error"
        out.append((st.sid, Rejected(e)))

    def _settle(self, out: list[Event]) -> None:
        # streams opened on a guess: the text confirms it (their events go out) or refutes it
        # (they start over from the stable ids, nothing of theirs sent)
        for st in list(self._streams.values()):
            lv = st.live
            if lv is None or lv.guess is None:
                continue
            if is_cancelled(st.cancel):
                self._finish(st, "cancelled", out)
                continue
            try:
                lv.plan.poll(lv.feed, 0)
                settled = lv.plan.live.confirms(lv.guess)
                if settled is None:
                    continue
                if not settled:
                    self._restart(st)
                    continue
            except Exception as e:
                self._reject(st, e, out)
                continue
            held, lv.guess, lv.held = lv.held, None, []
            for ev in held:
                if isinstance(ev, Finished):
                    self._finish(st, ev.outcome, out)
                else:
                    out.append((st.sid, ev))

    def _restart(self, st: _Stream) -> None:
        # as Pipeline.stream_live on a refuted guess: the same seed, a fresh start
        lv = st.live
        assert lv is not None and st.plan is not None
        if self._by_uid.pop(st.uid, None) is not None:
            self.frames.cancel(st.uid)
        lv.plan.request = replace(lv.plan.request, seed=st.plan.seed)
        st.info.codes.clear()
        st.info.frames = 0
        st.info.refuted += 1
        st.plan, st.segment, st.done, st.outcome = None, 0, 0, "ok"
        st.pending, st.acc, st.first_t, st.audio_s = [], StageTimings(), None, 0.0
        lv.rows, lv.guess, lv.held = None, None, []
        self._starting.append(st)

    def _admit(self, st: _Stream) -> None:
        talker = self.talker
        assert st.plan is not None
        budget = self.pipeline.segment_budget(st.plan, st.segment, st.done)
        sampler = FrameSampler(int(talker.cfg.vocab_size), talker.eos_id, st.plan.params,
                               st.plan.rng)
        rows = st.live.rows if st.live is not None else None
        st.uid = self.frames.add(st.plan.prompts[st.segment], sampler, budget, st.cancel, rows)
        self._by_uid[st.uid] = st

    def cancel(self, sid: int) -> bool:
        """End a stream now (no event follows); False if it is not here."""
        st = self._streams.pop(sid, None)
        if st is None:
            return False
        if st in self._starting:
            self._starting.remove(st)
        self._by_uid.pop(st.uid, None)
        self.frames.cancel(st.uid)
        st.info.outcome = "cancelled"
        return True

    def step(self, deliver: Deliver | None = None,
             pump: Callable[[], None] | None = None) -> list[Event]:
        """One round for every stream; returns (stream id, chunk or ``Finished``), each
        stream's in order, and hands each to ``deliver`` as soon as it is made (a chunk need
        not wait for the other streams' decoder pushes).

        The round's decoder work runs before its talker step (``FrameScheduler.iterate``'s
        ``before_step``), most urgent stream first: streams without audio yet (their first
        chunk is their time to first audio), then by how little audio they are ahead of a
        listener. Each stream's chunks are the same whatever the order.

        ``pump``: brings the live streams' text that has come meanwhile into their feeds; it
        runs after a push whose chunk waits for the text to confirm a guess, so the chunk goes
        out as soon as the text is there, not after the round's other pushes and its step."""
        out = _Out(deliver)
        self.decoder_s = 0.0
        self._pump = pump
        self._settle(out)
        if self._starting:
            self._start_live(out)
        events = self.frames.iterate(lambda evs: self._handle(evs, out))
        last = self.frames.last
        self.idle = not (out or events or last.cp_rows or last.batch or last.prefill_s)
        return out

    def _handle(self, events: list[Emitted | Ended | Paused], out: list[Event]) -> None:
        # the scheduler's events of this round, before its talker step
        by_stream: dict[int, list[Emitted | Ended | Paused]] = {}
        for ev in events:
            by_stream.setdefault(ev.uid, []).append(ev)
        now = time.perf_counter()
        order = sorted(by_stream, key=lambda uid: self._urgency(uid, now))
        order = self._push_filled(order, by_stream, out)
        for ev in (ev for uid in order for ev in by_stream[uid]):
            st = self._by_uid.get(ev.uid)
            if st is None:
                continue
            assert st.plan is not None
            if isinstance(ev, Emitted):
                st.take(ev)
                if len(st.pending) >= st.plan.ramp.target and self._push_due(st, out):
                    st.plan.ramp.advance(shared=len(self._streams) > 1)
                    self._pump_held([st], out)
            elif isinstance(ev, Paused):
                # as Pipeline._chunks on a pause: the frames held go out, the ramp restarts
                if not st.pending or self._push_due(st, out):
                    st.plan.ramp.advance(restart=True)
            else:
                self._segment_ended(st, ev, out)

    def _push_filled(self, order: list[int], by_stream: dict[int, list[Emitted | Ended | Paused]],
                     out: list[Event]) -> list[int]:
        """The streams whose chunk goes out this round (a frame fills it, or a pause for text
        flushes it) and that have nothing else this round push together
        (``Pipeline._push_together``: short chunks in one graph, so the decoder's weights are
        read once for all), each as ``_handle`` would push it; returns the streams left for
        ``_handle``."""
        due: list[tuple[_Stream, bool]] = []  # (stream, paused)
        for uid in order:
            st = self._by_uid.get(uid)
            if st is None or st.plan is None or is_cancelled(st.cancel):
                continue  # (a cancelled one is left for _handle, which ends it)
            kinds = [type(ev) for ev in by_stream[uid]]
            if kinds == [Emitted]:
                if len(st.pending) + 1 >= st.plan.ramp.target:
                    due.append((st, False))
            elif kinds == [Emitted, Paused] or (kinds == [Paused] and st.pending):
                due.append((st, True))
        if len(due) < 2:
            return order
        for st, _paused in due:
            ev = by_stream[st.uid][0]
            if isinstance(ev, Emitted):
                st.take(ev)
        streams = [st for st, _paused in due]
        for st, chunk in zip(streams, self._push_many(streams), strict=True):
            self._emit(st, chunk, out)
        shared = len(self._streams) > 1
        for st, paused in due:
            assert st.plan is not None
            # as _handle: a pause restarts the ramp, a filled chunk advances it
            st.plan.ramp.advance(restart=paused, shared=shared)
        self._pump_held(streams, out)
        pushed = {st.uid for st in streams}
        return [uid for uid in order if uid not in pushed]

    def _pump_held(self, streams: list[_Stream], out: list[Event]) -> None:
        # after a push whose chunk waits for the text to confirm a guess: read the text that
        # has come, so the chunk goes out now, not after the round's other pushes and its step
        if self._pump is not None and any(st.live is not None and st.live.held for st in streams):
            self._pump()
            self._settle(out)

    def _push_due(self, st: _Stream, out: list[Event]) -> bool:
        # the frames held go out, unless the stream was cancelled meanwhile (False: it ended)
        if is_cancelled(st.cancel):
            self._finish(st, "cancelled", out)
            return False
        self._emit(st, self._push(st, StageTimings()), out)
        return True

    def _urgency(self, uid: int, now: float) -> float:
        st = self._by_uid.get(uid)
        return np.inf if st is None else st.ahead(now)

    def _push(self, st: _Stream, extra: StageTimings) -> AudioChunk:
        st.acc = st.acc + extra
        return self._push_many([st])[0]

    def _push_many(self, streams: list[_Stream]) -> list[AudioChunk]:
        t0 = time.perf_counter()
        pushes = []
        for st in streams:
            assert st.plan is not None
            pushes.append((st.plan.decoder, st.pending, st.acc, st.info))
        chunks = self.pipeline._push_together(pushes)
        t1 = time.perf_counter()
        self.decoder_s += t1 - t0
        for st, chunk in zip(streams, chunks, strict=True):
            st.pending, st.acc = [], StageTimings()
            if st.first_t is None:
                st.first_t = t1
            st.audio_s += chunk.audio.shape[0] / self.pipeline.decoder.sample_rate
        return chunks

    def _segment_ended(self, st: _Stream, ev: Ended, out: list[Event]) -> None:
        self._by_uid.pop(ev.uid, None)
        assert st.plan is not None
        r = ev.result
        if r.error is not None:
            self._reject(st, r.error, out)
            return
        if r.outcome == "cancelled":
            self._finish(st, "cancelled", out)
            return
        st.done += r.frames
        if r.outcome == "truncated_no_eos":
            st.outcome = "truncated_no_eos"
        if st.pending:  # the segment's last frames go out before the next one's prefill
            if is_cancelled(st.cancel):
                self._finish(st, "cancelled", out)
                return
            self._emit(st, self._push(st, r.leftover), out)
        st.segment += 1
        if st.segment >= len(st.plan.prompts):
            self._finish(st, st.outcome, out)
        elif self.pipeline.segment_budget(st.plan, st.segment, st.done) < 1:
            self._finish(st, "truncated_no_eos", out)  # the budget ran out before the text
        else:
            self._admit(st)

    def _emit(self, st: _Stream, chunk: AudioChunk, out: list[Event]) -> None:
        if st.live is not None and st.live.guess is not None:
            st.live.held.append(chunk)
        else:
            out.append((st.sid, chunk))

    def _finish(self, st: _Stream, outcome: str, out: list[Event]) -> None:
        if st.uid in self._by_uid:
            self._by_uid.pop(st.uid)
            self.frames.cancel(st.uid)
        st.info.outcome = outcome
        lv = st.live
        if lv is not None and lv.guess is not None:
            if outcome != "cancelled":
                lv.held.append(Finished(outcome))  # it keeps its slot until the text settles
                return
            lv.guess, lv.held = None, []  # cancelled: what it held is never sent
        self._streams.pop(st.sid, None)
        if lv is not None and lv.rows is not None:
            st.info.text_tokens = len(lv.plan.live.ids)
        out.append((st.sid, Finished(outcome)))

    def close(self) -> None:
        """End every stream and free the batched graphs and caches."""
        self.frames.close()
        self._streams.clear()
        self._by_uid.clear()
        self._starting.clear()
