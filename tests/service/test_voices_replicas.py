"""Cloned voices with a real PostgreSQL server (started by the tests): two ``qtts serve``
replicas on one database (created through A, used and deleted through B), the database going
away and coming back (503 with Retry-After, the built-in voices and one-shot references keep
working), and owners from an API-keys file with their audit lines."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.postgres import Postgres
from tests.service.helpers import Server
from tests.service.voices_helpers import (
    REF_TEXT,
    assert_speech,
    audit_lines,
    auth,
    create,
    reference,
    speak,
)

_DB = itertools.count()


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return reference(tmp_path_factory.mktemp("ref"))


def _serve(model: Path, folder: Path, **env: Any) -> Server:
    s = Server(model, folder, **env)
    s.wait_ready()
    return s


def test_two_replicas_share_one_postgresql_database(
        postgres: Postgres, base_gguf: Path, tmp_path: Path, ref: bytes) -> None:
    url = postgres.new_database(f"replicas{next(_DB)}")
    a = _serve(base_gguf, tmp_path, voice_db=url)
    try:
        b = _serve(base_gguf, tmp_path, voice_db=url)
        try:
            r = create(a, ref, "shared")
            assert r.status_code == 200, r.text
            vid = r.json()["id"]
            assert [v["id"] for v in httpx.get(b.url + "/v1/audio/voices").json()["data"]] == [vid]
            assert_speech(speak(b, vid))  # made by A's worker, spoken by B's
            dup = create(b, ref, "shared")  # the name is taken in the one database
            assert dup.status_code == 409
            assert httpx.delete(f"{b.url}/v1/audio/voices/{vid}").status_code == 200
            assert httpx.get(f"{a.url}/v1/audio/voices/{vid}").status_code == 404
            assert speak(a, vid).status_code == 404
            # ids no voice can have are unknown without asking the database (PostgreSQL takes
            # no NUL in text: that once came back as 503 store_unavailable)
            for r in (speak(a, "voice_\x00x"), speak(a, {"id": "voice_" + "e" * 5000}),
                      httpx.get(f"{a.url}/v1/audio/voices/voice_%00"),
                      httpx.delete(f"{a.url}/v1/audio/voices/voice_%00")):
                assert r.status_code == 404, r.text
                assert r.json()["error"]["code"] == "voice_not_found"
                assert len(r.content) < 1000  # a long id is not echoed whole
            assert "voice store unavailable" not in a.log()
        finally:
            b.stop()
    finally:
        a.stop()


def _realtime_voice(server: Server, voice: str) -> tuple[str, int | None]:
    """The error code and close code of a realtime session that asks for ``voice``."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    async def go() -> tuple[str, int | None]:
        url = server.url.replace("http://", "ws://") + "/v1/tts/realtime"
        async with connect(url) as ws:
            await ws.recv()  # session.started
            await ws.send(json.dumps({"type": "session", "voice": voice}))
            event = json.loads(await ws.recv())
            with pytest.raises(ConnectionClosed):
                await ws.recv()
            return event["code"], ws.close_code

    return asyncio.run(go())


def test_database_down_is_503_and_the_rest_keeps_working(base_gguf: Path, service_model: Path,
                                                         tmp_path: Path, ref: bytes) -> None:
    pg = Postgres(tmp_path / "pg")  # its own server: this test stops it
    try:
        s = _serve(base_gguf, tmp_path, voice_db=pg.url, retry_after_seconds=3)
        try:
            vid = create(s, ref, "survivor").json()["id"]
            pg.stop()
            for r in (httpx.get(s.url + "/v1/audio/voices"), create(s, ref, "lost"),
                      httpx.get(f"{s.url}/v1/audio/voices/{vid}"), speak(s, vid),
                      httpx.delete(f"{s.url}/v1/audio/voices/{vid}")):
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"] == "3"
                assert r.json()["error"]["code"] == "store_unavailable"
            # a realtime session naming the voice: the same error, and a close that says
            # "try again later" (1013), not "your fault" (1008)
            assert _realtime_voice(s, vid) == ("store_unavailable", 1013)
            # a one-shot reference needs no store
            assert_speech(speak(s, None, ref_audio=base64.b64encode(ref).decode(),
                                ref_text=REF_TEXT))
            assert "Traceback" not in s.log()
            pg.start()
            assert [v["name"] for v in httpx.get(s.url + "/v1/audio/voices").json()["data"]] \
                == ["survivor"]
            assert_speech(speak(s, vid))
        finally:
            s.stop()
        # a CustomVoice model never needs the store: its built-in voices speak with it down
        pg.stop()
        c = _serve(service_model, tmp_path, voice_db=pg.url)
        try:
            assert_speech(speak(c, "ryan"))
            assert httpx.get(c.url + "/v1/audio/voices").status_code == 200
        finally:
            c.stop()
    finally:
        pg.close()


