"""Sampling: the reference's processor order, checked against transformers' own processors."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from engine.errors import InputError, QttsError
from engine.talker.sampling import (
    SamplingParams,
    choose,
    make_rng,
    suppress_mask,
    talker_scores,
    warp,
)

EOS = 2150
VOCAB = 3072
HAVE_HF = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def _logits(seed: int, n: int = VOCAB) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 3).astype(np.float32)


def test_suppress_mask() -> None:
    m = suppress_mask(VOCAB, EOS)
    assert m.sum() == 1023 and not m[EOS] and not m[:2048].any() and m[2048:].sum() == 1023


@pytest.mark.skipif(not HAVE_HF, reason="transformers not installed")
@pytest.mark.parametrize("n_generated", [0, 1, 2, 7])
def test_talker_processors_equal_transformers(n_generated: int) -> None:
    import torch
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SuppressTokensLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = _logits(n_generated)
    logits[EOS] = 4.0
    gen = [5, 17, 5, 2047, 99, 100, 17][:n_generated]
    sup = [i for i in range(VOCAB - 1024, VOCAB) if i != EOS]
    procs = LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(1.05),
        MinNewTokensLengthLogitsProcessor(0, 2, torch.tensor([EOS])),
        SuppressTokensLogitsProcessor(sup),
    ])
    ids = torch.tensor([gen], dtype=torch.long)
    hf = procs(ids, torch.from_numpy(logits.copy())[None])[0].numpy()
    ours = talker_scores(logits, gen, 1.05, 2, EOS, suppress_mask(VOCAB, EOS))
    assert np.array_equal(hf, ours)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(50),
                                TopPLogitsWarper(0.8)])
    hf_w = warpers(ids, torch.from_numpy(hf.copy())[None])[0].numpy()
    ours_w = warp(ours, 0.9, 50, 0.8)
    assert np.array_equal(np.isfinite(hf_w), np.isfinite(ours_w))
    fin = np.isfinite(hf_w)
    assert np.allclose(hf_w[fin], ours_w[fin], rtol=0, atol=1e-6)
    rng = np.random.default_rng(0)
    drawn = {choose(ours, True, 0.9, 50, 0.8, rng) for _ in range(400)}
    assert drawn <= set(np.flatnonzero(fin).tolist()) and len(drawn) >= min(3, int(fin.sum()))


def test_greedy_is_argmax_after_processors() -> None:
    logits = _logits(3)
    logits[EOS] = 100.0
    logits[2500] = 200.0  # suppressed
    supp = suppress_mask(VOCAB, EOS)
    s0 = talker_scores(logits, [], 1.05, 2, EOS, supp)
    assert choose(s0, False, 0.9, 50, 1.0, np.random.default_rng(0)) not in (EOS, 2500)
    s2 = talker_scores(logits, [1, 2], 1.05, 2, EOS, supp)
    assert choose(s2, False, 0.9, 50, 1.0, np.random.default_rng(0)) == EOS


def test_repetition_penalty_direction() -> None:
    logits = np.zeros(VOCAB, np.float32)
    logits[[1, 2]] = [2.0, -2.0]
    s = talker_scores(logits, [1, 2, 2], 2.0, 0, EOS, suppress_mask(VOCAB, EOS))
    assert s[1] == 1.0 and s[2] == -4.0 and s[3] == 0.0


def test_sampling_matches_the_distribution_and_is_seeded() -> None:
    logits = np.log(np.asarray([0.5, 0.3, 0.15, 0.05], np.float32))
    rng = np.random.default_rng(7)
    draws = np.array([choose(logits, True, 1.0, 0, 1.0, rng) for _ in range(20000)])
    freq = np.bincount(draws, minlength=4) / draws.size
    assert np.allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.015)
    top1 = [choose(logits, True, 1.0, 1, 1.0, rng) for _ in range(50)]
    assert set(top1) == {0}
    nucleus = {choose(logits, True, 1.0, 0, 0.7, rng) for _ in range(500)}
    assert nucleus == {0, 1}  # cumulative 0.05+0.15 <= 0.3 removed, then 0.3+... kept
    a = [choose(logits, True, 0.9, 3, 1.0, make_rng(11)[0]) for _ in range(5)]
    b = [choose(logits, True, 0.9, 3, 1.0, make_rng(11)[0]) for _ in range(5)]
    assert a == b


def test_params_from_defaults_and_overrides() -> None:
    class Gen:
        do_sample, temperature, top_k, top_p = True, 0.9, 50, 1.0
        repetition_penalty, min_new_tokens, max_new_tokens = 1.05, 2, 8192
        subtalker_dosample, subtalker_temperature = True, 0.9
        subtalker_top_k, subtalker_top_p = 50, 1.0

    p = SamplingParams.from_defaults(Gen())
    assert p.do_sample and p.top_k == 50 and p.min_new_tokens == 2
    g = p.with_overrides(greedy=True, temperature=None)
    assert not g.do_sample and not g.subtalker_do_sample and g.temperature == 0.9
    assert p.with_overrides(top_k=5).top_k == 5
    for bad in ({"temperature": 0.0}, {"top_p": 1.5}, {"top_k": -1}):
        with pytest.raises(InputError):
            p.with_overrides(**bad)
    seed_rng, seed = make_rng(None)
    assert 0 <= seed < 2**32 and isinstance(seed_rng, np.random.Generator)


def _slow_choose(scores: np.ndarray, t: float, k: int, p: float, rng: np.random.Generator) -> int:
    """The textbook path: warp the whole vocabulary, softmax, inverse-CDF draw."""
    w = warp(scores, t, k, p)
    e = np.exp(w - w.max(), dtype=np.float32)
    probs = (e / e.sum(dtype=np.float32)).astype(np.float64)
    cdf = np.cumsum(probs)
    return min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(w) - 1)


@pytest.mark.parametrize(("t", "k", "p"), [(0.9, 50, 1.0), (1.0, 0, 0.8), (0.7, 30, 0.9),
                                           (1.3, 5000, 1.0)])
def test_fast_draw_equals_full_vocabulary_draw(t: float, k: int, p: float) -> None:
    logits = _logits(11)
    logits[logits > 4] = 4.0  # ties at the top
    scores = talker_scores(logits, [1, 2], 1.05, 2, EOS, suppress_mask(VOCAB, EOS))
    a = [choose(scores, True, t, k, p, r) for r in [np.random.default_rng(5)] for _ in range(300)]
    r2 = np.random.default_rng(5)
    b = [_slow_choose(scores, t, k, p, r2) for _ in range(300)]
    assert a == b


@pytest.mark.parametrize("do_sample", [False, True])
def test_scores_that_are_not_numbers_are_an_error(do_sample: bool) -> None:
    """NaN or +inf scores, or none finite, came from a model whose weights overflow: greedy took
    the first NaN's id (codes of 0), sampling drew among the finite rest or died in numpy."""
    rng = np.random.default_rng(0)
    ok = np.array([0.5, -np.inf, 1.0, 0.2], np.float32)
    assert choose(ok, do_sample, 1.0, 0, 1.0, rng) in (0, 2, 3)
    for bad in ([0.5, np.nan, 1.0, 0.2], [np.nan] * 4, [0.5, np.inf, 1.0, 0.2], [-np.inf] * 4):
        with pytest.raises(QttsError, match="NaN or infinite"):
            choose(np.array(bad, np.float32), do_sample, 1.0, 0, 1.0, rng)
