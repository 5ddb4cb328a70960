"""The speaker encoder's log-mel front end, exactly as the reference computes it.

``mel_spectrogram`` of the reference: reflect-pad ``(n_fft - hop) / 2`` samples each side, STFT
(n_fft 1024, hop 256, periodic Hann 1024, no centring), magnitude ``sqrt(re^2 + im^2 + 1e-9)``,
128 Slaney-normalised mel bands over 0-12 kHz (librosa's filterbank, Slaney mel scale), then
``log(max(x, 1e-5))``. On ggml the STFT is two matrix products with a windowed DFT basis, which
keeps every step in F32.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from engine.ggml import Tensor, lib
from engine.speaker.schema import (
    MEL_FMAX,
    MEL_FMIN,
    MEL_HOP,
    MEL_LOG_CLAMP,
    MEL_MAG_EPS,
    MEL_N_FFT,
    MEL_WIN,
)

F32 = npt.NDArray[np.float32]


def _hz_to_mel(f: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Slaney mel scale (librosa ``htk=False``): linear below 1 kHz, log above."""
    f_sp = 200.0 / 3
    mels = f / f_sp
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = np.log(6.4) / 27.0
    log_part = min_log_mel + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep
    return np.where(f >= min_log_hz, log_part, mels)


def _mel_to_hz(m: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    f_sp = 200.0 / 3
    freqs = f_sp * m
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = np.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), freqs)


def mel_filterbank(sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> F32:
    """``librosa.filters.mel(sr, n_fft, n_mels, fmin, fmax)`` (Slaney norm), ``[n_mels, bins]``."""
    n_bins = n_fft // 2 + 1
    fftfreqs = np.fft.rfftfreq(n_fft, 1.0 / sr)
    mel_f = _mel_to_hz(np.linspace(_hz_to_mel(np.array(fmin)), _hz_to_mel(np.array(fmax)),
                                   n_mels + 2))  # fmt: skip
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fftfreqs[None, :]
    weights = np.zeros((n_mels, n_bins))
    for i in range(n_mels):
        lower = -ramps[i] / fdiff[i]
        upper = ramps[i + 2] / fdiff[i + 1]
        weights[i] = np.maximum(0, np.minimum(lower, upper))
    enorm = 2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels])
    weights *= enorm[:, None]
    return weights.astype(np.float32)


def dft_basis(n_fft: int, win: int) -> tuple[F32, F32]:
    """Windowed real-DFT bases ``(cos, sin)``, each ``[n_fft/2 + 1, n_fft]`` (periodic Hann)."""
    if win != n_fft:
        raise ValueError("the front end uses a window as long as the FFT")
    n = np.arange(n_fft)
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * n / n_fft)  # torch.hann_window(periodic=True)
    k = np.arange(n_fft // 2 + 1)[:, None]
    ang = 2.0 * np.pi * ((k * n[None, :]) % n_fft) / n_fft
    return (np.cos(ang) * window).astype(np.float32), (-np.sin(ang) * window).astype(np.float32)


def frame_count(n_samples: int) -> int:
    """Mel frames for ``n_samples`` of audio (after the reflect padding)."""
    pad = (MEL_N_FFT - MEL_HOP) // 2
    return (n_samples + 2 * pad - MEL_N_FFT) // MEL_HOP + 1


def min_samples() -> int:
    """Fewest samples the front end accepts (reflect padding needs more than the pad)."""
    return MEL_N_FFT // 2 + 1


class MelConstants:
    """The filterbank and DFT bases, computed once per process."""

    def __init__(self, sr: int, n_mels: int) -> None:
        self.mel = mel_filterbank(sr, MEL_N_FFT, n_mels, MEL_FMIN, MEL_FMAX)
        self.cos, self.sin = dft_basis(MEL_N_FFT, MEL_WIN)


def log_mel(ctx: Any, wav: Tensor, cos: Tensor, sin: Tensor, mel: Tensor) -> Tensor:
    """Graph: ``wav`` [1, N] -> log-mel ``[frames, n_mels]`` (time-major, for the network)."""
    pad = (MEL_N_FFT - MEL_HOP) // 2
    n = int(wav.ne[0])
    x = lib.ggml_pad_reflect_1d(ctx, wav, pad, pad)
    n_frames = (n + 2 * pad - MEL_N_FFT) // MEL_HOP + 1
    # frames as columns: im2col with the DFT basis as a 1-channel kernel of n_fft taps
    kernel = lib.ggml_reshape_3d(ctx, cos, MEL_N_FFT, 1, int(cos.ne[1]))
    cols = lib.ggml_im2col(ctx, kernel, x, MEL_HOP, 0, 0, 0, 1, 0, False, lib.GGML_TYPE_F32)
    frames = lib.ggml_reshape_2d(ctx, cols, MEL_N_FFT, n_frames)  # ne [n_fft, frames]
    re = lib.ggml_mul_mat(ctx, cos, frames)  # ne [bins, frames]
    im = lib.ggml_mul_mat(ctx, sin, frames)
    power = lib.ggml_add(ctx, lib.ggml_sqr(ctx, re), lib.ggml_sqr(ctx, im))
    mag = lib.ggml_sqrt(ctx, lib.ggml_scale_bias(ctx, power, 1.0, MEL_MAG_EPS))
    m = lib.ggml_mul_mat(ctx, mel, mag)  # ne [n_mels, frames]: time-major
    return lib.ggml_log(ctx, lib.ggml_clamp(ctx, m, MEL_LOG_CLAMP, 3.0e38))
