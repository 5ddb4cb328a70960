"""``SpeakerEncoder``: 24 kHz mono audio -> the x-vector a Base model's prompt carries."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from engine.backend import BackendSet
from engine.errors import InputError
from engine.ggml.graph import Graph
from engine.ggml.ops1d import ConvForm, direct_available
from engine.gguf_schema import PART_SPEAKER
from engine.speaker.ecapa import packed_weights, reflect_indices, reflect_paddings, x_vector
from engine.speaker.mel import MelConstants, frame_count, log_mel, min_samples
from engine.speaker.schema import SpeakerEncoderConfig, speaker_tensor_specs


class SpeakerEncoder:
    """The speaker encoder of one model, its weights resident on ``backends`` (F32)."""

    def __init__(self, model: Any, backends: BackendSet) -> None:
        model.require(PART_SPEAKER)
        cfg: SpeakerEncoderConfig = model.speaker_config
        self.config = cfg
        self._backends = backends
        store = backends.weight_store()
        shapes = {spec.name: spec.shape for spec in speaker_tensor_specs(cfg)}

        def tensor(name: str) -> npt.NDArray[np.float32]:
            out: npt.NDArray[np.float32] = model.tensor_f32(name).reshape(shapes[name])
            return out

        # (split BF16 where AMX runs it: the x-vector is compared within a tolerance)
        self._form = ConvForm.split_where_fast(direct_available(backends))
        packed = packed_weights(cfg, tensor, self._form)
        for name in shapes:
            if name not in packed:
                store.add_array(name, tensor(name))
        for name, (w, ggml_type) in packed.items():
            store.add_array(name, w, ggml_type)
        self._mel = MelConstants(cfg.sample_rate, cfg.mel_dim)
        store.allocate()
        self._store = store

    def embed(self, wav: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """The x-vector ``[enc_dim]`` of ``wav`` (mono float32 at the config's sample rate)."""
        x = np.ascontiguousarray(wav, dtype=np.float32).reshape(-1)
        # a reflect padding needs more frames than it pads
        need = max((max(p) for p in reflect_paddings(self.config)), default=0) + 1
        if x.size < min_samples() or frame_count(x.size) < need:
            raise InputError("audio", f"is too short for the speaker encoder ({x.size} samples)")
        W = self._store.__getitem__
        index = reflect_indices(self.config, frame_count(x.size))
        mel = log_mel(x, self._mel)
        with Graph() as g:
            inp = g.input("mel", mel.shape)
            pads = {p: g.input(f"reflect_{p[0]}_{p[1]}", (v.size,), dtype=np.int32)
                    for p, v in index.items()}  # fmt: skip
            g.output(x_vector(g.ctx, W, self.config, inp, lambda lo, hi: pads[(lo, hi)],
                              self._form), "xvec")  # fmt: skip
            out = self._backends.execute(g, {
                "mel": mel,
                **{f"reflect_{p[0]}_{p[1]}": v for p, v in index.items()},
            })  # fmt: skip
        return out["xvec"].reshape(-1).astype(np.float32)

    def close(self) -> None:
        """Free the weights."""
        self._store.close()
