#!/usr/bin/env python3
"""Fit the polynomial g of native/ops/gelu.c and print its coefficients as the C defines.

``erfc(a) = t * exp(-a^2 + g(t))`` with ``t = 1 / (1 + a/2)``: g is smooth in t over
``a in [0, 10]`` (``t in [1/6, 1]``). Fitted as a degree-9 polynomial in the centred variable
``u = (t - 7/12) * 12/5`` (small coefficients, so float32 Horner loses little), by least squares
on a Chebyshev basis reweighted towards the largest errors (close to minimax), against
``math.erfc`` in float64. Prints the maximum error of the fit over a dense grid.

  python native/fit_gelu.py
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

DEGREE = 9
T_LO, T_HI = 1.0 / 6.0, 1.0  # t over a in [0, 10]


def fit() -> tuple[npt.NDArray[np.float64], float]:
    """g's coefficients in u (lowest degree first) and the fit's maximum error."""
    a = np.linspace(0.0, 10.0, 200001)
    t = 1.0 / (1.0 + 0.5 * a)
    g = np.log(np.array([math.erfc(v) for v in a]) / t) + a * a
    mid, half = (T_LO + T_HI) / 2, (T_HI - T_LO) / 2
    u = (t - mid) / half
    basis = np.polynomial.chebyshev.chebvander(u, DEGREE)
    w = np.ones_like(u)
    for _ in range(30):
        c, *_ = np.linalg.lstsq(basis * w[:, None], g * w, rcond=None)
        err = np.abs(basis @ c - g)
        w = w * (1 + 5 * err / err.max())
        w /= w.mean()
    return np.polynomial.chebyshev.cheb2poly(c), float(err.max())


def main() -> None:
    coef, err = fit()
    for k, v in enumerate(coef):
        print(f"#define GELU_G{k} {v:.9e}f")
    print(f"/* max |fit - g| = {err:.2e} over a in [0, 10] */")


if __name__ == "__main__":
    main()
