"""Cloned voices over HTTP against real ``qtts serve`` processes on a tiny Base model (SQLite
store in a temporary data directory): every route, with httpx and the official ``openai``
client, every bad input, a worker crash mid-create, parallel creates and deletes, and a voice
made for another model."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.service.helpers import Server, log_records, metric, serving
from tests.service.voices_helpers import (
    REF_TEXT,
    assert_speech,
    audit_lines,
    create,
    reference,
    speak,
    wav_bytes,
)

MAX_REF_BYTES = 400_000


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return reference(tmp_path_factory.mktemp("ref"))


@pytest.fixture(scope="module")
def base(base_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(base_gguf, tmp_path_factory.mktemp("voices"),
                       max_reference_bytes=MAX_REF_BYTES, max_reference_seconds=8, queue_size=32)


def _names(server: Server) -> list[str]:
    r = httpx.get(server.url + "/v1/audio/voices")
    assert r.status_code == 200, r.text
    return [v["name"] for v in r.json()["data"] if v["object"] == "audio.voice"]


def test_create_list_get_use_delete(base: Server, ref: bytes) -> None:
    r = create(base, ref, "narrator")
    assert r.status_code == 200, r.text
    v = r.json()
    assert v["object"] == "audio.voice" and v["id"].startswith("voice_")
    assert v["name"] == "narrator" and v["mode"] == "icl" and v["type"] == "audio_sample"
    assert abs(v["reference_seconds"] - 3.1) < 0.5 and v["created_at"] > 0
    vid = v["id"]
    assert "narrator" in _names(base)
    got = httpx.get(f"{base.url}/v1/audio/voices/{vid}")
    assert got.status_code == 200 and got.json() == v
    # used by id, and as OpenAI's {"id": ...}, on both synthesis routes
    assert_speech(speak(base, vid))
    assert_speech(speak(base, {"id": vid}))
    r = httpx.post(base.url + "/v1/audio/speech", timeout=120, json={
        "model": "qtts", "input": "Hello there.", "voice": {"id": vid}, "response_format": "wav",
        "max_seconds": 0.5, "stream": False})
    assert_speech(r)
    lines = base.wait_request_lines(lambda x: x.get("voice") == vid, 3)
    assert len(lines) == 3  # the request log names the cloned voice
    # streamed like a built-in voice
    with httpx.stream("POST", base.url + "/tts", timeout=120, json={
            "text": "Hello there.", "voice": vid, "max_seconds": 0.5, "format": "pcm"}) as s:
        assert s.status_code == 200 and "content-length" not in s.headers
        assert sum(len(b) for b in s.iter_raw()) > 0
    d = httpx.delete(f"{base.url}/v1/audio/voices/{vid}")
    assert d.status_code == 200 and d.json() == {"id": vid, "object": "audio.voice.deleted",
                                                 "deleted": True}
    for r in (httpx.get(f"{base.url}/v1/audio/voices/{vid}"),
              httpx.delete(f"{base.url}/v1/audio/voices/{vid}"), speak(base, vid)):
        assert r.status_code == 404 and r.json()["error"]["code"] == "voice_not_found"
    assert "narrator" not in _names(base)
    events = [(a["event"], a["voice_id"]) for a in audit_lines(base) if a["voice_id"] == vid]
    assert events == [("voice.create", vid), ("voice.delete", vid)]
    ms = base.metrics()
    assert metric(ms, "qtts_voice_clone_seconds_count", stage="encode") >= 1
    assert metric(ms, "qtts_voice_clone_seconds_count", stage="prepare") >= 1
    assert metric(ms, "qtts_voice_clone_seconds_count", stage="store") >= 1


def test_x_vector_only_and_without_transcript(base: Server, ref: bytes) -> None:
    a = create(base, ref, "xv-flag", x_vector_only="true")
    b = create(base, ref, "xv-none", transcript=None)
    for r in (a, b):
        assert r.status_code == 200, r.text
        assert r.json()["mode"] == "x_vector_only"
        assert_speech(speak(base, r.json()["id"]))


def test_openai_sdk_creates_and_speaks_a_cloned_voice(base: Server, ref: bytes,
                                                      tmp_path: Path) -> None:  # fmt: skip
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=base.url + "/v1", api_key="unused", max_retries=0)
    f = tmp_path / "ref.wav"
    f.write_bytes(ref)
    with f.open("rb") as fh:
        voice = client.audio.voices.create(audio_sample=fh, consent="cons_test", name="sdk",
                                           extra_body={"transcript": REF_TEXT})
    assert voice.object == "audio.voice" and voice.name == "sdk"
    speech = client.audio.speech.create(model="qtts", voice={"id": voice.id},
                                        input="Hello there.", response_format="wav",
                                        extra_body={"max_seconds": 0.5})
    from tests.service.helpers import decoded_seconds

    assert decoded_seconds(speech.content, "wav") > 0
    gone = client.audio.voices.delete(voice.id)
    assert gone.deleted and gone.id == voice.id


def test_one_shot_reference_json_and_form(base: Server, ref: bytes) -> None:
    b64 = base64.b64encode(ref).decode()
    digest = hashlib.sha256(ref).hexdigest()

    def encoded() -> int:
        return sum(1 for line in base.log().splitlines() if line.startswith("{")
                   and json.loads(line).get("ref_sha256") == digest
                   and json.loads(line).get("msg") == "one-shot reference encoded")

    before = encoded()
    for _ in range(2):  # the second pays no encoding: the worker keeps it by the audio's hash
        assert_speech(speak(base, None, ref_audio=b64, ref_text=REF_TEXT))
    assert encoded() == before + 1
    # a browser's data: URL of the same file: the same reference (the cache's), the same audio
    via_url = speak(base, None, ref_audio="data:audio/wav;base64," + b64, ref_text=REF_TEXT)
    assert_speech(via_url)
    assert via_url.content == speak(base, None, ref_audio=b64, ref_text=REF_TEXT).content
    assert encoded() == before + 1
    not_url = speak(base, None, ref_audio="data:audio/wav," + b64)  # not base64: refused
    assert not_url.status_code == 400 and not_url.json()["error"]["field"] == "ref_audio"
    r = httpx.post(base.url + "/tts", timeout=120, data={
        "text": "Hello there.", "ref_text": REF_TEXT, "max_seconds": "0.5", "stream": "false",
        "seed": "1"}, files={"ref_audio": ("ref.wav", ref, "audio/wav")})
    assert_speech(r)
    bad = httpx.post(base.url + "/tts", timeout=30, data={"text": "Hi", "speed": "fast"},
                     files={"ref_audio": ("ref.wav", ref, "audio/wav")})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "speed"
    both = speak(base, "voice_0", ref_audio=b64)
    assert both.status_code == 400 and both.json()["error"]["field"] == "ref_audio"
    not64 = speak(base, None, ref_audio="%%%")
    assert not64.status_code == 400 and not64.json()["error"]["field"] == "ref_audio"
    silent = speak(base, None, ref_audio=base64.b64encode(wav_bytes(np.zeros(48000))).decode())
    assert silent.status_code == 400 and "silent" in silent.json()["error"]["message"]
    assert silent.json()["error"]["field"] == "ref_audio"


def test_form_text_is_utf8_or_says_its_charset(base: Server, ref: bytes) -> None:
    """A multipart ``/tts`` whose text field is not UTF-8 (Latin-1 bytes, as a terminal in that
    locale sends them) is a 400 naming the field, not speech of mojibake; UTF-8 text, and
    Latin-1 under a charset the Content-Type names, are read as sent."""
    import soundfile as sf

    # a reference of its own: the one-shot test counts the encodings of ``ref``
    audio, rate = sf.read(io.BytesIO(ref), dtype="float32")
    own = wav_bytes(0.7 * audio, rate)

    def post(text: bytes, content_type: str | None = None) -> httpx.Response:
        req = httpx.Request("POST", base.url + "/tts", data={
            "text": text, "ref_text": REF_TEXT, "max_seconds": "0.5", "stream": "false",
            "seed": "1"}, files={"ref_audio": ("ref.wav", own, "audio/wav")})
        body = req.read()
        ctype = req.headers["content-type"] + (f"; charset={content_type}" if content_type
                                               else "")
        return httpx.post(base.url + "/tts", content=body, timeout=120,
                          headers={"content-type": ctype})

    latin = "Un café, s'il vous plaît."
    bad = post(latin.encode("latin-1"))
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert err["field"] == "text" and "not UTF-8" in err["message"], err
    unknown = post(latin.encode("latin-1"), "x-klingon")
    assert unknown.status_code == 400 and unknown.json()["error"]["field"] == "text"
    assert "'x-klingon' is not one known here" in unknown.json()["error"]["message"]
    named_utf8 = post(latin.encode("latin-1"), "UTF8")  # UTF-8 by another name: still not it
    assert named_utf8.status_code == 400 and "not UTF-8 text" in named_utf8.text
    good = post(latin.encode("utf-8"))
    assert_speech(good)
    assert_speech(declared := post(latin.encode("latin-1"), "iso-8859-1"))
    assert declared.content == good.content  # the same text, so the same speech


def test_a_cut_short_mp3_reference_keeps_the_log_json(base: Server, ref: bytes) -> None:
    """libmpg123 prints notes on a damaged MP3 straight to the worker's stderr ("Warning: Xing
    stream size off ..." for one cut short, without a newline): the server's JSON log lines
    broke. They are one warning record now, and the audio that is there clones the voice."""
    import soundfile as sf

    audio, rate = sf.read(io.BytesIO(ref), dtype="float32")
    buf = io.BytesIO()
    sf.write(buf, audio, rate, format="MP3")
    cut = buf.getvalue()[: len(buf.getvalue()) * 3 // 4]  # a download cut short
    before = len(base.log().splitlines())
    assert_speech(speak(base, None, ref_audio=base64.b64encode(cut).decode()))
    said = [r for r in log_records(base, before) if "its decoder said" in r["msg"]]
    assert len(said) == 1 and "Xing stream size" in said[0]["msg"], said
    assert said[0]["logger"] == "qtts.clone" and said[0]["level"] == "warning"


def test_openai_sdk_clones_for_one_request(base: Server, ref: bytes) -> None:
    """One-shot cloning on /v1/audio/speech through the official client (extra_body; the
    client needs a voice: ``""``): the same samples as POST /tts with that reference."""
    openai = pytest.importorskip("openai")
    import soundfile as sf

    # a reference of its own, so this test's cache entry is not the other one-shot test's
    audio, rate = sf.read(io.BytesIO(ref), dtype="float32")
    b64 = base64.b64encode(wav_bytes(0.8 * audio, rate)).decode()
    client = openai.OpenAI(base_url=base.url + "/v1", api_key="unused", max_retries=0)
    extra = {"ref_audio": b64, "ref_text": REF_TEXT, "seed": 1, "max_seconds": 0.5,
             "stream": False}
    speech = client.audio.speech.create(model="qtts", voice="", input="Hello there.",
                                        response_format="wav", extra_body=extra)
    via_tts = speak(base, None, ref_audio=b64, ref_text=REF_TEXT)
    assert_speech(via_tts)
    got, _ = sf.read(io.BytesIO(speech.content), dtype="float32")
    want, _ = sf.read(io.BytesIO(via_tts.content), dtype="float32")
    assert got.size > 0 and np.array_equal(got, want)
    body = {"model": "qtts", "input": "Hello there.", "max_seconds": 0.5}
    both = httpx.post(base.url + "/v1/audio/speech", timeout=30,
                      json={**body, "voice": "voice_0", "ref_audio": b64})
    assert both.status_code == 400 and both.json()["error"]["field"] == "ref_audio"
    neither = httpx.post(base.url + "/v1/audio/speech", timeout=30, json=body)
    assert neither.status_code == 400 and neither.json()["error"]["field"] == "voice"


def _tone(seconds: float, rate: int = 24000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return wav_bytes(0.3 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t)),
                     rate)


@pytest.mark.parametrize(("case", "status", "field", "words"), [
    ("too_short", 400, "audio_sample", "at least"),
    ("too_long", 400, "audio_sample", "limit"),
    ("silent", 400, "audio_sample", "silent"),
    ("undecodable", 400, "audio_sample", "cannot be decoded"),
    ("over_cap", 413, "audio_sample", "larger than"),
    ("far_over_cap", 413, "file", "reference cap (400000 bytes"),
    ("text_part", 415, "audio_sample", "not audio"),
    ("json_body", 415, "content-type", "multipart/form-data"),
    ("no_file", 400, "file", "missing"),
    ("empty_name", 400, "name", "empty"),
    ("long_name", 400, "name", "limit"),
    ("unknown_field", 400, "colour", "not a known field"),
    ("bad_flag", 400, "x_vector_only", "true or false"),
    ("empty_file", 400, "audio_sample", "empty"),
    ("file_without_filename", 400, "body", "sent as a file part"),
    ("name_twice", 400, "name", "sent twice"),
    ("two_files", 400, "body", "more than 1 file part"),  # (was "Too many files. Maximum...")
    ("prompt_type", 400, "type", "from a text prompt"),  # (the SDK's other variant)
    ("c1_name", 400, "name", "control characters"),
    ("bidi_name", 400, "name", "control characters"),
    ("invisible_name", 400, "name", "empty"),
    ("latin1_transcript", 400, "transcript", "not UTF-8"),  # (was spoken as mojibake)
])  # fmt: skip
def test_bad_creates_are_clear_and_store_nothing(base: Server, ref: bytes, case: str,
                                                 status: int, field: str, words: str) -> None:
    url = base.url + "/v1/audio/voices"
    name = f"bad-{case}"
    audio = {"too_short": _tone(0.5), "too_long": _tone(9.0, 16000),
             "silent": wav_bytes(np.zeros(48000)), "undecodable": b"this is not audio" * 100,
             "over_cap": _tone(9.0), "far_over_cap": _tone(9.0, 48000),
             "empty_file": b""}.get(case, ref)
    files: Any = {"audio_sample": ("ref.wav", audio, "audio/wav")}
    data: dict[str, Any] = {"name": name, "transcript": REF_TEXT}
    if case == "text_part":
        files = {"audio_sample": ("notes.txt", b"hello", "text/plain")}
    elif case == "empty_name":
        data["name"] = "   "
    elif case == "long_name":
        data["name"] = "n" * 129
    elif case in ("c1_name", "bidi_name", "invisible_name"):
        data["name"] = {"c1_name": "a\u0085b", "bidi_name": "evil\u202egnp.exe",
                        "invisible_name": "\u200b \u2060"}[case]
    elif case == "unknown_field":
        data["colour"] = "blue"
    elif case == "latin1_transcript":
        data["transcript"] = "Un café, s'il vous plaît.".encode("latin-1")
    elif case == "bad_flag":
        data["x_vector_only"] = "maybe"
    elif case == "prompt_type":
        data.update(type="prompt", prompt="a warm low voice", script_hint="latin")
    if case == "json_body":
        r = httpx.post(url, json={"name": name}, timeout=60)
    elif case == "no_file":  # a form with a name and no file
        r = httpx.post(url, timeout=60,
                       headers={"content-type": "multipart/form-data; boundary=b"},
                       content=b'--b\r\nContent-Disposition: form-data; name="name"\r\n\r\n'
                       b"bad-no_file\r\n--b--\r\n")
    elif case == "file_without_filename":  # to the parser, a text field of the audio's size
        assert len(ref) > 64 * 1024
        r = httpx.post(url, timeout=60,
                       headers={"content-type": "multipart/form-data; boundary=b"},
                       content=b'--b\r\nContent-Disposition: form-data; name="audio_sample"'
                       b"\r\n\r\n" + ref + b'\r\n--b\r\nContent-Disposition: form-data; '
                       b'name="name"\r\n\r\n' + name.encode() + b"\r\n--b--\r\n")
    elif case == "name_twice":
        r = httpx.post(url, data={**data, "name": [name, "other"]}, files=files, timeout=120)
    elif case == "two_files":
        r = httpx.post(url, data=data, timeout=120, files=[
            ("audio_sample", ("a.wav", ref, "audio/wav")), ("files", ("b.wav", ref, "audio/wav"))])
    else:
        r = httpx.post(url, data=data, files=files, timeout=120)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field and words in err["message"], err
    assert name not in _names(base)


def test_duplicate_names_are_refused_per_owner(base: Server, ref: bytes) -> None:
    first = create(base, ref, "twin", x_vector_only="true")
    assert first.status_code == 200
    again = create(base, ref, "twin", x_vector_only="true")
    assert again.status_code == 409 and again.json()["error"]["code"] == "duplicate_name"
    assert _names(base).count("twin") == 1
    # one spelling per name: composed and decomposed "café" are the same name (NFC)
    assert create(base, ref, "caf\u00e9", x_vector_only="true").status_code == 200
    same = create(base, ref, "cafe\u0301", x_vector_only="true")
    assert same.status_code == 409 and same.json()["error"]["code"] == "duplicate_name"


def test_twenty_parallel_creates_and_deletes(base: Server, ref: bytes) -> None:
    olds = [create(base, ref, f"old-{i}", x_vector_only="true").json()["id"] for i in range(10)]
    results: dict[str, int] = {}

    def work(i: int) -> None:
        if i < 10:
            r = create(base, ref, f"par-{i}", x_vector_only="true")
        else:
            r = httpx.delete(f"{base.url}/v1/audio/voices/{olds[i - 10]}", timeout=120)
        results[f"{i}"] = r.status_code

    threads = [threading.Thread(target=work, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(results.values()) == {200}, results
    names = _names(base)
    assert sorted(n for n in names if n.startswith("par-")) == sorted(f"par-{i}"
                                                                      for i in range(10))
    assert not [n for n in names if n.startswith("old-")]
    for v in httpx.get(base.url + "/v1/audio/voices").json()["data"]:
        if v["name"].startswith("par-"):  # every stored voice is whole: it speaks
            assert_speech(speak(base, v["id"]))
            break


def test_a_crash_mid_create_stores_nothing(base_gguf: Path, tmp_path: Path, ref: bytes) -> None:
    s = Server(base_gguf, tmp_path, test_fault="exit@clone", data_dir=tmp_path / "data")
    try:
        s.wait_ready()
        r = create(s, ref, "doomed")
        assert r.status_code == 503 and r.json()["error"]["code"] == "worker_died"
        assert r.headers["retry-after"]
        assert _names(s) == []
    finally:
        s.stop()
    with sqlite3.connect(tmp_path / "data" / "voices.sqlite3") as db:
        assert db.execute("SELECT COUNT(*) FROM voices").fetchone()[0] == 0


def test_reference_audio_kept_only_when_asked(base_gguf: Path, tmp_path: Path,
                                              ref: bytes) -> None:  # fmt: skip
    for keep in (False, True):
        data = tmp_path / f"data-{keep}"
        s = Server(base_gguf, tmp_path, data_dir=data, keep_reference_audio=int(keep))
        try:
            s.wait_ready()
            assert create(s, ref, "kept", x_vector_only="true").status_code == 200
        finally:
            s.stop()
        with sqlite3.connect(data / "voices.sqlite3") as db:
            (audio,) = db.execute("SELECT ref_audio FROM voices").fetchone()
        assert (audio == ref) if keep else audio is None


def test_a_voice_of_another_model_is_a_409_naming_both(base_gguf: Path, tmp_path: Path,
                                                        ref: bytes) -> None:  # fmt: skip
    from engine.tools.make_model import make_model

    make_model(tmp_path / "other", "tiny", seed=22, variant="base", progress=False)
    data = tmp_path / "data"
    a = Server(base_gguf, tmp_path, data_dir=data, model_name="base-a")
    try:
        a.wait_ready()
        vid = create(a, ref, "portable", x_vector_only="true").json()["id"]
    finally:
        a.stop()
    b = Server(tmp_path / "other" / "model.gguf", tmp_path, data_dir=data, model_name="base-b")
    try:
        b.wait_ready()
        r = speak(b, vid)
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["field"] == "voice" and err["code"] == "voice_model_mismatch"
        assert "'base-a'" in err["message"] and "'base-b'" in err["message"]
    finally:
        b.stop()


def test_a_damaged_stored_voice_names_the_voice(base_gguf: Path, tmp_path: Path,
                                                ref: bytes) -> None:  # fmt: skip
    """A stored prompt that no longer reads (the database row damaged): the error names the
    voice the client sent, not a ``voice_file`` it never did, and the worker serves on."""
    import sqlite3

    data = tmp_path / "data"
    s = Server(base_gguf, tmp_path, data_dir=data)
    try:
        s.wait_ready()
        vid = create(s, ref, "damaged", x_vector_only="true").json()["id"]
        with sqlite3.connect(data / "voices.sqlite3") as db:
            db.execute("UPDATE voices SET prompt = ? WHERE id = ?", (b"\x00" * 64, vid))
        r = speak(s, vid)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["field"] == "voice" and "stored voice is damaged" in err["message"], err
        assert_speech(speak(s, None, ref_audio=base64.b64encode(ref).decode(),
                            ref_text=REF_TEXT))
    finally:
        s.stop()


def test_a_model_that_does_not_clone(server: Server, ref: bytes) -> None:
    """The CustomVoice tiny model: creating is a 422, its built-in voices are listed."""
    r = create(server, ref, "nope")
    assert r.status_code == 422 and r.json()["error"]["code"] == "cloning_unavailable"
    v = httpx.get(server.url + "/v1/audio/voices").json()
    assert all(x["object"] == "voice" for x in v["data"]) and v["data"]


def test_realtime_session_speaks_a_stored_voice(base: Server, ref: bytes) -> None:
    """A realtime session names a stored voice by id: the same samples as POST /tts in that
    voice with text_mode stream; an unknown id is an error event naming the field."""
    import asyncio

    from websockets.asyncio.client import connect

    r = create(base, ref, "realtime-voice")
    assert r.status_code == 200, r.text
    vid = r.json()["id"]
    text = "Good morning, and welcome."
    url = base.url.replace("http://", "ws://") + "/v1/tts/realtime"

    async def go(voice: str) -> tuple[list[dict[str, Any]], bytes]:
        events: list[dict[str, Any]] = []
        audio = b""
        async with connect(url) as ws:
            await ws.recv()  # session.started
            await ws.send(json.dumps({"type": "session", "voice": voice, "seed": 4}))
            events.append(json.loads(await ws.recv()))
            if events[-1]["type"] == "error":
                return events, audio
            await ws.send(json.dumps({"type": "text", "text": text}))
            await ws.send(json.dumps({"type": "end"}))
            async for msg in ws:
                if isinstance(msg, bytes):
                    audio += msg
                    continue
                events.append(json.loads(msg))
                if events[-1]["type"] in ("done", "error"):
                    break
        return events, audio

    events, audio = asyncio.run(go(vid))
    assert events[0]["type"] == "session.updated" and events[-1]["type"] == "done", events
    whole = httpx.post(base.url + "/tts", timeout=120, json={
        "text": text, "voice": vid, "seed": 4, "format": "pcm", "text_mode": "stream"})
    assert whole.status_code == 200, whole.text
    assert len(audio) > 0 and audio == whole.content
    events, _ = asyncio.run(go("voice_000000000000000000000000"))
    assert events[0]["type"] == "error" and events[0]["field"] == "voice", events
    assert events[0]["code"] == "voice_not_found"
    assert httpx.delete(base.url + f"/v1/audio/voices/{vid}").status_code == 200
