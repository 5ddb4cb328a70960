"""The text side of synthesis: request validation and the talker prompt as ids.

Layout: docs/talker.md, Prompt.

A prompt is described by ids only; the embeddings are computed in the prefill graph, because the
text embedding table (151936 x 2048) and the text projection live with the weights. Every
prefill position is ``T(text_ids[i]) + codec_mask[i] * C(codec_ids[i])`` where ``T`` is the text
projection of a text-vocabulary embedding and ``C`` the talker codec embedding. (Every position of
the reference prompt has a text term; only the instruction and role positions lack a codec term.)

Layout, exactly as ``Qwen3TTSForConditionalGeneration.generate`` builds it:

1. instruction (if any): ``T(ids of "<|im_start|>user\\n{instruct}<|im_end|>\\n")``;
2. role: ``T(ids[0:3])`` of the target string
   ``"<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n"``
   (the reference slices by position: ``ids[3:-5]`` are the text tokens ``w``);
3. codec prefix ``p`` = ``[nothink, think_bos, think_eos]`` for language "auto", else
   ``[think, think_bos, lang, think_eos]``; then the speaker id (CustomVoice); then ``[pad, bos]``.
   Positions ``PAD + C(p_j)`` for all but the last two elements, then ``BOS + C(pad)``;
4. text: non-streaming ("full"): ``T(w_i) + C(pad)`` for every token, ``EOS + C(pad)``,
   ``PAD + C(bos)``, and the trailing text is empty (PAD forever). Streaming ("stream"):
   ``T(w_0) + C(bos)`` and the trailing text is ``[w_1 .. w_{n-1}, EOS]``, one per frame.

A dialect speaker (``eric`` -> sichuan_dialect, ``dylan`` -> beijing_dialect) speaking Chinese or
"auto" uses the dialect's language id. The voice, language and instruction rules live in
engine/talker/voices.py (``VoiceCatalog``), which the service's front end applies too.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from engine.errors import InputError
from engine.talker.voices import VoiceCatalog

TextMode = Literal["full", "stream"]
TEXT_MODES: tuple[str, ...] = ("full", "stream")


def default_text_mode(cloned: bool) -> str:
    """The text mode of a request that names none: the reference's default for its kind.
    ``generate_voice_clone`` lays the text out streaming (``non_streaming_mode=False``), which
    also lets an in-context voice's prefix run through its transcript; ``generate_custom_voice``
    and ``generate_voice_design`` put the whole text in the prompt."""
    return "stream" if cloned else "full"

# The reference relies on these token counts; they hold for the Qwen2 tokenizer.
ROLE_TOKENS = 3  # "<|im_start|>", "assistant", "\n"
TAIL_TOKENS = 5  # "<|im_end|>", "\n", "<|im_start|>", "assistant", "\n"


def assistant_text(text: str) -> str:
    """The string the reference tokenises for the target text."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def instruct_text(instruct: str) -> str:
    """The string the reference tokenises for an instruction."""
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


@dataclass(frozen=True)
class Prompt:
    """A talker prompt as ids (see the module docstring for the layout).

    ``text_ids`` / ``codec_ids`` / ``codec_mask`` have one entry per prefill position;
    ``codec_ids`` holds 0 where ``codec_mask`` is 0. ``trailing_ids`` are the text ids added
    to the talker input of generated frames 0, 1, ... (then ``pad_id``). ``n_text_tokens`` is the
    number of target-text tokens (the frame-budget formula uses it). The first ``n_prefix``
    positions (instruction, role, codec prefix, speaker) do not depend on the target text, so
    their KV rows can be reused by the next request with the same prefix.
    """

    text_ids: npt.NDArray[np.int32]
    codec_ids: npt.NDArray[np.int32]
    codec_mask: npt.NDArray[np.float32]
    trailing_ids: npt.NDArray[np.int32]
    pad_id: int
    n_text_tokens: int
    voice: str | None
    language: str
    text_mode: str
    instruct: str | None
    n_prefix: int = 0
    # Voice cloning (Base models): rows added to the prefill embeddings ([L, hidden]; the
    # x-vector at the speaker slot, the summed reference-code embeddings at ICL codec
    # positions), and the reference codes [T_ref, 16] the decoder is primed with.
    embed_add: npt.NDArray[np.float32] | None = None
    ref_codes: npt.NDArray[np.int32] | None = None

    @property
    def length(self) -> int:
        """Number of prefill positions."""
        return int(self.text_ids.shape[0])


