"""Service settings: every knob is a ``QTTS_`` environment variable, read once at start.

The engine reads its own variables (``QTTS_BACKEND``, ``QTTS_DEVICE``, ...) from the environment
each worker process inherits; ``threads_per_worker`` is handed to it as ``QTTS_THREADS``. Facts
of the model (sample rate, frames per second, codebooks) are not settings: see model_info.py.
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.protocol import WorkerOptions


class Settings(BaseSettings):
    """Service configuration (environment variables ``QTTS_<NAME>``)."""

    # (allow_inf_nan: "inf" would pass every lower bound, then overflow where it is used)
    model_config = SettingsConfigDict(env_prefix="QTTS_", extra="ignore", frozen=True,
                                      allow_inf_nan=False)

    model: Path = Field(default=Path("model.gguf"), description="the qtts GGUF to serve")
    host: str = Field(default="127.0.0.1", description="address to listen on")
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port (0 = any free port)")
    workers: int = Field(
        default=1, ge=1, le=64,
        description="worker processes (each serves up to `QTTS_MAX_BATCH` requests at a time)",
    )
    max_batch: int = Field(
        default=4, ge=1, le=64,
        description=(
            "text requests one worker speaks at once: their talker and code-predictor steps "
            "run as one batch, realtime sessions among them (1 = one request at a time; codes "
            "and one-shot `ref_audio` requests always run alone). Each live session beyond the "
            "first holds ~130 MB per 1024 positions at 0.6B (docs/deploy.md, Sizing)"
        ),
    )
    threads_per_worker: int = Field(
        default=0,
        ge=0,
        le=256,
        description=(
            "CPU threads per worker; 0 = `QTTS_THREADS` if set, else usable CPUs / workers, at "
            "least 1 (never more threads than CPUs: ggml's threads spin-wait, and an "
            "oversubscribed worker slows down many times over)"
        ),
    )
    queue_size: int = Field(
        default=8,
        ge=0,
        le=10000,
        description="requests that may wait for a worker; one more gets 503 at once",
    )
    max_text_chars: int = Field(default=4096, ge=1, description="longest text, in characters")
    max_text_tokens: int = Field(
        default=2048, ge=1, description="longest accepted text in tokens (what costs)"
    )
    max_instruct_tokens: int = Field(
        default=256, ge=1, description="longest accepted instruction in tokens"
    )
    segment_tokens: int = Field(
        default=200, ge=16, le=2048,
        description="a longer text is spoken in segments of whole sentences of at most this",
    )
    prefill_chunk: int = Field(
        default=256, ge=1, le=4096,
        description="prompt positions per prefill graph (memory bound; cancel checked between)",
    )
    request_timeout: float = Field(
        default=300.0, gt=0, description="seconds a request may take, queue wait included"
    )
    max_audio_seconds: float = Field(
        default=120.0,
        gt=0,
        description=(
            "cap on the audio of one request: a text request stops at the talker's text-length "
            "budget or here, whichever is first (`max_seconds` lowers it); longer codes are refused"
        ),
    )
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, description="request body cap (413 above)"
    )
    api_key: str | None = Field(
        default=None,
        description=(
            "when set, `/tts` and `/v1/*` need `Authorization: Bearer KEY` (or `X-API-Key`)"
        ),
    )
    api_keys: Path | None = Field(
        default=None,
        description=(
            "file of API keys and their owners, one `KEY OWNER` per line (`#` comments): each "
            "owner sees, uses and deletes only its own cloned voices; `QTTS_API_KEY`, when also "
            "set, is owner `default`"
        ),
    )
    # cloned voices (docs/cloning.md, "In the service")
    data_dir: Path = Field(
        default=Path("~/.local/share/qtts"),
        description="where the embedded voice store lives (`voices.sqlite3`, WAL mode; made on "
        "first use, only when the served model clones voices)",
    )
    voice_db: str | None = Field(
        default=None,
        description=(
            "the voice store: `postgresql://user:pass@host:5432/db` (one database for many "
            "replicas) or `sqlite:///path`; unset: SQLite in `QTTS_DATA_DIR`"
        ),
    )
    cors_origins: str = Field(
        default="",
        description="origins (`https://app.example,http://localhost:3000`, or `*`) whose web "
        "pages may use the API: they get CORS answers; a POST or DELETE, or a realtime "
        "WebSocket, from any other page (a cross-site form) is a 403 `origin_not_allowed`. "
        "Empty: the server's own pages (the playground) only. Clients that are not browsers "
        "send no `Origin`",
    )
    voice_db_timeout: float = Field(
        default=5.0, gt=0, le=600,
        description="seconds one voice-store operation may wait on the database (PostgreSQL's "
        "statement and lock timeouts; a database that does not answer at all: this plus the "
        "connect timeout); then 503 `store_unavailable`",
    )
    keep_reference_audio: bool = Field(
        default=False,
        description="also store a cloned voice's reference audio (else only its prompt and hash)",
    )
    max_reference_bytes: int = Field(
        default=10 * 1024 * 1024, ge=1024,
        description="largest reference audio upload (413 above)",
    )
    max_reference_seconds: float = Field(
        default=30.0, gt=1, le=120, description="longest reference audio, in seconds",
    )
    voice_name_max_chars: int = Field(
        default=128, ge=1, le=1024, description="longest name of a cloned voice",
    )
    log_format: Literal["text", "json"] = Field(
        default="text", description="`text` or `json` (one object per line)"
    )
    log_level: str = Field(default="info", description="python logging level")
    precision: Literal["fast", "exact"] = Field(
        default="fast",
        description="decoder precision `fast` (BF16 kernels) or `exact` (F32); without "
        "AVX512-BF16 (an AVX2 CPU), `fast` runs the 7-tap and transposed convs by Winograd in "
        "F32 (~90-100 dB per conv against float64) and the rest as `exact`. Wherever `fast` "
        "runs Winograd (every CPU without AMX tiles), a stream's audio depends on how its "
        "frames are chunked, so batched with others (`QTTS_CHUNK_RAMP=auto`) it differs from "
        "alone at fast mode's precision (its codes do not); `exact`, or a fixed ramp, gives "
        "the same samples",
    )
    precision_target_db: float = Field(
        default=35.0, ge=0, le=120,
        description="with `fast` precision: the SNR (dB, against `exact`) the decoder must "
        "hold on this model; a worker measures it at load and keeps more layers in F32 until it "
        "does (seconds on the released size, once per model file: kept in "
        "`QTTS_DATA_DIR/calibration`); 0: the default F32 layers, not measured",
    )
    chunk_max_frames: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description=(
            "largest chunk of the decoder's ramp (`QTTS_CHUNK_RAMP`), in frames (unset: the "
            "engine's default, 16)"
        ),
    )
    chunk_ramp: Literal["auto", "double", "gentle"] = Field(
        default="auto",
        description=(
            "how the decoder's chunks grow to `QTTS_CHUNK_MAX_FRAMES`: `double` 1, 2, 4, 8, "
            "16; `gentle` 1, 1, 1, 2, 2, 3, 4, 6, 8, 12, 16, fewer stalls for a stream whose "
            "frames take more than half their audio's time to make; `auto`: gentle while a "
            "stream is alone in its worker, doubling to at most 8 frames while it shares the "
            "worker's batch (each small push holds up the other streams, and so does each long "
            "one)"
        ),
    )
    first_chunk_frames: int = Field(
        default=1,
        ge=1,
        le=16,
        description=(
            "frames in a stream's first chunk (and again after a realtime pause for text), "
            "before the ramp goes on; 2: no stalls at the start of a stream whose frames take "
            "about two thirds of their audio's time to make, for one more frame's time to first "
            "audio (docs/performance.md, Session 24)"
        ),
    )
    drain_seconds: float = Field(
        default=30.0, ge=0, description="on SIGTERM, how long in-flight requests may finish"
    )
    shutdown_delay_seconds: float = Field(
        default=5.0, ge=0,
        description="on SIGTERM: readiness answers 503 this long at least before the listener "
        "closes (a load balancer's probes see it); within drain_seconds",
    )
    header_timeout: float = Field(
        default=10.0, gt=0, description="seconds a connection has to send a request's headers"
    )
    body_timeout: float = Field(
        default=30.0, gt=0, description="seconds a request has to send its whole body (408)"
    )
    keepalive_timeout: int = Field(
        default=5, ge=1, description="an idle keep-alive connection is closed after this"
    )
    cancel_grace_seconds: float = Field(
        default=10.0,
        gt=0,
        description="a worker that ignores a cancel this long is killed and replaced",
    )
    worker_start_timeout: float = Field(
        default=600.0, gt=0, description="load + warm-up time allowed to a worker"
    )
    warmup_frames: int = Field(
        default=4, ge=0, le=64, description="frames decoded once at worker start"
    )
    pin_prefixes: bool = Field(
        default=True,
        description=(
            "at warm-up, precompute every voice x language prompt prefix (~1 MB each), so the "
            "first request of a built-in voice prefills only its text"
        ),
    )
    retry_after_seconds: int = Field(default=1, ge=1, description="`Retry-After` on a 503")
    model_name: str = Field(
        default="qtts", description="the model id in `/v1/models` and `qtts_build_info`"
    )
    # WS /v1/tts/realtime (docs/service.md)
    realtime_min_tokens: int = Field(
        default=5, ge=1, le=64,
        description="realtime default start policy: speak once this many text tokens, or a "
        "punctuation mark, are buffered")
    realtime_idle_seconds: float = Field(
        default=60.0, gt=0,
        description="realtime: close a session idle (no message, nothing speaking) this long")
    realtime_max_seconds: float = Field(
        default=1800.0, gt=0, description="realtime: close a session open this long")
    realtime_max_chars: int = Field(
        default=20000, ge=1, description="realtime: text characters per session")
    realtime_max_buffered_seconds: float = Field(
        default=30.0, gt=0,
        description="realtime: audio a slow client has not read yet before the session is "
        "closed (1008)")
    max_temperature: float = Field(
        default=2.0, gt=0, description="highest `temperature` a text request may ask for"
    )
    max_top_k: int = Field(
        default=2048, ge=1, description="highest `top_k` a text request may ask for"
    )
    max_repetition_penalty: float = Field(
        default=2.0, ge=1.0, description="highest `repetition_penalty` a text request may ask for"
    )

    @field_validator("data_dir")
    @classmethod
    def _data_dir(cls, v: Path) -> Path:
        return v.expanduser()

    @field_validator("voice_db")
    @classmethod
    def _voice_db(cls, v: str | None) -> str | None:
        if v:
            scheme = v.split(":", 1)[0].lower()
            if scheme not in ("postgresql", "postgres", "sqlite"):
                raise ValueError(f"{scheme!r} is not a supported database: postgresql://... "
                                 "or sqlite:///path")
        return v or None

    @field_validator("cors_origins")
    @classmethod
    def _cors(cls, v: str) -> str:
        from service.origins import parse_origins

        parse_origins(v)
        return v

    @cached_property  # (read by the gate on every POST: parsed once)
    def allowed_origins(self) -> tuple[str, ...]:
        from service.origins import parse_origins

        return parse_origins(self.cors_origins)

    @field_validator("api_key")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        # a key no client can send (it travels in an HTTP header) would refuse every request
        if v and not all("!" <= c <= "~" for c in v):
            raise ValueError("a key is sent in an HTTP header: visible ASCII characters only, "
                             "no spaces")
        return v

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v: Path | None) -> Path | None:
        if v is not None:
            from service.voices.owners import parse_keys

            parse_keys(v)  # a bad file stops the server at start, with its line
        return v

    def key_owners(self) -> dict[str, str]:
        """API key -> owner: the keys file, and ``api_key`` as owner ``default``."""
        from service.voices.owners import DEFAULT_OWNER, parse_keys

        keys = parse_keys(self.api_keys) if self.api_keys is not None else {}
        if self.api_key:
            keys.setdefault(self.api_key, DEFAULT_OWNER)
        return keys

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        v = v.lower()
        if v not in {"debug", "info", "warning", "error", "critical"}:
            raise ValueError("one of debug, info, warning, error, critical")
        return v

    def worker_options(self, index: int, max_frames_cap: int) -> WorkerOptions:
        """What worker ``index`` starts with (``max_frames_cap``: the server's longest audio in
        the model's frames)."""
        return WorkerOptions(
            index=index, model_path=str(self.model), precision=self.precision,
            precision_target_db=self.precision_target_db,
            calibration_dir=str(self.data_dir / "calibration"),
            env=self.worker_env(), warmup_frames=self.warmup_frames,
            max_frames_cap=max_frames_cap, chunk_max_frames=self.chunk_max_frames,
            pin_prefixes=self.pin_prefixes, max_text_tokens=self.max_text_tokens,
            max_instruct_tokens=self.max_instruct_tokens, segment_tokens=self.segment_tokens,
            prefill_chunk=self.prefill_chunk, max_batch=self.max_batch,
            chunk_ramp=self.chunk_ramp, first_chunk_frames=self.first_chunk_frames,
        )

    def worker_env(self) -> dict[str, str]:
        """Extra environment for a worker process (the engine's own variables)."""
        env: dict[str, str] = {}
        env["QTTS_LOG_FORMAT"] = self.log_format
        env["QTTS_LOG_LEVEL"] = self.log_level
        env["QTTS_THREADS"] = str(self.threads_for_workers())
        return env

    def threads_for_workers(self) -> int:
        """Threads each worker computes with: the setting, or an even share of the CPUs."""
        if self.threads_per_worker:
            return self.threads_per_worker
        engine_threads = os.environ.get("QTTS_THREADS", "")
        if engine_threads.isdigit() and int(engine_threads) > 0:
            return int(engine_threads)  # the engine's own variable, set by hand
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cpus = os.cpu_count() or 1
        from engine.options import MAX_THREADS

        # every CPU computes: the front end's HTTP and encoding are light next to synthesis
        # (measured in docs/performance.md, "Threads per worker"); more threads than CPUs
        # would make ggml's spin-waiting threads preempt each other
        return max(1, min(MAX_THREADS, cpus // self.workers))
