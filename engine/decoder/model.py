"""``DecoderModel``: the speech-tokenizer decoder loaded onto a BackendSet, ready to be driven."""

from __future__ import annotations

from typing import Any

from engine.backend import BackendSet
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

    @classmethod
    def load(cls, model: Any, backends: BackendSet, precision: Precision = "fast"
             ) -> DecoderModel:
        """Load the decoder of a validated GgufModel onto ``backends``."""
        model.require("decoder")
        return cls(DecoderWeights(model, backends, precision))

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
