"""Every message between the front end and a worker process, and the states both sides keep.

Messages are small frozen dataclasses sent pickled over one duplex pipe per worker:

  front end -> worker   ``RunJob`` | ``StopWorker``, ``TextIn`` for a live-text job,
                        ``CancelJob`` for a batching worker's job
  worker -> front end   ``Ready`` | ``Fatal`` (start-up), then per job: ``Chunk``* and one of
                        ``Done`` | ``Failed``; a clone job (``kind="clone"``) answers one
                        ``Cloned`` or ``Failed``; a batching worker adds ``StepDone`` per step

The pool forwards a job's ``Chunk`` / ``Done`` / ``Failed`` to its ticket and adds the events
only the front end sees: ``WorkerDied``, ``ClientGone`` and ``TimedOut``. A new message kind is
one dataclass here, one ``case`` where it is received. Cancellation is not a message: it is a
shared integer the worker polls between steps (see service/worker.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

import numpy as np


class WorkerState(StrEnum):
    STARTING = "starting"  # loading the model and warming up
    IDLE = "idle"
    BUSY = "busy"
    DEAD = "dead"


class TicketState(StrEnum):
    WAITING = "waiting"  # in the queue
    RUNNING = "running"  # on a worker
    FINISHED = "finished"


class Finish(StrEnum):
    """How a job that ran to its end finished."""

    OK = "ok"  # end of speech reached, or every code decoded
    TRUNCATED_NO_EOS = "truncated_no_eos"  # the frame budget ran out before end of speech
    CANCELLED = "cancelled"


@dataclass
class Job:
    """One synthesis, already validated: what a worker runs (the engine reads it duck-typed)."""

    id: int
    kind: Literal["codes", "text", "clone"]
    codes: np.ndarray[Any, Any] | None = None  # int32 [codebooks, T]
    text: str | None = None
    voice: str | None = None
    language: str | None = None
    instruct: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    max_frames: int = 0  # codes: decode at most this many frames (0: all)
    frame_limit: int | None = None  # text: lowers the engine's text-length budget
    chunk_max_frames: int | None = None  # None: the engine's default
    text_mode: str | None = None  # "full" | "stream" (None: the engine's default_text_mode)
    live: bool = False  # text: more arrives as TextIn messages while the job runs
    min_tokens: int = 1  # live: stable tokens before generation starts (start policy)
    # cloned voices (Base models). text: a stored voice (``voice_prompt``, a .qvoice file's
    # bytes) or a one-shot reference (``ref_audio`` [+ ``ref_text``], cloned and cached by the
    # worker); clone: the reference to make a voice from (answered with ``Cloned``)
    voice_prompt: bytes | None = None
    ref_audio: bytes | None = None
    ref_text: str | None = None
    x_vector_only: bool = False
    max_ref_seconds: float = 30.0


def batchable(job: Job) -> bool:
    """Whether a job may share its worker's steps with others: a text, whole or live, in a
    built-in or stored voice. Codes, clone jobs and one-shot references (their cloning takes
    seconds) run alone."""
    return job.kind == "text" and job.ref_audio is None


@dataclass(frozen=True)
class WorkerOptions:
    """Everything a worker process needs to start (its one argument besides its pipe ends)."""

    index: int
    model_path: str
    precision: Literal["fast", "exact"]
    # fast mode's SNR target against exact (0: the default F32 set, not measured) and where its
    # calibration is kept (engine.decoder.calibration_store; None: measured at every start)
    precision_target_db: float
    calibration_dir: str | None
    env: dict[str, str]  # the engine's variables for this worker (threads, backends, logs)
    warmup_frames: int
    max_frames_cap: int  # the server's longest audio, in frames
    chunk_max_frames: int | None  # None: the engine's default
    pin_prefixes: bool
    # what a text may cost (docs/talker.md "Long and hostile texts"); None: the engine's default
    max_text_tokens: int | None = None
    max_instruct_tokens: int | None = None
    segment_tokens: int | None = None
    prefill_chunk: int | None = None
    max_batch: int = 1  # text jobs spoken at once (>1: the batch loop of service/worker.py)
    chunk_ramp: Literal["auto", "double", "gentle"] = "auto"  # engine.pipeline.Ramp
    first_chunk_frames: int = 1  # the ramp's first chunk


# ---- front end -> worker -------------------------------------------------------------------


@dataclass(frozen=True)
class RunJob:
    job: Job


@dataclass(frozen=True)
class StopWorker:
    """Exit after the current job (the front end is shutting down)."""


@dataclass(frozen=True)
class TextIn:
    """More text for a running live job (a realtime session's delta, flush or end)."""

    job_id: int
    text: str = ""
    flush: bool = False
    end: bool = False


@dataclass(frozen=True)
class CancelJob:
    """Stop a job of a batching worker (it reads its pipe between steps; a worker running one
    job at a time watches its shared cancel word instead)."""

    job_id: int


ToWorker = RunJob | StopWorker | TextIn | CancelJob

# ---- worker -> front end -------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """Loaded and warm. ``load_seconds`` excludes the warm-up, which ``warmup_seconds`` is."""

    pid: int
    index: int
    backend: str
    load_seconds: float
    warmup_seconds: float
    decoder_snr_db: float | None = None  # fast mode's calibration, where it was measured


@dataclass(frozen=True)
class Fatal:
    """The worker could not start; it exits after sending this."""

    message: str


@dataclass(frozen=True)
class Chunk:
    """Audio of a job as it is decoded, with the stage times spent on it."""

    job_id: int
    audio: np.ndarray[Any, Any]  # float32 [-1, 1]
    timings: dict[str, float]  # {stage: seconds} for this chunk
    frames: int


@dataclass(frozen=True)
class Done:
    """A job ended normally (after all its chunks)."""

    job_id: int
    finish: Finish
    frames: int
    seconds: float  # synthesis wall time
    text_tokens: int = 0  # the text's tokens (0 for a codes job)
    guessed: int = 0  # live text: openings laid out on a guess of its first token(s)
    refuted: int = 0  # ... of which the text proved wrong (their work dropped unsent)


@dataclass(frozen=True)
class Failed:
    """A job was refused (``status`` 4xx, naming ``field``) or failed (5xx)."""

    job_id: int
    status: int
    field: str | None
    message: str
    code: str | None = None


@dataclass(frozen=True)
class StepDone:
    """A batching worker ran one step: how many streams it served and the seconds of each
    stage (for the ``qtts_batch_size`` and ``qtts_batch_step_seconds`` metrics)."""

    batch: int
    talker: float
    code_predictor: float
    decoder: float


@dataclass(frozen=True)
class Cloned:
    """A clone job's voice: ``prompt`` is the .qvoice file's bytes (engine.clone.voice_file),
    ``stages`` the seconds spent decoding and encoding the reference."""

    job_id: int
    prompt: bytes
    mode: Literal["icl", "x_vector_only"]
    ref_seconds: float
    stages: dict[str, float]


FromWorker = Ready | Fatal | Chunk | Done | Failed | Cloned | StepDone

# ---- events only the front end adds to a ticket ----------------------------------------------


@dataclass(frozen=True)
class WorkerDied:
    exit_code: int | None


@dataclass(frozen=True)
class ClientGone:
    pass


@dataclass(frozen=True)
class TimedOut:
    pass


TicketEvent = Chunk | Done | Failed | Cloned | WorkerDied | ClientGone | TimedOut
