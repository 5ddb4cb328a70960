"""Real speech for the voice-cloning tests: Debian's espeak-ng speaks sentences to WAV files.

A speaker encoder or a codec encoder fed noise proves little; espeak-ng (installed by
``make sysdeps``) gives deterministic, speech-like audio with formants, pauses and prosody.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import soundfile as sf
import soxr

SENTENCES = (
    "Hello, this is a short test of voice cloning.",
    "The quick brown fox jumps over the lazy dog, and then it runs away into the forest.",
    "Streaming audio should start quickly; the first chunk matters most.",
)


def espeak_wav(path: Path, text: str, voice: str = "en", speed: int = 160) -> Path:
    """Speak ``text`` into ``path`` (22.05 kHz mono 16-bit WAV); skips the test without it."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        pytest.skip("espeak-ng is not installed (run `make sysdeps`)")
    subprocess.run([exe, "-v", voice, "-s", str(speed), "-w", str(path), text], check=True,
                   capture_output=True)  # fmt: skip
    return path


def speech_24k(tmp: Path, text: str, voice: str = "en") -> npt.NDArray[np.float32]:
    """``text`` spoken by espeak-ng, resampled to 24 kHz mono float32 (soxr, high quality)."""
    wav, sr = sf.read(str(espeak_wav(tmp / "speech.wav", text, voice)), dtype="float32")
    return np.asarray(soxr.resample(wav, sr, 24000, quality="HQ"), dtype=np.float32)
