"""The decoder driver: offline ``decode`` and the stateful ``StreamingDecoder``.

Each ``push`` runs the five stages as five graphs on the worker's BackendSet (so each stage's
time is measured on its own) and carries every causal history forward. Decoding a whole
utterance is the same code path pushed in bounded chunks, so memory does not grow with length.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from engine.decoder import bigvgan, pre_conv, pre_transformer, rvq, upsample
from engine.decoder.blocks import StageGraph
from engine.decoder.model import DecoderModel
from engine.decoder.weights import RES_DILATIONS
from engine.errors import InputError
from engine.ggml import Tensor
from engine.timings import StageTimings

DEFAULT_OFFLINE_CHUNK = 50  # frames per push in decode(): 4 s of audio, bounded memory
CONV_KERNEL = 7  # the upsampler's depthwise convs and every causal conv of the wave generator


def history_frames(cfg: Any) -> int:
    """Frames of pre-transformer output that the upsampler's and the wave generator's carried
    histories depend on: every causal conv keeps ``(k - 1) * dilation`` of its input samples,
    each transposed conv of a wave-generator block (kernel 2r) one, the upsampler's (kernel =
    stride) none; summed at each one's rate (samples per frame) and rounded up. 0.6B and 1.7B:
    ~9.4 frames, so 10 (tests/parity/test_decoder_parity.py: 10 leave the state of a full push,
    9 do not)."""
    k = CONV_KERNEL - 1
    rate, need = 1, 0.0
    for u in cfg.upsampling_ratios:
        rate *= u
        need += k / rate  # ConvNeXt dwconv
    need += k / rate  # decoder.0
    for r in cfg.upsample_rates:
        need += 1 / rate  # the transposed conv's overlap: one earlier input
        rate *= r
        need += k * sum(RES_DILATIONS) / rate  # the three residual units
    need += k / rate  # conv_out
    return math.ceil(need)


def validate_codes(codes: Any, n_quantizers: int, codebook_size: int
                   ) -> np.ndarray[Any, np.dtype[np.int32]]:
    """Codes as int32 [n_quantizers, T]; any problem is an InputError on field ``codes``."""
    arr = np.asarray(codes)
    if arr.dtype.kind not in "iu":
        raise InputError("codes", f"must be integers, got {arr.dtype}")
    if arr.ndim != 2 or arr.shape[0] != n_quantizers:
        raise InputError("codes", f"must have shape [{n_quantizers}, T], got {list(arr.shape)}")
    if arr.shape[1] == 0:
        raise InputError("codes", "is empty (T = 0 frames)")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= codebook_size:
        bad = lo if lo < 0 else hi
        raise InputError("codes", f"id {bad} is outside 0..{codebook_size - 1}")
    return np.ascontiguousarray(arr, dtype=np.int32)


class StreamingDecoder:
    """Codes in, audio out, chunk by chunk; equal to one pass over all frames pushed so far."""

    def __init__(self, model: DecoderModel, capture: bool = False) -> None:
        self.model = model
        self.capture = capture
        self.state: dict[str, np.ndarray[Any, Any]] = {}
        self._taps: dict[str, list[np.ndarray[Any, Any]]] = {}
        self.frames = 0

    def reset(self) -> None:
        """Start a new utterance (all carried history back to zeros)."""
        self.state = {}
        self._taps = {}
        self.frames = 0

    def captured(self) -> dict[str, np.ndarray[Any, Any]]:
        """With ``capture=True``: every named intermediate so far, time-major [T, C]."""
        return {k: np.concatenate(v, axis=0) for k, v in self._taps.items()}

    def push(self, codes: Any) -> tuple[np.ndarray[Any, np.dtype[np.float32]], StageTimings]:
        """Decode the next frames: codes [16, n] -> float32 audio [n * 1920] in [-1, 1]."""
        tm = StageTimings()
        c = self._codes(codes)
        wav = self._wave(tm, self._features(tm, c))
        self.frames += c.shape[1]
        if self.model.backends.options.profile:
            tm.report(f"push {c.shape[1]} frame(s)")
        return wav.reshape(-1), tm

    def prime(self, codes: Any) -> StageTimings:
        """On a fresh decoder, take codes for context only (their audio is not wanted, as an
        in-context voice's reference frames): the state after it is the state after ``push``
        bit for bit, but the upsampler and the wave generator, whose histories reach back
        ``history_frames`` frames, see only that many of the last frames (the stages before
        them see every frame). Elsewhere it is ``push`` with the audio dropped."""
        c = self._codes(codes)
        keep = history_frames(self.model.cfg)
        if self.frames or self.state or c.shape[1] <= keep:
            return self.push(c)[1]
        tm = StageTimings()
        x = self._features(tm, c)
        self._wave(tm, np.ascontiguousarray(x[-keep:]))
        self.frames += c.shape[1]
        return tm

    def _codes(self, codes: Any) -> np.ndarray[Any, np.dtype[np.int32]]:
        cfg = self.model.cfg
        return validate_codes(codes, cfg.num_quantizers, cfg.codebook_size)

    def _features(self, tm: StageTimings, c: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        # quantizer, pre-conv and pre-transformer: [n, C] at the frame rate
        w, n = self.model.weights, c.shape[1]
        pos = np.arange(self.frames, self.frames + n, dtype=np.int32)
        mask = pre_transformer.attention_mask(self.frames, n, self.model.cfg.sliding_window)
        x = self._stage(tm, "quant", lambda g: rvq.build(g, w, n), codes=c)
        x = self._stage(tm, "preconv", lambda g: pre_conv.build(g, w, g.input("x", x.shape)), x=x)
        return self._stage(tm, "pretr",
                           lambda g: pre_transformer.build(g, w, g.input("x", x.shape)),
                           x=x, pos=pos, mask=mask)

    def _wave(self, tm: StageTimings, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        # upsampler and wave generator: the frames' audio
        w = self.model.weights
        x = self._stage(tm, "upsample", lambda g: upsample.build(g, w, g.input("x", x.shape)),
                        x=x)
        return self._stage(tm, "bigvgan", lambda g: bigvgan.build(g, w, g.input("x", x.shape)),
                           x=x)

    def _stage(self, tm: StageTimings, name: str, build: Callable[[StageGraph], Tensor],
               **inputs: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        started = time.perf_counter()
        g = StageGraph(self.state, self.model.use_custom_ops, self.capture,
                       self.model.backends.max_matmul_rows)
        try:
            g.output(build(g), "y")
            out = self.model.backends.execute(g, g.uploads(**inputs))
            g.update_state(out)
        finally:
            g.close()
        for key, arr in out.items():
            if key.startswith("tap."):
                # one time step comes back 1-D (ggml drops a trailing 1): [1, C]
                rows = arr.reshape(1, -1) if arr.ndim == 1 else arr.reshape(arr.shape[0], -1)
                self._taps.setdefault(key[4:], []).append(rows)
        setattr(tm, name, getattr(tm, name) + time.perf_counter() - started)
        return out["y"]


def decode(model: DecoderModel, codes: Any, chunk: int = DEFAULT_OFFLINE_CHUNK
           ) -> tuple[np.ndarray[Any, np.dtype[np.float32]], StageTimings]:
    """Offline decode of codes [16, T] -> float32 [T * 1920], through the bounded-memory path."""
    cfg = model.cfg
    c = validate_codes(codes, cfg.num_quantizers, cfg.codebook_size)
    sd = StreamingDecoder(model)
    pieces, total = [], StageTimings()
    for start in range(0, c.shape[1], max(1, chunk)):
        audio, tm = sd.push(c[:, start : start + chunk])
        pieces.append(audio)
        total = total + tm
    return np.concatenate(pieces), total
