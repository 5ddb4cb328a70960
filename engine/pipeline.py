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

import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from engine.backend import BackendSet
from engine.decoder import DecoderModel, StreamingDecoder, validate_codes
from engine.errors import InputError
from engine.talker.generate import (
    DEFAULT_MAX_FRAMES_CAP,
    Result,
    frame_budget,
    generate_frames,
    is_cancelled,
)
from engine.talker.model import TalkerModel
from engine.talker.prompt import PromptBuilder
from engine.talker.sampling import SamplingParams, make_rng
from engine.timings import StageTimings

# 16: the ramp then costs little more than an offline decode (docs/performance.md, Decoder)
DEFAULT_CHUNK_MAX_FRAMES = 16
Cancel = threading.Event | Callable[[], bool] | None


@dataclass
class SynthesisRequest:
    """A text request. ``None`` fields take the model's defaults (generation_config)."""

    text: str
    voice: str | None = None
    language: str | None = None  # None or "auto": the model decides
    instruct: str | None = None
    text_mode: str = "full"  # "full" (non-streaming text, default) | "stream"
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
            text_mode=getattr(obj, "text_mode", None) or "full",
            seed=sampling.get("seed"), greedy=bool(getattr(obj, "greedy", False)),
            max_frames=max_frames, frame_limit=getattr(obj, "frame_limit", None) or None,
            chunk_max_frames=chunk, **kwargs,
        )
    raise TypeError(f"not a synthesis request: {type(obj).__name__}")


def chunk_sizes(chunk_max_frames: int) -> Generator[int, None, None]:
    """The chunk ramp 1, 2, 4, ... capped at ``chunk_max_frames`` (forever)."""
    size = 1
    while True:
        yield size
        size = min(size * 2, max(1, chunk_max_frames))


class Pipeline:
    """The loaded model (talker when present, decoder) and the streaming driver.

    ``decoder``: a loaded ``DecoderModel`` to share (the service has one), else loaded here with
    ``precision``. ``kv_type``: talker/code-predictor cache type ("f16" or "f32").
    ``max_frames_cap``: the server cap on frames per request. ``ignore_unsupported_instruct``:
    drop instructions a model does not honour instead of refusing them.
    """

    def __init__(self, model: Any, backends: BackendSet, decoder: DecoderModel | None = None,
                 *, precision: str = "fast", kv_type: str = "f16",
                 max_frames_cap: int = DEFAULT_MAX_FRAMES_CAP,
                 chunk_max_frames: int = DEFAULT_CHUNK_MAX_FRAMES,
                 ignore_unsupported_instruct: bool = False) -> None:
        self.model = model
        self.backends = backends
        self._own_decoder = decoder is None
        self.decoder = decoder if decoder is not None else DecoderModel.load(
            model, backends, precision)  # type: ignore[arg-type]
        self.max_frames_cap = int(max_frames_cap)
        self.chunk_max_frames = int(chunk_max_frames)
        self.talker: TalkerModel | None = None
        self.prompts: PromptBuilder | None = None
        self.defaults: SamplingParams | None = None
        if "talker" in model.parts:
            self.prompts = PromptBuilder(model, ignore_unsupported_instruct)
            self.talker = TalkerModel(model, backends, kv_type)
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
        request.
        """
        if self.talker is None or self.prompts is None:
            return 0.0
        seconds = self.talker.warm_up()
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
        return seconds

    # -- streaming ---------------------------------------------------------------------------

    def stream(self, request: Any, cancel: Cancel = None, info: StreamInfo | None = None
               ) -> Generator[AudioChunk, None, str]:
        """Yield ``AudioChunk`` items; return "ok" | "truncated_no_eos" | "cancelled"."""
        req = as_request(request)
        check = _cancel_fn(cancel)
        info = info if info is not None else StreamInfo()
        if isinstance(req, CodesRequest):
            outcome = yield from self._stream_codes(req, check, info)
        else:
            outcome = yield from self._stream_text(req, check, info)
        info.outcome = outcome
        return outcome

    def _chunk_max(self, req: SynthesisRequest | CodesRequest) -> int:
        n = req.chunk_max_frames or self.chunk_max_frames
        if n < 1:
            raise InputError("chunk_max_frames", f"must be >= 1, got {n}")
        return int(n)

    def _push(self, sd: StreamingDecoder, codes: list[npt.NDArray[np.int32]],
              timings: StageTimings, info: StreamInfo) -> AudioChunk:
        block = np.stack(codes, axis=1) if codes[0].ndim == 1 else np.concatenate(codes, axis=1)
        audio, dec = sd.push(block)
        info.codes.append(block)
        info.frames += block.shape[1]
        return AudioChunk(np.asarray(audio, dtype=np.float32), timings + dec, int(block.shape[1]))

    def _stream_codes(self, req: CodesRequest, cancel: Callable[[], bool] | None,
                      info: StreamInfo) -> Generator[AudioChunk, None, str]:
        cfg = self.decoder.cfg
        codes = validate_codes(req.codes, cfg.num_quantizers, cfg.codebook_size)
        if req.max_frames:
            codes = codes[:, : int(req.max_frames)]
        sizes = chunk_sizes(self._chunk_max(req))
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

    def _stream_text(self, req: SynthesisRequest, cancel: Callable[[], bool] | None,
                     info: StreamInfo) -> Generator[AudioChunk, None, str]:
        if self.talker is None or self.prompts is None or self.defaults is None:
            raise InputError(
                "text", "this model file has no talker (a decoder-only GGUF): it cannot speak "
                "text; send codes, or convert the full model folder")
        prompt = self.prompts.build(req.text, req.voice, req.language, req.instruct,
                                    req.text_mode)
        params = self.defaults.with_overrides(
            greedy=req.greedy, **{k: getattr(req, k) for k in _SAMPLING_FIELDS})
        budget = frame_budget(prompt.n_text_tokens, req.max_frames, self.max_frames_cap,
                              self._max_new_tokens, req.frame_limit)
        chunk_max = self._chunk_max(req)
        rng, seed = make_rng(req.seed)
        info.seed, info.budget = seed, budget
        sd = StreamingDecoder(self.decoder)
        sizes = chunk_sizes(chunk_max)
        target = next(sizes)
        pending: list[npt.NDArray[np.int32]] = []
        acc = StageTimings()
        frames = generate_frames(self.talker, prompt, params, budget, rng, cancel)
        try:
            while True:
                try:
                    frame = next(frames)
                except StopIteration as stop:
                    result: Result = stop.value
                    break
                pending.append(frame.codes)
                acc = acc + frame.timings
                if len(pending) >= target:
                    if is_cancelled(cancel):
                        return "cancelled"
                    yield self._push(sd, pending, acc, info)
                    pending, acc = [], StageTimings()
                    target = next(sizes)
        finally:
            frames.close()
        if result.outcome == "cancelled":
            return "cancelled"
        if pending:
            if is_cancelled(cancel):
                return "cancelled"
            yield self._push(sd, pending, acc + result.leftover, info)
        return result.outcome

    def close(self) -> None:
        """Free the talker (and the decoder when this Pipeline loaded it)."""
        if self.talker is not None:
            self.talker.close()
            self.talker = None
        if self._own_decoder:
            self.decoder.close()


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
