"""Token sampling in numpy, in exactly the order of the reference's HF ``generate``.

Order: docs/architecture.md, Sampling.

Talker (codebook 0, vocabulary 3072), processors then warpers, as transformers 4.57 applies them:

1. repetition penalty over the codebook-0 ids generated so far (positive logits / p, negative * p);
2. EOS masked (-inf) while fewer than ``min_new_tokens`` tokens were generated;
3. suppression (-inf) of every id in ``[vocab - 1024, vocab)`` except EOS (only codes and EOS
   can be drawn);
4. sampling only: temperature, top-k (ties with the k-th value kept), top-p (only if < 1),
   softmax, one multinomial draw. Greedy = argmax after steps 1-3 (first index on ties).

Code predictor (codebooks 1..15, vocabulary 2048): no penalty, no suppression; its own
temperature / top-k / top-p, or greedy.

Draws use one seeded ``numpy.random.Generator`` per request (an inverse-CDF draw from a uniform
double), so a request with a seed is reproducible; it cannot reproduce torch's RNG stream.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.errors import InputError, QttsError
from engine.gguf_schema import GenerationDefaults

F32 = npt.NDArray[np.float32]
NEG_INF = np.float32(-np.inf)
_SPEC = GenerationDefaults()
# Logits are divided by the temperature in float32: below this, scores overflow to inf and the
# softmax is NaN (1e-45 did); sampling this cold is argmax anyway.
MIN_TEMPERATURE = 0.01


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (defaults come from the GGUF's generation config)."""

    # defaults: the released generation_config values, kept in one place (GenerationDefaults)
    do_sample: bool = _SPEC.do_sample
    temperature: float = _SPEC.temperature
    top_k: int = _SPEC.top_k
    top_p: float = _SPEC.top_p
    repetition_penalty: float = _SPEC.repetition_penalty
    min_new_tokens: int = _SPEC.min_new_tokens
    subtalker_do_sample: bool = _SPEC.subtalker_dosample
    subtalker_temperature: float = _SPEC.subtalker_temperature
    subtalker_top_k: int = _SPEC.subtalker_top_k
    subtalker_top_p: float = _SPEC.subtalker_top_p

    @classmethod
    def from_defaults(cls, gen: Any) -> SamplingParams:
        """From a ``GenerationDefaults`` (the GGUF's ``generation_config``)."""
        return cls(
            do_sample=bool(gen.do_sample),
            temperature=float(gen.temperature),
            top_k=int(gen.top_k),
            top_p=float(gen.top_p),
            repetition_penalty=float(gen.repetition_penalty),
            min_new_tokens=int(gen.min_new_tokens),
            subtalker_do_sample=bool(gen.subtalker_dosample),
            subtalker_temperature=float(gen.subtalker_temperature),
            subtalker_top_k=int(gen.subtalker_top_k),
            subtalker_top_p=float(gen.subtalker_top_p),
        )

    def greedy(self) -> SamplingParams:
        """The same settings with argmax decoding for both the talker and the code predictor."""
        return replace(self, do_sample=False, subtalker_do_sample=False)

    def with_overrides(self, **overrides: Any) -> SamplingParams:
        """Override fields whose value is not None, validating each (``InputError`` on a bad one).

        Accepted names: the field names, plus ``greedy`` (True = both greedy).
        """
        values: dict[str, Any] = {}
        for name, value in overrides.items():
            if value is None:
                continue
            if name == "greedy":
                if value:
                    values.update(do_sample=False, subtalker_do_sample=False)
                continue
            if name not in self.__dataclass_fields__:
                raise InputError(name, "is not a sampling setting")
            values[name] = value
        out = replace(self, **values)
        out.validate()
        return out

    def validate(self) -> None:
        """Raise ``InputError`` on an out-of-range value."""
        for name in ("temperature", "subtalker_temperature"):
            v = getattr(self, name)
            if not (np.isfinite(v) and v >= MIN_TEMPERATURE):
                raise InputError(name, f"must be >= {MIN_TEMPERATURE} (lower is greedy in "
                                 f"effect), got {v}")
        for name in ("top_p", "subtalker_top_p"):
            v = getattr(self, name)
            if not (np.isfinite(v) and 0 < v <= 1):
                raise InputError(name, f"must be in (0, 1], got {v}")
        for name in ("top_k", "subtalker_top_k", "min_new_tokens"):
            v = getattr(self, name)
            if int(v) != v or v < 0:
                raise InputError(name, f"must be an integer >= 0, got {v}")
        if not (np.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InputError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")


def suppress_mask(vocab_size: int, eos_id: int) -> npt.NDArray[np.bool_]:
    """True for the talker ids the reference suppresses: ``[vocab-1024, vocab)`` minus EOS."""
    mask = np.zeros(vocab_size, dtype=np.bool_)
    mask[max(0, vocab_size - 1024) :] = True
    mask[eos_id] = False
    return mask


def talker_scores(
    logits: F32,
    generated: npt.NDArray[np.int64] | list[int],
    penalty: float,
    min_new_tokens: int,
    eos_id: int,
    suppressed: npt.NDArray[np.bool_],
) -> F32:
    """Steps 1-3 of the module docstring on a copy of ``logits`` (float32 [vocab])."""
    scores = np.array(logits, dtype=np.float32, copy=True)
    if penalty != 1.0 and len(generated):
        ids = np.unique(np.asarray(generated, dtype=np.int64))
        s = scores[ids]
        p = np.float32(penalty)
        scores[ids] = np.where(s < 0, s * p, s / p)
    if len(generated) < min_new_tokens:
        scores[eos_id] = NEG_INF
    scores[suppressed] = NEG_INF
    return scores


def warp(scores: F32, temperature: float, top_k: int, top_p: float) -> F32:
    """Temperature, then top-k (ties with the k-th value kept), then top-p if < 1 (HF order)."""
    s = np.array(scores, dtype=np.float32, copy=True)
    if temperature != 1.0:
        s = s / np.float32(temperature)
    n = s.shape[0]
    if top_k:
        k = min(max(int(top_k), 1), n)
        kth = np.partition(s, n - k)[n - k]
        s[s < kth] = NEG_INF
    if top_p < 1.0:
        order = np.argsort(s, kind="stable")  # ascending, like torch.sort(descending=False)
        probs = _softmax(s[order])
        cum = np.cumsum(probs, dtype=np.float32)
        remove = cum <= np.float32(1.0 - top_p)
        remove[-1] = False  # min_tokens_to_keep = 1
        s[order[remove]] = NEG_INF
    return s


def choose(
    scores: F32,
    do_sample: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    rng: np.random.Generator,
) -> int:
    """Greedy argmax, or ``warp`` -> softmax -> one inverse-CDF draw from ``rng``.

    The draw works on the surviving candidates only (finite after suppression, top-k, top-p),
    in ascending id order: the same distribution and, for a given ``rng`` state, the same id as
    drawing over the whole vocabulary with masked entries at probability 0 (zeros change
    neither the running sums nor the order); tested against that textbook path.

    Scores with a NaN or +inf, or with no finite one, are the model's fault (weights that
    overflow float32): an error, not a code (argmax took the first NaN, the draw dropped them
    and drew among the rest, or found nothing to draw from).
    """
    s = np.asarray(scores, dtype=np.float32)
    if not (np.all(s < np.inf) and np.any(s > -np.inf)):
        raise QttsError("the model computed scores that are NaN or infinite (weights that "
                        "overflow float32?)")
    if not do_sample:
        return int(np.argmax(s))
    if temperature != 1.0:
        s = s / np.float32(temperature)
    ids = np.flatnonzero(np.isfinite(s))
    s = s[ids]
    n = s.shape[0]
    if top_k and top_k < n:
        kth = np.partition(s, n - top_k)[n - top_k]
        keep = s >= kth  # ties with the k-th value stay, as in HF's TopKLogitsWarper
        ids, s = ids[keep], s[keep]
    if top_p < 1.0:
        order = np.argsort(s, kind="stable")
        cum = np.cumsum(_softmax(s[order]), dtype=np.float32)
        remove = cum <= np.float32(1.0 - top_p)
        remove[-1] = False
        keep_sorted = np.sort(order[~remove])
        ids, s = ids[keep_sorted], s[keep_sorted]
    probs = _softmax(s).astype(np.float64)
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    j = min(int(np.searchsorted(cdf, u, side="right")), int(probs.shape[0]) - 1)
    while probs[j] == 0.0 and j > 0:  # never land on a zero-probability id through rounding
        j -= 1
    return int(ids[j])


def _softmax(s: F32) -> F32:
    m = np.max(s)
    e = np.exp(s - m, dtype=np.float32)
    out: F32 = e / np.sum(e, dtype=np.float32)
    return out


def make_rng(seed: int | None) -> tuple[np.random.Generator, int]:
    """A request's generator and the seed it uses (a fresh one when ``seed`` is None)."""
    if seed is None:
        seed = int(np.random.SeedSequence().entropy % (1 << 32))  # type: ignore[operator]
    if not 0 <= int(seed) < 1 << 64:
        raise InputError("seed", f"must be in [0, 2^64), got {seed}")
    return np.random.default_rng(int(seed)), int(seed)
