"""Text (or codes) in, streamed audio chunks out, with per-stage timings: the engine's one door.

``Pipeline.stream(request, cancel=None)`` is a generator. It yields ``AudioChunk`` items
``(audio float32 [n * 1920] in [-1, 1], StageTimings, n_frames)`` as frames arrive and *returns*
the outcome string: ``"ok"`` (EOS reached, or every code decoded), ``"truncated_no_eos"`` (the
frame budget ran out before EOS; the audio so far was delivered) or ``"cancelled"``.

* ``SynthesisRequest``: text -> talker -> code predictor -> StreamingDecoder. Chunk ramp: the
  first chunk is decoded after 1 frame, then 2, 4, ... up to ``chunk_max_frames`` per chunk, so
  the first audio comes as early as possible and later chunks amortise the decoder's per-call
  cost. Each chunk's timings carry ``prefill`` (first chunk only), ``talker_step`` and
  ``code_predictor`` for its frames, and the decoder's ``quant`` .. ``bigvgan`` for its push.
* ``CodesRequest``: codes [16, T] -> StreamingDecoder only, same ramp, same items, so an HTTP
  service needs one door for both kinds.
* Cancellation: ``cancel`` is a ``threading.Event`` or any callable returning True to stop; it
  is checked before every talker step, every code-predictor run and every decoder push, so work
  stops within one frame and the generator returns ``"cancelled"`` (pending frames are dropped).
* Errors in the request raise ``InputError(field, message)`` on the first ``next()``: unknown
  voice or language (the message lists the valid ones), empty text, an instruction the model
  does not honour, ``max_frames`` over the server cap, a text request to a decoder-only model.

One Pipeline serves one request at a time (the KV caches and cached graphs are shared state);
a worker process owns one. See docs/talker.md for the frame-budget formula and the policies.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import hashlib
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from engine.backend import BackendSet
from engine.clone.prompt import VoicePrompt, build_clone_prompt, live_start_tokens
from engine.decoder import DecoderModel, StreamingDecoder, push_together, validate_codes
from engine.decoder.streaming import JOIN_MAX_FRAMES
from engine.errors import InputError
from engine.talker.generate import (
    DEFAULT_MAX_FRAMES_CAP,
    Frame,
    Result,
    frame_budget,
    generate_frames,
    is_cancelled,
)
from engine.talker.live import (
    LiveText,
    TextFeed,
    TextUpdate,
    generate_live_frames,
    opening_prompt,
)
from engine.talker.model import PREFILL_CHUNK, TalkerModel
from engine.talker.prompt import PromptBuilder, check_speech, default_text_mode
from engine.talker.sampling import SamplingParams, make_rng
from engine.talker.segment import split_segments
from engine.timings import StageTimings

# Token caps (docs/talker.md "Long and hostile texts"): what a prefill costs is tokens, not
# characters (an emoji or a CJK character can be several tokens).
DEFAULT_MAX_TEXT_TOKENS = 2048
DEFAULT_MAX_INSTRUCT_TOKENS = 256
DEFAULT_SEGMENT_TOKENS = 200
# How long a live text that would be several segments waits for its end before it starts live
# (``LivePlan.holds``): a client's "end" right after its text comes within a few ms.
END_GRACE_S = 0.05
# 16: the ramp then costs little more than an offline decode (docs/performance.md, Decoder)
DEFAULT_CHUNK_MAX_FRAMES = 16
# Decoder states after an in-context voice's reference codes, kept for the most recent voices:
# the reference decodes its codes and the new ones in one pass and cuts the reference's share,
# so the new audio has every reference frame as context (the decoder's attention layers reach
# back up to 8 x 71 frames); priming is the same for every request in that voice.
PRIMED_VOICES = 16
Cancel = threading.Event | Callable[[], bool] | None


@dataclass
class SynthesisRequest:
    """A text request. ``None`` fields take the model's defaults (generation_config)."""

    text: str
    voice: str | None = None
    language: str | None = None  # None or "auto": the model decides
    instruct: str | None = None
    text_mode: str | None = None  # "full" | "stream"; None: default_text_mode (by voice kind)
    seed: int | None = None
    greedy: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    subtalker_temperature: float | None = None
    subtalker_top_k: int | None = None
    subtalker_top_p: float | None = None
    max_frames: int | None = None  # frame budget override (<= the pipeline's max_frames_cap)
    frame_limit: int | None = None  # lowers the budget (formula or max_frames), never raises it
    chunk_max_frames: int | None = None
    # A cloned voice (Base models): from ``Pipeline.clone_voice`` or a ``.qvoice`` file.
    voice_prompt: VoicePrompt | None = None


@dataclass
class CodesRequest:
    """A decoder-only request: codes [16, T] (ids 0..2047)."""

    codes: Any
    chunk_max_frames: int | None = None
    max_frames: int | None = None  # decode at most this many frames


class AudioChunk(NamedTuple):
    """One streamed item: float32 audio, the stage timings of this chunk, frames in it."""

    audio: npt.NDArray[np.float32]
    timings: StageTimings
    frames: int


