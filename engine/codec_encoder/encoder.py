"""``CodecEncoder``: 24 kHz mono audio -> reference codes ``[T, 16]`` (the tokenizer's encode).

Matches ``Qwen3TTSTokenizerV2Model.encode`` for one clip: SEANet -> transformer -> downsample ->
split RVQ (first ``num_quantizers`` levels), trimmed to ``ceil(samples / frame_samples)`` frames.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.backend import BackendSet
from engine.codec_encoder.quantizer import codebook, encode, neg_half_norms
from engine.codec_encoder.schema import CodecEncoderConfig, codec_encoder_tensor_specs
from engine.codec_encoder.seanet import ZERO_BUFFER, downsample, seanet, zero_buffer_size
from engine.codec_encoder.transformer import LINEARS, causal_mask, padded_length, transformer
from engine.errors import InputError
from engine.ggml import lib
from engine.ggml.graph import Graph
from engine.ggml.ops1d import ConvForm, direct_available
from engine.gguf_schema import PART_CODEC_ENCODER


class CodecEncoder:
    """The Mimi encoder of one model, its weights resident on ``backends`` (F32)."""

    def __init__(self, model: Any, backends: BackendSet) -> None:
        model.require(PART_CODEC_ENCODER)
        cfg: CodecEncoderConfig = model.codec_encoder_config
        self.config = cfg
        self._backends = backends
        store = backends.weight_store()
        form = self._form = ConvForm(direct_available(backends), winograd=True)
        # name -> (stride, dilation) of every conv
        convs = {f"cenc.conv.{n}.weight": (s, d)
                 for n, (*_, s, d) in enumerate(cfg.seanet_convs())}  # fmt: skip
        convs["cenc.downsample.weight"] = (2, 1)
        linears = {f"cenc.tr.{i}.{n}.weight" for i in range(cfg.num_hidden_layers)
                   for n in LINEARS}  # fmt: skip
        for spec in codec_encoder_tensor_specs(cfg):
            if spec.name.startswith("cenc.vq.cb."):
                continue
            w = model.tensor_f32(spec.name).reshape(spec.shape)
            # convs and linears run on the direct conv kernel, packed (strided convs folded)
            if spec.name in convs:
                w = form.pack(w, *convs[spec.name])
            elif spec.name in linears:
                w = form.pack(w[:, :, None])
            elif spec.name.endswith("_in_proj.weight"):
                store.add_array(spec.name.replace(".weight", ".packed"), form.pack(w[:, :, None]))
                continue
            store.add_array(spec.name, w)
        store.add_array(ZERO_BUFFER, np.zeros(zero_buffer_size(cfg), np.float32))
        for q in range(cfg.num_quantizers):
            g = f"cenc.vq.cb.{q}."
            e = codebook(model.tensor_f32(g + "embed_sum").reshape(cfg.codebook_size, -1),
                         model.tensor_f32(g + "usage").reshape(-1))  # fmt: skip
            store.add_array(g + "embed", e)
            store.add_array(g + "packed", form.pack(e[:, :, None]))
            store.add_array(g + "neg_half_norm", neg_half_norms(e))
        store.allocate()
        self._store = store

    def frames(self, n_samples: int) -> int:
        """Code frames the reference keeps for ``n_samples`` of audio."""
        return math.ceil(n_samples / self.config.frame_samples)

    def encode(self, wav: npt.NDArray[np.float32]) -> npt.NDArray[np.int32]:
        """Codes ``[frames, num_quantizers]`` of ``wav`` (mono float32 at 24 kHz)."""
        x = np.ascontiguousarray(wav, dtype=np.float32).reshape(-1)
        if x.size < self.config.frame_samples:
            raise InputError("audio", f"is too short to encode ({x.size} samples)")
        W = self._store.__getitem__
        with Graph() as g:
            ctx = g.ctx

            def zero_bias(n: int) -> Any:
                return lib.ggml_view_1d(ctx, W(ZERO_BUFFER), n, 0)

            inp = g.input("wav", (x.size, 1))  # time-major: one channel
            h = seanet(ctx, W, self._form, self.config, inp)  # [T25, hidden]
            t = padded_length(int(h.ne[1]))
            pos = g.input("pos", (t,), dtype=np.int32)
            mask = g.input("mask", (t, t))
            h = transformer(ctx, W, self._form, zero_bias, self.config, h, pos, mask)
            h = downsample(ctx, W, self._form, self.config, h)  # [T, hidden]
            g.output(encode(ctx, W, self._form, zero_bias, self.config, h), "codes")
            out = self._backends.execute(g, {
                "wav": x.reshape(-1, 1),
                "pos": np.arange(t, dtype=np.int32),
                "mask": causal_mask(t),
            })  # fmt: skip
        codes = out["codes"].reshape(self.config.num_quantizers, -1)
        return np.ascontiguousarray(codes[:, : self.frames(x.size)].T, dtype=np.int32)

    def close(self) -> None:
        """Free the weights."""
        self._store.close()
