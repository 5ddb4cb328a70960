"""The voice store: SQLite in the data directory (default) or PostgreSQL (``QTTS_VOICE_DB``).

One table of voices (service/voices/schema.py), read and written by the front end only. A voice
is written by one ``INSERT`` in one transaction, after its prompt was computed, so no reader
ever sees half a voice and a crash at any point leaves either the whole voice or nothing.
Names are unique per owner (the database's constraint, so parallel creates cannot both win).

The drivers are synchronous (``sqlite3``, ``psycopg``): the routes call the store in a thread.
A database that cannot be reached raises ``StoreUnavailable`` (the routes answer 503 with
``Retry-After``); the schema is migrated on first use, so a server whose database is down still
starts and speaks its built-in voices.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from service.voices.schema import SCHEMA_VERSION, VERSION_TABLE, statements

COLUMNS = ("id", "owner", "name", "mode", "model", "fingerprint", "ref_sha256", "ref_seconds",
           "created", "prompt", "ref_audio")
# (PostgreSQL's advisory lock key for migrations: any constant all replicas agree on)
_MIGRATION_LOCK = 0x71747473
# seconds a write keeps free before its caller's deadline for its commit to be answered
COMMIT_MARGIN = 1.0
T = TypeVar("T")


class StoreUnavailable(Exception):
    """The database cannot be reached or used right now (answered 503, Retry-After)."""


class DuplicateName(Exception):
    """The owner already has a voice of that name."""


@dataclass(frozen=True)
class StoredVoice:
    """One row of the store. ``prompt`` is the voice as a ``.qvoice`` file's bytes."""

    id: str
    owner: str
    name: str
    mode: str  # "icl" | "x_vector_only"
    model: str  # the served model's name when it was made
    fingerprint: str  # engine.clone.voice_file.model_fingerprint of that model
    ref_sha256: str
    ref_seconds: float
    created: float  # Unix time
    prompt: bytes
    ref_audio: bytes | None = None

    def row(self) -> tuple[Any, ...]:
        return tuple(getattr(self, c) for c in COLUMNS)


class VoiceStore(ABC):
    """The operations the routes need; every one may raise ``StoreUnavailable``."""

    dialect = ""
    placeholder = "?"
    # seconds within which an operation answers or raises; past them the database is taken as
    # unavailable (one frozen mid-statement answers nothing, and no timeout of its own fires)
    answer_seconds = 15.0

    def __init__(self) -> None:
        self._migrated = False
        self._lock = threading.Lock()
        self._calls = threading.local()  # the deadline of the call a thread runs

    # ---- back-end specifics ----------------------------------------------------------------
    @abstractmethod
    def _connect(self, write: bool) -> Any:
        """A connection in a new transaction (``write``: one that will write)."""

    @abstractmethod
    def _release(self, conn: Any, ok: bool) -> None: ...

    @abstractmethod
    def _begin_migration(self, cur: Any) -> None:
        """Take the lock that serialises migrating replicas (inside the transaction)."""

    @abstractmethod
    def _classify(self, exc: Exception) -> Exception | None:
        """The store's exception for a driver's, or None when it is not a driver error."""

    @abstractmethod
    def describe(self) -> str:
        """Where the store is, for logs (no password)."""

    def call(self, op: Callable[[VoiceStore], T], deadline: float) -> T:
        """``op(self)`` for a caller that stops waiting at ``deadline`` (``time.monotonic``):
        past it a transaction is rolled back, not committed. A database frozen mid-statement
        runs the statement when it thaws; the caller answered 503 long before, and a voice
        created or deleted after that 503 would be a change its client was told did not
        happen."""
        self._calls.deadline = deadline
        try:
            return op(self)
        finally:
            self._calls.deadline = None

    def _late(self, margin: float) -> bool:
        deadline = getattr(self._calls, "deadline", None)
        return deadline is not None and time.monotonic() > deadline - margin

    # ---- plumbing --------------------------------------------------------------------------
    def _sql(self, q: str) -> str:
        return q if self.placeholder == "?" else q.replace("?", self.placeholder)

    @contextmanager
    def _tx(self, write: bool = True) -> Iterator[Any]:
        """A cursor in one transaction: committed on success, rolled back on error or when its
        caller gave up (``call``); driver errors become the store's exceptions."""
        conn = None
        ok = False
        try:
            if self._late(0.0):  # (it waited for a thread that long)
                raise StoreUnavailable("the voice store did not answer in time")
            conn = self._connect(write)
            cur = conn.cursor()
            try:
                yield cur
                if write and self._late(COMMIT_MARGIN):
                    raise StoreUnavailable("the voice store answered after its caller gave "
                                           "up: rolled back")
                conn.commit()
                ok = True
            except BaseException:
                try:
                    conn.rollback()
                except Exception:
                    pass
                raise
            finally:
                cur.close()
        except (StoreUnavailable, DuplicateName):
            raise
        except Exception as exc:
            mapped = self._classify(exc)
            if mapped is None:
                raise
            raise mapped from exc
        finally:
            if conn is not None:
                self._release(conn, ok)

    def migrate(self) -> int:
        """Bring the schema to ``SCHEMA_VERSION``; returns the version found before."""
        with self._tx() as cur:
            self._begin_migration(cur)
            cur.execute(VERSION_TABLE)
            cur.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version")
            found = int(cur.fetchone()[0])
            if found > SCHEMA_VERSION:
                raise StoreUnavailable(f"the voice database has schema version {found}; this "
                                       f"qtts knows up to {SCHEMA_VERSION} (upgrade qtts)")
            for v in range(found, SCHEMA_VERSION):
                for stmt in statements(self.dialect, v):
                    cur.execute(stmt)
                cur.execute(self._sql("INSERT INTO schema_version (version) VALUES (?)"),
                            (v + 1,))
        return found

    def _ready(self) -> None:
        if self._migrated:
            return
        with self._lock:
            if not self._migrated:
                self.migrate()
                self._migrated = True

    # ---- operations ------------------------------------------------------------------------
    def create(self, voice: StoredVoice) -> None:
        """Insert ``voice`` whole, or raise (``DuplicateName`` for a name its owner has)."""
        self._ready()
        cols = ", ".join(COLUMNS)
        marks = ", ".join("?" for _ in COLUMNS)
        with self._tx() as cur:
            cur.execute(self._sql(f"INSERT INTO voices ({cols}) VALUES ({marks})"), voice.row())

    def get(self, owner: str, voice_id: str) -> StoredVoice | None:
        """The owner's voice ``voice_id`` (None for another owner's: no probing)."""
        self._ready()
        with self._tx(write=False) as cur:
            cur.execute(self._sql(f"SELECT {', '.join(COLUMNS)} FROM voices "
                                  "WHERE id = ? AND owner = ?"), (voice_id, owner))
            row = cur.fetchone()
        return _voice(row) if row is not None else None

    def list(self, owner: str) -> list[StoredVoice]:
        """The owner's voices, oldest first (prompts and audio left out)."""
        self._ready()
        cols = ", ".join(c if c not in ("prompt", "ref_audio") else "NULL" for c in COLUMNS)
        with self._tx(write=False) as cur:
            cur.execute(self._sql(f"SELECT {cols} FROM voices WHERE owner = ? "
                                  "ORDER BY created, id"), (owner,))
            rows: Sequence[Any] = cur.fetchall()
        return [_voice(r) for r in rows]

    def delete(self, owner: str, voice_id: str) -> StoredVoice | None:
        """Delete the owner's voice; returns it (without prompt), or None if it had none."""
        self._ready()
        cols = ", ".join(c if c not in ("prompt", "ref_audio") else "NULL" for c in COLUMNS)
        with self._tx() as cur:
            cur.execute(self._sql(f"SELECT {cols} FROM voices WHERE id = ? AND owner = ?"),
                        (voice_id, owner))
            row = cur.fetchone()
            if row is None:
                return None
            cur.execute(self._sql("DELETE FROM voices WHERE id = ? AND owner = ?"),
                        (voice_id, owner))
            if cur.rowcount == 0:
                # a delete of the same voice that committed after our SELECT (PostgreSQL's
                # read committed): it was that one's to report, not ours too
                return None
        return _voice(row)

    def count(self) -> int:
        """Voices of every owner (the stored-voice gauge)."""
        self._ready()
        with self._tx(write=False) as cur:
            cur.execute("SELECT COUNT(*) FROM voices")
            return int(cur.fetchone()[0])

    def close(self) -> None:  # noqa: B027 -- SQLite keeps no connection
        """Drop any kept connection."""


def _voice(row: Sequence[Any]) -> StoredVoice:
    d = dict(zip(COLUMNS, row, strict=True))
    d["prompt"] = bytes(d["prompt"]) if d["prompt"] is not None else b""
    d["ref_audio"] = bytes(d["ref_audio"]) if d["ref_audio"] is not None else None
    d["ref_seconds"] = float(d["ref_seconds"])
    d["created"] = float(d["created"])
    return StoredVoice(**d)


