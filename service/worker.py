"""The worker process: loads the model once, warms up, then synthesizes one job at a time.

It talks to the front end over one duplex pipe with the messages of service/protocol.py:
``RunJob`` / ``StopWorker`` in; ``Ready`` or ``Fatal`` once, then ``Chunk``* and ``Done`` or
``Failed`` per job out.

Cancellation is a shared 64-bit integer: the front end writes the id of the job to stop, the
worker's pipeline compares it with its current job before every talker step and decoder push.
No HTTP here, and the engine is only touched through its public names.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from service.protocol import (
    CancelJob,
    Chunk,
    Cloned,
    Done,
    Failed,
    Fatal,
    Finish,
    Job,
    Ready,
    RunJob,
    StepDone,
    StopWorker,
    TextIn,
    WorkerOptions,
    batchable,
)

if TYPE_CHECKING:
    from engine.options import EngineOptions

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
        self.options = options
        self.backends = BackendSet.from_options(options)
        self.decoder = DecoderModel.load(self.model, self.backends, precision=opts.precision)
        caps = {name: v for name in ("max_text_tokens", "max_instruct_tokens", "segment_tokens",
                                     "prefill_chunk")
                if (v := getattr(opts, name)) is not None}  # else the engine's defaults
        self.pipeline = Pipeline(
            self.model, self.backends, self.decoder, max_frames_cap=opts.max_frames_cap,
            chunk_max_frames=opts.chunk_max_frames or DEFAULT_CHUNK_MAX_FRAMES, **caps)
        self._voices: OrderedDict[str, Any] = OrderedDict()

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
        return Cloned(job.id, voice_file.dumps(vp), "icl" if vp.icl else "x_vector_only",
                      wav.shape[0] / 24000, {"decode": t1 - t0, "encode": t2 - t1})

    def voice_of(self, job: Job) -> Any:
        """The cloned voice a text job speaks in (``VoicePrompt``), or None."""
        from engine.clone import voice_file

        if job.voice_prompt is not None:
            raw = job.voice_prompt
            return self._cached("v:" + hashlib.sha256(raw).hexdigest(), lambda: voice_file.load(
                raw, self.pipeline.voice_fingerprint))
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
        return PipeFeed(self.conn, job_id)

    @property
    def backend_name(self) -> str:
        return str(getattr(self.backends, "name", "unknown"))

    def warm_up(self, frames: int) -> float:
        """Decode a few frames and build the talker's cached graphs, so the first request does
        not pay graph building and page faults."""
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
        return time.perf_counter() - t0

    def stream(self, job: Job, cancelled: Callable[[], bool]) -> Generator[Piece, None, Finish]:
        """Audio chunks of ``job`` as they are decoded; returns the pipeline's outcome:
        "ok", "truncated_no_eos" (frame budget spent without end of speech) or "cancelled".
        The pipeline checks ``cancelled`` before every talker step and decoder push."""
        req: Any = job
        voice = self.voice_of(job)
        if voice is not None:
            from engine.pipeline import as_request

            req = replace(as_request(job), voice_prompt=voice)
        if job.live:
            gen = self.pipeline.stream_live(req, self.feed(job.id), cancel=cancelled,
                                            min_tokens=job.min_tokens)
        else:
            gen = self.pipeline.stream(req, cancel=cancelled)
        while True:
            try:
                audio, timings, n = next(gen)
            except StopIteration as stop:
                return Finish(stop.value or "ok")
            yield np.asarray(audio, dtype=np.float32), _timings(timings), int(n)


class PipeFeed:
    """The engine's ``TextFeed`` of a live job: ``TextIn`` messages read off the worker's pipe
    between frames. A ``StopWorker`` met here ends the worker after this job; messages of other
    (finished) jobs are dropped."""

    def __init__(self, conn: Any, job_id: int) -> None:
        self.conn, self.job_id = conn, job_id

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
                    _STATE["term"] = True
        return TextUpdate(text, flush, end) if got else None


def _timings(t: Any) -> dict[str, float]:
    """StageTimings (or a dict) -> {stage: seconds} with every stage that took time."""
    if t is None:
        return {}
    if isinstance(t, dict):
        d = t
    else:
        from engine.timings import DECODER_STAGES, TALKER_STAGES

        d = t.as_dict(DECODER_STAGES + TALKER_STAGES)
    return {str(k): float(v) for k, v in d.items() if v}


def worker_main(conn: Any, cancel: Any, opts: WorkerOptions) -> None:
    """Entry point of a worker process (``multiprocessing`` spawn). ``conn``: its end of the
    pipe; ``cancel``: the shared id of the job to stop."""
    # Ctrl-C reaches the whole process group: the front end decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM (e.g. systemd signalling the whole group while the front end drains): an idle
    # worker exits at once, a busy one finishes its request first.
    signal.signal(signal.SIGTERM, _on_sigterm)
    from engine.options import EngineOptions
    from service.logs import setup_logging

    setup_logging(opts.env.get("QTTS_LOG_FORMAT", "text"), opts.env.get("QTTS_LOG_LEVEL", "info"))
    from service import faults

    try:
        fault = faults.from_env()
        if fault is not None:
            fault.hit("start")
        t0 = time.perf_counter()
        # the engine's options: its own QTTS_* variables with what the settings decided (threads,
        # prefix pinning) on top; read here, once, and passed down
        options = replace(EngineOptions.from_env({**os.environ, **opts.env}),
                          pin_prefixes=opts.pin_prefixes)
        synth = Synthesizer(opts, options)
        synth.conn = conn
        load = time.perf_counter() - t0
        warm = synth.warm_up(opts.warmup_frames)
        conn.send(Ready(pid=os.getpid(), index=opts.index, backend=synth.backend_name,
                        load_seconds=load, warmup_seconds=warm))
    except Exception as e:
        try:
            conn.send(Fatal(f"{type(e).__name__}: {e}"))
        finally:
            sys.exit(1)

    if opts.max_batch > 1 and synth.pipeline.has_talker:
        _serve_batched(conn, cancel, synth, fault, opts.max_batch)
        return
    while not _STATE["term"]:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # front end gone
        match msg:
            case StopWorker():
                return
            case TextIn() | CancelJob():
                pass  # for a job that already ended (cancelled, failed)
            case RunJob(job=job):
                _STATE["busy"] = True
                try:
                    _run_job(conn, cancel, synth, job, fault)
                except (BrokenPipeError, EOFError, ConnectionResetError):
                    return  # front end gone mid-request
                finally:
                    _STATE["busy"] = False


_STATE = {"busy": False, "term": False}


class _Running:
    """A job in the batch: what its Done reports."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.frames = 0
        self.sent = 0
        self.t0 = time.perf_counter()