class PromptRows:
    """The prefill positions of a prompt as they are laid out, one :meth:`put` each (shared by
    the built-in voices here and the cloned voices in engine/clone/prompt.py)."""

    def __init__(self) -> None:
        self.text_ids: list[int] = []
        self.codec_ids: list[int] = []
        self.mask: list[float] = []
        self.adds: dict[int, npt.NDArray[np.float32]] = {}

    def __len__(self) -> int:
        return len(self.text_ids)

    def put(self, t: int, c: int | None, add: npt.NDArray[np.float32] | None = None) -> None:
        """One position: text id ``t``, codec id ``c`` (None: no codec term) and an optional
        row added to its embedding."""
        if add is not None:
            self.adds[len(self.text_ids)] = add
        self.text_ids.append(t)
        self.codec_ids.append(0 if c is None else c)
        self.mask.append(0.0 if c is None else 1.0)

    def embed_add(self, hidden: int) -> npt.NDArray[np.float32]:
        """The added rows as a [positions, hidden] array (zero where nothing was added)."""
        out = np.zeros((len(self.text_ids), hidden), dtype=np.float32)
        for i, row in self.adds.items():
            out[i] = row
        return out

    def to_prompt(self, trailing: Sequence[int], *, pad_id: int, n_text_tokens: int,
                  language: str, text_mode: str, n_prefix: int, voice: str | None = None,
                  instruct: str | None = None, embed_add: npt.NDArray[np.float32] | None = None,
                  ref_codes: npt.NDArray[np.int32] | None = None) -> Prompt:
        """The :class:`Prompt` of these positions and ``trailing`` text ids."""
        return Prompt(
            text_ids=np.asarray(self.text_ids, dtype=np.int32),
            codec_ids=np.asarray(self.codec_ids, dtype=np.int32),
            codec_mask=np.asarray(self.mask, dtype=np.float32),
            trailing_ids=np.asarray(trailing, dtype=np.int32),
            pad_id=pad_id,
            n_text_tokens=n_text_tokens,
            voice=voice,
            language=language,
            text_mode=text_mode,
            instruct=instruct,
            n_prefix=n_prefix,
            embed_add=embed_add,
            ref_codes=ref_codes,
        )


