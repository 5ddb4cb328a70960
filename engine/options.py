"""``EngineOptions``: every setting of the engine, read once at the edge and passed down.

The edge is whatever starts the engine: the ``qtts`` command line and the service's worker
process. They call ``EngineOptions.from_env`` (the one place under engine/ that reads the
environment) and hand the result to ``BackendSet.from_options``; the BackendSet carries it to
everything built on it (decoder weights, talker, stage timings), so nothing below reads
``QTTS_*`` variables on its own.

Variables (all optional):
  QTTS_BACKEND           auto | cpu | blas | rpc | cuda | vulkan | metal | hexagon (default auto)
  QTTS_BACKEND_FALLBACK  auto order, comma list (default: every GPU-class backend the build
                         has, then cpu). ``blas`` is never chosen by default: it only runs large
                         F32 matmuls and converts every other weight type on each call.
  QTTS_DEVICE            device index within the chosen backend (default 0)
  QTTS_RPC_SERVERS       comma list of host:port of ggml RPC servers (``python -m
                         cli.rpc_server``); each adds one ``rpc`` device
  QTTS_THREADS           CPU threads, 1..256 (default: the CPUs this process may run on)
  QTTS_DEBUG_BACKEND=1   print per-graph placement: nodes per backend, op types on the CPU
  QTTS_MAX_MATMUL_ROWS   split matmuls whose src1 has more rows (default: per backend, e.g.
                         1024 for hexagon; none elsewhere) so they stay on the accelerator
  QTTS_CUSTOM_OPS=0      do not use qtts's own CPU kernels (native/ops): stock ggml ops only,
                         e.g. to rule them out when bisecting a wrong result
  QTTS_OP_LOG=1          log every graph node's output (see engine/diagnostics.py)
  QTTS_OP_FILTER         comma list of ggml op names the op log keeps
  QTTS_CHECK_DETERMINISM=1  run every graph twice and name the first node that differs
  QTTS_WINOGRAD=0        fast decoder: the direct conv kernels instead of Winograd
  QTTS_INT8_PREFILL=0    no int8 copy of a quantised talker's matrices for prefills
  QTTS_PROFILE=1         print the per-stage times of every decoder push (engine/debug_out.py)
  QTTS_PIN_PREFIXES=0    at warm-up, do not precompute every voice x language prompt prefix

The on/off variables take 1 or 0 (also true/false, yes/no, on/off; empty: the default); any
other value is refused.
The backend choice (backend, fallback, device, threads, rpc servers) stays as the variables
spell it: it can only be checked against the build and the machine, which ``choose_backend``
does with an error that names what is available (``check_backend_settings``: the part that
needs no device, which ``qtts serve`` runs before it starts a worker).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.errors import BackendError


def qtts_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$QTTS_CACHE_DIR`` (default ``~/.cache/qtts``): where native builds, models and the
    vocabulary are cached. Read here, with the engine's other variables."""
    e = os.environ if env is None else env
    return Path(e.get("QTTS_CACHE_DIR") or "~/.cache/qtts").expanduser()


def parse_op_filter(raw: str | None) -> frozenset[str]:
    """QTTS_OP_FILTER: comma list of ggml op names (as ggml_op_desc spells them)."""
    if not raw:
        return frozenset()
    return frozenset(p.strip().upper() for p in raw.split(",") if p.strip())


@dataclass(frozen=True)
class DiagnosticSettings:
    """Which diagnostics are on (see engine/diagnostics.py)."""

    op_log: bool = False
    op_filter: frozenset[str] = frozenset()
    check_determinism: bool = False

    @property
    def any_hook(self) -> bool:
        """Whether an eval callback is needed."""
        return self.op_log or self.check_determinism


# QTTS_THREADS's cap: thousands of threads fail to start or crash the process (ggml's own cap
# is 512), and more than a machine's CPUs only slow ggml down (its threads spin-wait)
MAX_THREADS = 256
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """On/off variables: ``1`` on, ``0`` off (or the words the service's settings take for a
    boolean: true/false, yes/no, on/off), unset or empty the default; anything else is refused
    (a typo would otherwise quietly keep the default)."""
    raw = env.get(name)
    if raw in (None, ""):
        return default
    word = raw.strip().lower()
    if word not in _ON + _OFF:
        raise BackendError(f"{name}={raw!r}: use 1 (on) or 0 (off)")
    return word in _ON


def _positive_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw in (None, ""):
        return None
    try:
        value = int(raw)
    except ValueError:
        raise BackendError(f"{name}={raw!r} is not an integer") from None
    if value < 1:
        raise BackendError(f"{name}={value} must be >= 1")
    return value


@dataclass(frozen=True)
class EngineOptions:
    """The engine's settings; the defaults are what an empty environment gives."""

    # where graphs run (BackendSet)
    backend: str = "auto"
    backend_fallback: str | None = None
    device: str | None = None
    threads: str | None = None
    rpc_servers: str | None = None
    max_matmul_rows: int | None = None
    custom_ops: bool = True
    debug_backend: bool = False
    diagnostics: DiagnosticSettings = field(default_factory=DiagnosticSettings)
    # what the models do (DecoderWeights, TalkerModel, Pipeline.warm_up)
    winograd: bool = True
    amx: bool = True
    int8_prefill: bool = True
    pin_prefixes: bool = True
    # reporting (StageTimings)
    profile: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> EngineOptions:
        """Read the ``QTTS_*`` variables (the process environment when ``env`` is None), then
        apply ``overrides`` by field name (e.g. ``threads="2"`` from the service's settings)."""
        e = os.environ if env is None else env
        options = cls(
            backend=e.get("QTTS_BACKEND", "auto"),
            backend_fallback=e.get("QTTS_BACKEND_FALLBACK"),
            device=e.get("QTTS_DEVICE"),
            threads=e.get("QTTS_THREADS"),
            rpc_servers=e.get("QTTS_RPC_SERVERS"),
            max_matmul_rows=_positive_int(e, "QTTS_MAX_MATMUL_ROWS"),
            custom_ops=_flag(e, "QTTS_CUSTOM_OPS", True),
            debug_backend=_flag(e, "QTTS_DEBUG_BACKEND", False),
            diagnostics=DiagnosticSettings(
                op_log=_flag(e, "QTTS_OP_LOG", False),
                op_filter=parse_op_filter(e.get("QTTS_OP_FILTER")),
                check_determinism=_flag(e, "QTTS_CHECK_DETERMINISM", False),
            ),
            winograd=_flag(e, "QTTS_WINOGRAD", True),
            amx=_flag(e, "QTTS_AMX", True),
            int8_prefill=_flag(e, "QTTS_INT8_PREFILL", True),
            pin_prefixes=_flag(e, "QTTS_PIN_PREFIXES", True),
            profile=_flag(e, "QTTS_PROFILE", False),
        )
        return replace(options, **overrides) if overrides else options

    def replace(self, **changes: Any) -> EngineOptions:
        """A copy with some fields changed."""
        return replace(self, **changes)