class SqliteStore(VoiceStore):
    """``voices.sqlite3`` in the data directory, in WAL mode (readers never wait on a writer;
    writers wait up to ``busy_seconds`` for each other)."""

    dialect = "sqlite"

    def __init__(self, path: Path, busy_seconds: float = 10.0) -> None:
        super().__init__()
        self.path = path
        self.busy_seconds = busy_seconds
        self.answer_seconds = busy_seconds + 5.0

    def _connect(self, write: bool) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnavailable(f"data directory {self.path.parent}: {exc.strerror or exc}"
                                   ) from None  # fmt: skip
        conn = sqlite3.connect(self.path, timeout=self.busy_seconds, isolation_level=None,
                               check_same_thread=False)  # fmt: skip
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")  # durable across crashes in WAL mode
            # writes take the lock at BEGIN: no upgrade deadlock between two writers; reads
            # take none (WAL: they read the last commit while a writer holds the lock)
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        except BaseException:
            conn.close()
            raise
        return conn

    def _release(self, conn: Any, ok: bool) -> None:
        conn.close()

    def _begin_migration(self, cur: Any) -> None:
        pass  # BEGIN IMMEDIATE already holds the write lock

    def _classify(self, exc: Exception) -> Exception | None:
        if isinstance(exc, sqlite3.IntegrityError):
            return DuplicateName(str(exc))
        if isinstance(exc, sqlite3.Error):
            return StoreUnavailable(f"voice database {self.path}: {exc}")
        return None

    def describe(self) -> str:
        return f"sqlite:{self.path}"


class PostgresStore(VoiceStore):
    """A PostgreSQL database (``postgresql://user:pass@host/db``) shared by every replica."""

    dialect = "postgresql"
    placeholder = "%s"
    KEEP = 4  # idle connections kept

    def __init__(self, url: str, connect_timeout: float = 3.0,
                 statement_timeout: float = 5.0) -> None:  # fmt: skip
        super().__init__()
        import psycopg

        self._psycopg = psycopg
        self.url = url
        self.connect_timeout = connect_timeout
        self.statement_timeout = statement_timeout
        self.answer_seconds = connect_timeout + statement_timeout + 2.0
        self._idle: list[Any] = []
        self._pool_lock = threading.Lock()

    def _connect(self, write: bool) -> Any:
        with self._pool_lock:
            if self._idle:
                return self._idle.pop()
        ms = max(1, round(self.statement_timeout * 1000))
        # a statement or a lock wait past the timeout is the server's error (a table another
        # client locked); TCP keepalives find a peer that went away without closing
        return self._psycopg.connect(
            self.url, connect_timeout=max(1, int(self.connect_timeout)),
            options=f"-c statement_timeout={ms} -c lock_timeout={ms}",
            keepalives=1, keepalives_idle=10, keepalives_interval=5, keepalives_count=3)

    def _release(self, conn: Any, ok: bool) -> None:
        if ok and not conn.closed:
            with self._pool_lock:
                if len(self._idle) < self.KEEP:
                    self._idle.append(conn)
                    return
        try:
            conn.close()
        except Exception:
            pass

    def _begin_migration(self, cur: Any) -> None:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))

    def _classify(self, exc: Exception) -> Exception | None:
        pg = self._psycopg
        if isinstance(exc, pg.errors.UniqueViolation):
            return DuplicateName(str(exc))
        if isinstance(exc, pg.Error):
            self.close()  # kept connections are as likely broken (a restarted server)
            return StoreUnavailable(f"voice database {self.describe()}: "
                                    f"{str(exc).strip().splitlines()[0] if str(exc) else exc}")
        return None

    def describe(self) -> str:
        u = urlsplit(self.url)
        host = u.hostname or ""
        netloc = (f"{u.username}@" if u.username else "") + host + (f":{u.port}" if u.port else "")
        return urlunsplit((u.scheme, netloc, u.path, "", ""))

    def close(self) -> None:
        with self._pool_lock:
            idle, self._idle = self._idle, []
        for c in idle:
            try:
                c.close()
            except Exception:
                pass


def open_store(url: str | None, data_dir: Path, timeout: float = 5.0) -> VoiceStore:
    """The store ``url`` names (``postgresql://...``, ``sqlite:///path``), else SQLite in
    ``data_dir``; ``timeout``: seconds an operation may wait on the database. Nothing is
    connected yet."""
    if not url:
        return SqliteStore(data_dir / "voices.sqlite3", busy_seconds=timeout)
    scheme = url.split(":", 1)[0].lower()
    if scheme in ("postgresql", "postgres"):
        return PostgresStore(url, statement_timeout=timeout)
    if scheme == "sqlite":
        return SqliteStore(Path(url.split(":", 1)[1].removeprefix("//")), busy_seconds=timeout)
    raise ValueError(f"QTTS_VOICE_DB: {scheme!r} is not a supported database (postgresql://... "
                     "or sqlite:///path)")
