"""The real Qwen2 vocabulary: make-model's vocab.json + merges.txt tokenize exactly like tiktoken
on the released qwen.tiktoken ranks, through both the `tokenizers` library and the GGUF."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import numpy as np
import pytest

from engine.errors import ConversionError
from engine.tokenizer_gguf import build_tokenizer, read_hf_tokenizer
from engine.tools import qwen_vocab
from engine.tools.make_model import write_tokenizer_files
from tests.engine.test_tokenizer_gguf import QWEN2_REGEX, reference_tokenizer

# Ids every Qwen2-family checkpoint has (its chat template's words): they pin the vocabulary to
# the real one, not merely to a self-consistent one.
KNOWN = {
    "Hello world": [9707, 1879],
    "<|im_start|>system\n": [151644, 8948, 198],
    "<|im_start|>user\n": [151644, 872, 198],
    "<|im_start|>assistant\n": [151644, 77091, 198],
    "<|endoftext|>": [151643],
}

_POOLS = {
    "english": "the quick brown fox jumps over lazy dog speech synthesis stream latency model "
               "Hello World I'm you're they'll we've HE'S isn'T don't",
    "cjk": "你好世界今天天气很好我们语音合成模型流式輸出繁體字測試",
    "kana": "こんにちはカタカナひらがなテストです",
    "hangul": "안녕하세요세계음성합성",
    "khmer": "សួស្តីពិភពលោកខ្មែរភាសា",
    "arabic": "مرحبا بالعالم العربية",
    "devanagari": "नमस्ते दुनिया हिन्दी",
    "cyrillic": "Привет мир Ёжик",
    "thai": "สวัสดีชาวโลก",
    "emoji": ["🎉", "🚀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "🇯🇵", "😀", "🤖", "✨"],
    "digits": "0123456789",
    "space": [" ", "  ", "\t", "\n", "\r\n", "\n\n", "   \n", "\u00a0", "\u3000", " \t "],
    "punct": list(".,;:!?()[]{}<>\"'`~@#$%^&*-_=+/\\|…—–«»“”、。！？"),  # noqa: RUF001
}


def corpus(n: int, seed: int = 0) -> list[str]:
    """``n`` varied strings: script mixes, emoji sequences, digit and whitespace runs, random
    code points (astral too), combining marks, contractions, long repeats."""
    rng = np.random.default_rng(seed)
    names = list(_POOLS)
    out = ["", " ", "a" * 300, "1" * 40, " " * 17, "\n" * 9, "cafe\u0301 café", "x\u200by"]
    while len(out) < n:
        parts = []
        for _ in range(int(rng.integers(1, 12))):
            pool = _POOLS[names[int(rng.integers(len(names)))]]
            kind = int(rng.integers(6))
            if isinstance(pool, str) and " " in pool and kind < 3:
                words = pool.split()
                parts.append(" ".join(words[int(rng.integers(len(words)))]
                                      for _ in range(int(rng.integers(1, 5)))))
            elif kind == 5:  # a random code point, not a surrogate
                cp = int(rng.integers(0x20, 0x2FFFF))
                parts.append(chr(cp) if not 0xD800 <= cp < 0xE000 else "?")
            else:
                k = int(rng.integers(1, 9))
                parts.append("".join(pool[int(rng.integers(len(pool)))] for _ in range(k)))
            if rng.random() < 0.3:
                parts.append(_POOLS["space"][int(rng.integers(10))])
        out.append("".join(parts))
    return out


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """make-model's tokenizer files for the released text vocabulary (151936)."""
    folder = tmp_path_factory.mktemp("qwen_vocab")
    try:
        write_tokenizer_files(folder, 151936)
    except ConversionError as exc:  # offline and never fetched: say how to fetch it
        pytest.skip(f"QWEN2 VOCABULARY NOT AVAILABLE ({exc}): run `make vocab` once online")
    return folder


def test_files_are_the_released_format(qwen_folder: Path) -> None:
    vocab = (qwen_folder / "vocab.json").read_text(encoding="utf-8")
    merges = (qwen_folder / "merges.txt").read_text(encoding="utf-8").split("\n")
    assert merges[0] == "#version: 0.2"
    assert len([m for m in merges[1:] if m]) == qwen_vocab.N_RANKS - 256
    assert merges[1] == "Ġ Ġ" and vocab.startswith('{"!": 0, "\\"": 1')


def test_known_ids(qwen_folder: Path) -> None:
    tok = reference_tokenizer(qwen_folder)
    for text, ids in KNOWN.items():
        assert tok.encode(text).ids == ids, text


def test_tokenizers_and_gguf_equal_tiktoken_on_1200_strings(qwen_folder: Path) -> None:
    tiktoken = pytest.importorskip("tiktoken", reason="tiktoken is in the dev extra")
    enc = tiktoken.Encoding(
        "qwen2", pat_str=QWEN2_REGEX, special_tokens={},
        mergeable_ranks=qwen_vocab.read_ranks(qwen_vocab.tiktoken_path()))
    hf = reference_tokenizer(qwen_folder)
    data = read_hf_tokenizer(qwen_folder, 151936)
    ours = build_tokenizer(data.tokens, data.token_types, data.merges)
    texts = corpus(1200)
    mismatches = []
    for text in texts:
        # Qwen2TokenizerFast normalises NFC before splitting; tiktoken does not
        want = enc.encode_ordinary(unicodedata.normalize("NFC", text))
        if hf.encode(text).ids != want or ours.encode(text).ids != want:
            mismatches.append(text)
    assert not mismatches, f"{len(mismatches)} of {len(texts)} differ, e.g. {mismatches[:3]!r}"
    # the corpus really is varied: long and short, many scripts, astral characters
    assert sum(len(enc.encode_ordinary(t)) for t in texts) > 20_000
    assert any(ord(c) > 0xFFFF for t in texts for c in t)


def test_merges_recovered_from_ranks() -> None:
    ranks = {bytes([b]): b for b in range(256)}
    for tok in (b"ab", b"bc", b"abc", b"abcd"):
        ranks[tok] = len(ranks)
    vocab, merges = qwen_vocab.vocab_and_merges(ranks)
    # "abc": BPE over a, b, c merges "ab" (ranked before "bc") first
    assert merges == [("a", "b"), ("b", "c"), ("ab", "c"), ("abc", "d")]
    assert vocab["abc"] == 258


def test_bad_tiktoken_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.tiktoken"
    bad.write_bytes(b"YQ== 0\nYg== 5\n")
    with pytest.raises(ConversionError, match=r"ranks are not 0\.\.n-1"):
        qwen_vocab.read_ranks(bad)
    bad.write_bytes(b"not-base64!! 0\n")
    with pytest.raises(ConversionError, match="line 1"):
        qwen_vocab.read_ranks(bad)
