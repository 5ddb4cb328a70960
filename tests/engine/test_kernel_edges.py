"""The native kernels at their edges: more threads than work units, 3 to 8 threads (each must
equal the 1-thread result bit for bit), and NaN/Inf inputs (they stay where the maths puts them:
in the outputs that depend on them, and nowhere else)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engine.backend import BackendSet
from tests.engine.test_custom_ops import conv_data, run_conv, run_snake, snake_input, snake_params
from tests.engine.test_gemm_i8 import data as gemm_data
from tests.engine.test_gemm_i8 import run_gemm

pytestmark = pytest.mark.usefixtures("native_ops")


def cpu(threads: int) -> BackendSet:
    return BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": str(threads)})


THREADS = [3, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("c,t", [(96, 1), (100, 2), (96, 37), (1536, 5)])
def test_snake_any_thread_count(cpu1: BackendSet, threads: int, c: int, t: int) -> None:
    rng = np.random.default_rng(threads * 100 + t)
    ea, ib = snake_params(rng, c)
    x = snake_input(rng, t, c)
    assert np.array_equal(run_snake(cpu(threads), x, ea, ib), run_snake(cpu1, x, ea, ib))


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("c_in,c_out,t,d", [(96, 96, 1, 1), (40, 100, 3, 2), (96, 1, 11, 3)])
def test_conv_any_thread_count(cpu1: BackendSet, threads: int, c_in: int, c_out: int, t: int,
                               d: int) -> None:
    xp, w, b = conv_data(np.random.default_rng(threads + t), c_in, c_out, t, 7, d)
    assert np.array_equal(run_conv(cpu(threads), xp, w, b, d), run_conv(cpu1, xp, w, b, d))


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("n,k,t", [(17, 7, 1), (48, 258, 2), (64, 1024, 5)])
def test_gemm_i8_any_thread_count(cpu1: BackendSet, threads: int, n: int, k: int,
                                  t: int) -> None:
    w, x = gemm_data(np.random.default_rng(n + threads), n, k, t)
    assert np.array_equal(run_gemm(cpu(threads), w, x), run_gemm(cpu1, w, x))


BAD = [np.nan, np.inf, -np.inf]


def _poison(x: np.ndarray[Any, Any], where: list[tuple[int, int]]) -> np.ndarray[Any, Any]:
    y = x.copy()
    for i, (r, c) in enumerate(where):
        y[r, c] = BAD[i % len(BAD)]
    return y


def test_snake_non_finite_inputs_stay_put(cpu2: BackendSet) -> None:
    rng = np.random.default_rng(3)
    c, t = 96, 50
    ea, ib = snake_params(rng, c)
    x = snake_input(rng, t, c)
    where = [(0, 0), (7, 50), (49, 95), (20, 3)]
    clean = run_snake(cpu2, x, ea, ib)
    got = run_snake(cpu2, _poison(x, where), ea, ib)
    bad = np.zeros_like(x, dtype=bool)
    for r, col in where:
        bad[r, col] = True
    # x + sin^2(a x) / b: sin of +-Inf is NaN, so every poisoned element gives NaN
    assert np.isnan(got[bad]).all(), got[bad]
    assert np.array_equal(got[~bad], clean[~bad])


def test_conv_non_finite_inputs_reach_only_their_receptive_field(cpu2: BackendSet) -> None:
    c_in, c_out, t, k, d = 96, 40, 60, 7, 2
    xp, w, b = conv_data(np.random.default_rng(4), c_in, c_out, t, k, d)
    clean = run_conv(cpu2, xp, w, b, d)
    for value in BAD:
        x = xp.copy()
        x[30, 5] = value  # padded input row 30 feeds outputs 30 - (k-1)d .. 30
        got = run_conv(cpu2, x, w, b, d)
        hit = np.zeros(t, dtype=bool)
        hit[30 - (k - 1) * d : 31 : d] = True
        assert not np.isfinite(got[hit]).any(), value
        assert np.array_equal(got[~hit], clean[~hit]), value


@pytest.mark.parametrize("value", [
    pytest.param(np.nan, marks=pytest.mark.xfail(strict=True, reason=(
        "known defect: the int8 GEMM quantizes a row holding NaN to finite codes (its absmax "
        "ignores NaN), so the row comes back as plausible numbers; remove this mark when fixed"))),
    np.inf, -np.inf])
def test_gemm_i8_non_finite_rows_stay_in_their_row(cpu2: BackendSet, value: float) -> None:
    n, k, t = 64, 512, 6
    w, x = gemm_data(np.random.default_rng(5), n, k, t)
    clean = run_gemm(cpu2, w, x)
    xx = x.copy()
    xx[2, 100] = value
    got = run_gemm(cpu2, w, xx)
    others = np.arange(t) != 2
    assert np.array_equal(got[others], clean[others]), value
    # the poisoned row must not come back as plausible finite numbers
    assert not np.isfinite(got[2]).all(), (value, got[2][:4])
