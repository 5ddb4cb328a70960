"""Prometheus metrics. The front-end process owns the one registry; workers send their stage
timings with each chunk and the front end observes them here.

Labels are bounded: ``stage`` (fixed list), ``route`` (the two synthesis routes), ``outcome``
(fixed list), ``reason`` (fixed list). Never a voice, a text or a request id.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from engine.timings import DECODER_STAGES, TALKER_STAGES

CONTENT_TYPE = CONTENT_TYPE_LATEST

# the engine's stages, as its workers report them, and the front end's own encoding
STAGES = (*DECODER_STAGES, *TALKER_STAGES, "encode")
PER_FRAME_STAGES = ("talker_step", "code_predictor")
ROUTES = ("/tts", "/v1/audio/speech")
REALTIME_ROUTE = "/v1/tts/realtime"  # each utterance of a session is one request
OUTCOMES = (
    "ok",
    "rejected",
    "timeout",
    "client_gone",
    "error",
    "truncated_no_eos",
    "worker_died",
    "cancelled",
)
CLONE_STAGES = ("decode", "encode", "prepare", "store", "total")
REJECT_REASONS = ("queue_full", "draining", "invalid", "unauthorized", "not_ready")

# 1 ms .. 10 s: per-chunk stage costs (a talker step is ~ms, a big decoder chunk ~s)
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5, 10)
# vLLM's time-to-first-token buckets, extended: first audio on CPU can take seconds
# (2.0 is the first-audio alert's threshold: a bucket edge, so the alert counts, not interpolates)
TTFA_BUCKETS = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.25, 0.35, 0.5, 0.75, 1.0, 1.5,
                2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5, 10, 30, 60, 120, 300)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10, 20, 30, 60, 120, 240, 480, 960)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
BATCH_STAGES = ("talker", "code_predictor", "decoder")
RTF_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0, 3.0,
               4.0)


class Metrics:
    """Every metric of the service in one registry (one instance per app)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=r)  # the front end's CPU, memory, open fds (process_*)
        self.stage_seconds = Histogram(
            "qtts_stage_seconds",
            "Wall time of one pipeline stage for one chunk (decoder stages, talker, encode).",
            ["stage"], buckets=STAGE_BUCKETS, registry=r,
        )
        self.ttfa = Histogram(
            "qtts_time_to_first_audio_seconds",
            "From request arrival to the first audio byte handed to the client.",
            buckets=TTFA_BUCKETS, registry=r,
        )
        self.queue_seconds = Histogram(
            "qtts_request_queue_seconds",
            "Time a request waited for a free worker.",
            buckets=QUEUE_BUCKETS, registry=r,
        )
        self.duration = Histogram(
            "qtts_request_duration_seconds",
            "From request arrival to the end of its response (synthesis requests).",
            buckets=DURATION_BUCKETS, registry=r,
        )
        self.rtf = Histogram(
            "qtts_rtf",
            "Real-time factor of a finished request: synthesis wall time / audio duration.",
            buckets=RTF_BUCKETS, registry=r,
        )
        self.requests = Counter(
            "qtts_requests", "Synthesis requests by route and outcome.",
            ["route", "outcome"], registry=r,
        )
        self.rejections = Counter(
            "qtts_rejections", "Requests refused before any work, by reason.",
            ["reason"], registry=r,
        )
        self.internal_errors = Counter(
            "qtts_internal_errors", "Requests that ended in an unexpected server error (500).",
            ["route"], registry=r,
        )
        self.audio_seconds = Counter(
            "qtts_audio_seconds", "Seconds of audio sent to clients.", registry=r
        )
        self.worker_restarts = Counter(
            "qtts_worker_restarts", "Worker processes replaced after they died.", registry=r
        )
        self.stream_gaps = Counter(
            "qtts_stream_gaps",
            "Stalls of streamed audio: chunks sent after the audio already sent had played "
            "out (a client playing as it receives waits there, then plays on); realtime "
            "utterances count those after their whole text had arrived.",
            registry=r,
        )
        self.stream_gap_seconds = Counter(
            "qtts_stream_gap_seconds",
            "How long listeners waited in the stalls qtts_stream_gaps counts, summed: from the "
            "moment the audio already sent had played out to the next chunk.",
            registry=r,
        )
        self.realtime_sessions = Gauge(
            "qtts_realtime_sessions", "Realtime WebSocket sessions open.", registry=r)
        self.realtime_ttfa = Histogram(
            "qtts_realtime_text_to_first_audio_seconds",
            "Realtime: from an utterance's first text delta to its first audio frame sent.",
            buckets=TTFA_BUCKETS, registry=r,
        )
        self.realtime_guesses = Counter(
            "qtts_realtime_guesses_total",
            "Realtime: utterances opened on a guess of their first token, the word being "
            "written as it stood (result=made), and those the next delta proved wrong "
            "(result=refuted: started over, nothing of the guess sent).",
            ["result"], registry=r,
        )
        for result in ("made", "refuted"):  # both series from the start: a rate reads 0, not none
            self.realtime_guesses.labels(result)
        self.realtime_behind = Histogram(
            "qtts_realtime_audio_behind_text_seconds",
            "Realtime: from the end of an utterance's text to its last audio frame sent.",
            buckets=DURATION_BUCKETS, registry=r,
        )
        self.voice_clone_seconds = Histogram(
            "qtts_voice_clone_seconds",
            "Creating a cloned voice, per stage: decode (reference audio), encode (x-vector and "
            "codes, in a worker), prepare (its prompt prefix and primed decoder, in that "
            "worker), store (the database write), total (the whole request).",
            ["stage"], buckets=QUEUE_BUCKETS, registry=r,
        )
        self.voices_stored = Gauge(
            "qtts_voices_stored", "Cloned voices in the store (every owner).", registry=r)
        self.voice_store_errors = Counter(
            "qtts_voice_store_errors_total",
            "Voice-store operations that failed because the database was unreachable.",
            registry=r,
        )
        self.running = Gauge(
            "qtts_requests_running", "Requests a worker is synthesizing now.", registry=r
        )
        self.waiting = Gauge("qtts_requests_waiting", "Requests waiting for a worker.", registry=r)
        self.capacity = Gauge(
            "qtts_capacity",
            "Requests this server can synthesize at once (configured workers x requests each).",
            registry=r,
        )
        self.workers_alive = Gauge(
            "qtts_workers_alive", "Worker processes that are loaded, warm and alive.", registry=r
        )
        self.batch_size = Histogram(
            "qtts_batch_size",
            "Streams in one step of a batching worker (QTTS_MAX_BATCH > 1).",
            buckets=BATCH_BUCKETS, registry=r,
        )
        self.batch_step_seconds = Histogram(
            "qtts_batch_step_seconds",
            "Wall time of one step of a batching worker, by stage: the batched talker step, "
            "the batched code-predictor pass (15 graphs), the decoder pushes due after them.",
            ["stage"], buckets=STAGE_BUCKETS, registry=r,
        )
        self.build_info = Gauge(
            "qtts_build_info", "Version, compute backend and model of this server (value 1).",
            ["version", "backend", "model"], registry=r,
        )
        # every labelled series exists from the start, at zero
        for s in STAGES:
            self.stage_seconds.labels(stage=s)
        for route in (*ROUTES, REALTIME_ROUTE):
            for o in OUTCOMES:
                self.requests.labels(route=route, outcome=o)
        for reason in REJECT_REASONS:
            self.rejections.labels(reason=reason)
        for stage in CLONE_STAGES:  # series from the start: the dashboard's panel has them
            self.voice_clone_seconds.labels(stage=stage)
        for route in (*ROUTES, "other"):  # service/guard.py's route labels
            self.internal_errors.labels(route=route)
        for stage in BATCH_STAGES:
            self.batch_step_seconds.labels(stage=stage)

    def set_build_info(self, version: str, backend: str, model: str) -> None:
        self.build_info.clear()
        self.build_info.labels(version=version, backend=backend, model=model).set(1)

    def count_stall(self, waited: float) -> None:
        """A stall a listener waited ``waited`` seconds in (0.0: none)."""
        if waited > 0.0:
            self.stream_gaps.inc()
            self.stream_gap_seconds.inc(waited)

    def observe_stages(self, timings: dict[str, float], frames: int = 1) -> None:
        """One chunk's stage times. ``talker_step`` and ``code_predictor`` arrive summed over
        the chunk's frames: they are observed once per frame at the chunk's mean, so their
        count is steps and their sum is exact; the other stages once per chunk."""
        for stage, seconds in timings.items():
            if stage not in STAGES or seconds < 0:
                continue
            h = self.stage_seconds.labels(stage=stage)
            if stage in PER_FRAME_STAGES and frames > 1:
                for _ in range(frames):
                    h.observe(seconds / frames)
            else:
                h.observe(seconds)

    def observe_step(self, batch: int, talker: float, code_predictor: float,
                     decoder: float) -> None:
        """One step of a batching worker: its batch size and each stage's seconds (a stage
        that did not run in the step is not observed)."""
        self.batch_size.observe(batch)
        for stage, seconds in zip(BATCH_STAGES, (talker, code_predictor, decoder), strict=True):
            if seconds > 0:
                self.batch_step_seconds.labels(stage=stage).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
