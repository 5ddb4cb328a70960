"""Fast mode's per-layer precision: which layers run in BF16, and a load-time calibration.

Fast mode runs the wave generator's convs in BF16. Each BF16 conv rounds its input and weights
(~2^-9 relative); how much of that reaches the waveform depends on the weights after it (snake
slopes, residual gains), so a fixed split that holds on one checkpoint can lose several dB on
another. ``calibrate`` decodes a few frames both ways on the loaded weights and keeps the layers
whose rounding the stack amplifies most in F32 until the waveform SNR holds.
"""

from __future__ import annotations

from typing import Any


def bf16_layers(model: Any) -> list[str]:
    """GGUF prefixes of the layers fast mode runs in BF16, in graph order."""
    cfg = model.decoder_config
    out = [f"dec.up.{i}.pwconv{j}" for i in range(len(cfg.upsampling_ratios)) for j in (1, 2)]
    out.append("dec.conv_in")
    for b in range(1, len(cfg.upsample_rates) + 1):
        out.append(f"dec.blk.{b}.tconv")
        out += [f"dec.blk.{b}.res.{r}.conv{j}" for r in range(3) for j in (1, 2)]
    out.append("dec.conv_out")
    return out
