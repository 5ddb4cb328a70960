"""The decoder driver: offline ``decode`` and the stateful ``StreamingDecoder``.

Each ``push`` runs the five stages as five graphs on the worker's BackendSet (so each stage's
time is measured on its own) and carries every causal history forward. Decoding a whole
utterance is the same code path pushed in bounded chunks, so memory does not grow with length.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
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
# Chunks up to this many frames join other streams' pushes: a short push mostly reads weights,
# which a joint push reads once; a long one is compute, and the joins then cost more than the
# shared reads save (docs/performance.md, Session 23).
JOIN_MAX_FRAMES = 8
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
        return push_together([self], [codes])[0]

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
        x = _features([self], tm, [c])
        _wave([self], tm, np.ascontiguousarray(x[-keep:]), [keep])
        self.frames += c.shape[1]
        return tm

    def _codes(self, codes: Any) -> np.ndarray[Any, np.dtype[np.int32]]:
        cfg = self.model.cfg
        return validate_codes(codes, cfg.num_quantizers, cfg.codebook_size)


def joinable(decoders: Sequence[StreamingDecoder]) -> bool:
    """Whether these streams' pushes can run as one (``push_together`` joins them): one model
    whose audio does not depend on how its frames are pushed (``DecoderModel.chunk_invariant``:
    its CPU kernels, whose rows are summed in an order of their own), no captured taps."""
    model = decoders[0].model
    return (len(decoders) > 1 and model.chunk_invariant
            and len({id(d) for d in decoders}) == len(decoders)
            and all(d.model is model and not d.capture for d in decoders))


def push_together(decoders: Sequence[StreamingDecoder], codes: Sequence[Any]
                  ) -> list[tuple[np.ndarray[Any, np.dtype[np.float32]], StageTimings]]:
    """``push`` of each decoder's next frames. The streams whose chunks are short
    (``JOIN_MAX_FRAMES``) run in one graph per stage when they are ``joinable``: each stream's
    audio and carried state are its own push's bit for bit, and the weights are read once for
    all of them. Each stream's timings are then the joint stages' wall times (what it waited
    for)."""
    cs = [d._codes(c) for d, c in zip(decoders, codes, strict=True)]
    short = [i for i, c in enumerate(cs) if c.shape[1] <= JOIN_MAX_FRAMES]
    if len(short) < 2 or not joinable([decoders[i] for i in short]):
        short = []
    joint = iter(_push_group([decoders[i] for i in short], [cs[i] for i in short]) if short
                 else [])
    return [next(joint) if i in short else _push_group([d], [c])[0]
            for i, (d, c) in enumerate(zip(decoders, cs, strict=True))]


def _push_group(decoders: Sequence[StreamingDecoder], cs: Sequence[np.ndarray[Any, Any]]
                ) -> list[tuple[np.ndarray[Any, np.dtype[np.float32]], StageTimings]]:
    # one stream's push, or several streams' in one graph per stage (checked codes)
    frames = [int(c.shape[1]) for c in cs]
    tm = StageTimings()
    wav = _wave(decoders, tm, _features(decoders, tm, cs), frames)
    model = decoders[0].model
    if model.backends.options.profile:
        tm.report(f"push {'+'.join(map(str, frames))} frame(s)")
    out, start = [], 0
    for d, n in zip(decoders, frames, strict=True):
        d.frames += n
        n_samples = n * model.samples_per_frame
        out.append((wav[start : start + n_samples], tm))
        start += n_samples
    return out


def _features(decoders: Sequence[StreamingDecoder], tm: StageTimings,
              codes: Sequence[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    # quantizer, pre-conv and pre-transformer: [n, C] at the frame rate, the streams joined
    model = decoders[0].model
    w, frames = model.weights, [int(c.shape[1]) for c in codes]
    c = np.ascontiguousarray(np.concatenate(codes, axis=1)) if len(codes) > 1 else codes[0]
    pos = np.concatenate([np.arange(d.frames, d.frames + n, dtype=np.int32)
                          for d, n in zip(decoders, frames, strict=True)])
    x = _stage(decoders, frames, tm, "quant", lambda g: rvq.build(g, w, c.shape[1]), codes=c)
    x = _stage(decoders, frames, tm, "preconv",
               lambda g: pre_conv.build(g, w, g.input("x", x.shape)), x=x)
    inputs = {"x": x, "pos": pos}
    if not model.use_custom_ops:  # ggml's attention reads a mask (one stream: not joinable)
        inputs["mask"] = pre_transformer.attention_mask(decoders[0].frames, frames[0],
                                                        model.cfg.sliding_window)
    return _stage(decoders, frames, tm, "pretr",
                  lambda g: pre_transformer.build(g, w, g.input("x", x.shape)), **inputs)


def _wave(decoders: Sequence[StreamingDecoder], tm: StageTimings, x: np.ndarray[Any, Any],
          frames: Sequence[int]) -> np.ndarray[Any, Any]:
    # upsampler and wave generator: the frames' audio, the streams joined
    w = decoders[0].model.weights
    x = _stage(decoders, frames, tm, "upsample",
               lambda g: upsample.build(g, w, g.input("x", x.shape)), x=x)
    return _stage(decoders, frames, tm, "bigvgan",
                  lambda g: bigvgan.build(g, w, g.input("x", x.shape)), x=x).reshape(-1)


def _stage(decoders: Sequence[StreamingDecoder], frames: Sequence[int], tm: StageTimings,
           name: str, build: Callable[[StageGraph], Tensor], **inputs: np.ndarray[Any, Any]
           ) -> np.ndarray[Any, Any]:
    started = time.perf_counter()
    model, first = decoders[0].model, decoders[0]
    g = StageGraph([d.state for d in decoders], model.use_custom_ops, first.capture,
                   model.backends.max_matmul_rows, frames=frames)
    try:
        g.output(build(g), "y")
        out = model.backends.execute(g, g.uploads(**inputs))
        g.update_state(out)
    finally:
        g.close()
    for key, arr in out.items():
        if key.startswith("tap."):
            # one time step comes back 1-D (ggml drops a trailing 1): [1, C]
            rows = arr.reshape(1, -1) if arr.ndim == 1 else arr.reshape(arr.shape[0], -1)
            first._taps.setdefault(key[4:], []).append(rows)
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
