"""The example commands of README.md and docs/service.md, read from their fenced code blocks.

The README walk (tests/service/test_readme_walk.py) runs them against a server, and the
weights bench (bench/weights.py) times the README's text example: both read the Markdown, so an
edited example is what gets run. A command is one shell command as a person would paste it:
backslash-continued lines and lines inside an open quote belong to it.
"""

from __future__ import annotations

import itertools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/service.md")
_FENCE = re.compile(r"^```(\w*)\s*$")
# the address the docs serve on, in either spelling
_ADDRESS = re.compile(r"(?:localhost|127\.0\.0\.1):8000")


@dataclass(frozen=True)
class Example:
    """One example: a shell command (``lang == "sh"``) or a whole Python block."""

    doc: str
    line: int  # 1-based line of its first line in ``doc``
    lang: str
    text: str

    @property
    def program(self) -> str:
        """The program a shell command runs, past ``VAR=value`` prefixes ("" for Python)."""
        if self.lang != "sh":
            return ""
        for word in shlex.split(self.text, comments=True):
            if "=" not in word.split("/")[0]:
                return word.rsplit("/", 1)[-1]
        return ""

    @property
    def is_http(self) -> bool:
        """Talks to the service (so it can be run against a test server)."""
        return bool(_ADDRESS.search(self.text))

    def at(self, host: str, port: int) -> str:
        """The example with the docs' address replaced by ``host:port``; nothing else changes."""
        return _ADDRESS.sub(f"{host}:{port}", self.text)

    def output_file(self) -> str | None:
        """The file a shell command writes its response to (``-o F`` or ``> F``), if any."""
        if self.lang != "sh":
            return None
        words = shlex.split(self.text, comments=True)
        for flag, value in itertools.pairwise(words):
            if flag in ("-o", "--output", ">"):
                return value
        m = re.search(r">\s*(\S+)\s*$", self.text)
        return m.group(1) if m else None


def _open_quote(line: str, quote: str | None) -> str | None:
    """The shell quote still open after ``line`` (None if none), given the one open before."""
    escaped = False
    for ch in line:
        if quote == "'":
            if ch == "'":
                quote = None
        elif escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif quote == '"':
            if ch == '"':
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            break
    return quote


def _shell_commands(doc: str, first_line: int, lines: list[str]) -> list[Example]:
    out: list[Example] = []
    buf: list[str] = []
    start, quote = 0, None
    for k, line in enumerate(lines):
        if not buf:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start = first_line + k
        buf.append(line)
        quote = _open_quote(line, quote)
        if quote is None and not line.rstrip().endswith("\\"):
            out.append(Example(doc, start, "sh", "\n".join(buf)))
            buf = []
    if buf:
        raise ValueError(f"{doc}:{start}: unfinished shell command")
    return out


def examples(docs: tuple[str, ...] = DOCS, root: Path = ROOT) -> list[Example]:
    """Every shell command of the ``sh``/``bash``/``console`` blocks and every ``python`` block."""
    out: list[Example] = []
    for doc in docs:
        lines = (root / doc).read_text(encoding="utf-8").splitlines()
        k = 0
        while k < len(lines):
            m = _FENCE.match(lines[k])
            if not m:
                k += 1
                continue
            end = next(j for j in range(k + 1, len(lines)) if lines[j].startswith("```"))
            body, lang = lines[k + 1:end], m.group(1)
            if lang in ("sh", "bash", "console", "shell"):
                out += _shell_commands(doc, k + 2, body)
            elif lang == "python":
                out.append(Example(doc, k + 2, "python", "\n".join(body)))
            k = end + 1
    return out