def test_a_locked_or_frozen_database_is_a_503_in_seconds(base_gguf: Path, tmp_path: Path,
                                                         ref: bytes) -> None:
    """A table another client holds locked, and a database server that stops answering
    (SIGSTOP: its kernel still keeps the connections open): both waited without end (a locked
    table ~70 s, a frozen server for ever on a kept connection)."""
    import time

    import psycopg

    pg = Postgres(tmp_path / "pg")  # its own server: this test freezes it
    try:
        s = _serve(base_gguf, tmp_path, voice_db=pg.url, voice_db_timeout=1.5)
        try:
            vid = create(s, ref, "kept").json()["id"]
            with psycopg.connect(pg.url) as locker:
                locker.execute("LOCK TABLE voices IN ACCESS EXCLUSIVE MODE")
                t0 = time.monotonic()
                r = httpx.get(s.url + "/v1/audio/voices", timeout=60)
                assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
                assert time.monotonic() - t0 < 6
            assert httpx.get(f"{s.url}/v1/audio/voices/{vid}").status_code == 200
            with pg.frozen():
                t0 = time.monotonic()
                r = speak(s, vid)  # the kept connection would wait on the frozen server
                assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
                assert time.monotonic() - t0 < 12
            assert_speech(speak(s, vid))  # back without a restart
            assert "Traceback" not in s.log()
        finally:
            s.stop()
    finally:
        pg.close()


def test_owners_see_use_and_delete_only_their_own_voices(base_gguf: Path, tmp_path: Path,
                                                         ref: bytes) -> None:  # fmt: skip
    keys = tmp_path / "keys"
    keys.write_text("# key owner\nalice-key-123456 alice\nbob-key-1234567 bob\n")
    s = _serve(base_gguf, tmp_path, api_keys=keys, api_key="single-key-000")
    try:
        assert httpx.get(s.url + "/v1/audio/voices").status_code == 401
        assert httpx.get(s.url + "/v1/audio/voices", headers=auth("wrong-key-000")
                         ).status_code == 401  # fmt: skip
        r = create(s, ref, "mine", key="alice-key-123456")
        assert r.status_code == 200, r.text
        vid = r.json()["id"]
        # bob: the same name is free for him; alice's id does not exist for him
        assert create(s, ref, "mine", key="bob-key-1234567", x_vector_only="true"
                      ).status_code == 200  # fmt: skip
        bob_list = httpx.get(s.url + "/v1/audio/voices", headers=auth("bob-key-1234567")).json()
        assert vid not in [v["id"] for v in bob_list["data"]]
        for r in (httpx.get(f"{s.url}/v1/audio/voices/{vid}", headers=auth("bob-key-1234567")),
                  httpx.delete(f"{s.url}/v1/audio/voices/{vid}",
                               headers=auth("bob-key-1234567")),
                  speak(s, vid, key="bob-key-1234567"),
                  speak(s, vid, key="single-key-000")):  # QTTS_API_KEY is owner "default"
            assert r.status_code == 404, r.text
        assert_speech(speak(s, vid, key="alice-key-123456"))
        assert httpx.delete(f"{s.url}/v1/audio/voices/{vid}",
                            headers=auth("alice-key-123456")).status_code == 200
        lines = audit_lines(s)
        assert [(x["event"], x["owner"]) for x in lines] == [
            ("voice.create", "alice"), ("voice.create", "bob"), ("voice.delete", "alice")]
        assert all(len(x["ref_sha256"]) == 64 and x["voice_id"].startswith("voice_")
                   for x in lines)
        log = s.log()
        assert "alice-key-123456" not in log and "bob-key-1234567" not in log
    finally:
        s.stop()


def test_a_bad_keys_file_stops_the_server_with_its_line(base_gguf: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alice-key-123456 alice\nonlyoneword\n")
    s = Server(base_gguf, tmp_path, api_keys=keys)
    assert s.proc.wait(60) == 2
    assert "QTTS_API_KEYS" in s.log() and "line 2" in s.log()
    s.stop()
