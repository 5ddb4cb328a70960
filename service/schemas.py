"""Request bodies of the HTTP API.

Static checks live on the pydantic models (types, ranges; strict types, as the OpenAPI
document says: no ``true`` for a number, ``"1"`` or ``1.5`` for an integer, and text that is
valid Unicode); checks that need the server settings or the model (caps, the codes' shape and
ids, voices, languages, talker) live in ``validation.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    model_validator,
)

FORMATS = ("wav", "pcm", "flac", "mp3", "opus", "aac")
AudioFormat = Literal["wav", "pcm", "flac", "mp3", "opus", "aac"]
# pydantic reports every element that is not an integer, and FastAPI copies every report: a
# 4 MB body of 1M floats held the event loop ~10 s and 1 GB; the first one is enough to answer
_FIRST = Field(fail_fast=True)
Codes = Annotated[list[Annotated[list[StrictInt], _FIRST]], _FIRST] | None


def check_unicode(v: str | None) -> str | None:
    """``v``, or a ValueError where it holds a lone surrogate: JSON may carry one ("\ud800"),
    and no tokenizer, encoder or log takes it."""
    if v is not None:
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"has a lone surrogate U+{ord(v[e.start]):04X} at character "
                             f"{e.start}: not valid Unicode text") from None
    return v


Text = Annotated[str, AfterValidator(check_unicode)]
MIN_TEMPERATURE = 0.01  # the engine's floor (engine.talker.sampling): colder is argmax anyway


class Body(BaseModel):
    """A client's JSON object: ``null`` is a field not sent, and unknown fields are refused by
    the first one's name."""

    @model_validator(mode="before")
    @classmethod
    def _as_sent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            # null takes the field's default, for every field alike: the SDKs send an option
            # given as None/null, and some fields took it while others were a 400
            # (an unknown field is refused whatever its value)
            data = {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        # as with the codes: a body of 300k unknown keys was 300k reports (seconds of the
        # event loop); only the first is kept for ``extra="forbid"`` to name
        if isinstance(data, dict) and cls.model_config.get("extra") == "forbid":
            unknown = next((k for k in data if k not in cls.model_fields), None)
            if unknown is not None:
                return {k: v for k, v in data.items() if k in cls.model_fields or k == unknown}
        return data


class Sampling(Body):
    """Sampling overrides for text requests (capped again by the server settings)."""

    # (NaN and Infinity, which Python's JSON reader takes, were "should be <= 4"; the request
    # models inherit this)
    model_config = ConfigDict(allow_inf_nan=False)

    seed: int | None = Field(default=None, ge=0, le=2**32 - 1, description="random seed")
    temperature: float | None = Field(default=None, ge=MIN_TEMPERATURE,
                                      description="sampling temperature (>= 0.01)")
    top_k: int | None = Field(default=None, ge=1, description="top-k cut")
    top_p: float | None = Field(default=None, gt=0, le=1, description="nucleus cut")
    repetition_penalty: float | None = Field(default=None, ge=1.0, description="≥ 1")


class VoiceRef(Body):
    """A voice by id (OpenAI's ``{"id": "voice_..."}``)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: Text


def _voice_form(v: object) -> object:
    # one error that names both forms (a union reports only its first member's complaint), and
    # the id's own Unicode check here for the same reason
    if isinstance(v, dict) and set(v) == {"id"} and isinstance(v["id"], str):
        check_unicode(v["id"])
        return v
    if v is None or isinstance(v, str | VoiceRef):
        return v
    raise ValueError('must be a voice name or {"id": "<voice id>"}')


Voice = Annotated[Text | VoiceRef | None, BeforeValidator(_voice_form)]


class TTSRequest(Sampling):
    """``POST /tts``: synthesize ``text``, or decode ``codes`` [codebooks, T] (decoder-only use)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: Text | None = Field(default=None, description="text to speak (needs a talker model)")
    codes: Codes = Field(
        default=None, description="codec frames [codebooks][T] (16 rows of ids 0..2047 for "
        "Qwen3-TTS), instead of text"
    )
    voice: Voice = Field(
        default=None, description="speaker name or cloned voice id (GET /v1/audio/voices)")
    language: Text | None = Field(default=None, description="language name, e.g. english")
    instruct: Text | None = Field(default=None, description="style instruction (text requests)")
    format: AudioFormat = Field(default="wav", description="wav | pcm | flac | mp3 | opus | aac")
    stream: bool = Field(default=True, description="chunked streaming (true) or one file; "
                         "flac: one file unless true is sent")
    speed: float = Field(default=1.0, ge=0.25, le=4.0, description="playback speed 0.25..4")
    text_mode: Literal["full", "stream"] | None = Field(
        default=None, description="full: whole text in the prompt; stream: one text token "
        "per frame (what WS /v1/tts/realtime uses); default: stream for a cloned voice (as "
        "the reference clones), full otherwise")
    max_seconds: float | None = Field(default=None, gt=0, description="cap on audio length")
    # one-shot cloning (Base models): a reference that is not stored
    ref_audio: str | None = Field(
        default=None, description="one-shot cloning: reference audio, base64 or a data: URL "
        "of base64 (any format libsndfile or FFmpeg decodes); instead of `voice`")
    ref_text: Text | None = Field(
        default=None, description="transcript of `ref_audio` (in-context cloning; without it "
        "the voice is x-vector only)")
    x_vector_only: bool = Field(default=False, description="ignore `ref_text`")

    @property
    def voice_name(self) -> str | None:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice


class SpeechRequest(Sampling):
    """``POST /v1/audio/speech``: OpenAI's speech request, plus qtts extensions."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Text = Field(description="model id (GET /v1/models); one model is served")
    input: Text = Field(description="text to speak; empty when `codes` is sent")
    voice: Voice = Field(
        default=None, description="voice name or cloned voice id (GET /v1/audio/voices); "
        "required unless `ref_audio` is sent")
    instructions: Text | None = Field(default=None, description="style instruction")
    response_format: AudioFormat = Field(default="mp3", description="mp3|opus|aac|flac|wav|pcm")
    speed: float = Field(default=1.0, ge=0.25, le=4.0, description="0.25..4.0 (time-stretch)")
    stream_format: Literal["audio", "sse"] = Field(default="audio", description="audio | sse")
    # qtts extensions (send with the openai client's extra_body)
    codes: Codes = Field(default=None, description="qtts: frames [codebooks][T]")
    language: Text | None = Field(default=None, description="qtts: language name")
    stream: bool = Field(default=True, description="qtts: false = one file with Content-Length; "
                         "flac: one file unless true is sent")
    max_seconds: float | None = Field(default=None, gt=0, description="qtts: cap on audio")
    ref_audio: str | None = Field(
        default=None, description="qtts, one-shot cloning (Base models): reference audio, "
        "base64 or a data: URL of base64, instead of `voice` (the openai client, which needs "
        "a voice: `voice=\"\"`)")
    ref_text: Text | None = Field(default=None, description="qtts: transcript of `ref_audio`")
    x_vector_only: bool = Field(default=False, description="qtts: ignore `ref_text`")

    @property
    def voice_name(self) -> str | None:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice
