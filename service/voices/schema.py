"""The voice store's schema, versioned: ``MIGRATIONS[i]`` takes the schema from version ``i`` to
``i + 1``. Both back ends run the same statements; ``{blob}`` and ``{real}`` are the two types
whose spelling differs (SQLite ``BLOB``/``REAL``, PostgreSQL ``BYTEA``/``DOUBLE PRECISION``).

A migration is applied in one transaction together with its row in ``schema_version``, so a
crash mid-migration leaves the previous version; replicas starting together serialise on a lock
(SQLite: the write lock of ``BEGIN IMMEDIATE``; PostgreSQL: an advisory transaction lock).
Never edit a released migration: append a new one.
"""

from __future__ import annotations

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE voices (
            id TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            name TEXT NOT NULL,
            mode TEXT NOT NULL,
            model TEXT NOT NULL,
            fingerprint TEXT NOT NULL,
            ref_sha256 TEXT NOT NULL,
            ref_seconds {real} NOT NULL,
            created {real} NOT NULL,
            prompt {blob} NOT NULL,
            ref_audio {blob},
            UNIQUE (owner, name)
        )""",
        "CREATE INDEX voices_owner_created ON voices (owner, created)",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)
# made before reading the version (it is what the version is read from)
VERSION_TABLE = "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)"
TYPES = {
    "sqlite": {"blob": "BLOB", "real": "REAL"},
    "postgresql": {"blob": "BYTEA", "real": "DOUBLE PRECISION"},
}


def statements(dialect: str, version: int) -> list[str]:
    """The statements of migration ``version`` -> ``version + 1`` for ``dialect``."""
    return [s.format(**TYPES[dialect]) for s in MIGRATIONS[version]]
