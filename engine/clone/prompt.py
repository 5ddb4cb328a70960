"""Voice-clone talker prompts, exactly as ``Qwen3TTSForConditionalGeneration.generate`` lays
them out for a Base model.

Positions (``T`` = projected text embedding, ``C`` = talker codec embedding):

1. role ``T(<|im_start|>, assistant, \\n)``;
2. codec prefix as for any model (``[nothink, think_bos, think_eos]`` for "auto", else
   ``[think, think_bos, lang, think_eos]``), then the **x-vector** in the speaker slot, each as
   ``PAD + ...``, then ``BOS + C(pad)``;
3. x-vector-only mode: the text part of a CustomVoice prompt (non-streaming: ``T(w) + C(pad)``
   per token, ``EOS + C(pad)``, ``PAD + C(bos)``; streaming: ``T(w_0) + C(bos)``, the rest
   trailing). ICL mode: text ``ref_ids ++ w ++ [EOS]`` against codec ``[C(bos)] ++
   [sum_q emb_q(ref_code[t, q]) per reference frame]`` -- non-streaming: every text row
   ``+ C(pad)``, then every codec row ``+ PAD``; streaming: rows added pairwise over the codec
   length, surplus text trailing (a shorter text is padded with PAD).

The reference text is tokenised as ``<|im_start|>assistant\\n{ref}<|im_end|>\\n`` and its text
tokens are ``ids[3:-2]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from engine.errors import InputError
from engine.gguf_schema import TalkerConfig
from engine.talker.prompt import (
    ROLE_TOKENS,
    Prompt,
    PromptBuilder,
    PromptRows,
    check_speech,
    check_text,
)
from engine.talker.voices import AUTO

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]
REF_TAIL_TOKENS = 2  # "<|im_end|>", "\n"


def ref_text(text: str) -> str:
    """The string the reference tokenises for a reference transcript."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


@dataclass(frozen=True)
class VoicePrompt:
    """What a cloned voice is made of (a ``.qvoice`` file holds exactly this).

    ``x_vector`` [hidden]; ICL mode also has ``ref_codes`` [T, 16] and ``ref_ids`` (the text
    tokens of the transcript); ``fingerprint`` names the model it was made with.
    """

    x_vector: F32
    ref_codes: I32 | None
    ref_ids: I32 | None
    ref_text: str | None
    fingerprint: str

    @property
    def icl(self) -> bool:
        """In-context mode (reference codes and transcript), else x-vector only."""
        return self.ref_codes is not None


def transcript_ids(builder: PromptBuilder, text: str) -> I32:
    """Text tokens of a reference transcript (``InputError`` on field ``ref_text`` if empty)."""
    if not isinstance(text, str) or not text.strip():
        raise InputError("ref_text", "is empty: in-context cloning needs the transcript of the "
                         "reference audio (or ask for x-vector-only cloning)")  # fmt: skip
    check_speech("ref_text", text)
    check_text("ref_text", text)
    ids = builder.encode(ref_text(text))
    if len(ids) <= ROLE_TOKENS + REF_TAIL_TOKENS:
        raise InputError("ref_text", "tokenises to no text tokens")
    return np.asarray(ids[ROLE_TOKENS:-REF_TAIL_TOKENS], dtype=np.int32)


def live_start_tokens(voice: VoicePrompt) -> int:
    """Stable tokens live text needs before an in-context voice can start: its streaming
    prompt pairs the transcript and the text with the reference frames (and BOS), and a text
    shorter than those would place EOS and PAD there, which says the text is over."""
    if voice.ref_codes is None or voice.ref_ids is None:
        return 1
    return max(1, 1 + len(voice.ref_codes) - len(voice.ref_ids))


