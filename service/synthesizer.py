"""What a worker process holds: the model, its backends and decoder, the engine's Pipeline and
the cloned voices it has decoded (``Synthesizer``); the live-text feed read off its pipe
(``PipeFeed``). service/worker.py runs the process around it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Generator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.errors import InputError
from service.protocol import Cloned, Finish, Job, StopWorker, TextIn, WorkerOptions

if TYPE_CHECKING:
    from engine.options import EngineOptions
    from engine.pipeline import StreamInfo

Piece = tuple[np.ndarray[Any, Any], dict[str, float], int]
# cloned voices a worker keeps decoded: one-shot references (by their audio's hash, so a client
# resending one pays its encoding once) and stored voices (by their prompt's hash)
VOICE_CACHE = 32
log = logging.getLogger("qtts.worker")


class Synthesizer:
    """The model, its backends, its decoder and the engine's Pipeline (text and codes)."""

    def __init__(self, opts: WorkerOptions, options: EngineOptions) -> None:
        from engine.backend import BackendSet
        from engine.decoder import DecoderModel
        from engine.gguf_model import open_model
        from engine.pipeline import DEFAULT_CHUNK_MAX_FRAMES, Pipeline

        self.model = open_model(opts.model_path)
        self.conn: Any = None  # the pipe, for live text (set by worker_main)
        # what a StopWorker read during a live job does (set by worker_main)
        self.on_stop: Callable[[], None] = lambda: None
        self.options = options
        self.backends = BackendSet.from_options(options)
        self.decoder_snr_db: float | None = None
        self.decoder = DecoderModel.load(self.model, self.backends, precision=opts.precision,
                                         f32_layers=self._fast_layers(opts))
        caps = {name: v for name in ("max_text_tokens", "max_instruct_tokens", "segment_tokens",
                                     "prefill_chunk")
                if (v := getattr(opts, name)) is not None}  # else the engine's defaults
        self.pipeline = Pipeline(
            self.model, self.backends, self.decoder, max_frames_cap=opts.max_frames_cap,
            chunk_max_frames=opts.chunk_max_frames or DEFAULT_CHUNK_MAX_FRAMES,
            chunk_ramp=opts.chunk_ramp, first_chunk_frames=opts.first_chunk_frames, **caps)
        self._voices: OrderedDict[str, Any] = OrderedDict()

    def _fast_layers(self, opts: WorkerOptions) -> frozenset[str] | None:
        # fast mode's F32 layers for its SNR target on this model (None: the default set)
        if opts.precision != "fast" or not opts.precision_target_db or (
                "decoder" not in self.model.parts):
            return None
        from pathlib import Path

        from engine.decoder.calibration_store import calibration_for

        folder = Path(opts.calibration_dir) if opts.calibration_dir else None
        cal, kept = calibration_for(self.model, self.backends, opts.precision_target_db, folder)
        self.decoder_snr_db = cal.snr_db
        log.log(logging.WARNING if not cal.met and not cal.saturated else logging.INFO,
                "%s%s", cal.summary(), " (kept from an earlier start)" if kept else "")
        return cal.f32_layers

    def _cached(self, key: str, make: Callable[[], Any]) -> Any:
        v = self._voices.get(key)
        if v is None:
            v = make()
            self._voices[key] = v
            while len(self._voices) > VOICE_CACHE:
                self._voices.popitem(last=False)
        self._voices.move_to_end(key)
        return v

    def clone(self, job: Job) -> Cloned:
        """Make the voice of a clone job (the reference decoded, checked, encoded)."""
        from engine.clone import voice_file
        from engine.clone.audio import load_reference

        assert job.ref_audio is not None
        t0 = time.perf_counter()
        wav = load_reference(job.ref_audio, job.max_ref_seconds)
        t1 = time.perf_counter()
        vp = self.pipeline.clone_voice(wav, job.ref_text, job.x_vector_only)
        t2 = time.perf_counter()
        # a new voice is about to speak: its first request here prefills only its own text
        self.pipeline.prepare_voice(vp)
        t3 = time.perf_counter()
        return Cloned(job.id, voice_file.dumps(vp), "icl" if vp.icl else "x_vector_only",
                      wav.shape[0] / 24000,
                      {"decode": t1 - t0, "encode": t2 - t1, "prepare": t3 - t2})

    def voice_of(self, job: Job) -> Any:
        """The cloned voice a text job speaks in (``VoicePrompt``), or None."""
        from engine.clone import voice_file

        if job.voice_prompt is not None:
            raw = job.voice_prompt

            def stored() -> Any:
                try:
                    return voice_file.load(raw, self.pipeline.voice_fingerprint)
                except InputError as exc:  # (the client sent an id, not a file: name it)
                    raise InputError("voice", f"the stored voice is damaged ({exc.problem}); "
                                     "delete it and clone it again") from None

            return self._cached("v:" + hashlib.sha256(raw).hexdigest(), stored)
        if job.ref_audio is not None:
            ref = job.ref_audio
            digest = hashlib.sha256(ref).hexdigest()
            key = "r:" + digest + (
                ":x" if job.x_vector_only else ":" + hashlib.sha256(
                    (job.ref_text or "").encode()).hexdigest())  # fmt: skip

            def make() -> Any:
                vp = self.pipeline.clone_voice(ref, job.ref_text, job.x_vector_only,
                                               job.max_ref_seconds)
                log.info("one-shot reference encoded", extra={"ref_sha256": digest})
                return vp

            return self._cached(key, make)
        return None

    def feed(self, job_id: int) -> PipeFeed:
        assert self.conn is not None
        return PipeFeed(self.conn, job_id, self.on_stop)

    @property
    def backend_name(self) -> str:
        return str(getattr(self.backends, "name", "unknown"))

    def warm_up(self, frames: int) -> float:
        """Decode a few frames, build the talker's cached graphs and load a Base model's
        cloning encoders, so the first request does not pay graph building, page faults or
        loading."""
        from engine.decoder import StreamingDecoder

        t0 = time.perf_counter()
        if frames > 0:
            sd = StreamingDecoder(self.decoder)
            assert self.model.decoder_config is not None
            rows = self.model.decoder_config.num_quantizers
            codes = np.zeros((rows, frames), dtype=np.int32)
            sd.push(codes[:, :1])
            if frames > 1:
                sd.push(codes[:, 1:])
        self.pipeline.warm_up(pin_prefixes=self.options.pin_prefixes)
        self.pipeline.load_cloner()  # a Base model's first voice create then only encodes
        return time.perf_counter() - t0

    def stream(self, job: Job, cancelled: Callable[[], bool], info: StreamInfo | None = None
               ) -> Generator[Piece, None, Finish]:
        """Audio chunks of ``job`` as they are decoded; returns the pipeline's outcome:
        "ok", "truncated_no_eos" (frame budget spent without end of speech) or "cancelled".
        The pipeline checks ``cancelled`` before every talker step and decoder push, and fills
        ``info`` (the text's tokens, the seed) as it goes."""
        req: Any = job
        voice = self.voice_of(job)
        if voice is not None:
            from engine.pipeline import as_request

            req = replace(as_request(job), voice_prompt=voice)
        if job.live:
            gen = self.pipeline.stream_live(req, self.feed(job.id), cancel=cancelled,
                                            info=info, min_tokens=job.min_tokens)
        else:
            gen = self.pipeline.stream(req, cancel=cancelled, info=info)
        while True:
            try:
                audio, timings, n = next(gen)
            except StopIteration as stop:
                return Finish(stop.value or "ok")
            yield np.asarray(audio, dtype=np.float32), stage_seconds(timings), int(n)


