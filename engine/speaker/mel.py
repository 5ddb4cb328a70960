"""The speaker encoder's log-mel front end, exactly as the reference computes it.

``mel_spectrogram`` of the reference: reflect-pad ``(n_fft - hop) / 2`` samples each side, STFT
(n_fft 1024, hop 256, periodic Hann 1024, no centring), magnitude ``sqrt(re^2 + im^2 + 1e-9)``,
128 Slaney-normalised mel bands over 0-12 kHz (librosa's filterbank, Slaney mel scale), then
``log(max(x, 1e-5))``. Computed with NumPy in float64 (an FFT); the network runs on ggml.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

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


def hann(n: int) -> npt.NDArray[np.float64]:
    """``torch.hann_window(n, periodic=True)`` in float64."""
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(n) / n)


def frame_count(n_samples: int) -> int:
    """Mel frames for ``n_samples`` of audio (after the reflect padding)."""
    pad = (MEL_N_FFT - MEL_HOP) // 2
    return (n_samples + 2 * pad - MEL_N_FFT) // MEL_HOP + 1


def min_samples() -> int:
    """Fewest samples the front end accepts (reflect padding needs more than the pad)."""
    return MEL_N_FFT // 2 + 1


class MelConstants:
    """The filterbank and window, computed once per process."""

    def __init__(self, sr: int, n_mels: int) -> None:
        if MEL_WIN != MEL_N_FFT:
            raise ValueError("the front end uses a window as long as the FFT")
        self.mel = mel_filterbank(sr, MEL_N_FFT, n_mels, MEL_FMIN, MEL_FMAX).astype(np.float64)
        self.window = hann(MEL_WIN)


# STFT frames per pass: a pass's frames, spectrum and magnitudes stay in the cache (~3 MB in
# float64) where the whole clip's (~23 MB for 10 s) went out to memory and back at every step
FRAMES_PER_PASS = 128


def log_mel(wav: F32, consts: MelConstants) -> F32:
    """``wav`` [N] (N >= ``min_samples()``) -> log-mel ``[frames, n_mels]`` (time-major, for the
    network), by a float64 FFT: the STFT is a few milliseconds this way, against a 2 GFLOP
    windowed-DFT matrix product per 10 s on ggml."""
    pad = (MEL_N_FFT - MEL_HOP) // 2
    x = np.pad(np.asarray(wav, dtype=np.float64), pad, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(x, MEL_N_FFT)[::MEL_HOP]
    out = np.empty((frames.shape[0], consts.mel.shape[0]), dtype=np.float32)
    for a in range(0, frames.shape[0], FRAMES_PER_PASS):
        spec = np.fft.rfft(frames[a:a + FRAMES_PER_PASS] * consts.window, axis=1)
        mag = np.sqrt(spec.real**2 + spec.imag**2 + MEL_MAG_EPS)
        out[a:a + FRAMES_PER_PASS] = np.log(np.maximum(mag @ consts.mel.T, MEL_LOG_CLAMP))
    return out
