"""What the front end knows about the served model, read once from the GGUF header at start.

Codebooks, code ids, sample rate and samples per frame come from the decoder's metadata; the
voices, languages, dialects and the instruction rule from the engine's ``VoiceCatalog`` (the
same rules the worker's prompt builder applies). The front end never loads weights.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from engine.talker.prompt import check_text
from engine.talker.voices import VoiceCatalog


@dataclass(frozen=True)
class ModelInfo:
    """The served model's facts (see the module docstring)."""

    path: str
    parts: frozenset[str]
    synthetic: bool
    model_type: str  # as the file says it ("" when absent)
    catalog: VoiceCatalog
    n_codebooks: int
    codebook_size: int  # code ids are 0 .. codebook_size - 1
    sample_rate: int
    samples_per_frame: int
    text_ready: bool  # the engine has a text pipeline for this model
    # engine.clone.voice_file.model_fingerprint (Base models): what a stored voice must match
    voice_fingerprint: str | None = None
    # the talker's text tokenizer (``tokenizers.Tokenizer``), so the token caps are checked
    # before a request queues, as every other cap (None without a talker)
    tokenizer: Any = None

    @classmethod
    def load(cls, path: str) -> ModelInfo:
        """Read the facts of the GGUF at ``path`` (``ModelFileError`` when it cannot serve)."""
        from engine.errors import ModelFileError
        from engine.gguf_model import open_model

        m = open_model(path)
        try:
            dec = m.decoder_config
            if dec is None:
                raise ModelFileError(str(path), "has no decoder part: the service needs one to "
                                     "make audio (convert with the decoder)")
            parts = frozenset(m.parts)
            fingerprint = None
            if m.tts_model_type == "base" and "talker" in parts:
                from engine.clone.voice_file import model_fingerprint

                fingerprint = model_fingerprint(m)  # hashes the talker's norms: small reads
            return cls(
                path=str(path), parts=parts, synthetic=bool(m.synthetic),
                model_type=str(m.tts_model_type or ""), catalog=VoiceCatalog.from_model(m),
                n_codebooks=int(dec.num_quantizers), codebook_size=int(dec.codebook_size),
                sample_rate=int(dec.sample_rate), samples_per_frame=int(dec.upsample_total),
                text_ready="talker" in parts
                and importlib.util.find_spec("engine.pipeline") is not None,
                voice_fingerprint=fingerprint,
                tokenizer=m.tokenizer() if "talker" in parts else None,
            )
        finally:
            m.close()

    def count_tokens(self, field: str, s: str) -> int:
        """Text tokens of ``s``, as the worker's prompt builder counts them (``InputError`` on
        ``field`` if ``s`` is not valid Unicode text)."""
        check_text(field, s)
        return len(self.tokenizer.encode(s).ids) if self.tokenizer is not None else 0

    @property
    def clones(self) -> bool:
        """A Base model with a talker: it speaks cloned voices."""
        return self.voice_fingerprint is not None

    @property
    def has_talker(self) -> bool:
        return "talker" in self.parts

    @property
    def frame_rate(self) -> float:
        """Codec frames per second of audio."""
        return self.sample_rate / self.samples_per_frame

    def frames(self, seconds: float) -> int:
        """Whole codec frames in ``seconds`` of audio."""
        return int(seconds * self.frame_rate)

    @property
    def voices(self) -> list[str]:
        """Voice names a request may use (none without a talker)."""
        return self.catalog.voices if self.has_talker else []

    @property
    def languages(self) -> list[str]:
        """Languages a request may name: "auto" and every non-dialect language."""
        return self.catalog.languages if self.has_talker else []

    @property
    def dialects(self) -> dict[str, str]:
        """Dialect voices -> the dialect they speak for Chinese or "auto"."""
        return dict(self.catalog.dialects) if self.has_talker else {}
