"""The real Qwen2 text vocabulary, fetched once through pip and written as vocab.json + merges.txt.

The released Qwen3-TTS checkpoints use the Qwen2 byte-level BPE vocabulary: 151,643 ranked
tokens, then the added special tokens. Its canonical source is ``qwen.tiktoken`` (one
``base64(token bytes) rank`` line per token), which the Apache-2.0 wheel ``dashscope==1.20.0``
ships under ``dashscope/resources/``. ``ensure_tiktoken_file`` downloads that wheel with
``pip download`` (pinned version, sha256 checked), extracts the file into the qtts cache and
never touches the network again; ``write_vocab_files`` turns the ranks into the released
``vocab.json`` (byte-level unicode strings -> rank) and ``merges.txt`` (each token's merge,
recovered by running BPE over its bytes with only lower-ranked tokens, in rank order), the files
``Qwen2TokenizerFast`` reads.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engine.errors import ConversionError
from engine.options import qtts_cache_dir
from engine.tokenizer_gguf import bytes_to_unicode

WHEEL_REQUIREMENT = "dashscope==1.20.0"
WHEEL_NAME = "dashscope-1.20.0-py3-none-any.whl"
WHEEL_SHA256 = "c404a3fbee63e2c82b105e5038f2860615f20f783fbccdae2a98942f8986b91c"
WHEEL_MEMBER = "dashscope/resources/qwen.tiktoken"
N_RANKS = 151643
"""Ranked BPE tokens in Qwen2's vocabulary; the added special tokens start at this id."""
# the file's own digest, checked on every read of the cached copy
TIKTOKEN_SHA256_FILE = "qwen.tiktoken.sha256"


def cache_dir() -> Path:
    """``$QTTS_CACHE_DIR/vocab`` (default ``~/.cache/qtts/vocab``)."""
    return qtts_cache_dir() / "vocab"


def tiktoken_path(cache: Path | None = None) -> Path:
    """Where the cached ``qwen.tiktoken`` lives (it may not exist yet)."""
    return (cache or cache_dir()) / "qwen.tiktoken"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _download_wheel(dest: Path) -> Path:
    """``pip download --no-deps`` the pinned wheel into ``dest``; pip requires its sha256 (and it
    is checked again here)."""
    req = dest / "requirements.txt"
    req.write_text(f"{WHEEL_REQUIREMENT} --hash=sha256:{WHEEL_SHA256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--require-hashes", "--disable-pip-version-check", "-q", "-d", str(dest),
           "-r", str(req)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheel = dest / WHEEL_NAME
    if done.returncode != 0 or not wheel.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ConversionError(WHEEL_REQUIREMENT, f"pip download failed: {tail[0]}")
    digest = _sha256(wheel.read_bytes())
    if digest != WHEEL_SHA256:
        raise ConversionError(str(wheel), f"sha256 {digest} is not the pinned {WHEEL_SHA256}")
    return wheel


def ensure_tiktoken_file(cache: Path | None = None) -> Path:
    """The cached ``qwen.tiktoken``; fetched through pip (pinned, hash-checked) when missing."""
    path = tiktoken_path(cache)
    stamp = path.with_name(TIKTOKEN_SHA256_FILE)
    if path.is_file() and stamp.is_file():
        if _sha256(path.read_bytes()) == stamp.read_text().strip():
            return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        wheel = _download_wheel(Path(tmp))
        try:
            with zipfile.ZipFile(wheel) as z:
                data = z.read(WHEEL_MEMBER)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ConversionError(str(wheel), f"no {WHEEL_MEMBER} ({exc})") from None
        part = Path(tmp) / "qwen.tiktoken"
        part.write_bytes(data)
        ranks = read_ranks(part)  # validate before it goes into the cache
        if len(ranks) != N_RANKS:
            raise ConversionError(str(wheel), f"{len(ranks)} ranks, expected {N_RANKS}")
        os.replace(part, path)
        stamp.write_text(_sha256(data) + "\n")
    return path


def read_ranks(path: Path) -> dict[bytes, int]:
    """``token bytes -> rank`` from a tiktoken file; ranks must be 0..n-1, each once."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line:
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except ValueError as exc:
            raise ConversionError(str(path), f"line {lineno}: not 'base64 rank' ({exc})") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ConversionError(str(path), "ranks are not 0..n-1, each once")
    return ranks


def _split(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The merge that makes ``token``: byte-level BPE over its bytes using only tokens ranked
    below it, run until two parts are left (exactly how tiktoken would reach it)."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = limit, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1], limit)
            if r < best:
                best, at = r, i
        if at < 0:
            raise ConversionError("qwen.tiktoken", f"token {token!r} is not reachable by merges")
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts[0], parts[1]


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The released ``vocab.json`` mapping and ``merges.txt`` pairs (in rank order)."""
    b2u = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {text(tok): rank for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    merges = [(text(a), text(b)) for a, b in
              (_split(tok, ranks) for tok, _ in sorted(ranks.items(), key=lambda kv: kv[1])
               if len(tok) > 1)]
    return vocab, merges


def ensure_vocab_files(cache: Path | None = None) -> Path:
    """The folder holding the cached ``vocab.json`` + ``merges.txt``, built from the cached
    ``qwen.tiktoken`` (fetched first if missing) unless already built from that same file."""
    src = ensure_tiktoken_file(cache)
    built = src.parent / "qwen2"
    digest = src.with_name(TIKTOKEN_SHA256_FILE).read_text().strip()
    stamp = built / "source.sha256"
    if stamp.is_file() and stamp.read_text().strip() == digest:
        return built
    vocab, merges = vocab_and_merges(read_ranks(src))
    built.mkdir(parents=True, exist_ok=True)
    files = (("vocab.json", json.dumps(vocab, ensure_ascii=False).encode()),
             ("merges.txt",
              ("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)).encode()),
             ("source.sha256", (digest + "\n").encode()))  # last: marks the others complete
    for name, data in files:
        tmp = built / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, built / name)
    return built


def write_vocab_files(folder: Path, cache: Path | None = None) -> None:
    """Write the real ``vocab.json`` + ``merges.txt`` into ``folder``."""
    built = ensure_vocab_files(cache)
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(built / name, folder / name)


def main() -> int:
    """``python -m engine.tools.qwen_vocab``: fetch the vocabulary into the cache and build its
    vocab.json + merges.txt there (set-up: `make`, the Docker build)."""
    try:
        path = ensure_vocab_files()
    except ConversionError as exc:
        print(f"qtts: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
