"""The Qwen2 byte-level BPE text tokenizer: read it from HF files, store it in a GGUF, rebuild it.

Storage follows llama.cpp for Qwen2 models: ``tokenizer.ggml.model = "gpt2"``,
``tokenizer.ggml.pre = "qwen2"``, ``tokenizer.ggml.tokens`` (one string per id, the full text
vocabulary; ids no file names are ``[PAD{id}]`` of type UNUSED), ``tokenizer.ggml.token_type``
(NORMAL = BPE vocabulary, CONTROL = special added token, USER_DEFINED = non-special added token,
UNUSED = gap) and ``tokenizer.ggml.merges`` (``"a b"`` strings, in rank order).

``build_tokenizer`` turns those arrays back into a ``tokenizers.Tokenizer`` configured exactly as
transformers' ``Qwen2TokenizerFast`` is when built from ``vocab.json`` + ``merges.txt``: NFC
normaliser, the Qwen2 split regex, byte-level mapping without prefix space, byte-level decoder;
added tokens are matched before BPE and keep their ids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from engine.gguf_schema import Keys, SchemaError

# llama.cpp token types (gguf.TokenType)
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
_KNOWN_TYPES = frozenset({1, 2, 3, 4, 5, 6})

TOKENIZER_MODEL = "gpt2"
TOKENIZER_PRE = "qwen2"

QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE alphabet)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def qwen2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """The Qwen2 pre-tokenizer: regex split, then byte-level mapping (no prefix space)."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@dataclass
class TokenizerData:
    """The tokenizer as stored in a GGUF (parallel arrays indexed by token id)."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    eos_token_id: int | None = None
    pad_token_id: int | None = None


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SchemaError(f"{path.name} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SchemaError(f"{path.name} is not valid JSON ({exc})") from None


def read_merges(path: Path) -> list[str]:
    """Merges from a ``merges.txt`` as ``"a b"`` strings (header and blank lines skipped)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SchemaError(f"{path.name} is missing") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SchemaError(f"{path.name} cannot be read ({exc})") from None
    merges: list[str] = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not line or (lineno == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise SchemaError(f"{path.name} line {lineno} is not a merge 'a b': {line[:60]!r}")
        merges.append(line)
    return merges


def read_hf_tokenizer(folder: Path, vocab_size: int) -> TokenizerData:
    """Read ``vocab.json``, ``merges.txt`` and ``tokenizer_config.json`` of a Qwen2 tokenizer.

    The result has exactly ``vocab_size`` entries (the talker's text-embedding rows); ids that
    no file names become ``[PAD{id}]`` / UNUSED. Raises ``SchemaError`` on any inconsistency.
    """
    vocab = _load_json(folder / "vocab.json")
    if not isinstance(vocab, dict) or not vocab:
        raise SchemaError("vocab.json is not a non-empty object of token -> id")
    merges = read_merges(folder / "merges.txt")
    cfg = _load_json(folder / "tokenizer_config.json")
    if not isinstance(cfg, dict):
        raise SchemaError("tokenizer_config.json is not an object")
    tokens: list[str | None] = [None] * vocab_size
    types = [TOKEN_UNUSED] * vocab_size
    for tok, idx in vocab.items():
        if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < vocab_size:
            raise SchemaError(
                f"vocab.json token {tok!r} has id {idx!r}, outside the text vocabulary "
                f"[0, {vocab_size})"
            )
        if tokens[idx] is not None:
            raise SchemaError(f"vocab.json gives id {idx} to two tokens")
        tokens[idx] = tok
        types[idx] = TOKEN_NORMAL
    added = cfg.get("added_tokens_decoder", {})
    if not isinstance(added, dict):
        raise SchemaError("tokenizer_config.json added_tokens_decoder is not an object")
    by_content: dict[str, int] = {}
    for key, entry in added.items():
        try:
            idx = int(key)
        except ValueError:
            raise SchemaError(
                f"tokenizer_config.json added token id {key!r} is not an integer"
            ) from None
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise SchemaError(f"tokenizer_config.json added token {idx} has no content")
        if not 0 <= idx < vocab_size:
            raise SchemaError(
                f"added token {entry['content']!r} has id {idx}, outside the text vocabulary "
                f"[0, {vocab_size})"
            )
        content = entry["content"]
        if tokens[idx] is not None and tokens[idx] != content:
            raise SchemaError(f"added token {content!r} reuses id {idx} of {tokens[idx]!r}")
        tokens[idx] = content
        types[idx] = TOKEN_CONTROL if entry.get("special", False) else TOKEN_USER_DEFINED
        by_content[content] = idx
    known = set(vocab)
    for m in merges:
        a, b = m.split(" ")
        if a not in known or b not in known or a + b not in known:
            raise SchemaError(f"merges.txt merge {m!r} uses a token that is not in vocab.json")
    out = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]

    def _special_id(name: str) -> int | None:
        val = cfg.get(name)
        if isinstance(val, dict):
            val = val.get("content")
        if isinstance(val, str):
            if val in by_content:
                return by_content[val]
            if val in vocab:
                return int(vocab[val])
        return None

    return TokenizerData(
        tokens=out,
        token_types=types,
        merges=merges,
        eos_token_id=_special_id("eos_token"),
        pad_token_id=_special_id("pad_token"),
    )