def _serve_batched(conn: Any, cancel: Any, synth: Synthesizer, fault: Any,
                   max_batch: int) -> None:
    """The batch loop (QTTS_MAX_BATCH > 1): up to ``max_batch`` text jobs share each step
    (engine/batching.py). Between steps it reads its pipe: new jobs join, ``CancelJob`` marks
    a job to stop (the runner drops it before its next frame). A job that must run alone (codes,
    live text; the pool sends one only to an empty worker) runs to its end as without batching.
    An engine error in a step fails every job of the batch (a 500 each) and the loop goes on
    with a fresh batch."""
    from engine.batching import BatchRunner, Finished
    from engine.errors import QttsError
    from engine.pipeline import as_request

    runner = BatchRunner(synth.pipeline, max_batch)
    running: dict[int, _Running] = {}  # stream id -> job
    stop: set[int] = set()  # ids of the jobs to cancel

    def flag(job_id: int) -> Callable[[], bool]:
        return lambda: job_id in stop or cancel.value == job_id

    while True:
        if _STATE["term"] and not running:
            return
        wait: float | None = 0 if running else 0.25  # idle: wake now and then for SIGTERM
        while conn.poll(wait):
            wait = 0
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return  # front end gone
            match msg:
                case StopWorker():
                    # as the one-job loop: exit after the running jobs (the pool cancels them
                    # first when it stops)
                    _STATE["term"] = True
                case CancelJob(job_id=jid):
                    stop.add(jid)
                case TextIn():
                    pass
                case RunJob(job=job) if not batchable(job):
                    _STATE["busy"] = True
                    try:
                        _run_job(conn, cancel, synth, job, fault)
                    finally:
                        _STATE["busy"] = bool(running)
                case RunJob(job=job) if _STATE["term"]:
                    conn.send(Failed(job.id, 503, None, "worker stopping"))
                case RunJob(job=job):
                    try:
                        voice = synth.voice_of(job)  # a stored voice: loaded once, cached
                        req: Any = job if voice is None else replace(as_request(job),
                                                                     voice_prompt=voice)
                        sid = runner.submit(req, cancel=flag(job.id))
                    except QttsError as e:
                        conn.send(_failure(job.id, e))
                        continue
                    running[sid] = _Running(job)
                    _STATE["busy"] = True
        if not running:
            stop.clear()
            continue
        try:
            events = runner.step()
        except (BrokenPipeError, EOFError, ConnectionResetError):
            return
        except Exception as e:
            if not isinstance(e, QttsError):
                traceback.print_exc(file=sys.stderr)
            message = str(e) if isinstance(e, QttsError) else (
                f"internal error: {type(e).__name__}")
            for r in running.values():
                conn.send(Failed(r.job.id, 500, None, message))
            running.clear()
            runner.close()
            runner = BatchRunner(synth.pipeline, max_batch)
            _STATE["busy"] = False
            continue
        last = runner.last
        if last.cp_rows:
            conn.send(StepDone(max(last.batch, last.cp_rows), last.talker_s,
                               last.code_predictor_s, runner.decoder_s))
        for sid, item in events:
            r = running[sid]
            if isinstance(item, Finished):
                del running[sid]
                stop.discard(r.job.id)
                conn.send(Done(r.job.id, Finish(item.outcome), r.frames,
                               time.perf_counter() - r.t0))
                continue
            if fault is not None:  # QTTS_TEST_FAULT (tests only)
                fault.hit("chunk", r.sent)
            r.sent += 1
            r.frames += item.frames
            conn.send(Chunk(r.job.id, np.asarray(item.audio, dtype=np.float32),
                            _timings(item.timings), int(item.frames)))
        _STATE["busy"] = bool(running)
        if not running:
            synth.pipeline.release()


