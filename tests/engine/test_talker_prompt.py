"""The text side: tokenizer from the GGUF and the prompt layout of docs/talker.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.errors import InputError
from engine.gguf_model import open_model
from engine.talker.prompt import PromptBuilder, assistant_text, instruct_text
from engine.talker.voices import instruct_supported


@pytest.fixture(scope="module")
def model(tiny_gguf: Path) -> Any:
    return open_model(tiny_gguf)


@pytest.fixture(scope="module")
def pb(model: Any) -> PromptBuilder:
    return PromptBuilder(model)


def ids(model: Any) -> dict[str, int]:
    t, s = model.talker_config, model.special_ids
    return {
        "pad": t.codec_pad_id, "bos": t.codec_bos_id, "think": t.codec_think_id,
        "nothink": t.codec_nothink_id, "tbos": t.codec_think_bos_id,
        "teos": t.codec_think_eos_id, "PAD": s.tts_pad_token_id, "BOS": s.tts_bos_token_id,
        "EOS": s.tts_eos_token_id,
    }  # fmt: skip


def test_chat_markers_tokenise_as_the_reference_assumes(pb: PromptBuilder) -> None:
    full = pb.encode(assistant_text("Hello world."))
    assert full[:3] == pb.encode("<|im_start|>assistant\n")
    assert len(pb.encode("<|im_start|>assistant\n")) == 3
    assert full[-5:] == pb.encode("<|im_end|>\n<|im_start|>assistant\n")
    assert len(full[-5:]) == 5
    words = full[3:-5]
    assert pb.tokenizer.decode(words) == "Hello world."


def test_non_streaming_layout(pb: PromptBuilder, model: Any) -> None:
    i = ids(model)
    p = pb.build("Hello world.", "Ryan", "English")
    words = pb.encode(assistant_text("Hello world."))[3:-5]
    n = len(words)
    assert p.length == 11 + n  # CustomVoice, language, speaker, full text
    role = pb.encode("<|im_start|>assistant\n")
    codec = [i["think"], i["tbos"], model.languages["english"], i["teos"], model.speakers["ryan"],
             i["pad"]]
    assert p.text_ids.tolist() == role + [i["PAD"]] * 5 + [i["BOS"]] + words + [i["EOS"], i["PAD"]]
    assert p.codec_mask.tolist() == [0.0] * 3 + [1.0] * (8 + n)
    assert p.codec_ids[3:].tolist() == codec + [i["pad"]] * (n + 1) + [i["bos"]]
    assert p.codec_ids[:3].tolist() == [0, 0, 0]
    assert p.trailing_ids.size == 0 and p.n_text_tokens == n and p.pad_id == i["PAD"]
    assert p.voice == "ryan" and p.language == "english" and p.text_mode == "full"


def test_streaming_layout(pb: PromptBuilder, model: Any) -> None:
    i = ids(model)
    p = pb.build("Hello world.", "ryan", "english", text_mode="stream")
    words = pb.encode(assistant_text("Hello world."))[3:-5]
    assert p.length == 10
    assert p.text_ids[-1] == words[0] and p.codec_ids[-1] == i["bos"]
    assert p.trailing_ids.tolist() == [*words[1:], i["EOS"]]


def test_auto_language_uses_nothink(pb: PromptBuilder, model: Any) -> None:
    i = ids(model)
    for lang in (None, "auto", "AUTO", ""):
        p = pb.build("Hi.", "vivian", lang)
        assert p.language == "auto"
        assert p.codec_ids[3:8].tolist() == [i["nothink"], i["tbos"], i["teos"],
                                             model.speakers["vivian"], i["pad"]]
        assert p.text_ids[3:8].tolist() == [i["PAD"]] * 4 + [i["BOS"]]


@pytest.mark.parametrize(("voice", "lang", "expect"), [
    ("eric", "chinese", "sichuan_dialect"),
    ("eric", "auto", "sichuan_dialect"),
    ("dylan", None, "beijing_dialect"),
    ("eric", "english", "english"),
    ("ryan", "chinese", "chinese"),
])
def test_dialect_speakers_map_their_language(pb: PromptBuilder, model: Any, voice: str,
                                             lang: str | None, expect: str) -> None:
    i = ids(model)
    p = pb.build("你好。", voice, lang)
    assert p.codec_ids[3:7].tolist() == [i["think"], i["tbos"], model.languages[expect],
                                         i["teos"]]


def test_instruction_policy(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not instruct_supported("custom_voice", "0b6")
    assert not instruct_supported("custom_voice", "")
    assert instruct_supported("custom_voice", "1b7")
    assert instruct_supported("voice_design", "1b7")
    pb = PromptBuilder(model)
    with pytest.raises(InputError) as err:
        pb.build("Hi.", "ryan", "english", instruct="whisper")
    assert err.value.field == "instruct"
    assert pb.build("Hi.", "ryan", "english", instruct="").instruct is None
    dropped = PromptBuilder(model, ignore_unsupported_instruct=True).build(
        "Hi.", "ryan", "english", instruct="whisper")
    assert dropped.instruct is None
    monkeypatch.setattr(model, "tts_model_size", "1b7")
    big = PromptBuilder(model)
    p = big.build("Hi.", "ryan", "english", instruct="whisper")
    ins = big.encode(instruct_text("whisper"))
    assert p.instruct == "whisper"
    assert p.text_ids[: len(ins)].tolist() == ins
    assert p.codec_mask[: len(ins) + 3].tolist() == [0.0] * (len(ins) + 3)
    assert p.length == len(ins) + pb.build("Hi.", "ryan", "english").length


def test_bad_requests_are_one_line_input_errors(pb: PromptBuilder) -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"text": "hi", "voice": "bob"}, "voice", "aiden, dylan, eric"),
        ({"text": "hi", "voice": None}, "voice", "ryan"),
        ({"text": "hi", "voice": "ryan", "language": "klingon"}, "language", "auto, chinese"),
        ({"text": "hi", "voice": "ryan", "language": "sichuan_dialect"}, "language", "english"),
        ({"text": "   ", "voice": "ryan"}, "text", "empty"),
        ({"text": "\u200b\u0000\u0301", "voice": "ryan"}, "text", "nothing to speak"),
        ({"text": "hi", "voice": "ryan", "text_mode": "fast"}, "text_mode", "full, stream"),
    ]
    for kwargs, field, fragment in cases:
        with pytest.raises(InputError) as err:
            pb.build(**kwargs)
        assert err.value.field == field
        assert fragment in str(err.value) and "\n" not in str(err.value)


def test_voices_and_languages(pb: PromptBuilder) -> None:
    assert pb.voices == sorted(pb.voices) and "ryan" in pb.voices
    assert pb.languages[0] == "auto"
    assert not any("dialect" in x for x in pb.languages)


def test_voice_design_and_base_models(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model, "tts_model_type", "voice_design")
    vd = PromptBuilder(model)
    p = vd.build("Hi.", None, "english", instruct="a calm low voice")
    i = ids(model)
    assert i["pad"] in p.codec_ids.tolist()
    assert not set(model.speakers.values()) & set(p.codec_ids.tolist())
    with pytest.raises(InputError):
        vd.build("Hi.", "ryan", "english")
    monkeypatch.setattr(model, "tts_model_type", "base")
    with pytest.raises(InputError) as err:
        PromptBuilder(model).build("Hi.", "ryan")
    assert err.value.field == "voice"
    assert np.all(np.isin(p.codec_mask, [0.0, 1.0]))