def check_text(field: str, s: str) -> None:
    """``InputError`` on ``field`` unless ``s`` can be UTF-8 encoded (a lone surrogate cannot:
    JSON's ``"\\ud800"`` escape decodes to one, and the tokenizer refuses it)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(field, f"has a lone surrogate U+{ord(s[e.start]):04X} at character "
                         f"{e.start}: not valid Unicode text") from None


NOTHING_TO_SPEAK = "has nothing to speak: only control, invisible or combining characters"


def has_speech(s: str) -> bool:
    """Whether ``s`` has a character to speak: a letter, digit, punctuation mark or symbol. Text
    of spaces, control characters (NUL, escapes), invisible ones (zero-width, BOM) or lone
    combining marks has none; the model would make seconds of sound from its tokens."""
    return any(unicodedata.category(c)[0] in "LNPS" for c in s)


def check_speech(field: str, s: str) -> None:
    """``InputError`` on ``field`` for text with nothing to speak (see :func:`has_speech`)."""
    if not s.strip():
        raise InputError(field, "is empty", code="empty")
    if not has_speech(s):
        raise InputError(field, NOTHING_TO_SPEAK, code="empty")


class PromptBuilder:
    """Validates a request's text/voice/language/instruction and builds its :class:`Prompt`.

    ``model`` is a validated ``GgufModel`` with the talker part (its tokenizer, special ids,
    voices and languages are read from the file). ``ignore_unsupported_instruct``: by default an
    instruction sent to a model that does not honour it is an ``InputError`` on field
    ``instruct`` (a 4xx); with True it is dropped silently, as the reference wrapper does.
    """

    def __init__(self, model: Any, ignore_unsupported_instruct: bool = False) -> None:
        model.require("talker")
        self.tokenizer = model.tokenizer()
        self.cfg = model.talker_config
        self.special = model.special_ids
        self.catalog = VoiceCatalog.from_model(model)
        self.speakers: dict[str, int] = dict(model.speakers)
        self.model_type: str = self.catalog.model_type
        self.model_size: str = self.catalog.model_size
        self.ignore_unsupported_instruct = ignore_unsupported_instruct
        self.role_ids = self.encode("<|im_start|>assistant\n")

    # -- what a request may ask for (the rules live in engine/talker/voices.py) -------------

    @property
    def languages(self) -> list[str]:
        """Languages a request may name: "auto" plus every non-dialect language of the model.

        Dialects are reached through their speakers, as in the reference wrapper.
        """
        return self.catalog.languages

    @property
    def voices(self) -> list[str]:
        """Speaker names (lower case), sorted."""
        return self.catalog.voices

    @property
    def honours_instruct(self) -> bool:
        """Whether this model uses instructions (see :func:`instruct_supported`)."""
        return self.catalog.honours_instruct

    def encode(self, s: str) -> list[int]:
        """Token ids of ``s`` (no BOS is ever added: the Qwen2 tokenizer has none)."""
        return list(self.tokenizer.encode(s).ids)

    def offsets(self, field: str, s: str) -> list[tuple[int, int]]:
        """(start, end) character spans of the tokens of ``s`` alone; ``InputError`` on
        ``field`` if ``s`` is not valid Unicode text."""
        check_text(field, s)
        return [(int(a), int(b)) for a, b in self.tokenizer.encode(s).offsets]

    def resolve_voice(self, voice: str | None) -> str | None:
        """The lower-cased speaker name, or an ``InputError`` listing the valid ones."""
        return self.catalog.resolve_voice(voice)

    def resolve_language(self, language: str | None) -> str:
        """The lower-cased language name ("auto" for None), or an ``InputError``."""
        return self.catalog.resolve_language(language)

    def resolve_instruct(self, instruct: str | None) -> str | None:
        """The instruction to use (None for none), or an ``InputError`` if unsupported."""
        return self.catalog.resolve_instruct(instruct, self.ignore_unsupported_instruct)

    # -- the pieces every prompt shares (CustomVoice and VoiceDesign here, cloned voices in
    # engine/clone/prompt.py) ---------------------------------------------------------------

    def target_words(self, text: str, text_mode: str) -> list[int]:
        """The text tokens of the text to speak, or an ``InputError`` (on ``text`` or
        ``text_mode``)."""
        if not isinstance(text, str):
            raise InputError("text", "is empty")
        check_speech("text", text)
        check_text("text", text)
        if text_mode not in TEXT_MODES:
            raise InputError(
                "text_mode", f"must be one of {', '.join(TEXT_MODES)}, got {text_mode!r}"
            )
        ids = self.encode(assistant_text(text))
        if len(ids) <= ROLE_TOKENS + TAIL_TOKENS or ids[:ROLE_TOKENS] != self.role_ids:
            # Cannot happen with a Qwen2 tokenizer; a foreign tokenizer would break the slicing.
            raise InputError("text", "tokenises to no text tokens between the chat markers")
        return ids[ROLE_TOKENS:-TAIL_TOKENS]

    def codec_head(self, lang_id: int | None) -> list[int]:
        """The codec ids that open every prompt: no-think for "auto", else think + language."""
        cfg = self.cfg
        if lang_id is None:
            return [cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id]
        return [cfg.codec_think_id, cfg.codec_think_bos_id, lang_id, cfg.codec_think_eos_id]

    def put_target_text(self, put: Callable[[int, int | None], None], words: Sequence[int],
                        text_mode: str) -> list[int]:
        """Lay out the text to speak after the codec prefix; return the trailing text ids.

        Non-streaming: every token + C(pad), EOS + C(pad), PAD + C(bos), nothing trailing.
        Streaming: the first token + C(bos); the rest and EOS trail (one per frame).
        """
        cfg, sp = self.cfg, self.special
        if text_mode == "full":
            for w in words:
                put(w, cfg.codec_pad_id)
            put(sp.tts_eos_token_id, cfg.codec_pad_id)
            put(sp.tts_pad_token_id, cfg.codec_bos_id)
            return []
        put(words[0], cfg.codec_bos_id)
        return [*words[1:], sp.tts_eos_token_id]

    # -- the prompt -------------------------------------------------------------------------

    def build(
        self,
        text: str,
        voice: str | None = None,
        language: str | None = None,
        instruct: str | None = None,
        text_mode: str = "full",
    ) -> Prompt:
        """Validate the request fields and lay out the prompt (module docstring)."""
        if instruct is not None:
            check_text("instruct", instruct)
        words = self.target_words(text, text_mode)
        spk = self.resolve_voice(voice)
        lang = self.resolve_language(language)
        ins = self.resolve_instruct(instruct)
        cfg, sp = self.cfg, self.special

        prefix = self.codec_head(self.catalog.language_id(spk, lang))
        if spk is not None:
            prefix.append(self.speakers[spk])
        prefix += [cfg.codec_pad_id, cfg.codec_bos_id]

        rows = PromptRows()
        put = rows.put
        if ins is not None:
            for t in self.encode(instruct_text(ins)):
                put(t, None)
        for t in self.role_ids:
            put(t, None)
        for j, c in enumerate(prefix[:-1]):
            put(sp.tts_bos_token_id if j == len(prefix) - 2 else sp.tts_pad_token_id, c)
        n_prefix = len(rows)
        trailing = self.put_target_text(put, words, text_mode)
        return rows.to_prompt(trailing, pad_id=sp.tts_pad_token_id, n_text_tokens=len(words),
                              language=lang, text_mode=text_mode, n_prefix=n_prefix,
                              voice=spk, instruct=ins)