def _on_sigterm(signum: int, frame: Any) -> None:
    _STATE["term"] = True
    if not _STATE["busy"]:
        raise SystemExit(0)


def _failure(job_id: int, e: Exception) -> Failed:
    """A job's exception as its ``Failed`` answer: an ``InputError`` is a 400 naming its field,
    another engine error a 500 with its message, anything else a 500 naming only its type (the
    traceback goes to stderr, never to the client). Call it while handling ``e``."""
    from engine.errors import InputError, QttsError

    if isinstance(e, InputError):
        return Failed(job_id, 400, e.field, str(e), e.code)
    if isinstance(e, QttsError):
        return Failed(job_id, 500, None, str(e))
    traceback.print_exc(file=sys.stderr)
    return Failed(job_id, 500, None, f"internal error: {type(e).__name__}")


@contextmanager
def _answering_failures(conn: Any, job_id: int) -> Iterator[None]:
    """Run one job: an exception becomes its ``Failed`` answer (``_failure``), except a broken
    pipe to the front end, which goes on up (the worker's loop ends on it)."""
    try:
        yield
    except (BrokenPipeError, EOFError, ConnectionResetError):
        raise
    except Exception as e:
        conn.send(_failure(job_id, e))


def _run_job(conn: Any, cancel: Any, synth: Synthesizer, job: Job,
             fault: Any = None) -> None:
    def cancelled() -> bool:
        return bool(cancel.value == job.id)

    if job.kind == "clone":
        _run_clone(conn, synth, job, fault)
        return
    frames = sent = 0
    t0 = time.perf_counter()
    with _answering_failures(conn, job.id):
        gen = synth.stream(job, cancelled)
        while True:
            try:
                audio, timings, n = next(gen)
            except StopIteration as stop:
                finish = stop.value
                break
            if fault is not None:  # QTTS_TEST_FAULT (tests only)
                fault.hit("chunk", sent)
            sent += 1
            frames += n
            conn.send(Chunk(job.id, audio, timings, n))
        conn.send(Done(job.id, finish, frames, time.perf_counter() - t0))


def _run_clone(conn: Any, synth: Synthesizer, job: Job, fault: Any = None) -> None:
    with _answering_failures(conn, job.id):
        msg = synth.clone(job)
        if fault is not None:  # QTTS_TEST_FAULT (tests only): a crash mid-create
            fault.hit("clone")
        conn.send(msg)
