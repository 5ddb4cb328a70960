"""The end of every synthesis request: its counters, histograms and its one request log line
(a realtime session's utterances each count as one request)."""

from __future__ import annotations

import logging
import time

from service.errors import ApiError
from service.logs import REQUEST_LOGGER, round_or_none
from service.metrics import REALTIME_ROUTE
from service.realtime import Utterance
from service.state import State
from service.validation import Synthesis

reqlog = logging.getLogger(REQUEST_LOGGER)


def finish_log(st: State, syn: Synthesis, admitted: bool) -> None:
    """Count and log a request that reached the queue (``admitted``) or was refused by it."""
    m = st.metrics
    m.requests.labels(route=syn.route, outcome=syn.outcome).inc()
    now = time.monotonic()
    gen_seconds = syn.frames / st.model.frame_rate
    rtf = None
    if syn.synth_seconds and gen_seconds > 0 and syn.outcome in ("ok", "truncated_no_eos"):
        rtf = syn.synth_seconds / gen_seconds
        m.rtf.observe(rtf)
    if admitted:
        m.duration.observe(now - syn.arrival)
    reqlog.info(
        "%s %s %s", syn.route, syn.outcome, syn.request_id,
        extra={
            "id": syn.request_id, "route": syn.route, "status": syn.status,
            "voice": syn.voice, "chars": syn.chars, "format": syn.fmt, "stream": syn.stream,
            "frames": syn.frames, "audio_seconds": round(syn.audio_seconds_out, 3),
            "queue_seconds": round_or_none(syn.queue_seconds),
            "ttfa_seconds": round_or_none(syn.ttfa), "rtf": round_or_none(rtf),
            "duration_seconds": round(now - syn.arrival, 4), "stream_gaps": syn.gaps,
            "stream_gap_seconds": round(syn.gap_seconds, 4),
            "outcome": syn.outcome,
        },
    )


def log_rejected(route: str, request_id: str, err: ApiError) -> None:
    """The log line of a request refused before it was validated into a ``Synthesis``."""
    reqlog.info(
        "%s rejected %s", route, request_id,
        extra={"id": request_id, "route": route, "status": err.status, "voice": None,
               "chars": 0, "audio_seconds": 0.0, "queue_seconds": None, "ttfa_seconds": None,
               "rtf": None, "outcome": "rejected", "field": err.field},
    )


def finish_utterance(st: State, session_id: str, utt: Utterance, outcome: str, fmt: str,
                     voice: str | None) -> None:
    """Count and log a realtime utterance that reached a worker, as ``finish_log`` does a
    request (its time to first audio runs from its first text delta; no RTF: the text's pace
    is the client's)."""
    st.metrics.requests.labels(route=REALTIME_ROUTE, outcome=outcome).inc()
    if (utt.end_at is not None and utt.last_audio_at is not None and not utt.cancelled
            and outcome in ("ok", "truncated_no_eos")):  # (spoken to its end)
        st.metrics.realtime_behind.observe(max(0.0, utt.last_audio_at - utt.end_at))
    ttfa = None if utt.first_audio_at is None else utt.first_audio_at - utt.first_text_at
    reqlog.info(
        "%s %s %s", REALTIME_ROUTE, outcome, session_id,
        extra={
            "id": session_id, "route": REALTIME_ROUTE, "utterance": utt.job_id, "voice": voice,
            "chars": utt.chars, "format": fmt, "stream": True, "frames": utt.frames,
            "audio_seconds": round(utt.samples / st.model.sample_rate, 3),
            "ttfa_seconds": round_or_none(ttfa),
            "duration_seconds": round(time.monotonic() - utt.first_text_at, 4),
            "stream_gaps": utt.gaps, "stream_gap_seconds": round(utt.gap_seconds, 4),
            "outcome": outcome,
        },
    )


def refuse_utterance(st: State, session_id: str, reason: str) -> None:
    """Count and log a realtime utterance no worker could take (the session closes 1013)."""
    st.metrics.rejections.labels(reason=reason).inc()
    st.metrics.requests.labels(route=REALTIME_ROUTE, outcome="rejected").inc()
    log_rejected(REALTIME_ROUTE, session_id, ApiError(503, "no worker free", code=reason))