@dataclass
class StreamInfo:
    """Filled in while a stream runs (pass one to ``stream(info=...)``)."""

    seed: int | None = None
    budget: int = 0
    frames: int = 0
    codes: list[npt.NDArray[np.int32]] = field(default_factory=list)  # [16, n] per chunk
    outcome: str = ""
    text_tokens: int = 0  # the text's tokens (a live text: those spoken when it ended)
    guessed: int = 0  # live text: openings laid out on a guess of its first ids
    refuted: int = 0  # ... of which the text proved wrong (started over; their audio unsent)


_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "repetition_penalty",
                    "subtalker_temperature", "subtalker_top_k", "subtalker_top_p")


def as_request(obj: Any) -> SynthesisRequest | CodesRequest:
    """Accept our request types, or a duck-typed job with ``kind`` "text"/"codes".

    A job carries ``text``, ``voice``, ``language``, ``instruct``, ``max_frames``,
    ``chunk_max_frames`` and optionally ``frame_limit``, ``text_mode``, ``greedy`` and a
    ``sampling`` dict (``seed``, ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``,
    ...).
    """
    if isinstance(obj, SynthesisRequest | CodesRequest):
        return obj
    kind = getattr(obj, "kind", None)
    chunk = getattr(obj, "chunk_max_frames", None) or None
    max_frames = getattr(obj, "max_frames", None) or None
    if kind == "codes":
        return CodesRequest(codes=obj.codes, chunk_max_frames=chunk, max_frames=max_frames)
    if kind == "text":
        sampling = dict(getattr(obj, "sampling", None) or {})
        kwargs = {k: sampling.get(k) for k in _SAMPLING_FIELDS}
        return SynthesisRequest(
            text=obj.text, voice=getattr(obj, "voice", None),
            language=getattr(obj, "language", None), instruct=getattr(obj, "instruct", None),
            text_mode=getattr(obj, "text_mode", None) or None,
            seed=sampling.get("seed"), greedy=bool(getattr(obj, "greedy", False)),
            max_frames=max_frames, frame_limit=getattr(obj, "frame_limit", None) or None,
            chunk_max_frames=chunk, **kwargs,
        )
    raise TypeError(f"not a synthesis request: {type(obj).__name__}")


@dataclass
class TextPlan:
    """A text request made ready to speak (``Pipeline.plan_text``)."""

    prompts: list[Any]  # one Prompt per segment
    params: SamplingParams
    total: int  # frame budget of the whole text
    rng: np.random.Generator
    seed: int
    decoder: StreamingDecoder
    ramp: Ramp


@dataclass
class LivePlan:
    """A live-text request waiting to start (``Pipeline.plan_live``): the text so far, how its
    prompt opens, and when it may start."""

    request: SynthesisRequest
    live: LiveText
    opening: Callable[[list[int]], Any]  # the prompt for the stable ids known at the start
    need: int  # stable ids an in-context voice needs before it starts
    min_tokens: int  # the start policy: stable ids before speech starts
    # whether a text would be spoken as several segments (``Pipeline._segments``)
    several_segments: Callable[[str], bool] = lambda _text: False
    startable_at: float | None = None  # when ``holds`` first saw a start allowed

    def holds(self, now: float) -> bool:
        """Whether a start the policy allows waits (up to ``END_GRACE_S`` from when it was
        first allowed) for the end of the text: while the text so far would be several
        segments. A client that sends a long text and then its end (two messages) means one
        request whose whole text is known: spoken as several segments, as ``stream`` speaks
        it. Started live before the end came, it would be one utterance with the live budget
        (other audio). A text of one segment is spoken alike either way: no wait."""
        if self.live.ended:
            return False
        if self.startable_at is None:
            self.startable_at = now
        return now - self.startable_at < END_GRACE_S and self.several_segments(self.live.text)

    def ready(self) -> bool:
        """Whether generation may start: the start policy met (and an in-context voice's
        reference covered), or the text ended."""
        live = self.live
        return live.ended or (live.text_ready(self.min_tokens) and len(live.ids) >= self.need)

    def refuse_empty(self) -> None:
        """``InputError`` when the text ended with nothing to speak, in POST /tts's words (spaces
        only, or no speech; a text with speech has tokens)."""
        if self.ready() and not self.live.ids:
            check_speech("text", self.live.text)
            raise InputError("text", "is empty", code="empty")

    def start(self, guess: bool = True) -> list[int] | None:
        """The ids to open the prompt with if generation may start now, else None: the stable
        ids once ``ready``; before that, when the start policy is met counting the word being
        written as complete (``LiveText.tentative``), the stable ids if the opening needs no
        more, else (``guess``) the guessed ids the opening places, for the caller to confirm
        (``LiveText.confirms``) before it lets audio out."""
        live = self.live
        if self.ready():
            return list(live.ids)
        ids, _ = live.tentative()
        if len(ids) < self.need or not live.text_ready(self.min_tokens, tentative=True):
            return None
        if len(live.ids) >= self.need:
            return list(live.ids)
        return ids[: self.need] if guess else None

    def poll(self, feed: TextFeed, timeout: float) -> None:
        """Take what ``feed`` delivers within ``timeout`` seconds (0: what it holds now)."""
        update = feed.take(timeout)
        if update is not None:
            self.live.add(update)

    def whole(self) -> SynthesisRequest:
        """The request for the whole text, once it ended before speech started: exactly a
        streaming-text request."""
        return replace(self.request, text=self.live.text, text_mode="stream")


