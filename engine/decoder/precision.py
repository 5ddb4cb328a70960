"""Fast mode's per-layer precision: which layers run in BF16, and a load-time calibration.

Fast mode runs the wave generator's convs in BF16. Each BF16 conv rounds its input and weights
(~2^-9 relative, ~50 dB per conv); what reaches the waveform depends on the layers after it:
every SnakeBeta multiplies a perturbation by ``1 + (a/b) sin(2 a x)``, so with O(1) snake
parameters the rounding of the first layers (the upsampler's pointwise layers, conv_in) and of
the transposed convs is amplified by the rest of the stack and dominates the error, while the
residual units' rounding barely shows (docs/performance.md, "Fast-mode precision").

So fast mode keeps those layers in F32 (``default_f32``) and runs the residual units -- most
of the FLOPs -- in BF16. That holds 35 dB on the stress decoder, not on every checkpoint: louder
residual branches or snakes lose more (a residual unit's second conv at gain 0.5 instead of
0.3: ~27 dB). ``calibrate`` measures, on the loaded weights, what fast mode gives against exact
mode on a few frames of codes and promotes further layers to F32, earliest first
(``promotion_order``), until a target SNR holds; the service runs it when a worker loads a
model, and keeps the result (``calibration_store``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_TARGET_DB = 35.0
CALIBRATION_FRAMES = 16  # 1.3 s of audio: enough for every layer's history to fill
# An exact decode that clips more than this share of its samples is a saturated square wave
# (qtts make-model's default decoder: 93-98 %): the clamp decides the output, fast mode's error
# there is where the wave crosses zero, and no promotion makes it speech-like; keep the default.
SATURATED = 0.25


def bf16_layers(model: Any) -> list[str]:
    """GGUF prefixes of every layer fast mode can run in BF16, in graph order."""
    cfg = model.decoder_config
    out = [f"dec.up.{i}.pwconv{j}" for i in range(len(cfg.upsampling_ratios)) for j in (1, 2)]
    out.append("dec.conv_in")
    for b in range(1, len(cfg.upsample_rates) + 1):
        out.append(f"dec.blk.{b}.tconv")
        out += [f"dec.blk.{b}.res.{r}.conv{j}" for r in range(3) for j in (1, 2)]
    out.append("dec.conv_out")
    return out


def default_f32(model: Any) -> frozenset[str]:
    """The layers fast mode keeps in F32 by default: every layer that changes the time
    resolution or feeds the wave generator -- the upsampler's pointwise layers, conv_in and the
    four transposed convs. Measured on weights with O(1) snakes (the stress decoder, released
    size): together ~3/4 of an all-BF16 decode's error (30.1-30.9 -> 35.8-36.6 dB)."""
    cfg = model.decoder_config
    keep = [f"dec.up.{i}.pwconv{j}" for i in range(len(cfg.upsampling_ratios)) for j in (1, 2)]
    keep.append("dec.conv_in")
    keep += [f"dec.blk.{b}.tconv" for b in range(1, len(cfg.upsample_rates) + 1)]
    return frozenset(keep)


def promotion_order(model: Any) -> list[list[str]]:
    """Groups of BF16 layers the calibration promotes, most amplified (earliest) first: the
    residual units of block 1, then block 2, ..., then conv_out."""
    cfg = model.decoder_config
    groups = [[f"dec.blk.{b}.res.{r}.conv1", f"dec.blk.{b}.res.{r}.conv2"]
              for b in range(1, len(cfg.upsample_rates) + 1) for r in range(3)]
    groups.append(["dec.conv_out"])
    done = default_f32(model)
    return [g for g in ([x for x in grp if x not in done] for grp in groups) if g]


@dataclass(frozen=True)
class Calibration:
    """What ``calibrate`` measured and chose."""

    f32_layers: frozenset[str]
    snr_db: float  # fast against exact on the calibration codes, with ``f32_layers``
    target_db: float
    steps: int  # promotions made after the default set
    seconds: float
    clipped: float = 0.0  # share of the exact decode's samples at +-1

    @property
    def met(self) -> bool:
        return self.snr_db >= self.target_db

    @property
    def saturated(self) -> bool:
        return self.clipped > SATURATED

    def summary(self) -> str:
        why = (f"; the exact decode clips {100 * self.clipped:.0f} % of its samples: nothing "
               "promoted" if self.saturated else "")
        return (f"fast-mode calibration: SNR {self.snr_db:.1f} dB against exact (target "
                f"{self.target_db:g}), {len(self.f32_layers)} layer(s) kept out of BF16 "
                f"({self.steps} promoted{why}), {self.seconds:.1f} s")


def calibration_codes(model: Any, frames: int = CALIBRATION_FRAMES, seed: int = 0
                      ) -> np.ndarray[Any, np.dtype[np.int32]]:
    """Seeded uniform codes [n_quantizers, frames]."""
    cfg = model.decoder_config
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.codebook_size, size=(cfg.num_quantizers, frames), dtype=np.int32)


def snr_db(reference: np.ndarray[Any, Any], test: np.ndarray[Any, Any]) -> float:
    """SNR of ``test`` against ``reference`` in dB."""
    ref = reference.astype(np.float64)
    noise = float(np.sum((ref - test) ** 2))
    return 10 * float(np.log10(max(float(np.sum(ref**2)), 1e-30) / max(noise, 1e-30)))


def calibrate(model: Any, backends: Any, target_db: float | None = None,
              frames: int = CALIBRATION_FRAMES, start: frozenset[str] | None = None,
              max_steps: int | None = None) -> Calibration:
    """Decode ``frames`` frames exactly and in fast mode; promote layers (``promotion_order``)
    until fast mode's SNR against exact reaches ``target_db``, at most ``max_steps`` times
    (None: until every group is F32), none where the exact decode is saturated (``SATURATED``).

    Each step reloads the fast weights (seconds on the released size); the result's
    ``f32_layers`` is what to load fast mode with. Costs one exact load on top.
    """
    from engine.decoder.model import DecoderModel
    from engine.decoder.streaming import decode

    started = time.perf_counter()
    target = DEFAULT_TARGET_DB if target_db is None else target_db
    codes = calibration_codes(model, frames)
    exact = DecoderModel.load(model, backends, "exact")
    try:
        ref, _ = decode(exact, codes)
    finally:
        exact.close()
    clipped = float(np.mean(np.abs(ref) >= 1.0))
    layers = default_f32(model) if start is None else start
    order = [] if clipped > SATURATED else promotion_order(model)
    steps = 0
    while True:
        fast = DecoderModel.load(model, backends, "fast", f32_layers=layers)
        try:
            got, _ = decode(fast, codes)
        finally:
            fast.close()
        snr = snr_db(ref, got)
        log.debug("calibration: %d layer(s) kept out of BF16 -> %.1f dB", len(layers), snr)
        if snr >= target or not order or (max_steps is not None and steps >= max_steps):
            break
        layers = layers | frozenset(order.pop(0))
        steps += 1
    return Calibration(layers, snr, target, steps, time.perf_counter() - started, clipped)
