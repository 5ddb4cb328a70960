"""The worker process: loads the model once, warms up, then synthesizes one job at a time.

It talks to the front end over one duplex pipe (pickled tuples):

  front end -> worker   ("job", Job) | ("stop",)
  worker -> front end   ("ready", info) | ("fatal", message)
                        ("chunk", job_id, float32 audio, {stage: seconds}, frames)
                        ("done", job_id, {"finish": "ok"|"truncated_no_eos"|"cancelled", ...})
                        ("error", job_id, {"status": int, "field": str|None, "message": str})

Cancellation is a shared 64-bit integer: the front end writes the id of the job to stop, the
worker's pipeline compares it with its current job before every talker step and decoder push.
No HTTP here, and the engine is only touched through its public names.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Generator, Mapping
from typing import Any, Literal

import numpy as np

from service.schemas import Job

Chunk = tuple[np.ndarray[Any, Any], dict[str, float], int]


class Synthesizer:
    """The model, its backends, its decoder and the engine's Pipeline (text and codes)."""

    def __init__(self, model_path: str, precision: Literal["fast", "exact"],
                 env: Mapping[str, str], max_frames_cap: int, chunk_max_frames: int) -> None:
        from engine.backend import BackendSet
        from engine.decoder import DecoderModel
        from engine.gguf_model import open_model
        from engine.pipeline import Pipeline

        self.model = open_model(model_path)
        self.backends = BackendSet.from_env(env)
        self.decoder = DecoderModel.load(self.model, self.backends, precision=precision)
        self.pipeline = Pipeline(self.model, self.backends, self.decoder,
                                 max_frames_cap=max_frames_cap, chunk_max_frames=chunk_max_frames)

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
            codes = np.zeros((16, frames), dtype=np.int32)
            sd.push(codes[:, :1])
            if frames > 1:
                sd.push(codes[:, 1:])
        self.pipeline.warm_up(pin_prefixes=os.environ.get("QTTS_PIN_PREFIXES", "1") != "0")
        return time.perf_counter() - t0

    def stream(self, job: Job, cancelled: Callable[[], bool]) -> Generator[Chunk, None, str]:
        """Audio chunks of ``job`` as they are decoded; returns the pipeline's outcome:
        "ok", "truncated_no_eos" (frame budget spent without end of speech) or "cancelled".
        The pipeline checks ``cancelled`` before every talker step and decoder push."""
        gen = self.pipeline.stream(job, cancel=cancelled)
        while True:
            try:
                audio, timings, n = next(gen)
            except StopIteration as stop:
                return str(stop.value or "ok")
            yield np.asarray(audio, dtype=np.float32), _timings(timings), int(n)


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


def worker_main(
    conn: Any,
    cancel: Any,
    index: int,
    model_path: str,
    precision: Literal["fast", "exact"],
    env: dict[str, str],
    warmup_frames: int,
    max_frames_cap: int,
    chunk_max_frames: int,
) -> None:
    """Entry point of a worker process (``multiprocessing`` spawn)."""
    # Ctrl-C reaches the whole process group: the front end decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM (e.g. systemd signalling the whole group while the front end drains): an idle
    # worker exits at once, a busy one finishes its request first.
    signal.signal(signal.SIGTERM, _on_sigterm)
    os.environ.update(env)
    from service.logs import setup_logging

    setup_logging(env.get("QTTS_LOG_FORMAT", "text"), env.get("QTTS_LOG_LEVEL", "info"))
    from service import faults

    try:
        fault = faults.from_env()
        if fault is not None:
            fault.hit("start")
        t0 = time.perf_counter()
        synth = Synthesizer(model_path, precision, os.environ, max_frames_cap, chunk_max_frames)
        warm = synth.warm_up(warmup_frames)
        conn.send(
            (
                "ready",
                {
                    "pid": os.getpid(),
                    "index": index,
                    "backend": synth.backend_name,
                    "load_seconds": time.perf_counter() - t0,
                    "warmup_seconds": warm,
                },
            )
        )
    except Exception as e:
        try:
            conn.send(("fatal", f"{type(e).__name__}: {e}"))
        finally:
            sys.exit(1)

    while not _STATE["term"]:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # front end gone
        if msg[0] == "stop":
            return
        if msg[0] != "job":
            continue
        job: Job = msg[1]
        _STATE["busy"] = True
        try:
            _run_job(conn, cancel, synth, job, fault)
        except (BrokenPipeError, EOFError, ConnectionResetError):
            return  # front end gone mid-request
        finally:
            _STATE["busy"] = False


_STATE = {"busy": False, "term": False}


def _on_sigterm(signum: int, frame: Any) -> None:
    _STATE["term"] = True
    if not _STATE["busy"]:
        raise SystemExit(0)


def _run_job(conn: Any, cancel: Any, synth: Synthesizer, job: Job,
             fault: Any = None) -> None:
    from engine.errors import InputError, QttsError

    def cancelled() -> bool:
        return bool(cancel.value == job.id)

    frames = sent = 0
    t0 = time.perf_counter()
    gen = synth.stream(job, cancelled)
    try:
        while True:
            try:
                audio, timings, n = next(gen)
            except StopIteration as stop:
                finish = stop.value or "ok"
                break
            if fault is not None:  # QTTS_TEST_FAULT (tests only)
                fault.hit("chunk", sent)
            sent += 1
            frames += n
            conn.send(("chunk", job.id, audio, timings, n))
        conn.send(
            ("done", job.id, {"finish": finish, "frames": frames,
                              "seconds": time.perf_counter() - t0})
        )
    except InputError as e:
        conn.send(("error", job.id, {"status": 400, "field": e.field, "message": str(e)}))
    except QttsError as e:
        conn.send(("error", job.id, {"status": 500, "field": None, "message": str(e)}))
    except (BrokenPipeError, EOFError, ConnectionResetError):
        raise
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        conn.send(
            ("error", job.id, {"status": 500, "field": None,
                               "message": f"internal error: {type(e).__name__}"})
        )