class Ramp:
    """Where a stream is on the chunk ramp: ``target`` frames make the next decoder push.

    ``auto`` (``chunk_sizes``): the gentle ramp while the stream is alone in its worker, the
    doubling one while it shares the worker's steps with other streams (``advance(shared=
    True)``): alone, a stream at RTF ~0.6 cannot double its chunks without running dry; in a
    batch, every small push holds up the other streams' frames (docs/performance.md, Session
    19). In a batch the chunks stop at ``JOIN_MAX_FRAMES``: a 16-frame push held every other
    stream's frames for ~80 ms, long enough to run a younger stream's audio dry, and pushes
    this short that fall due together are decoded in one graph (Session 28). A doubled size
    skips the gentle sizes below it, so a stream left alone again goes on gently from where
    it is. ``first``: the first chunk's frames (again after a restart)."""

    def __init__(self, chunk_max_frames: int, ramp: str = "double", first: int = 1) -> None:
        self.chunk_max = max(1, chunk_max_frames)
        self.ramp = ramp
        self.first = first
        self.advance(restart=True)

    def advance(self, restart: bool = False, shared: bool = False) -> None:
        """The next size after a push (the first chunk again after ``restart``: a pause for text);
        ``shared``: other streams share the worker's steps now (``auto`` doubles then)."""
        if restart:
            self._sizes = chunk_sizes(self.chunk_max, self.ramp, self.first)
            self._doubled = False
            self.target = next(self._sizes)
        elif self.ramp != "auto":
            self.target = next(self._sizes)
        elif shared:
            self._doubled = True
            self.target = min(self.target * 2, self.chunk_max, JOIN_MAX_FRAMES)
        else:  # alone: the gentle ramp, or after a doubling its growth from the size reached
            self.target = _grow(self.target, self.chunk_max) if self._doubled else next(
                self._sizes)


RAMPS = ("auto", "double", "gentle")


def chunk_sizes(chunk_max_frames: int, ramp: str = "double", first: int = 1
                ) -> Generator[int, None, None]:
    """The chunk ramp capped at ``chunk_max_frames`` (forever): ``double`` 1, 2, 4, 8, ...;
    ``gentle`` 1, 1, 1, 2, 2, 3, 4, 6, 8, 12, 16, 24, ... (x1.5 a step); ``auto`` is gentle
    here (a stream alone: ``Ramp`` doubles it while the stream shares a batch). ``first``:
    the first chunk's frames, the ramp going on after it as after a first chunk of one frame
    (``gentle`` 2, 1, 1, 2, 2, 3, ...): what a listener holds before the second chunk, for
    that much more time to first audio.

    A chunk of n frames must be made while the audio before it plays. Doubling asks for 2n
    frames in the time n play, which a stream whose frames take more than ~half their audio's
    time (plus each push's fixed cost) cannot do: it stalls at every step. The gentle ramp
    asks for 1.5x and gives the buffer three one-frame chunks to start from, for a few more
    pushes (docs/performance.md, Session 19: one client's stalls 44 -> 11 in 11 requests)."""
    if ramp not in RAMPS:
        raise ValueError(f"ramp must be one of {RAMPS}, got {ramp!r}")
    if first < 1:
        raise ValueError(f"the first chunk must be >= 1 frame, got {first}")
    cap = max(1, chunk_max_frames)
    yield min(first, cap)
    gentle = ramp != "double"
    if gentle:
        for size in (1, 1, 2):
            yield min(size, cap)
    size = 2
    while True:
        yield min(size, cap)
        size = _grow(size, cap) if gentle else min(size * 2, cap)


def _grow(size: int, cap: int) -> int:
    """The gentle ramp's step: 2, 3, 4, 6, 8, 12, ...: x1.5 from a power of two, x4/3 to the
    next one."""
    return min(size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3, cap)


