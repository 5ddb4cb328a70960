"""``qtts tokenize``: how a model's text tokenizer splits a prompt (ids, pieces, JSON).

Pieces are the bytes each token stands for, shown as text; a token that holds only part of a
multi-byte character shows its bytes as ``\\xNN`` escapes. Special tokens (``<|im_start|>``...)
in the text are matched as such, as the talker's prompt builder does.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from engine.errors import InputError
from engine.tokenizer_gguf import bytes_to_unicode

_BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}
# stdin is read whole: an endless pipe (/dev/zero) must end in this one-line refusal, not in
# a MemoryError (the service takes 4096 characters; this is a tool for whole documents too)
MAX_STDIN_CHARS = 1_000_000


def piece(tokenizer: Any, token_id: int) -> str:
    """The text a token stands for (byte-level symbols mapped back to bytes)."""
    tok = tokenizer.id_to_token(token_id)
    if tok is None:
        return ""
    if not all(c in _BYTE_OF for c in tok):  # an added (special) token: its own text
        return str(tok)
    return bytes(_BYTE_OF[c] for c in tok).decode("utf-8", errors="backslashreplace")


def tokenize(model_path: str, text: str) -> tuple[list[int], list[str]]:
    """``(ids, pieces)`` of ``text`` under the model's stored tokenizer."""
    from engine.gguf_model import open_model
    from engine.talker.prompt import check_text

    check_text("text", text)  # (argv decodes bytes that are not UTF-8 to lone surrogates)
    model = open_model(model_path)
    try:
        tok = model.tokenizer()
        ids = [int(i) for i in tok.encode(text).ids]
        return ids, [piece(tok, i) for i in ids]
    finally:
        model.close()


def run_tokenize(model_path: str, text: str | None, as_json: bool, show_tokens: bool) -> int:
    """Print the ids (one line), the pieces (``--tokens``: ``id<TAB>piece`` lines, the piece
    JSON-quoted so whitespace shows) or a JSON object (``--json``)."""
    if text is None:
        if sys.stdin.isatty():
            raise InputError("text", "give the text as an argument, or pipe it on stdin")
        text = sys.stdin.read(MAX_STDIN_CHARS + 1)
        if len(text) > MAX_STDIN_CHARS:
            raise InputError("text", f"stdin holds more than {MAX_STDIN_CHARS} characters")
    ids, pieces = tokenize(model_path, text)
    if as_json:
        out: dict[str, Any] = {"count": len(ids), "ids": ids}
        if show_tokens:
            out["tokens"] = pieces
        print(json.dumps(out, ensure_ascii=False))
    elif show_tokens:
        for i, p in zip(ids, pieces, strict=True):
            print(f"{i}\t{json.dumps(p, ensure_ascii=False)}")
    else:
        print(" ".join(str(i) for i in ids))
    return 0
