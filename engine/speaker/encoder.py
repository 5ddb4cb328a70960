"""``SpeakerEncoder``: 24 kHz mono audio -> the x-vector a Base model's prompt carries."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from engine.backend import BackendSet
from engine.errors import InputError
from engine.ggml.graph import Graph
from engine.gguf_schema import PART_SPEAKER
from engine.speaker.ecapa import x_vector
from engine.speaker.mel import MelConstants, log_mel, min_samples
from engine.speaker.schema import SpeakerEncoderConfig, speaker_tensor_specs


class SpeakerEncoder:
    """The speaker encoder of one model, its weights resident on ``backends`` (F32)."""

    def __init__(self, model: Any, backends: BackendSet) -> None:
        model.require(PART_SPEAKER)
        cfg: SpeakerEncoderConfig = model.speaker_config
        self.config = cfg
        self._backends = backends
        store = backends.weight_store()
        for spec in speaker_tensor_specs(cfg):
            store.add_array(spec.name, model.tensor_f32(spec.name).reshape(spec.shape))
        consts = MelConstants(cfg.sample_rate, cfg.mel_dim)
        store.add_array("spk.mel_basis", consts.mel)
        store.add_array("spk.dft_cos", consts.cos)
        store.add_array("spk.dft_sin", consts.sin)
        store.allocate()
        self._store = store

    def embed(self, wav: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """The x-vector ``[enc_dim]`` of ``wav`` (mono float32 at the config's sample rate)."""
        x = np.ascontiguousarray(wav, dtype=np.float32).reshape(-1)
        if x.size < min_samples():
            raise InputError("audio", f"is too short for the speaker encoder ({x.size} samples)")
        W = self._store.__getitem__
        with Graph() as g:
            inp = g.input("wav", (1, x.size))
            mel = log_mel(g.ctx, inp, W("spk.dft_cos"), W("spk.dft_sin"), W("spk.mel_basis"))
            g.output(x_vector(g.ctx, W, self.config, mel), "xvec")
            out = self._backends.execute(g, {"wav": x.reshape(1, -1)})
        return out["xvec"].reshape(-1).astype(np.float32)

    def close(self) -> None:
        """Free the weights."""
        self._store.close()
