"""Owners: who a request is, from its API key (``QTTS_API_KEYS``, ``QTTS_API_KEY``).

Without any key every client is owner ``default``; with one key (``QTTS_API_KEY``) its holder
is ``default``; with a keys file each key names its owner. Keys are compared in constant time
and never logged.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT_OWNER = "default"
OWNER = re.compile(r"^[A-Za-z0-9._@+-]{1,128}$")


def parse_keys(path: Path) -> dict[str, str]:
    """``KEY OWNER`` lines of ``path`` (blank lines and ``#`` comments skipped);
    ``ValueError`` naming the line of anything else."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    keys: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path} line {n}: expected `KEY OWNER` (two words)")
        key, owner = parts
        if len(key) < 8:
            raise ValueError(f"{path} line {n}: a key needs at least 8 characters")
        if not OWNER.match(owner):
            raise ValueError(f"{path} line {n}: owner must be 1-128 of A-Z a-z 0-9 . _ @ + -")
        if key in keys:
            raise ValueError(f"{path} line {n}: this key is already listed")
        keys[key] = owner
    if not keys:
        raise ValueError(f"{path}: no keys")
    return keys


def header_key(headers: Mapping[str, str]) -> str:
    """The API key of a request's headers: ``Authorization: Bearer KEY``, else ``X-API-Key``;
    "" if neither."""
    given = headers.get("authorization", "")
    token = given[7:].strip() if given[:7].lower() == "bearer " else ""
    return token or headers.get("x-api-key", "").strip()


def owner_of(keys: dict[str, str], token: str) -> str | None:
    """The owner of ``token``; with no keys configured, ``default``; None when refused."""
    if not keys:
        return DEFAULT_OWNER
    found = None
    given = token.encode()
    for key, owner in keys.items():  # every key compared: the time does not tell which
        if hmac.compare_digest(given, key.encode()):
            found = owner
    return found


def request_owner(request: Any) -> str:
    """The owner the gate found for ``request`` (``default`` when the gate did not run)."""
    owner: str = request.scope.get("state", {}).get("owner") or DEFAULT_OWNER
    return owner
