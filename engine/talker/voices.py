"""What a request may ask of a model: its voices, languages, dialects and instructions.

Read from the GGUF metadata alone (no tokenizer, no weights), so the service's front end checks
a request with exactly the rules the talker's prompt builder applies, before any queueing.

* Voices: the model's speaker names, lower case. A CustomVoice model needs one; a VoiceDesign
  model has none (the instruction describes the voice); a Base (voice-clone) model has none
  either: it speaks cloned voices (engine/clone), so a named voice is refused.
* Languages: "auto" plus every language that is not a dialect. A dialect (``sichuan_dialect``,
  ``beijing_dialect``) is reached through its speaker (``eric``, ``dylan``) speaking Chinese or
  "auto", as in the reference wrapper; naming it as a language is an ``unknown_language`` error
  that says which voice speaks it.
* Instructions: see :func:`instruct_supported`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.errors import InputError, quoted

AUTO = "auto"


def instruct_supported(model_type: str, model_size: str) -> bool:
    """Whether the model honours style instructions.

    VoiceDesign models always do (the instruction *is* the voice). CustomVoice models do only at
    1.7B: the reference wrapper drops instructions when ``tts_model_size in "0b6"`` (which also
    matches an empty size), and so does this function.
    """
    if model_type == "voice_design":
        return True
    return model_type == "custom_voice" and model_size not in "0b6"


@dataclass(frozen=True)
class VoiceCatalog:
    """The voices, languages and dialects of one model, and the rules a request must follow.

    ``speakers``: name -> codec id; ``all_languages``: name -> codec id, dialects included;
    ``dialects``: speaker -> its dialect's language name.
    """

    speakers: Mapping[str, int]
    all_languages: Mapping[str, int]
    dialects: Mapping[str, str]
    model_type: str = "custom_voice"
    model_size: str = ""

    @classmethod
    def from_model(cls, model: Any) -> VoiceCatalog:
        """The catalog of a ``GgufModel`` (empty for a decoder-only file)."""
        return cls(speakers=dict(model.speakers), all_languages=dict(model.languages),
                   dialects=dict(model.dialects),
                   model_type=model.tts_model_type or "custom_voice",
                   model_size=model.tts_model_size)

    @property
    def voices(self) -> list[str]:
        """Speaker names (lower case), sorted."""
        return sorted(self.speakers)

    @property
    def dialect_languages(self) -> dict[str, list[str]]:
        """Each dialect language -> the voices that speak it."""
        out: dict[str, list[str]] = {}
        for lang in self.all_languages:
            if "dialect" in lang or lang in self.dialects.values():
                out[lang] = sorted(s for s, d in self.dialects.items() if d == lang)
        return out

    @property
    def languages(self) -> list[str]:
        """Languages a request may name: "auto" plus every non-dialect language, sorted."""
        dialects = self.dialect_languages
        return [AUTO, *sorted(n for n in self.all_languages if n not in dialects)]

    @property
    def honours_instruct(self) -> bool:
        """Whether this model uses instructions (see :func:`instruct_supported`)."""
        return instruct_supported(self.model_type, self.model_size)

    def resolve_voice(self, voice: str | None) -> str | None:
        """The lower-cased speaker name, or an ``InputError`` listing the valid ones."""
        if self.model_type == "base":
            raise InputError(
                "voice", "this is a Base (voice-clone) model: it has no named voices; give "
                "reference audio (ref_audio and ref_text) or a cloned voice (its id from "
                "POST /v1/audio/voices; on the command line a .qvoice file)",
                code="unsupported_model")
        if self.model_type == "voice_design":
            if voice:
                raise InputError(
                    "voice", "a VoiceDesign model has no named voices; describe the voice in "
                    "`instruct` instead", code="unknown_voice")
            return None
        if not voice:
            raise InputError("voice", f"is required; choose one of: {', '.join(self.voices)}",
                             code="voice_required")
        return self.named_voice(voice)

    def named_voice(self, voice: str) -> str:
        """``voice`` as one of the model's speakers (lower case), or an ``InputError``; the
        model-type rules of :meth:`resolve_voice` are not applied."""
        name = voice.strip().lower()
        if name not in self.speakers:
            raise InputError(
                "voice", f"unknown voice {quoted(voice)}; choose one of: {', '.join(self.voices)}",
                code="unknown_voice")
        return name

    def resolve_language(self, language: str | None) -> str:
        """The lower-cased language name ("auto" for None), or an ``InputError``."""
        if language is None or not language.strip():
            return AUTO
        name = language.strip().lower()
        if name in self.languages:
            return name
        valid = ", ".join(self.languages)
        speakers = self.dialect_languages.get(name)
        if speakers is not None:
            by = f"voice {', '.join(speakers)}" if speakers else "a dialect voice"
            problem = (f"{quoted(language)} is a dialect, not a language: it is spoken by {by} "
                       f"with language chinese or auto; choose one of: {valid}")
        else:
            problem = f"unknown language {quoted(language)}; choose one of: {valid}"
        raise InputError("language", problem, code="unknown_language")

    def resolve_instruct(self, instruct: str | None, ignore_unsupported: bool = False
                         ) -> str | None:
        """The instruction to use (None for none), or an ``InputError`` if unsupported."""
        if instruct is None or instruct == "":
            return None  # the reference treats an empty instruction as none (also VoiceDesign)
        if not self.honours_instruct:
            if ignore_unsupported:
                return None
            size = self.model_size or "unknown size"
            raise InputError(
                "instruct",
                f"this {self.model_type} model ({size}) does not honour style instructions "
                "(only 1.7B CustomVoice and VoiceDesign models do); omit it",
                code="unsupported_instruct")
        return instruct

    def language_id(self, voice: str | None, language: str) -> int | None:
        """The codec language id of a resolved voice and language (None for "auto" without a
        dialect): a dialect speaker speaking Chinese or "auto" uses its dialect's id."""
        if voice is not None and language in ("chinese", AUTO) and voice in self.dialects:
            return self.all_languages[self.dialects[voice]]
        return None if language == AUTO else self.all_languages[language]
