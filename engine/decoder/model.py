"""``DecoderModel``: the speech-tokenizer decoder loaded onto a BackendSet, ready to be driven."""

from __future__ import annotations

from typing import Any

from engine.backend import BackendSet
from engine.decoder.precision import Calibration, calibrate
from engine.decoder.weights import DecoderWeights, Precision


class DecoderModel:
    """A loaded decoder: config, weights on a BackendSet, and the precision mode."""

    def __init__(self, weights: DecoderWeights) -> None:
        self.weights = weights
        self.cfg = weights.cfg
        self.backends = weights.backends
        self.precision = weights.precision
        # Our fused CPU kernels only pay where the graph runs on the CPU; on an accelerator they
        # would split every block back to the host (and an rpc server cannot run them at all).
        self.use_custom_ops = weights.use_custom_ops
        self.calibration: Calibration | None = None  # set by load(calibrate_db=...)

    @classmethod
    def load(cls, model: Any, backends: BackendSet, precision: Precision = "fast",
             f32_layers: frozenset[str] | None = None, calibrate_db: float | None = None
             ) -> DecoderModel:
        """Load the decoder of a validated GgufModel onto ``backends``.

        ``f32_layers``: fast mode's layers kept in F32 (GGUF prefixes; default
        ``precision.default_f32``). ``calibrate_db``: in fast mode, first measure fast against
        exact on a few frames and promote layers until that SNR holds (``precision.calibrate``;
        the result is ``self.calibration``).
        """
        model.require("decoder")
        calibration = None
        if precision == "fast" and calibrate_db is not None:
            calibration = calibrate(model, backends, calibrate_db, start=f32_layers)
            f32_layers = calibration.f32_layers
        dm = cls(DecoderWeights(model, backends, precision, f32_layers))
        dm.calibration = calibration
        return dm

    @property
    def chunk_invariant(self) -> bool:
        """Whether a stream's audio is the same bits however its frames are pushed: on the CPU
        with qtts's kernels every stage sums in an order fixed by positions, not by where a
        chunk starts (the pre-transformer's window attention included), except the Winograd
        convs, whose tiles start where a chunk starts. ggml's stock nodes (accelerators) group
        their sums by offsets in the chunk."""
        return self.use_custom_ops and not self.weights.winograd

    @property
    def samples_per_frame(self) -> int:
        """Output samples per codec frame (1920 at 24 kHz / 12.5 Hz)."""
        return int(self.cfg.upsample_total)

    @property
    def sample_rate(self) -> int:
        """Output sample rate in Hz."""
        return int(self.cfg.sample_rate)

    def close(self) -> None:
        """Free the weights."""
        self.weights.close()
