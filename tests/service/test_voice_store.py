"""The voice store on SQLite (a file in a temporary data directory) and on a real PostgreSQL
server started by the test session: migrations, owners, atomic creates, duplicate names, an
unreachable database, a newer schema, and 20 parallel creates and deletes."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from service.voices.schema import SCHEMA_VERSION
from service.voices.store import (
    DuplicateName,
    PostgresStore,
    StoredVoice,
    StoreUnavailable,
    VoiceStore,
    open_store,
)


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[VoiceStore]:
    if request.param == "sqlite":
        s = open_store(None, tmp_path / "data")
    else:
        pg = request.getfixturevalue("postgres")
        s = open_store(pg.url, tmp_path)
        s.migrate()
        with s._tx() as cur:  # each test starts from an empty table
            cur.execute("DELETE FROM voices")
    yield s
    s.close()


def voice(i: int, owner: str = "alice", name: str | None = None) -> StoredVoice:
    return StoredVoice(id=f"voice_{i:04d}", owner=owner, name=name or f"v{i}", mode="icl",
                       model="m", fingerprint="f" * 64, ref_sha256="a" * 64, ref_seconds=3.5,
                       created=time.time(), prompt=bytes([i % 256]) * 100)


def test_migrations_are_versioned_and_idempotent(store: VoiceStore) -> None:
    store.migrate()
    assert store.migrate() == SCHEMA_VERSION  # already current: nothing applied
    with store._tx() as cur:
        cur.execute("SELECT COUNT(*), MAX(version) FROM schema_version")
        assert tuple(cur.fetchone()) == (SCHEMA_VERSION, SCHEMA_VERSION)


def test_create_get_list_delete_scoped_to_the_owner(store: VoiceStore) -> None:
    a, b = voice(1), voice(2, owner="bob")
    store.create(a)
    store.create(b)
    got = store.get("alice", a.id)
    assert got is not None and got.prompt == a.prompt and got.name == "v1"
    assert store.get("bob", a.id) is None  # another owner's voice does not exist for bob
    assert [v.id for v in store.list("alice")] == [a.id]
    assert store.delete("bob", a.id) is None and store.get("alice", a.id) is not None
    assert store.count() == 2
    gone = store.delete("alice", a.id)
    assert gone is not None and gone.id == a.id
    assert store.get("alice", a.id) is None and store.count() == 1


def test_names_are_unique_per_owner(store: VoiceStore) -> None:
    store.create(voice(1, name="narrator"))
    with pytest.raises(DuplicateName):
        store.create(voice(2, name="narrator"))
    store.create(voice(3, owner="bob", name="narrator"))  # another owner may use the name
    assert [v.id for v in store.list("alice")] == ["voice_0001"]


def test_reference_audio_kept_only_when_given(store: VoiceStore) -> None:
    v = StoredVoice(**{**voice(1).__dict__, "ref_audio": b"RIFF...."})
    store.create(v)
    store.create(voice(2))
    got1, got2 = store.get("alice", v.id), store.get("alice", "voice_0002")
    assert got1 is not None and got1.ref_audio == b"RIFF...."
    assert got2 is not None and got2.ref_audio is None


def test_twenty_parallel_creates_and_deletes_stay_consistent(store: VoiceStore) -> None:
    for i in range(10):
        store.create(voice(100 + i))
    errors: list[BaseException] = []
    dup_refused: list[int] = []

    def work(i: int) -> None:
        try:
            if i < 10:
                store.create(voice(i))
            else:
                assert store.delete("alice", f"voice_{90 + i:04d}") is not None
            try:  # everyone races for one name: exactly one wins
                store.create(voice(500 + i, name="contested"))
            except DuplicateName:
                dup_refused.append(i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(dup_refused) == 19
    ids = sorted(v.id for v in store.list("alice"))
    contested = [v for v in store.list("alice") if v.name == "contested"]
    assert len(contested) == 1
    assert sorted(set(ids) - {contested[0].id}) == [f"voice_{i:04d}" for i in range(10)]
    assert store.count() == 11
    for v in store.list("alice"):  # every stored voice is whole
        full = store.get("alice", v.id)
        assert full is not None and len(full.prompt) == 100


def test_parallel_deletes_of_one_voice_report_it_once(store: VoiceStore) -> None:
    """Of several deletes of one voice at once exactly one returns it (the API's 200 and the
    stored-voice gauge's one decrement); on PostgreSQL every one that had read the row before
    the first committed returned it too."""
    def work(vid: str, start: threading.Barrier, got: list[StoredVoice | None]) -> None:
        start.wait()
        got.append(store.delete("alice", vid))

    for trial in range(5):
        store.create(voice(trial))
        start = threading.Barrier(8)
        got: list[StoredVoice | None] = []
        threads = [threading.Thread(target=work, args=(f"voice_{trial:04d}", start, got))
                   for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(g is not None for g in got) == 1, (trial, got)
    assert store.count() == 0


def test_unreachable_sqlite_is_unavailable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    s = open_store(None, blocker / "data")
    with pytest.raises(StoreUnavailable, match="data directory"):
        s.list("alice")


def test_unreachable_postgresql_is_unavailable(tmp_path: Path) -> None:
    from tests.service.helpers import free_port

    s = open_store(f"postgresql://qtts:secret@127.0.0.1:{free_port()}/qtts", tmp_path)
    with pytest.raises(StoreUnavailable) as err:
        s.list("alice")
    assert "secret" not in str(err.value)
    assert s.describe().startswith("postgresql://qtts@127.0.0.1:")


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    s = open_store(None, tmp_path)
    s.migrate()
    with sqlite3.connect(tmp_path / "voices.sqlite3") as c:
        c.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION + 1,))
    with pytest.raises(StoreUnavailable, match="upgrade qtts"):
        open_store(None, tmp_path).list("alice")


def test_sqlite_is_in_wal_mode(tmp_path: Path) -> None:
    open_store(None, tmp_path).count()
    with sqlite3.connect(tmp_path / "voices.sqlite3") as c:
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_sqlite_reads_do_not_wait_for_a_writer(tmp_path: Path) -> None:
    """While another connection holds the write lock, lookups read the last commit at once
    (every operation took the write lock: a stored voice's request waited, then got a 503)
    and a create waits its timeout, then is unavailable."""
    s = open_store(None, tmp_path, timeout=1.0)
    s.create(voice(1))
    with sqlite3.connect(tmp_path / "voices.sqlite3", isolation_level=None) as writer:
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("DELETE FROM voices")  # not committed: readers still see the voice
        t0 = time.monotonic()
        assert [v.id for v in s.list("alice")] == ["voice_0001"]
        assert s.get("alice", "voice_0001") is not None and s.count() == 1
        assert time.monotonic() - t0 < 0.5
        with pytest.raises(StoreUnavailable, match="locked"):
            s.create(voice(2))
        writer.execute("ROLLBACK")
    s.create(voice(2))
    assert s.count() == 2


def test_a_write_answered_after_its_caller_gave_up_is_rolled_back(tmp_path: Path) -> None:
    """A create and a delete sent to a PostgreSQL server that froze (SIGSTOP) got their 503,
    then happened when it thawed: a voice the client was told was not made (and a 409 for its
    retry), a voice it was told still exists gone."""
    import asyncio

    from service.voices.api import _in_store_thread
    from tests.postgres import Postgres

    pg = Postgres(tmp_path / "pg")  # its own server: this test freezes it
    store = PostgresStore(pg.url, connect_timeout=1.0, statement_timeout=1.0)

    def while_frozen(op: Callable[[VoiceStore], object]) -> None:
        # on the connection the store keeps: the statement waits in the frozen server
        finished = threading.Event()

        def run(st: VoiceStore) -> object:
            try:
                return op(st)
            finally:
                finished.set()

        with pg.frozen(), pytest.raises(TimeoutError):
            asyncio.run(_in_store_thread(store, run))
        assert finished.wait(30)  # the statement ran when the server thawed

    try:
        store.create(voice(1))
        while_frozen(lambda st: st.create(voice(2)))
        assert [v.id for v in store.list("alice")] == ["voice_0001"]
        while_frozen(lambda st: st.delete("alice", "voice_0001"))
        assert [v.id for v in store.list("alice")] == ["voice_0001"]
        store.create(voice(2))  # the retry of the create that was refused
        assert store.count() == 2
    finally:
        store.close()
        pg.close()


def test_unknown_database_scheme(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mysql"):
        open_store("mysql://x", tmp_path)


