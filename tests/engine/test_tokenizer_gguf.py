"""The text tokenizer stored in the GGUF equals the HF-style tokenizer built from the files."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from engine.gguf_model import open_model
from engine.gguf_schema import Keys, SchemaError
from engine.tokenizer_gguf import (
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
    build_tokenizer,
    check_tokenizer_arrays,
    read_hf_tokenizer,
)
from engine.tools.make_model import QWEN3_ADDED_TOKENS, write_tokenizer_files

# Written out again here on purpose (not imported), so a typo in the module's copy shows up.
QWEN2_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "multiple\n\nnewlines\r\nand\ttabs   \n",
    "I'm sure they'll say we've done it; HE'S here, isn'T he?",
    "numbers 1234567 and 3.14159, dates 2024-05-17",
    "你好，世界！今天天气很好。",  # noqa: RUF001
    "こんにちは世界 안녕하세요 Привет, мир!",
    "emoji 🎉🚀 and symbols ©®™ ∑∫",
    "<|im_start|>assistant\nHello there<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nSpeak softly, please.<|im_end|>\n",
    "<tts_pad><tts_text_bos>x<tts_text_eod><tts_text_bos_single>",
    "<think></think><tool_call>{}</tool_call><|fim_prefix|>",
    "café vs cafe\u0301 (NFC folds the second)",
    "",
    " ",
    "a" * 300,
    "The quick brown fox jumps over the lazy dog.",
]


def reference_tokenizer(folder: Path) -> Tokenizer:
    """What Qwen2TokenizerFast builds from vocab.json + merges.txt + tokenizer_config.json."""
    tok = Tokenizer(
        models.BPE.from_file(
            str(folder / "vocab.json"),
            str(folder / "merges.txt"),
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    for idx, entry in sorted(cfg["added_tokens_decoder"].items(), key=lambda kv: int(kv[0])):
        added = AddedToken(entry["content"], normalized=False, special=entry["special"])
        if entry["special"]:
            tok.add_special_tokens([added])
        else:
            tok.add_tokens([added])
        assert tok.token_to_id(entry["content"]) == int(idx)  # appended ids match the config
    return tok


def _compare(ours: Tokenizer, ref: Tokenizer) -> None:
    for text in TEXTS:
        a, b = ours.encode(text).ids, ref.encode(text).ids
        assert a == b, text
        assert ours.decode(a, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_gguf_tokenizer_equals_reference(tiny_gguf: Path, tiny_model_dir: Path) -> None:
    with open_model(tiny_gguf) as m:
        ours = m.tokenizer()
        assert m.special_ids is not None
        ids = ours.encode("<|im_start|>assistant\n").ids
        assert len(ids) == 3 and ids[0] == m.special_ids.im_start_token_id
        tail = ours.encode("<|im_end|>\n<|im_start|>assistant\n").ids
        assert len(tail) == 5 and tail[0] == m.special_ids.im_end_token_id
        assert ours.token_to_id("<tts_pad>") == m.special_ids.tts_pad_token_id
        assert ours.encode("<|im_start|>user\n").ids[1] == ours.token_to_id("user")
    _compare(ours, reference_tokenizer(tiny_model_dir))


def test_stored_like_llama_cpp(tiny_gguf: Path, tiny_model_dir: Path) -> None:
    with open_model(tiny_gguf) as m:
        md = m.metadata
    assert md[Keys.TOKENIZER_MODEL] == "gpt2" and md[Keys.TOKENIZER_PRE] == "qwen2"
    tokens, types = md[Keys.TOKENIZER_TOKENS], md[Keys.TOKENIZER_TOKEN_TYPE]
    assert len(tokens) == len(types) == 512
    vocab = json.loads((tiny_model_dir / "vocab.json").read_text())
    for tok, idx in vocab.items():
        assert tokens[idx] == tok and types[idx] == TOKEN_NORMAL
    base = len(vocab)
    for k, (content, special) in enumerate(QWEN3_ADDED_TOKENS):
        assert tokens[base + k] == content
        assert types[base + k] == (TOKEN_CONTROL if special else TOKEN_USER_DEFINED)
    lines = (tiny_model_dir / "merges.txt").read_text().splitlines()[1:]
    assert md[Keys.TOKENIZER_MERGES] == lines
    assert md[Keys.TOKENIZER_EOS_ID] == base + 2  # <|im_end|>
    assert md[Keys.TOKENIZER_PAD_ID] == base  # <|endoftext|>


def test_full_size_vocabulary(tmp_path: Path) -> None:
    special = write_tokenizer_files(tmp_path, 151936)
    assert special == {
        "im_start_token_id": 151644,
        "im_end_token_id": 151645,
        "tts_pad_token_id": 151671,
        "tts_bos_token_id": 151672,
        "tts_eos_token_id": 151673,
    }
    data = read_hf_tokenizer(tmp_path, 151936)
    check_tokenizer_arrays(data.tokens, data.token_types, data.merges, 151936)
    assert data.tokens[151669] == "<|audio_start|>" and data.tokens[151675] == "<|audio_pad|>"
    assert data.token_types[151676] == TOKEN_UNUSED and data.tokens[151935] == "[PAD151935]"
    ours = build_tokenizer(data.tokens, data.token_types, data.merges)
    _compare(ours, reference_tokenizer(tmp_path))


def test_transformers_loads_the_folder(tiny_model_dir: Path, tiny_gguf: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen2TokenizerFast.from_pretrained(str(tiny_model_dir))
    with open_model(tiny_gguf) as m:
        ours = m.tokenizer()
    for text in TEXTS:
        assert hf(text)["input_ids"] == ours.encode(text).ids, text


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: (d / "vocab.json").write_text('{"a": 0, "b": 9999}'),
         "vocab.json token 'b' has id 9999, outside the text vocabulary [0, 512)"),
        (lambda d: (d / "vocab.json").write_text('{"a": 0, "b": 0}'),
         "vocab.json gives id 0 to two tokens"),
        (lambda d: (d / "merges.txt").write_text("#version: 0.2\nabc\n"),
         "merges.txt line 2 is not a merge 'a b': 'abc'"),
        (lambda d: (d / "tokenizer_config.json").write_text("not json"),
         "tokenizer_config.json is not valid JSON"),
        (lambda d: (d / "tokenizer_config.json").write_text(
            '{"added_tokens_decoder": {"0": {"content": "<x>", "special": true}}}'),
         "added token '<x>' reuses id 0 of '!'"),
    ],
)  # fmt: skip
def test_read_hf_tokenizer_refusals(
    tiny_model_dir: Path, tmp_path: Path, edit: object, message: str
) -> None:
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    edit(tmp_path)  # type: ignore[operator]
    with pytest.raises(SchemaError) as info:
        read_hf_tokenizer(tmp_path, 512)
    assert message in str(info.value)
