"""Long texts as a sequence of segments: whole sentences, each at most a token budget.

A text within the budget is one segment, exactly as sent (so a sentence or a paragraph is one
prompt, with its prosody across sentences). A longer text is cut at sentence ends and the
sentences are packed greedily into segments of at most ``max_tokens`` tokens; a sentence
longer than that (no punctuation: a run of emoji or of one CJK character) is cut at a clause
mark or a space in the second half of the window when there is one, else at a token boundary
that is also a character boundary. Every character of the text is in exactly one segment;
segments that are only white space are dropped.

Token counts come from the model's own tokenizer (its offsets map tokens back to characters),
so the budget is in the unit that costs: prefill positions. (Counted in the whole text: a
segment tokenised alone can take a token or two more, its first word lacking a leading space.)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

# A sentence ends after . ! ? ; and the ellipsis (and the CJK/fullwidth full stop, ! ? ;), plus
# closing quotes or brackets, before white space; the CJK marks need no space; a newline
# always ends one. (Escapes: the fullwidth marks look like their ASCII twins.)
_CLOSERS = "\"'\u201d\u2019)\\]\u00bb\u300d\u300f\uff09"
_SENTENCE_END = re.compile(
    f"(?<=[.!?;\u2026])[{_CLOSERS}]*\\s+"
    f"|(?<=[\u3002\uff01\uff1f\uff1b\uff61])[{_CLOSERS}]*\\s*"
    "|\n\\s*"
)
# Where a too-long sentence may be cut: after a clause mark (, ; : and their CJK forms, dashes)
# or before white space.
_SOFT_BREAK = re.compile("(?<=[,\uff0c\u3001:\uff1a\u2014\u2013-])|(?=\\s)")


def sentence_starts(text: str) -> list[int]:
    """Character indices where a sentence starts (0 first; no index equals ``len(text)``)."""
    starts = [0]
    for m in _SENTENCE_END.finditer(text):
        if 0 < m.end() < len(text) and m.end() > starts[-1]:
            starts.append(m.end())
    return starts


def split_segments(text: str, offsets: Sequence[tuple[int, int]], max_tokens: int
                   ) -> list[str]:
    """Cut ``text`` into segments of at most ``max_tokens`` tokens (module docstring).

    ``offsets``: the (start, end) character span of every token of ``text`` in order, as a
    ``tokenizers`` encoding of ``text`` alone reports them.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if len(offsets) <= max_tokens:
        return [text] if text.strip() else []
    starts = [s for s, _ in offsets]
    # a token may start only where the one before it ended (byte-level pieces of one
    # character share its span): only such starts are character boundaries to cut at
    cuttable = [i == 0 or offsets[i - 1][1] <= starts[i] for i in range(len(offsets))]
    sentences = sentence_starts(text)
    # token index where each sentence starts
    bounds = _sentence_token_bounds(offsets, cuttable, sentences)
    cuts: list[int] = [0]  # token indices where segments start
    i = 0
    while i < len(offsets):
        # the furthest sentence start within the budget
        limit = i + max_tokens
        if limit >= len(offsets):
            break
        best = max((b for b in bounds if i < b <= limit), default=None)
        if best is None:
            best = _soft_cut(text, starts, cuttable, i, limit)
        cuts.append(best)
        i = best
    pieces = []
    for a, b in zip(cuts, [*cuts[1:], len(offsets)], strict=True):
        lo = 0 if a == 0 else starts[a]
        hi = len(text) if b == len(offsets) else starts[b]
        pieces.append(text[lo:hi])
    return [p.strip() for p in pieces if p.strip()]


def _sentence_token_bounds(offsets: Sequence[tuple[int, int]], cuttable: Sequence[bool],
                           sentences: Sequence[int]) -> list[int]:
    # the token holding a sentence's first character (" How" starts at its space)
    out: list[int] = []
    j = 0
    for s in sentences[1:]:
        while j < len(offsets) and offsets[j][1] <= s:
            j += 1
        if 0 < j < len(offsets) and cuttable[j]:
            out.append(j)
    return out


def _soft_cut(text: str, starts: Sequence[int], cuttable: Sequence[bool], i: int,
              limit: int) -> int:
    # a clause mark or a space in the second half of the window, else the last token boundary
    # that is a character boundary (at least one token always moves forward)
    half = i + max(1, (limit - i) // 2)
    for t in range(limit, half - 1, -1):
        if cuttable[t] and t > i and _is_soft_break(text, starts[t]):
            return t
    for t in range(limit, i, -1):
        if cuttable[t]:
            return t
    return limit


def _is_soft_break(text: str, pos: int) -> bool:
    return bool(_SOFT_BREAK.match(text, pos)) and pos > 0


def token_offsets(tokenizer: Any, text: str) -> list[tuple[int, int]]:
    """(start, end) character spans of the tokens of ``text`` (a ``tokenizers.Tokenizer``)."""
    return [(int(a), int(b)) for a, b in tokenizer.encode(text).offsets]