class PipeFeed:
    """The engine's ``TextFeed`` of a live job: ``TextIn`` messages read off the worker's pipe
    between frames. A ``StopWorker`` met here ends the worker after this job; messages of other
    (finished) jobs are dropped."""

    def __init__(self, conn: Any, job_id: int, on_stop: Callable[[], None]) -> None:
        self.conn, self.job_id, self.on_stop = conn, job_id, on_stop

    def take(self, timeout: float) -> Any:
        from engine.talker.live import TextUpdate

        text, flush, end, got = "", False, False, False
        wait = timeout
        while self.conn.poll(wait):
            wait = 0
            msg = self.conn.recv()
            match msg:
                case TextIn(job_id=jid) if jid == self.job_id:
                    text += msg.text
                    flush, end, got = flush or msg.flush, end or msg.end, True
                case StopWorker():
                    self.on_stop()
        return TextUpdate(text, flush, end) if got else None


class BufferFeed:
    """The engine's ``TextFeed`` of a live job in the batch loop: the loop reads the pipe and
    puts each of the job's ``TextIn`` here; the runner takes them between steps, merged as
    ``PipeFeed`` merges what it reads at once."""

    def __init__(self, fault: Callable[[], None] | None = None) -> None:
        self._pending: list[TextIn] = []
        self._fault = fault  # QTTS_TEST_FAULT's ``text=N`` (tests only)

    def put(self, msg: TextIn) -> None:
        self._pending.append(msg)

    def take(self, timeout: float) -> Any:
        """What came since the last take (never waits: the loop waits on the pipe)."""
        from engine.talker.live import TextUpdate

        got, self._pending = self._pending, []
        if not got:
            return None
        if self._fault is not None:
            self._fault()
        return TextUpdate("".join(m.text for m in got), any(m.flush for m in got),
                          any(m.end for m in got))


def stage_seconds(t: Any) -> dict[str, float]:
    """StageTimings (or a dict) -> {stage: seconds} with every stage that took time."""
    if t is None:
        return {}
    if isinstance(t, dict):
        d = t
    else:
        from engine.timings import DECODER_STAGES, TALKER_STAGES

        d = t.as_dict(DECODER_STAGES + TALKER_STAGES)
    return {str(k): float(v) for k, v in d.items() if v}