def tokenizer_kv(data: TokenizerData) -> list[tuple[str, str, object]]:
    """``(key, kind, value)`` triples to write; kind is "str", "str[]", "i32[]", "u32", "bool"."""
    kv: list[tuple[str, str, object]] = [
        (Keys.TOKENIZER_MODEL, "str", TOKENIZER_MODEL),
        (Keys.TOKENIZER_PRE, "str", TOKENIZER_PRE),
        (Keys.TOKENIZER_TOKENS, "str[]", data.tokens),
        (Keys.TOKENIZER_TOKEN_TYPE, "i32[]", data.token_types),
        (Keys.TOKENIZER_MERGES, "str[]", data.merges),
        (Keys.TOKENIZER_ADD_BOS, "bool", False),
    ]
    if data.eos_token_id is not None:
        kv.append((Keys.TOKENIZER_EOS_ID, "u32", data.eos_token_id))
    if data.pad_token_id is not None:
        kv.append((Keys.TOKENIZER_PAD_ID, "u32", data.pad_token_id))
    return kv


def check_tokenizer_arrays(
    tokens: Sequence[str], types: Sequence[int], merges: Sequence[str], vocab_size: int
) -> None:
    """Raise ``SchemaError`` unless the stored arrays form a usable tokenizer."""
    if len(tokens) != vocab_size:
        raise SchemaError(
            f"tokenizer has {len(tokens)} tokens, expected text_vocab_size = {vocab_size}"
        )
    if len(types) != len(tokens):
        raise SchemaError(f"tokenizer has {len(tokens)} tokens but {len(types)} token types")
    bad = [t for t in set(types) if t not in _KNOWN_TYPES]
    if bad:
        raise SchemaError(f"tokenizer token type {bad[0]} is unknown")
    seen: set[str] = set()
    for tok, typ in zip(tokens, types, strict=True):
        if typ == TOKEN_UNUSED:
            continue
        if not tok:
            raise SchemaError("tokenizer has an empty token")
        if tok in seen:
            raise SchemaError(f"tokenizer token {tok[:40]!r} appears twice")
        seen.add(tok)
    for m in merges:
        parts = m.split(" ")
        if (
            len(parts) != 2
            or parts[0] not in seen
            or parts[1] not in seen
            or parts[0] + parts[1] not in seen
        ):
            raise SchemaError(f"tokenizer merge {m[:60]!r} is malformed or names unknown tokens")


def build_tokenizer(
    tokens: Sequence[str], types: Sequence[int], merges: Sequence[str]
) -> Tokenizer:
    """Rebuild a ``tokenizers.Tokenizer`` (Qwen2TokenizerFast behaviour) from stored arrays."""
    vocab: dict[str, int] = {}
    control: list[tuple[int, str]] = []
    user: list[tuple[int, str]] = []
    for idx, (tok, typ) in enumerate(zip(tokens, types, strict=True)):
        if typ == TOKEN_UNUSED:
            continue
        vocab[tok] = idx
        if typ == TOKEN_CONTROL:
            control.append((idx, tok))
        elif typ == TOKEN_USER_DEFINED:
            user.append((idx, tok))
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(
        vocab=vocab,
        merges=[(a, b) for a, b in pairs],
        unk_token=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = qwen2_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Added tokens are already in the BPE vocabulary, so they keep their ids.
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for _, t in user])
    if control:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for _, t in control])
    return tok
