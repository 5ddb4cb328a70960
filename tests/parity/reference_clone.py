"""The official voice-cloning path (``qwen-tts`` 0.1.1) on a ``qtts make-model`` checkpoint.

For parity tests and benchmarks only; ``engine/`` never imports it. ``Qwen3TTSModel`` loads the
checkpoint folder make-model writes (released layout), so both sides read the same weights.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tests.parity import reference as ref


@functools.cache
def load_model(folder: str) -> Any:
    """``Qwen3TTSModel.from_pretrained(folder)`` in float32 on the CPU (cached per folder)."""
    r = ref.import_reference()
    from qwen_tts import Qwen3TTSModel  # type: ignore[import-untyped]

    r.torch.set_num_threads(2)
    return Qwen3TTSModel.from_pretrained(folder, dtype=r.torch.float32)


def x_vector(folder: Path, wav24k: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """``extract_speaker_embedding`` of the reference (24 kHz input)."""
    m = load_model(str(folder))
    out = m.model.extract_speaker_embedding(np.asarray(wav24k, np.float32), 24000)
    return np.asarray(out.float().numpy(), np.float32)


def encode(folder: Path, wav: npt.NDArray[np.float32], sr: int = 24000) -> npt.NDArray[np.int64]:
    """``speech_tokenizer.encode(wav, sr)`` of the reference: codes ``[T, 16]``."""
    m = load_model(str(folder))
    enc = m.model.speech_tokenizer.encode(np.asarray(wav, np.float32), sr=sr)
    return np.asarray(enc.audio_codes[0].numpy(), np.int64)


def _capture(m: Any, call: Any) -> npt.NDArray[np.int32]:
    captured: dict[str, Any] = {}
    inner = m.model.generate

    def gen(*a: Any, **kw: Any) -> Any:
        codes_list, hidden = inner(*a, **kw)
        captured["codes"] = codes_list[0].numpy()
        return codes_list, hidden

    m.model.generate = gen
    try:
        call()
    finally:
        del m.model.generate
    return np.ascontiguousarray(captured["codes"].T, dtype=np.int32)


def design_codes(folder: Path, text: str, instruct: str, language: str, non_streaming: bool,
                 frames: int) -> npt.NDArray[np.int32]:  # fmt: skip
    """Greedy codes ``[16, T]`` of the official ``generate_voice_design``."""
    m = load_model(str(folder))
    return _capture(m, lambda: m.generate_voice_design(
        text=text, instruct=instruct, language=language, non_streaming_mode=non_streaming,
        do_sample=False, subtalker_dosample=False, max_new_tokens=frames + 1))


def custom_codes(folder: Path, text: str, speaker: str, language: str, instruct: str | None,
                 non_streaming: bool, frames: int) -> npt.NDArray[np.int32]:  # fmt: skip
    """Greedy codes ``[16, T]`` of the official ``generate_custom_voice``."""
    m = load_model(str(folder))
    return _capture(m, lambda: m.generate_custom_voice(
        text=text, speaker=speaker, language=language, instruct=instruct,
        non_streaming_mode=non_streaming, do_sample=False, subtalker_dosample=False,
        max_new_tokens=frames + 1))


def clone_codes(folder: Path, wav: npt.NDArray[np.float32], sr: int, text: str, language: str,
                ref_text: str | None, x_vector_only: bool, non_streaming: bool,
                frames: int) -> npt.NDArray[np.int32]:  # fmt: skip
    """Greedy codes ``[16, T]`` of the official ``generate_voice_clone`` (reference part cut)."""
    return clone_speech(folder, wav, sr, text, language, ref_text, x_vector_only, non_streaming,
                        frames)[0]


def clone_speech(folder: Path, wav: npt.NDArray[np.float32], sr: int, text: str, language: str,
                 ref_text: str | None, x_vector_only: bool, non_streaming: bool, frames: int
                 ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]:  # fmt: skip
    """Greedy codes ``[16, T]`` and the 24 kHz audio of the official ``generate_voice_clone``
    (it decodes reference + new codes in one pass and cuts the reference's share)."""
    m = load_model(str(folder))
    captured: dict[str, Any] = {}
    inner = m.model.generate

    def gen(*a: Any, **kw: Any) -> Any:
        codes_list, hidden = inner(*a, **kw)
        captured["codes"] = codes_list[0].numpy()
        return codes_list, hidden

    m.model.generate = gen
    try:
        wavs, _ = m.generate_voice_clone(
            text=text, language=language, ref_audio=(np.asarray(wav, np.float32), sr),
            ref_text=ref_text, x_vector_only_mode=x_vector_only,
            non_streaming_mode=non_streaming, do_sample=False, subtalker_dosample=False,
            max_new_tokens=frames + 1,
        )
    finally:
        del m.model.generate
    return (np.ascontiguousarray(captured["codes"].T, dtype=np.int32),
            np.asarray(wavs[0], dtype=np.float32))
