"""Per-stage wall times of one engine call, returned with every chunk of audio."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from engine.debug_out import debug_line

DECODER_STAGES = ("quant", "preconv", "pretr", "upsample", "bigvgan")
TALKER_STAGES = ("prefill", "talker_step", "code_predictor")


@dataclass
class StageTimings:
    """Seconds spent in each stage (graph build + compute + transfers) for one call."""

    quant: float = 0.0
    preconv: float = 0.0
    pretr: float = 0.0
    upsample: float = 0.0
    bigvgan: float = 0.0
    prefill: float = 0.0
    talker_step: float = 0.0
    code_predictor: float = 0.0

    def as_dict(self, stages: tuple[str, ...] = DECODER_STAGES) -> dict[str, float]:
        """The named stages as a plain dict (decoder stages by default)."""
        d = asdict(self)
        return {s: d[s] for s in stages}

    @property
    def total(self) -> float:
        """Sum over every stage."""
        return float(sum(getattr(self, f.name) for f in fields(self)))

    def __add__(self, other: StageTimings) -> StageTimings:
        return StageTimings(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                               for f in fields(self)})

    def report(self, label: str = "") -> None:
        """Write the stages that took time as one debug line (``EngineOptions.profile``)."""
        parts = " ".join(f"{k}={v * 1e3:.1f}ms" for k, v in asdict(self).items() if v)
        debug_line(f"[qtts profile]{' ' + label if label else ''} {parts}")