class Pipeline:
    """The loaded model (talker when present, decoder) and the streaming driver.

    ``decoder``: a loaded ``DecoderModel`` to share (the service has one), else loaded here with
    ``precision``. ``kv_type``: talker/code-predictor cache type ("f16" or "f32").
    ``max_frames_cap``: the server cap on frames per request. ``ignore_unsupported_instruct``:
    drop instructions a model does not honour instead of refusing them. ``max_text_tokens`` /
    ``max_instruct_tokens``: the longest text / instruction, in tokens (``InputError`` over
    it). ``segment_tokens``: a longer text is spoken segment by segment, each at most this
    many tokens of whole sentences (``engine.talker.segment``), with its own frame budget.
    ``prefill_chunk``: prompt positions per prefill graph (``TalkerModel``). ``chunk_ramp``:
    how the decoder's chunks grow to ``chunk_max_frames`` from ``first_chunk_frames``
    (``chunk_sizes``).
    """

    def __init__(self, model: Any, backends: BackendSet, decoder: DecoderModel | None = None,
                 *, precision: str = "fast", kv_type: str = "f16",
                 max_frames_cap: int = DEFAULT_MAX_FRAMES_CAP,
                 chunk_max_frames: int = DEFAULT_CHUNK_MAX_FRAMES,
                 ignore_unsupported_instruct: bool = False,
                 max_text_tokens: int = DEFAULT_MAX_TEXT_TOKENS,
                 max_instruct_tokens: int = DEFAULT_MAX_INSTRUCT_TOKENS,
                 segment_tokens: int = DEFAULT_SEGMENT_TOKENS,
                 prefill_chunk: int = PREFILL_CHUNK, chunk_ramp: str = "double",
                 first_chunk_frames: int = 1) -> None:
        if chunk_ramp not in RAMPS:
            raise ValueError(f"chunk_ramp must be one of {RAMPS}, got {chunk_ramp!r}")
        if first_chunk_frames < 1:
            raise ValueError(f"first_chunk_frames must be >= 1, got {first_chunk_frames}")
        self.chunk_ramp = chunk_ramp
        self.first_chunk_frames = int(first_chunk_frames)
        self.model = model
        self.backends = backends
        self._own_decoder = decoder is None
        self.decoder = decoder if decoder is not None else DecoderModel.load(
            model, backends, precision)  # type: ignore[arg-type]
        self.max_frames_cap = int(max_frames_cap)
        self.chunk_max_frames = int(chunk_max_frames)
        for name, v in (("max_text_tokens", max_text_tokens),
                        ("max_instruct_tokens", max_instruct_tokens),
                        ("segment_tokens", segment_tokens)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.max_text_tokens = int(max_text_tokens)
        self.max_instruct_tokens = int(max_instruct_tokens)
        self.segment_tokens = int(segment_tokens)
        self._steady_compute: int | None = None  # compute buffer bytes after warm_up
        self.talker: TalkerModel | None = None
        self.prompts: PromptBuilder | None = None
        self._fingerprint: str | None = None
        self._cloner: Any = None
        self._primed: collections.OrderedDict[bytes, tuple[dict[str, Any], int]] = (
            collections.OrderedDict())
        self.defaults: SamplingParams | None = None
        if "talker" in model.parts:
            self.prompts = PromptBuilder(model, ignore_unsupported_instruct)
            self.talker = TalkerModel(model, backends, kv_type, prefill_chunk=prefill_chunk)
            self.defaults = SamplingParams.from_defaults(model.generation_defaults)
            self._max_new_tokens = int(model.generation_defaults.max_new_tokens)

    # -- what the model offers --------------------------------------------------------------

    @property
    def has_talker(self) -> bool:
        """Whether text requests are possible (the GGUF has the talker part)."""
        return self.talker is not None

    @property
    def sample_rate(self) -> int:
        """Output sample rate (24000)."""
        return self.decoder.sample_rate

    @property
    def voices(self) -> list[str]:
        """Speaker names ([] without a talker)."""
        return self.prompts.voices if self.prompts else []

    @property
    def languages(self) -> list[str]:
        """Language names a request may use, "auto" first ([] without a talker)."""
        return self.prompts.languages if self.prompts else []

    @property
    def honours_instruct(self) -> bool:
        """Whether ``instruct`` is used by this model."""
        return bool(self.prompts and self.prompts.honours_instruct)

    def warm_up(self, pin_prefixes: bool = True) -> float:
        """Build the cached code-predictor graphs (seconds); the decoder warms up separately.

        ``pin_prefixes``: also compute the prompt prefix (role, codec prefix, speaker) of every
        voice x language without an instruction and keep its K/V rows for good, so no request
        of a built-in voice pays for it (~1 MB each, computed in batches: 9 x 11 for the
        released CustomVoice models). Models that ignore instructions (0.6B CustomVoice) have
        no other prefixes. Also sizes the compute buffers for a prompt before the first
        request, and for the decoder's largest chunk: that size is the steady state
        ``release`` returns to after a request that needed more.
        """
        t0 = time.perf_counter()
        sd = StreamingDecoder(self.decoder)
        silence = np.zeros((self.decoder.cfg.num_quantizers, self.chunk_max_frames), np.int32)
        for _ in range(2):  # the second push carries history (its graphs are the larger)
            sd.push(silence)
        seconds = time.perf_counter() - t0
        if self.talker is None or self.prompts is None:
            self._steady_compute = self.backends.compute_buffer_bytes()
            return seconds
        seconds += self.talker.warm_up()
        if pin_prefixes:
            t0 = time.perf_counter()
            voices: list[str | None] = list(self.prompts.voices) or [None]
            prompts = []
            for voice in voices:
                for language in self.prompts.languages:
                    try:
                        prompts.append(self.prompts.build(".", voice, language))
                    except InputError:  # e.g. a VoiceDesign model wants an instruction
                        continue
            self.talker.pin_prefixes(prompts)
            seconds += time.perf_counter() - t0
        self._steady_compute = self.backends.compute_buffer_bytes()
        return seconds

    # -- streaming ---------------------------------------------------------------------------

    def stream(self, request: Any, cancel: Cancel = None, info: StreamInfo | None = None
               ) -> Generator[AudioChunk, None, str]:
        """Yield ``AudioChunk`` items; return "ok" | "truncated_no_eos" | "cancelled"."""
        req = as_request(request)
        check = _cancel_fn(cancel)
        info = info if info is not None else StreamInfo()
        try:
            if isinstance(req, CodesRequest):
                outcome = yield from self._stream_codes(req, check, info)
            else:
                outcome = yield from self._stream_text(req, check, info)
        finally:
            self.release()
        info.outcome = outcome
        return outcome

    def _chunk_max(self, req: SynthesisRequest | CodesRequest) -> int:
        n = req.chunk_max_frames or self.chunk_max_frames
        if n < 1:
            raise InputError("chunk_max_frames", f"must be >= 1, got {n}")
        return int(n)

    def _ramp(self, chunk_max: int) -> Ramp:
        return Ramp(chunk_max, self.chunk_ramp, self.first_chunk_frames)

    def _push(self, sd: StreamingDecoder, codes: list[npt.NDArray[np.int32]],
              timings: StageTimings, info: StreamInfo) -> AudioChunk:
        return self._push_together([(sd, codes, timings, info)])[0]

    def _push_together(self, pushes: Sequence[tuple[StreamingDecoder, list[npt.NDArray[np.int32]],
                                                     StageTimings, StreamInfo]]
                       ) -> list[AudioChunk]:
        """Each stream's frames held as one chunk, the streams' pushes joined where
        ``push_together`` joins them."""
        blocks = [np.stack(codes, axis=1) if codes[0].ndim == 1
                  else np.concatenate(codes, axis=1) for _sd, codes, _tm, _info in pushes]
        decoded = push_together([sd for sd, *_ in pushes], blocks)
        chunks = []
        for (_sd, _codes, timings, info), block, (audio, dec) in zip(pushes, blocks, decoded,
                                                                    strict=True):
            info.codes.append(block)
            info.frames += block.shape[1]
            chunks.append(AudioChunk(np.asarray(audio, dtype=np.float32), timings + dec,
                                     int(block.shape[1])))
        return chunks

    def _stream_codes(self, req: CodesRequest, cancel: Callable[[], bool] | None,
                      info: StreamInfo) -> Generator[AudioChunk, None, str]:
        cfg = self.decoder.cfg
        codes = validate_codes(req.codes, cfg.num_quantizers, cfg.codebook_size)
        if req.max_frames:
            codes = codes[:, : int(req.max_frames)]
        sizes = chunk_sizes(self._chunk_max(req), self.chunk_ramp, self.first_chunk_frames)
        sd = StreamingDecoder(self.decoder)
        pos, total = 0, codes.shape[1]
        info.budget = total
        while pos < total:
            if is_cancelled(cancel):
                return "cancelled"
            n = min(next(sizes), total - pos)
            yield self._push(sd, [codes[:, pos : pos + n]], StageTimings(), info)
            pos += n
        return "ok"

    def _segments(self, req: SynthesisRequest) -> list[str]:
        """The text as segments (``engine.talker.segment``), after the token caps."""
        assert self.prompts is not None
        offsets = self.prompts.offsets("text", req.text)
        if len(offsets) > self.max_text_tokens:
            raise InputError("text", f"{len(offsets)} tokens; the limit is "
                             f"{self.max_text_tokens} tokens", code="too_long")
        if req.instruct:
            n = len(self.prompts.offsets("instruct", req.instruct))
            if n > self.max_instruct_tokens:
                raise InputError("instruct", f"{n} tokens; the limit is "
                                 f"{self.max_instruct_tokens} tokens", code="too_long")
        return split_segments(req.text, offsets, self.segment_tokens) or [req.text]

    def plan_text(self, req: SynthesisRequest) -> TextPlan:
        """Everything a text request needs before its first frame (its segments' prompts, the
        sampling, the frame budget, the RNG, a primed decoder), or ``InputError``. Shared by
        ``stream`` and the batch scheduler (engine/batching.py)."""
        if self.talker is None or self.prompts is None or self.defaults is None:
            raise InputError(
                "text", "this model file has no talker (a decoder-only GGUF): it cannot speak "
                "text; send codes, or convert the full model folder")
        segments = self._segments(req)
        if req.voice_prompt is not None:
            prompts = [self._clone_prompt(replace(req, text=t)) for t in segments]
        else:
            mode = req.text_mode or default_text_mode(cloned=False)
            prompts = [self.prompts.build(t, req.voice, req.language, req.instruct, mode)
                       for t in segments]
        params = self._sampling(req)
        if len(prompts) == 1:
            total = frame_budget(prompts[0].n_text_tokens, req.max_frames, self.max_frames_cap,
                                 self._max_new_tokens, req.frame_limit)
        else:
            # the request's max_frames or frame_limit (else the server cap) bounds the whole
            # text; each segment has its own budget by the formula, within what is left
            total = frame_budget(0, req.max_frames or self.max_frames_cap, self.max_frames_cap,
                                 self._max_new_tokens, req.frame_limit)
        chunk_max = self._chunk_max(req)
        rng, seed = make_rng(req.seed)
        return TextPlan(prompts, params, total, rng, seed, self._primed_decoder(req.voice_prompt),
                        self._ramp(chunk_max))

    def _primed_decoder(self, voice: VoicePrompt | None) -> StreamingDecoder:
        """A streaming decoder; for an in-context voice, primed with its reference codes
        (decoded for context only, as the reference cuts that audio), from the kept state when
        this voice was primed before."""
        sd = StreamingDecoder(self.decoder)
        if voice is None or voice.ref_codes is None:
            return sd
        prime = np.ascontiguousarray(voice.ref_codes.T)
        key = hashlib.blake2b(prime.tobytes(), digest_size=16).digest()
        kept = self._primed.get(key)
        if kept is None:
            sd.prime(prime)
            self._primed[key] = (dict(sd.state), sd.frames)
            if len(self._primed) > PRIMED_VOICES:
                self._primed.popitem(last=False)
        else:
            # pushes replace the state's arrays, never write into them: a copy of the dict is
            # a private state
            self._primed.move_to_end(key)
            sd.state, sd.frames = dict(kept[0]), kept[1]
        return sd

    def segment_budget(self, plan: TextPlan, i: int, done: int) -> int:
        """Frames segment ``i`` may take when the earlier ones took ``done`` (0: none left)."""
        left = plan.total - done
        if left < 1 or len(plan.prompts) == 1:
            return max(0, left)
        return min(left, frame_budget(plan.prompts[i].n_text_tokens, None, self.max_frames_cap,
                                      self._max_new_tokens))

    def _stream_text(self, req: SynthesisRequest, cancel: Callable[[], bool] | None,
                     info: StreamInfo) -> Generator[AudioChunk, None, str]:
        plan = self.plan_text(req)
        assert self.talker is not None
        info.seed, info.budget = plan.seed, plan.total
        info.text_tokens = sum(p.n_text_tokens for p in plan.prompts)
        outcome = "ok"
        done = 0  # frames of the earlier segments
        for i, prompt in enumerate(plan.prompts):
            budget = self.segment_budget(plan, i, done)
            if budget < 1:
                return "truncated_no_eos"  # the text's frame budget ran out before its end
            frames = generate_frames(self.talker, prompt, plan.params, budget, plan.rng, cancel)
            # the segment's last frames go out before the next one's prefill
            result = yield from self._chunks(frames, plan.decoder, plan.ramp, cancel, info)
            if result.outcome == "cancelled":
                return "cancelled"
            done += result.frames
            if result.outcome == "truncated_no_eos":
                outcome = "truncated_no_eos"
        return outcome

    def release(self) -> None:
        """Give back what one request grew past the steady state (after ``warm_up``): the
        talker cache back to its reserved size, compute buffers back to their warm-up size,
        and free heap pages to the system."""
        if self.talker is not None:
            self.talker.trim()
        if self._steady_compute is not None:
            # (slack: a request may legitimately need a little more than the sizing graphs)
            self.backends.trim_compute_buffers(int(self._steady_compute * 1.25) + (4 << 20))
        _malloc_trim()

    @property
    def voice_fingerprint(self) -> str:
        """The fingerprint cloned voices of this model carry (``engine.clone.voice_file``)."""
        if self._fingerprint is None:
            from engine.clone.voice_file import model_fingerprint

            self._fingerprint = model_fingerprint(self.model)
        return self._fingerprint

    def _voice_cloner(self) -> Any:
        """The model's ``VoiceCloner`` (made once; its encoders load on first use);
        ``InputError`` when this model file cannot clone."""
        from engine.clone.cloner import VoiceCloner, check_base

        if self.prompts is None:
            raise InputError("ref_audio", "this model file has no talker")
        check_base(self.model)
        if self._cloner is None:
            self._cloner = VoiceCloner(self.model, self.backends, self.prompts)
        return self._cloner

    def load_cloner(self) -> bool:
        """Load the voice cloner's encoders now, if this model file can clone (a Base model
        with its speaker encoder); True if so. A server calls it at warm-up, so its first
        ``clone_voice`` does not also load them."""
        try:
            cloner = self._voice_cloner()
        except InputError:
            return False
        cloner.load()
        return True

    def clone_voice(self, audio: bytes | str | npt.NDArray[np.float32], ref_text: str | None,
                    x_vector_only: bool = False, max_seconds: float | None = None
                    ) -> VoicePrompt:  # fmt: skip
        """A voice from reference audio (any format/rate, or samples ``load_reference`` already
        made: 24 kHz mono float32) and its transcript (ICL mode unless ``x_vector_only``).
        ``InputError`` for a non-Base model, an empty transcript, or audio that cannot be
        decoded, is too short/long or silent."""
        from engine.clone.audio import DEFAULT_MAX_SECONDS, load_reference
        from engine.clone.prompt import transcript_ids

        cloner = self._voice_cloner()
        if not x_vector_only:
            transcript_ids(cloner.builder, ref_text or "")
        if isinstance(audio, np.ndarray):
            wav = np.ascontiguousarray(audio, dtype=np.float32)
        else:
            wav = load_reference(audio, DEFAULT_MAX_SECONDS if max_seconds is None
                                 else max_seconds)  # fmt: skip
        voice: VoicePrompt = cloner.make(wav, ref_text, x_vector_only)
        return voice

    def pin_voice(self, voice: VoicePrompt) -> None:
        """Compute a stored voice's prompt prefix in every language now and keep it (like the
        built-in voices'), so its requests prefill only their own text; and its primed decoder
        state. The prefix is the default text mode's (streaming, as the realtime route's too): a
        request asking for ``full`` computes its own once and keeps it among the recent ones."""
        if self.prompts is None:
            raise InputError("voice_prompt", "this model file has no talker")
        self._ready_voice(voice, self.prompts.languages, pin=True)

    def prepare_voice(self, voice: VoicePrompt, language: str | None = None) -> None:
        """Get a voice ready to speak soon without keeping it for good: its prompt prefix in
        ``language`` (default "auto") and the default text mode goes among the recent prefixes,
        its primed decoder state among the recent voices. A new voice's first request then
        prefills only its own text (the service does this when a worker makes a voice)."""
        self._ready_voice(voice, [language], pin=False)

    def _ready_voice(self, voice: VoicePrompt, languages: Sequence[str | None], pin: bool
                     ) -> None:
        # the voice's prompt prefixes in those languages (pinned, or among the recent ones) and
        # its primed decoder state
        if self.talker is None or self.prompts is None:
            raise InputError("voice_prompt", "this model file has no talker")
        self.talker.pin_prefixes([
            self._clone_prompt(SynthesisRequest(".", voice_prompt=voice, language=lang))
            for lang in languages], pin=pin)
        self._primed_decoder(voice)

    def _clone_prompt(self, req: SynthesisRequest, live_ids: list[int] | None = None) -> Any:
        assert self.prompts is not None and self.talker is not None
        vp = req.voice_prompt
        assert vp is not None
        if self.model.tts_model_type != "base":
            raise InputError("voice_prompt", f"this is a {self.model.tts_model_type} model; "
                             "only Base models speak cloned voices")  # fmt: skip
        if req.voice:
            raise InputError("voice", "give a named voice or a cloned voice, not both")
        if req.instruct:
            raise InputError("instruct", "Base models do not take instructions")
        if vp.fingerprint != self.voice_fingerprint:
            raise InputError("voice_prompt", "this voice was made for another model; clone "
                             "it again with this model")  # fmt: skip
        return build_clone_prompt(self.prompts, vp, req.text, req.language,
                                  req.text_mode or default_text_mode(cloned=True),
                                  self.talker.frame_embeddings, live_ids)

    def plan_live(self, request: Any, min_tokens: int = 1) -> LivePlan:
        """A live-text request checked (voice, language, instruction) before any text is
        awaited, with ``request.text`` taken as the text known so far. Shared by
        ``stream_live`` and the batch scheduler (engine/batching.py)."""
        req = as_request(request)
        if not isinstance(req, SynthesisRequest):
            raise InputError("text", "live text needs a text request")
        if self.talker is None or self.prompts is None or self.defaults is None:
            raise InputError("text", "this model file has no talker: it cannot speak text")
        live = LiveText(self.prompts)
        vp = req.voice_prompt
        opening: Callable[[list[int]], Any]
        if vp is not None:
            self._clone_prompt(replace(req, text=".", text_mode="stream"))
            need = live_start_tokens(vp)

            def opening(ids: list[int]) -> Any:
                return self._clone_prompt(replace(req, text=".", text_mode="stream"), ids)
        else:
            opening = opening_prompt(self.prompts, req.voice, req.language, req.instruct)
            need = 1
        live.add(TextUpdate(req.text, end=False))

        def several_segments(text: str) -> bool:
            try:
                return len(self._segments(replace(req, text=text))) > 1
            except InputError:  # over the token cap: the end, if it comes, is refused anyway
                return False

        return LivePlan(req, live, opening, need, min_tokens, several_segments)

    def _sampling(self, req: SynthesisRequest) -> SamplingParams:
        # the model's generation defaults with the request's overrides
        assert self.defaults is not None
        return self.defaults.with_overrides(
            greedy=req.greedy, **{k: getattr(req, k) for k in _SAMPLING_FIELDS})

    def live_text_plan(self, plan: LivePlan) -> tuple[TextPlan, Callable[[int], int]]:
        """What a live request needs once it starts (sampling, RNG, a primed decoder, the
        ramp; no prompts: the opening is laid out from the ids known then), and its frame
        budget as a function of the text's tokens so far."""
        req = plan.request
        params = self._sampling(req)
        cap = self.max_frames_cap

        def budget(n_tokens: int) -> int:
            return frame_budget(min(n_tokens, 1 << 20), req.max_frames, cap,
                                self._max_new_tokens, req.frame_limit)

        rng, seed = make_rng(req.seed)
        return TextPlan([], params, budget(1 << 20), rng, seed,
                        self._primed_decoder(req.voice_prompt),
                        self._ramp(self._chunk_max(req))), budget

    def stream_live(self, request: Any, feed: TextFeed, cancel: Cancel = None,
                    info: StreamInfo | None = None, min_tokens: int = 1
                    ) -> Generator[AudioChunk, None, str]:
        """Speak text that is still being written: ``request.text`` is what is known at the
        start, ``feed`` delivers the rest (engine/talker/live.py). Generation starts once
        ``min_tokens`` stable tokens, a flush or the end of the text are there. When the whole
        text (and its end) is known at the start this is exactly ``stream`` with
        ``text_mode="stream"``. After a pause for text the chunk ramp restarts at its first chunk.
        An in-context cloned voice starts once the text covers its reference frames
        (``live_start_tokens``) or ends."""
        check = _cancel_fn(cancel)
        info = info if info is not None else StreamInfo()
        plan = self.plan_live(request, min_tokens)
        live = plan.live
        start = plan.start()
        while True:
            while start is None or plan.holds(time.perf_counter()):
                if is_cancelled(check):
                    info.outcome = "cancelled"
                    return "cancelled"
                plan.poll(feed, 0.02 if start is None else END_GRACE_S / 5)
                start = plan.start()
            plan.refuse_empty()
            if live.ended:
                outcome = yield from self._stream_text(plan.whole(), check, info)
                info.outcome = outcome
                return outcome
            assert self.talker is not None and self.prompts is not None
            tp, budget = self.live_text_plan(plan)
            info.seed, info.budget = tp.seed, tp.total
            frames = generate_live_frames(self.talker, self.prompts, live, feed, plan.opening,
                                          tp.params, budget, tp.rng, check, start=start)
            chunks = self._chunks(frames, tp.decoder, tp.ramp, check, info)
            made = len(info.codes), info.frames
            info.guessed += live.ids[: len(start)] != start
            result = yield from self._confirmed(chunks, plan, feed, start, check)
            if result is not None:
                break
            info.refuted += 1
            # the text proved the guess wrong before any audio went out: start over from the
            # stable ids, with the same seed (a seeded request speaks as if never guessed)
            del info.codes[made[0]:]
            info.frames = made[1]
            plan.request = replace(plan.request, seed=tp.seed)
            start = plan.start()
        info.outcome, info.text_tokens = result.outcome, len(live.ids)
        return result.outcome

    def _confirmed(self, chunks: Generator[AudioChunk, None, Result], plan: LivePlan,
                   feed: TextFeed, start: list[int], cancel: Callable[[], bool] | None
                   ) -> Generator[AudioChunk, None, Result | None]:
        """``chunks`` passed on once the live text confirms the ids it opened with (at once
        unless they were a guess); None, with ``chunks`` closed, when the text refutes them."""
        settled = plan.live.confirms(start)
        try:
            while True:
                chunk: AudioChunk | None = None
                result: Result | None = None
                try:
                    chunk = next(chunks)
                except StopIteration as stop:
                    result = stop.value
                while settled is None:  # audio (or the end) is ready: hear from the text
                    if is_cancelled(cancel):
                        return Result(outcome="cancelled")
                    plan.poll(feed, 0.02)
                    settled = plan.live.confirms(start)
                if not settled:
                    return None
                if chunk is None:
                    return result
                yield chunk
        finally:
            chunks.close()

    def _chunks(self, frames: Generator[Frame | None, None, Result], sd: StreamingDecoder,
                ramp: Ramp, cancel: Callable[[], bool] | None, info: StreamInfo
                ) -> Generator[AudioChunk, None, Result]:
        """Frames in, audio chunks out: frames are pushed to ``sd`` in the ramp's sizes; a
        ``None`` item (live text ran dry) pushes what is pending and restarts the ramp; the
        last frames (with the talker time after them) go out when ``frames`` ends. Returns the
        frames' ``Result`` (outcome "cancelled" when a cancel stopped a push)."""
        pending: list[npt.NDArray[np.int32]] = []
        acc = StageTimings()
        cancelled = Result(outcome="cancelled")
        try:
            while True:
                try:
                    frame = next(frames)
                except StopIteration as stop:
                    result: Result = stop.value
                    break
                if frame is not None:
                    pending.append(frame.codes)
                    acc = acc + frame.timings
                    if len(pending) < ramp.target:
                        continue
                if pending:
                    if is_cancelled(cancel):
                        return cancelled
                    yield self._push(sd, pending, acc, info)
                    pending, acc = [], StageTimings()
                ramp.advance(restart=frame is None)
        finally:
            frames.close()
        if result.outcome != "cancelled" and pending:
            if is_cancelled(cancel):
                return cancelled
            yield self._push(sd, pending, acc + result.leftover, info)
        return result

    def close(self) -> None:
        """Free the talker (and the decoder when this Pipeline loaded it)."""
        if self._cloner is not None:
            self._cloner.close()
            self._cloner = None
        if self.talker is not None:
            self.talker.close()
            self.talker = None
        if self._own_decoder:
            self.decoder.close()


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def _malloc_trim() -> None:
    # glibc keeps freed heap pages (numpy's mid-sized arrays) unless asked to return them
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(ctypes.c_size_t(0))


def _cancel_fn(cancel: Cancel) -> Callable[[], bool] | None:
    if cancel is None:
        return None
    if isinstance(cancel, threading.Event):
        return cancel.is_set
    if callable(cancel):
        return cancel
    raise TypeError("cancel must be a threading.Event or a callable returning bool")


def synthesize(pipeline: Pipeline, request: Any, cancel: Cancel = None
               ) -> tuple[npt.NDArray[np.float32], StreamInfo, float]:
    """Run a whole request: (audio, info, seconds to the first chunk). For the CLI and tests."""
    info = StreamInfo()
    pieces: list[npt.NDArray[np.float32]] = []
    t0 = time.perf_counter()
    first = 0.0
    for chunk in pipeline.stream(request, cancel, info):
        if not pieces:
            first = time.perf_counter() - t0
        pieces.append(chunk.audio)
    audio = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
    return audio, info, first