def _check_reference(voice: VoicePrompt, cfg: TalkerConfig) -> None:
    # A voice file's transcript ids index the text embedding (out of range: ggml aborts the
    # process), and its reference frames all enter the prompt: both are checked before any work
    assert voice.ref_codes is not None and voice.ref_ids is not None
    ids, vocab = np.asarray(voice.ref_ids), int(cfg.text_vocab_size)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise InputError("voice", f"its transcript ids fall outside the model's 0..{vocab - 1}: "
                         "the voice is damaged")  # fmt: skip
    n = len(voice.ref_codes) + ids.size
    if n > int(cfg.max_position_embeddings):
        raise InputError("voice", f"its reference is {n} positions; the talker holds "
                         f"{cfg.max_position_embeddings}")  # fmt: skip


def build_clone_prompt(
    builder: PromptBuilder,
    voice: VoicePrompt,
    text: str,
    language: str | None,
    text_mode: str,
    frame_embed: Callable[[I32], F32],
    words: Sequence[int] | None = None,
) -> Prompt:
    """The talker prompt of ``text`` spoken in ``voice`` (module docstring for the layout).

    ``frame_embed`` turns reference codes [T, 16] into their talker input rows [T, hidden].
    ``words``: live text (streaming mode only): the stable token ids known so far, in place of
    ``text``; the end of the text is not known, so EOS is left out (the caller feeds it when
    the text ends), and an in-context voice needs at least :func:`live_start_tokens` of them.
    """
    text_open = words is not None
    if words is None:
        words = builder.target_words(text, text_mode)
    elif text_mode != "stream" or not words:
        raise InputError("text", "live text is laid out in streaming mode, from one token on")
    elif len(words) < live_start_tokens(voice):
        raise InputError("text", f"an in-context voice starts from {live_start_tokens(voice)} "
                         "tokens of live text")
    lang = builder.resolve_language(language)
    cfg, sp = builder.cfg, builder.special
    hidden = int(cfg.hidden_size)
    xv = np.asarray(voice.x_vector, dtype=np.float32).reshape(-1)
    if xv.shape[0] != hidden:
        raise InputError("voice", f"x-vector has {xv.shape[0]} values, the model needs {hidden}")
    if voice.icl:
        _check_reference(voice, cfg)
    head = builder.codec_head(None if lang == AUTO else builder.catalog.all_languages[lang])

    rows = PromptRows()
    put = rows.put
    for t in builder.role_ids:
        put(t, None)
    for c in head:
        put(sp.tts_pad_token_id, c)
    put(sp.tts_pad_token_id, None, xv)  # the speaker slot holds the x-vector itself
    put(sp.tts_bos_token_id, cfg.codec_pad_id)
    n_prefix = len(rows)
    trailing: Sequence[int] = []
    ref_codes: I32 | None = None
    if voice.icl:
        assert voice.ref_codes is not None and voice.ref_ids is not None
        ref_codes = np.ascontiguousarray(voice.ref_codes, dtype=np.int32)
        frames = frame_embed(ref_codes)
        ref_ids = [int(t) for t in voice.ref_ids]
        seq = [*ref_ids, *words, sp.tts_eos_token_id]
        codec: list[tuple[int | None, F32 | None]] = [(cfg.codec_bos_id, None)]
        codec += [(None, frames[i]) for i in range(frames.shape[0])]
        if text_mode == "full":
            for t in seq:
                put(t, cfg.codec_pad_id)
            for code, add in codec:
                put(sp.tts_pad_token_id, code, add)
            n_prefix += len(ref_ids)
        else:
            n_c = len(codec)
            padded = seq + [sp.tts_pad_token_id] * max(0, n_c - len(seq))
            for i, (code, add) in enumerate(codec):
                put(padded[i], code, add)
            trailing = seq[n_c:]
            n_prefix += min(len(ref_ids), n_c)
    else:
        trailing = builder.put_target_text(put, words, text_mode)
    if text_open:
        trailing = trailing[:-1]  # EOS
    return rows.to_prompt(trailing, pad_id=sp.tts_pad_token_id, n_text_tokens=len(words),
                          language=lang, text_mode=text_mode, n_prefix=n_prefix,
                          embed_add=rows.embed_add(hidden), ref_codes=ref_codes)
