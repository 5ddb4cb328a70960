"""``VoiceCloner``: reference audio (+ transcript) -> a :class:`VoicePrompt` for one model.

Runs the speaker encoder (x-vector, both modes) and, in ICL mode, the speech-tokenizer encoder
(reference codes), as ``Qwen3TTSModel.create_voice_clone_prompt`` does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from engine.backend import BackendSet
from engine.clone.prompt import VoicePrompt, transcript_ids
from engine.clone.voice_file import model_fingerprint
from engine.codec_encoder.encoder import CodecEncoder
from engine.errors import InputError
from engine.gguf_schema import PART_CODEC_ENCODER, PART_SPEAKER
from engine.speaker.encoder import SpeakerEncoder
from engine.talker.prompt import PromptBuilder


def check_base(model: Any) -> None:
    """``InputError`` unless ``model`` is a Base model with what cloning needs."""
    if model.tts_model_type != "base":
        raise InputError("ref_audio", f"this is a {model.tts_model_type or 'custom_voice'} "
                         "model; only Base models clone voices")  # fmt: skip
    if PART_SPEAKER not in model.parts:
        raise InputError("ref_audio", "this model file has no speaker encoder (converted "
                         "with --parts without speaker_encoder): it can only use stored "
                         "voices (--voice-file)")  # fmt: skip


class VoiceCloner:
    """Makes voice prompts for one Base model; encoders load on first use."""

    def __init__(self, model: Any, backends: BackendSet, builder: PromptBuilder | None = None
                 ) -> None:  # fmt: skip
        check_base(model)
        self.model = model
        self.backends = backends
        self.builder = builder or PromptBuilder(model)
        self._speaker: SpeakerEncoder | None = None
        self._codec: CodecEncoder | None = None
        self._fingerprint: str | None = None

    @property
    def fingerprint(self) -> str:
        """The model's voice fingerprint (computed once)."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model)
        return self._fingerprint

    def load(self) -> None:
        """Load the encoders now (a server's warm-up) instead of at the first voice."""
        if self._speaker is None:
            self._speaker = SpeakerEncoder(self.model, self.backends)
        if self._codec is None and PART_CODEC_ENCODER in self.model.parts:
            self._codec = CodecEncoder(self.model, self.backends)

    def x_vector(self, wav24k: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """The speaker embedding of 24 kHz audio."""
        if self._speaker is None:
            self._speaker = SpeakerEncoder(self.model, self.backends)
        return self._speaker.embed(wav24k)

    def codes(self, wav24k: npt.NDArray[np.float32]) -> npt.NDArray[np.int32]:
        """Reference codes [T, 16] of 24 kHz audio."""
        if PART_CODEC_ENCODER not in self.model.parts:
            raise InputError("ref_text", "this model file has no speech-tokenizer encoder "
                             "(codec_encoder part): only x-vector-only cloning works")  # fmt: skip
        if self._codec is None:
            self._codec = CodecEncoder(self.model, self.backends)
        return self._codec.encode(wav24k)

    def make(self, wav24k: npt.NDArray[np.float32], ref_text: str | None,
             x_vector_only: bool = False) -> VoicePrompt:  # fmt: skip
        """A voice from 24 kHz mono audio; ICL mode unless ``x_vector_only``."""
        ids = None if x_vector_only else transcript_ids(self.builder, ref_text or "")
        codes = None if x_vector_only else self.codes(wav24k)
        return VoicePrompt(
            x_vector=self.x_vector(wav24k),
            ref_codes=codes,
            ref_ids=ids,
            ref_text=None if x_vector_only else ref_text,
            fingerprint=self.fingerprint,
        )

    def close(self) -> None:
        """Free the encoders."""
        if self._speaker is not None:
            self._speaker.close()
            self._speaker = None
        if self._codec is not None:
            self._codec.close()
            self._codec = None
