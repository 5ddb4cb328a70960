"""``WS /v1/tts/realtime`` against a real ``qtts serve`` on loopback, with the real
``websockets`` client: deltas with delays, pauses, flush, cancel, disconnect, bad messages,
auth, several utterances, and the identity with ``POST /tts`` (``text_mode: stream``)."""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from engine.pipeline import chunk_sizes
from tests.service.helpers import FRAME_SAMPLES, Server, decoded_seconds, metric, serving
from tests.service.realtime_helpers import (
    collect,
    error_event,
    events_until_closed,
    first_audio,
    open_session,
    run,
    send,
    speak,
    words,
    ws_url,
)

SENTENCE = "The quick brown fox jumps over the lazy dog, then rests in the sun."
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def rt_server(service_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(service_model, tmp_path_factory.mktemp("rt"), workers=2,
                       realtime_min_tokens=3)


def test_deltas_with_delays_then_end(rt_server: Server) -> None:
    async def go() -> tuple[list[dict[str, Any]], bytes]:
        async with connect(ws_url(rt_server)) as ws:
            started = json.loads(await ws.recv())
            assert started["type"] == "session.started"
            assert started["audio"] == {"encoding": "pcm_s16le", "sample_rate": 24000,
                                        "channels": 1}
            await send(ws, type="session", voice="ryan", seed=7)
            updated = json.loads(await ws.recv())
            assert updated["type"] == "session.updated" and updated["audio"] == started["audio"]
            rng = random.Random(1)
            for w in words(SENTENCE):
                await send(ws, type="text", text=w)
                await asyncio.sleep(rng.uniform(0.005, 0.05))
            await send(ws, type="end")
            return await collect(ws)

    events, audio = run(go())
    kinds = [e["type"] for e in events]
    assert kinds[0] == "utterance.started"
    assert "audio.first" in kinds and kinds[-1] == "done"
    chunks = [e for e in events if e["type"] == "audio"]
    assert chunks and all(e["timings_ms"] is not None for e in chunks)
    done = events[-1]["usage"]
    assert done["characters"] == len(SENTENCE)
    assert done["outcome"] in ("ok", "truncated_no_eos")
    assert done["frames"] == sum(e["frames"] for e in chunks)
    assert len(audio) == 2 * sum(e["samples"] for e in chunks) == 2 * 1920 * done["frames"]
    ms = rt_server.metrics()
    assert metric(ms, "qtts_realtime_text_to_first_audio_seconds_count") >= 1
    assert metric(ms, "qtts_realtime_audio_behind_text_seconds_count") >= 1


def test_letters_and_a_pause_longer_than_the_buffer(rt_server: Server) -> None:
    """Single letters, then a pause while the talker has spoken every token: generation waits
    (no PAD ends the text) and resumes on the next delta, in the same utterance."""
    async def go() -> tuple[list[dict[str, Any]], bytes]:
        async with connect(ws_url(rt_server)) as ws:
            await open_session(ws, voice="ryan", start="immediate", seed=3)
            for ch in "Hello there, ":
                await send(ws, type="text", text=ch)
                await asyncio.sleep(0.005)
            await send(ws, type="flush")
            await asyncio.sleep(1.5)
            for w in words("how are you today?"):
                await send(ws, type="text", text=w)
                await asyncio.sleep(0.02)
            await send(ws, type="end")
            return await collect(ws)

    events, audio = run(go())
    ids = {e.get("id") for e in events if "id" in e}
    assert len(ids) == 1  # one utterance across the pause
    assert events[-1]["type"] == "done"
    assert len(audio) == 2 * 1920 * events[-1]["usage"]["frames"]


def test_a_late_chunk_after_the_text_is_a_stream_gap(make_server: Any) -> None:
    """The worker sleeps 1.5 s before its fourth chunk (QTTS_TEST_FAULT), long after the whole
    text arrived: a client playing the 7 frames it had ran dry, so the utterance reports a
    stream gap and the server's counter has it."""
    s: Server = make_server(test_fault="sleep=1.5@chunk=3")
    before = metric(s.metrics(), "qtts_stream_gaps_total")
    before_s = metric(s.metrics(), "qtts_stream_gap_seconds_total")

    events, _ = run(speak(s, "Hello there, this is a test of the realtime route.", voice="ryan",
                          start="immediate", seed=5))
    assert sum(e["type"] == "audio" for e in events) >= 4, events  # the late chunk came
    gaps = events[-1]["usage"]["stream_gaps"]
    assert gaps >= 1
    assert metric(s.metrics(), "qtts_stream_gaps_total") - before == gaps
    # and how long the listener waited: most of the 1.5 s, less the audio it held
    waited = events[-1]["usage"]["stream_gap_seconds"]
    assert 0.3 < waited < 2.5
    assert metric(s.metrics(), "qtts_stream_gap_seconds_total") - before_s == pytest.approx(
        waited, abs=1e-3)


@pytest.mark.parametrize("fmt", ["pcm", "opus"])
def test_a_cancel_drops_the_audio_the_worker_made_before_it(make_server: Any, fmt: str) -> None:
    """A listener who interrupts hears nothing more of the utterance. The worker sleeps 2 s
    before sending its second chunk (QTTS_TEST_FAULT), so that chunk is made before the cancel
    arrives and reaches the session after it: it is not sent, and the utterance's usage and
    the audio counter hold only what was."""
    s: Server = make_server(test_fault="sleep=2.0@chunk=1")
    before = metric(s.metrics(), "qtts_audio_seconds_total")

    async def go() -> tuple[list[dict[str, Any]], bytes, list[dict[str, Any]], bytes]:
        async with connect(ws_url(s)) as ws:
            await open_session(ws, voice="ryan", start="immediate", seed=5, format=fmt)
            await send(ws, type="text", text=SENTENCE)
            await send(ws, type="end")
            first: list[dict[str, Any]] = []
            async for msg in ws:  # up to the first chunk's audio
                if isinstance(msg, bytes):
                    head = msg
                    break
                first.append(json.loads(msg))
            await send(ws, type="cancel")
            events, rest = await collect(ws)
            return first, head, events, rest

    first, head, events, rest = run(go())
    announced = [e for e in first if e["type"] == "audio"]
    assert len(announced) == 1, first
    assert not [e for e in events if e["type"] == "audio"], events
    done = events[-1]
    assert done["type"] == "done" and done["usage"]["outcome"] == "cancelled"
    assert done["usage"]["frames"] == announced[0]["frames"]
    seconds = announced[0]["samples"] / 24000
    assert done["usage"]["audio_seconds"] == pytest.approx(seconds, abs=1e-4)
    if fmt == "pcm":
        assert rest == b"" and len(head) == 2 * announced[0]["samples"]
    else:  # the Ogg stream ends whole, with what was made before the cancel
        assert abs(decoded_seconds(head + rest, "opus") - seconds) < 0.1
    assert metric(s.metrics(), "qtts_audio_seconds_total") - before == pytest.approx(
        seconds, abs=1e-3)


def test_a_cancel_after_the_whole_utterance_was_sent_stops_nothing(make_server: Any) -> None:
    """The worker holds an utterance's end 6 s after its last chunk (QTTS_TEST_FAULT): a
    cancel sent in that time stops nothing, so the done reports the utterance's own outcome with
    every frame it sent (not ``cancelled``), and the request counter agrees."""
    s: Server = make_server(test_fault="sleep=6@done")
    route = "/v1/tts/realtime"
    before = metric(s.metrics(), "qtts_requests_total", route=route, outcome="cancelled")

    async def go() -> tuple[list[dict[str, Any]], bytes]:
        async with connect(ws_url(s)) as ws:
            await open_session(ws, voice="ryan", start="immediate", seed=3)
            await send(ws, type="text", text="A short answer.")
            await send(ws, type="end")
            events: list[dict[str, Any]] = []
            audio = b""
            while True:  # until the audio stops (the last chunk came; the end is held)
                try:
                    msg = await asyncio.wait_for(ws.recv(), 3.0 if audio else 60)
                except TimeoutError:
                    break
                if isinstance(msg, bytes):
                    audio += msg
                else:
                    events.append(json.loads(msg))
                    assert events[-1]["type"] != "done", events
            await send(ws, type="cancel")
            rest, more = await collect(ws)
            return events + rest, audio + more

    events, audio = run(go())
    done = events[-1]
    assert done["type"] == "done"
    assert done["usage"]["outcome"] in ("ok", "truncated_no_eos"), done
    frames = sum(e["frames"] for e in events if e["type"] == "audio")
    assert done["usage"]["frames"] == frames > 0
    assert len(audio) == 2 * 1920 * frames
    assert metric(s.metrics(), "qtts_requests_total", route=route, outcome="cancelled") == before


def _post_stream(server: Server, text: str) -> bytes:
    """POST /tts of the same text in streaming-text mode with the same seed: its PCM."""
    r = httpx.post(server.url + "/tts", json={"text": text, "seed": 11, "format": "pcm",
                                              "voice": "ryan", "text_mode": "stream"},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.content


def test_identity_with_post_tts_stream(rt_server: Server) -> None:
    """All text at once: the same samples as POST /tts with text_mode stream and the seed, in
    the chunks of the gentle ramp (a stream alone in its worker: QTTS_CHUNK_RAMP auto)."""
    events, got = run(speak(rt_server, SENTENCE, voice="ryan", seed=11))
    assert events[-1]["usage"]["outcome"] != "error"
    sizes = [e["frames"] for e in events if e["type"] == "audio"]
    ramp = chunk_sizes(16, "gentle")
    want = [next(ramp) for _ in sizes]
    assert len(sizes) > 6 and sizes[:-1] == want[:-1] and sizes[-1] <= want[-1]
    assert len(got) > 0
    assert got == _post_stream(rt_server, SENTENCE)


def test_several_utterances_and_cancel(rt_server: Server) -> None:
    async def go() -> list[list[dict[str, Any]]]:
        out = []
        async with connect(ws_url(rt_server)) as ws:
            await open_session(ws, voice="ryan", start="immediate")
            await send(ws, type="text", text="A first short answer. ")
            await send(ws, type="end")
            out.append((await collect(ws))[0])
            # the second: cancelled mid-text; the third still works on the same socket. The
            # random tiny model may sample its end of speech before the cancel arrives: then
            # another utterance is cut (a broken cancel never gives "cancelled")
            for _ in range(4):
                await send(ws, type="text", text="This one is cut off before it ends ")
                await send(ws, type="flush")
                await asyncio.sleep(0.05)
                await send(ws, type="cancel")
                out.append((await collect(ws))[0])
                if out[-1][-1]["usage"]["outcome"] == "cancelled":
                    break
                assert out[-1][-1]["usage"]["outcome"] == "ok", out[-1]
            await send(ws, type="text", text="And a third.")
            await send(ws, type="end")
            out.append((await collect(ws))[0])
        return out

    first, *middle, third = run(go())
    second = middle[-1]
    assert first[-1]["usage"]["outcome"] in ("ok", "truncated_no_eos")
    assert second[-1]["usage"]["outcome"] == "cancelled"
    assert third[-1]["type"] == "done" and third[-1]["usage"]["outcome"] != "cancelled"
    assert len({u[0]["id"] for u in (first, *middle, third)}) == 2 + len(middle)


def test_each_utterance_is_a_request_counted_and_logged(rt_server: Server) -> None:
    """Every utterance of a session counts in ``qtts_requests_total`` (route
    ``/v1/tts/realtime``) with the outcome its ``done`` says, and leaves one request log line
    under the session's id (the client's ``X-Request-Id``, echoed in ``session.started``):
    without them the service's error-rate and gap alerts divide realtime failures and stalls
    by HTTP requests only."""
    route = "/v1/tts/realtime"
    before = {o: metric(rt_server.metrics(), "qtts_requests_total", route=route, outcome=o)
              for o in ("ok", "truncated_no_eos", "cancelled")}

    async def go() -> tuple[dict[str, Any], list[list[dict[str, Any]]]]:
        out = []
        async with connect(ws_url(rt_server),
                           additional_headers={"X-Request-Id": "rt-log-1"}) as ws:
            started = json.loads(await ws.recv())
            await send(ws, type="session", voice="ryan", start="immediate", seed=2)
            await ws.recv()
            await send(ws, type="text", text="A first short answer.")
            await send(ws, type="end")
            out.append((await collect(ws))[0])
            await send(ws, type="text", text="This one is cut off before it ends ")
            await send(ws, type="flush")
            await first_audio(ws)
            await send(ws, type="cancel")
            out.append((await collect(ws))[0])
        return started, out

    started, utterances = run(asyncio.wait_for(go(), 120))
    assert started["id"] == "rt-log-1"
    dones = [u[-1] for u in utterances]
    ids = [d["id"] for d in dones]
    outcomes = [d["usage"]["outcome"] for d in dones]
    assert outcomes[0] in ("ok", "truncated_no_eos")
    assert outcomes[1] in ("cancelled", "ok", "truncated_no_eos")  # (its end may come first)
    lines = rt_server.wait_request_lines(lambda r: r.get("id") == "rt-log-1", count=2)
    assert [r["utterance"] for r in lines] == ids
    for rec, done in zip(lines, dones, strict=True):
        usage = done["usage"]
        assert rec["route"] == route and rec["outcome"] == usage["outcome"]
        assert (rec["frames"], rec["chars"], rec["audio_seconds"], rec["stream_gaps"]) == (
            usage["frames"], usage["characters"], round(usage["audio_seconds"], 3),
            usage["stream_gaps"])
        assert rec["ttfa_seconds"] is not None and rec["ttfa_seconds"] > 0
        assert rec["voice"] == "ryan" and rec["format"] == "pcm"
    ms = rt_server.metrics()
    for o in before:
        assert metric(ms, "qtts_requests_total", route=route, outcome=o) - before[o] == \
            outcomes.count(o)


def test_a_cancel_after_the_end_stops_the_speech(rt_server: Server) -> None:
    """Barge-in: a voice agent sends the whole answer and its end, the listener interrupts
    while it is spoken, and the cancel stops it (its done says cancelled). A cancel after the
    next utterance's text is that utterance's, not the one speaking."""
    async def go() -> list[list[dict[str, Any]]]:
        out = []
        async with connect(ws_url(rt_server)) as ws:
            await open_session(ws, voice="ryan", start="immediate")
            # (the random tiny model may end its speech before the cancel arrives: then again)
            for _ in range(4):
                await send(ws, type="text", text=SENTENCE + " " + SENTENCE)
                await send(ws, type="end")
                await first_audio(ws)
                await send(ws, type="cancel")
                out.append((await collect(ws))[0])
                if out[-1][-1]["usage"]["outcome"] == "cancelled":
                    break
            await send(ws, type="text", text=SENTENCE)
            await send(ws, type="end")
            await send(ws, type="text", text="The next one.")
            await send(ws, type="cancel")
            out.append((await collect(ws))[0])
            out.append((await collect(ws))[0])
        return out

    *interrupted, spoken, next_one = run(asyncio.wait_for(go(), 120))
    assert interrupted[-1][-1]["usage"]["outcome"] == "cancelled", interrupted
    assert spoken[-1]["usage"]["outcome"] in ("ok", "truncated_no_eos"), spoken[-1]
    assert next_one[-1]["usage"]["outcome"] == "cancelled"


def test_settings_sent_after_an_end_are_the_next_utterances(rt_server: Server) -> None:
    """A voice agent pipelines: an answer and its end, then the next answer's settings (another
    voice) and text, before the first is spoken. The settings wait for the first's done and the
    second speaks with them: the audio a fresh session makes with those settings. Settings while
    an utterance's text is still being written are refused, and the utterance goes on."""
    second_text = "And now another voice speaks."

    async def pipelined() -> bytes:
        async with connect(ws_url(rt_server)) as ws:
            await open_session(ws, voice="ryan", seed=3)
            await send(ws, type="text", text=SENTENCE)
            await send(ws, type="end")
            await send(ws, type="session", voice="vivian", seed=4)
            await send(ws, type="text", text=second_text)
            await send(ws, type="end")
            first, _ = await collect(ws)
            assert first[-1]["usage"]["outcome"] in ("ok", "truncated_no_eos"), first[-1]
            updated = json.loads(await ws.recv())  # after the first's done, before the second
            assert updated["type"] == "session.updated", updated
            assert updated["settings"]["voice"] == "vivian"
            events, audio = await collect(ws)
            assert events[0]["type"] == "utterance.started"
            return audio

    async def fresh() -> bytes:
        return (await speak(rt_server, second_text, voice="vivian", seed=4))[1]

    async def mid_text() -> tuple[dict[str, Any], list[dict[str, Any]], bytes]:
        # refused, and nothing lost: the utterance goes on in its own voice to its done
        async with connect(ws_url(rt_server)) as ws:
            await open_session(ws, voice="ryan", seed=4)
            await send(ws, type="text", text="Still writing ")
            await send(ws, type="session", voice="vivian")
            refused = await error_event(ws)
            await send(ws, type="text", text=second_text)
            await send(ws, type="end")
            events, audio = await collect(ws)
            return refused, events, audio

    got = run(asyncio.wait_for(pipelined(), 120))
    assert got and got == run(asyncio.wait_for(fresh(), 120))
    refused, events, audio = run(asyncio.wait_for(mid_text(), 60))
    assert refused["code"] == "session_busy" and refused["field"] == "type"
    assert events[-1]["usage"]["outcome"] in ("ok", "truncated_no_eos"), events[-1]
    assert events[-1]["usage"]["characters"] == len("Still writing " + second_text)
    assert len(audio) == 2 * FRAME_SAMPLES * events[-1]["usage"]["frames"] > 0


def test_an_answer_that_opens_with_whitespace_and_one_with_nothing_to_say(
        rt_server: Server) -> None:
    """A model's answer often opens with a newline: that first delta starts the utterance as
    any other does. An utterance with nothing to say ends in an error event and its done, and
    the session goes on."""
    async def go() -> list[list[dict[str, Any]]]:
        async with connect(ws_url(rt_server)) as ws:
            await open_session(ws, voice="ryan")
            utterances = []
            for deltas in (["\n\n", "Hello there."], ["  \n\t "], ["\u200b", "\u0000"],
                           ["Still here."]):
                for d in deltas:
                    await send(ws, type="text", text=d)
                await send(ws, type="end")
                events, audio = await collect(ws)
                assert (len(audio) > 0) == (deltas[-1] in ("Hello there.", "Still here.")), deltas
                utterances.append(events)
            return utterances

    spoken, empty, invisible, after = run(asyncio.wait_for(go(), 120))
    assert spoken[-1]["usage"]["outcome"] in ("ok", "truncated_no_eos")
    # (zero-width and NUL characters were spoken: seconds); the code and messages of POST /tts
    for nothing, says in ((empty, "text: is empty"), (invisible, "text: has nothing to speak")):
        (err,) = [ev for ev in nothing if ev["type"] == "error"]
        assert err["field"] == "text" and err["code"] == "empty", err
        assert err["message"].startswith(says), err
        assert nothing[-1]["type"] == "done"
    assert after[-1]["usage"]["outcome"] in ("ok", "truncated_no_eos")


def test_chinese_speaks_as_it_is_written(rt_server: Server) -> None:
    """Text with no spaces (an LLM's Chinese answer, a character or two a delta) is spoken
    clause by clause while it is written: audio comes before the text's end, with no flush."""
    answer = ("\u4f60\u597d\u4e16\u754c\u3002\u4eca\u5929\u5929\u6c14\u5f88\u597d\uff0c"
              "\u6211\u4eec\u53bb\u516c\u56ed\u5427\u3002")

    async def go() -> tuple[list[dict[str, Any]], bytes]:
        async with connect(ws_url(rt_server)) as ws:
            await open_session(ws, voice="ryan", language="chinese")
            for i in range(0, len(answer), 2):
                await send(ws, type="text", text=answer[i:i + 2])
                await asyncio.sleep(0.02)
            await asyncio.wait_for(first_audio(ws), 30)  # before the end: without it, never
            await send(ws, type="end")
            return await collect(ws)

    events, audio = run(asyncio.wait_for(go(), 120))
    assert audio and events[-1]["type"] == "done"
    assert events[-1]["usage"]["outcome"] in ("ok", "truncated_no_eos"), events[-1]


def test_disconnect_frees_the_worker(rt_server: Server) -> None:
    async def go() -> None:
        for _ in range(3):  # more sessions than workers: each disconnect must free its worker
            async with connect(ws_url(rt_server)) as ws:
                await open_session(ws, voice="ryan")
                await send(ws, type="text", text="Some words that never end, ")
                await send(ws, type="flush")
                await asyncio.sleep(0.1)
        async with connect(ws_url(rt_server)) as ws:
            await open_session(ws, voice="ryan")
            await send(ws, type="text", text="Still served.")
            await send(ws, type="end")
            events, _ = await collect(ws)
            assert events[-1]["type"] == "done"

    run(go())
    ms = rt_server.metrics()
    assert metric(ms, "qtts_realtime_sessions") == 0


START_FORMS = 'start: must be "immediate", "auto" or a number of tokens 1..2048'
LONE_SURROGATE = "has a lone surrogate U+D800 at character 1: not valid Unicode text"


async def flood(ws: ClientConnection, pairs: int) -> None:
    """``pairs`` empty deltas, each followed by a flush: messages that carry nothing."""
    empty, flush = json.dumps({"type": "text", "text": ""}), json.dumps({"type": "flush"})
    for _ in range(pairs):
        await ws.send(empty)
        await ws.send(flush)


@pytest.mark.parametrize(("message", "code", "close", "says"), [
    ("not json", "invalid_json", 1008, "not JSON"),
    ("[" * 100_000 + "]" * 100_000, "invalid_json", 1008, "not JSON: nested too deep"),
    ('{"type": "session", "seed": 1' + "0" * 5000 + "}", "invalid_value", 1008,
     "the message has a number of more than 4300 digits"),
    (json.dumps({"type": "sing"}), "unknown_type", 1008, "unknown message type"),
    (json.dumps({"type": "text"}), "invalid_value", 1008, "text: Field required"),
    (json.dumps({"type": "text", "text": "a\ud800b"}), "invalid_value", 1008,
     "text: " + LONE_SURROGATE),
    (json.dumps({"type": "session", "voice": "a\ud800b"}), "invalid_value", 1008,
     "voice: " + LONE_SURROGATE),
    (json.dumps({"type": "session", "voice": "nobody-at-all"}), None, 1008, "voice: "),
    (json.dumps({"type": "text", "text": "no voice was set"}), None, 1008, "voice: "),
    (json.dumps({"type": "session", "temperature": -1}), "invalid_value", 1008, "temperature: "),
    (json.dumps({"type": "session", "start": 0}), "invalid_value", 1008, START_FORMS),
    (json.dumps({"type": "session", "start": 10**6}), "invalid_value", 1008, START_FORMS),
    (json.dumps({"type": "session", "start": 1.5}), "invalid_value", 1008, START_FORMS),
    (json.dumps({"type": "session", "start": True}), "invalid_value", 1008, START_FORMS),
    (json.dumps({"type": "session", "start": "soon"}), "invalid_value", 1008, START_FORMS),
    (json.dumps([1, 2]), "invalid_message", 1008, "a message must be a JSON object"),
    (b"\x00\x01", "binary_message", 1003, "messages are JSON text"),
])
def test_bad_messages_error_then_close(rt_server: Server, message: str | bytes,
                                       code: str | None, close: int, says: str) -> None:
    async def go() -> tuple[dict[str, Any], int | None]:
        async with connect(ws_url(rt_server)) as ws:
            await ws.recv()
            await ws.send(message)
            ev = json.loads(await ws.recv())
            with pytest.raises(ConnectionClosed):
                await ws.recv()
            return ev, ws.close_code

    ev, got = run(go())
    assert ev["type"] == "error"
    if code is not None:
        assert ev["code"] == code
    else:
        assert ev["field"] == "voice", ev
    assert ev["message"].startswith(says), ev
    assert "[" not in ev["message"].split(":")[0]  # no pydantic names in the field's path
    assert got == close


def test_a_voice_by_id_as_the_http_routes_take_it(rt_server: Server) -> None:
    """``voice: {"id": ...}`` (OpenAI's form, which POST /tts and /v1/audio/speech take) in a
    ``session`` message: the voice of that id, sample for sample; another shape is refused
    naming both forms."""
    by_name = run(speak(rt_server, "Hello there.", voice="ryan", seed=3))
    by_id = run(speak(rt_server, "Hello there.", voice={"id": "ryan"}, seed=3))
    assert by_id[0][-1]["type"] == "done" and by_id[1] and by_id[1] == by_name[1]

    async def bad() -> dict[str, Any]:
        async with connect(ws_url(rt_server)) as ws:
            await ws.recv()
            await send(ws, type="session", voice={"id": "ryan", "x": 1})
            return await error_event(ws)

    err = run(asyncio.wait_for(bad(), 60))
    assert err["field"] == "voice" and err["message"].startswith(
        'voice: must be a voice name or {"id": "<voice id>"}'), err


def test_a_connection_lost_mid_utterance_is_logged(rt_server: Server) -> None:
    """A client whose connection drops while its utterance is spoken (no close frame): the
    session ends, its worker is freed, and the server logs one line saying so (the session
    had no other trace of it); a client that closes normally between utterances is not."""
    async def go() -> dict[str, Any]:
        async with connect(ws_url(rt_server),
                           additional_headers={"X-Request-Id": "rt-lost-1"}) as ws:
            await open_session(ws, voice="ryan")
            await send(ws, type="text", text=SENTENCE)
            await send(ws, type="end")
            await first_audio(ws)
            ws.transport.abort()  # gone without a close frame (1006)
        async with connect(ws_url(rt_server)) as ws:  # the server goes on
            await open_session(ws, voice="ryan")
            await send(ws, type="text", text="Still here.")
            await send(ws, type="end")
            events, _ = await collect(ws)
            return events[-1]

    before = len(rt_server.log())
    gone = metric(rt_server.metrics(), "qtts_requests_total", route="/v1/tts/realtime",
                  outcome="client_gone")
    done = run(asyncio.wait_for(go(), 120))
    assert done["type"] == "done"
    # the utterance cut short is a request that ended client_gone, in the metrics and the log
    (rec,) = rt_server.wait_request_lines(lambda r: r.get("id") == "rt-lost-1")
    assert rec["outcome"] == "client_gone" and rec["frames"] > 0
    assert metric(rt_server.metrics(), "qtts_requests_total", route="/v1/tts/realtime",
                  outcome="client_gone") - gone == 1
    line = re.compile(r"realtime session ended: the client's connection closed \(code "
                      r"(\d+|None)\) while an utterance was spoken")
    deadline = time.monotonic() + 10
    while not line.search(log := rt_server.log()[before:]) and time.monotonic() < deadline:
        time.sleep(0.1)
    (code,) = line.findall(log)  # this session's, once
    assert code not in ("1000", "1001")  # (uvicorn reports a dropped connection as 1005/1006)


def test_what_the_log_says_of_a_lost_connection() -> None:
    """A send that failed (a client cut by the keepalive because it stopped reading) is named
    with its error; a normal close between utterances says nothing."""
    from service.realtime import lost_connection

    async def failed_send() -> None:
        raise ConnectionResetError("keepalive ping timeout")

    async def go() -> tuple[str | None, ...]:
        sender = asyncio.ensure_future(failed_send())
        await asyncio.wait([sender])
        return (lost_connection(None, sender, True), lost_connection(1000, None, False),
                lost_connection(1001, None, True))

    failed, normal, mid = run(go())
    assert failed == ("the connection failed while audio was sent (ConnectionResetError: "
                      "keepalive ping timeout)")
    assert normal is None
    assert mid == "the client's connection closed (code 1001) while an utterance was spoken"


def test_the_outcome_of_an_utterance_the_session_cut_short() -> None:
    """The request an utterance counts as when its session ends under it: the client left
    (connection gone, or cut for not reading its audio), the session's time limit, or the
    client broke the protocol (the session cancelled it)."""
    from service.realtime import CLOSE_POLICY, cut_short

    assert cut_short((0, ""), False) == "client_gone"
    assert cut_short((1000, ""), True) == "client_gone"
    assert cut_short((CLOSE_POLICY, "client reads too slowly"), True) == "client_gone"
    assert cut_short((1000, "session_limit"), False) == "timeout"
    assert cut_short((CLOSE_POLICY, "too_long"), False) == "cancelled"


def test_a_text_frame_not_in_utf8_closes_1007_with_one_log_line(rt_server: Server) -> None:
    """The WebSocket layer refuses it (1007); the server logs one warning line, not uvicorn's
    traceback, and goes on serving."""
    async def go() -> tuple[int | None, dict[str, Any]]:
        async with connect(ws_url(rt_server)) as ws:
            await ws.recv()
            await ws.send(b'{"type": "text", "text": "\xff\xfe"}', text=True)
            with pytest.raises(ConnectionClosed):
                await ws.recv()
            code = ws.close_code
        async with connect(ws_url(rt_server)) as ws:
            return code, json.loads(await ws.recv())

    code, started = run(go())
    assert code == 1007
    assert started["type"] == "session.started"
    log = rt_server.log()
    assert "Invalid UTF-8 sequence received from client. (closed with 1007)" in log
    assert "Traceback" not in log and "UnicodeDecodeError" not in log


def test_text_cut_inside_a_surrogate_pair_is_joined(rt_server: Server) -> None:
    """JavaScript cuts strings in UTF-16 units: "Ok \U0001f600 yes.".slice(0, 4) ends with the
    emoji's first half, and JSON.stringify sends it as a lone surrogate; the next delta starts
    with the second half. The halves are joined (the session was closed 1008); a half that
    never finds its other is still refused."""
    async def go() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        async with connect(ws_url(rt_server)) as ws:
            await open_session(ws, voice="ryan", seed=5)
            await ws.send('{"type": "text", "text": "Ok \\ud83d"}')
            await ws.send('{"type": "text", "text": "\\ude00 yes."}')
            await send(ws, type="end")
            joined, _ = await collect(ws)
            await ws.send('{"type": "text", "text": "half \\ud83d"}')
            await send(ws, type="end")
            return joined, await error_event(ws)

    joined, refused = run(go())
    assert joined[-1]["usage"]["characters"] == len("Ok \U0001f600 yes.")
    assert joined[-1]["usage"]["outcome"] in ("ok", "truncated_no_eos"), joined[-1]
    assert refused["field"] == "text" and "lone surrogate U+D83D" in refused["message"]


def test_the_pair_joiner() -> None:
    from service.realtime import PairJoiner, ProtocolError

    j = PairJoiner()
    assert j.take("a\ud83d") == "a" and j.take("\ude00b") == "\U0001f600b"
    assert j.take("\ud83d") == "" and j.take("\ude00") == "\U0001f600"
    j.take("x\ud83d")
    j.finish(check=False)  # (a cancel: the half goes with its text)
    assert j.take("y") == "y"
    for bad in ("\ude00", "a\ud800b"):
        with pytest.raises(ProtocolError):
            PairJoiner().take(bad)
    j.take("\ud83d")
    with pytest.raises(ProtocolError):
        j.finish()


def test_the_next_utterances_messages_stay_compact() -> None:
    """What waits for the next utterance: adjacent text merged, a repeated control dropped,
    text-flush-text-flush as one text and its flush (the worker takes them as one update
    when replayed at once), an utterance boundary kept; past the cap, refused."""
    from service.realtime import MAX_BACKLOG, Backlog, Control, ProtocolError, TextDelta

    def text(t: str) -> TextDelta:
        return TextDelta(type="text", text=t)

    def ctl(kind: str) -> Control:
        return Control(type=kind)  # type: ignore[arg-type]

    def shape(b: Backlog) -> list[str]:
        return [m.text if isinstance(m, TextDelta) else m.type for m in b]  # type: ignore[union-attr]

    b = Backlog()
    for m in (text("Hel"), text("lo "), ctl("flush"), ctl("flush"), text("wor"), ctl("flush"),
              text("ld."), ctl("end"), ctl("end"), text("Next"), ctl("flush"), text(" one")):
        b.add(m)
    assert shape(b) == ["Hello wor", "flush", "ld.", "end", "Next", "flush", " one"]
    flood = Backlog()
    for _ in range(100_000):
        flood.add(text(""))
        flood.add(ctl("flush"))
    assert shape(flood) == ["", "flush"]
    many = Backlog()
    with pytest.raises(ProtocolError) as e:
        for i in range(MAX_BACKLOG):
            many.add(text(f"utterance {i}."))
            many.add(ctl("end"))
    assert e.value.code == "too_many_messages" and len(many) == MAX_BACKLOG


def test_text_for_a_waiting_job_stays_compact() -> None:
    """Live text sent while its job waits in the queue is held merged where the worker sees no
    difference: runs of text up to a flush or end joined, empty deltas and repeated flushes
    dropped, every flush and end where it was."""
    from service.handles import Ticket
    from service.protocol import Job, TextIn

    t = Ticket(job=Job(id=1, kind="text"))
    for msg in (TextIn(1, "Hel"), TextIn(1, "lo "), TextIn(1, ""), TextIn(1, flush=True),
                TextIn(1, flush=True), TextIn(1, "wor"), TextIn(1, "ld."), TextIn(1, end=True)):
        t.hold(msg)
    assert t.outbox == [TextIn(1, "Hello ", flush=True), TextIn(1, "world.", end=True)]
    flood = Ticket(job=Job(id=2, kind="text"))
    for _ in range(100_000):
        flood.hold(TextIn(2, ""))
        flood.hold(TextIn(2, flush=True))
    assert flood.outbox == [TextIn(2, flush=True)]


def test_a_message_too_big_to_be_valid_is_not_read(rt_server: Server) -> None:
    """A client message past what any valid one can be (max_message_bytes in
    service/realtime_handshake.py: the session's whole text in one delta, every character
    escaped the longest way) is refused by the WebSocket layer, close 1009, without being read
    whole or parsed; one within the bound is read, and refused for what it says (the
    session's character cap, 1008)."""
    from service.realtime_handshake import max_message_bytes
    from service.settings import Settings

    limit = max_message_bytes(Settings())
    over_cap = json.dumps({"type": "text", "text": "\U0001F600" * 20001})  # 12 bytes each
    assert len(over_cap) < limit

    async def go(message: str) -> tuple[int | None, list[dict[str, Any]]]:
        async with connect(ws_url(rt_server)) as ws:
            await open_session(ws, voice="ryan")
            await ws.send(message)
            events = await events_until_closed(ws)
            return ws.close_code, events

    before = len(rt_server.log())
    code, events = run(go(json.dumps({"type": "text", "text": "x" * (limit + 1)})))
    assert code == 1009 and not events
    deadline = time.monotonic() + 10
    while "over the size limit (close 1009)" not in rt_server.log()[before:]:
        assert time.monotonic() < deadline, rt_server.log()[before:]
        time.sleep(0.1)
    code, events = run(go(over_cap))
    assert code == 1008 and events[-1]["code"] == "too_long"


def test_a_flood_mid_utterance_stays_in_the_front_end(make_server: Any) -> None:
    """While an utterance is spoken, 100,000 empty deltas and repeated flushes add nothing to
    it: they do not reach its worker (each was a pipe message the worker read and merged,
    slowing every stream it served), and the utterance ends as usual."""
    server = make_server(workers=1)
    pid = server.workers()[0]["pid"]

    def worker_reads() -> int:  # bytes the worker has read through read() calls: its pipe
        io = Path(f"/proc/{pid}/io").read_text()
        return int(next(x for x in io.splitlines() if x.startswith("rchar:")).split()[1])

    async def go() -> tuple[list[dict[str, Any]], int]:
        async with connect(ws_url(server)) as ws:
            await open_session(ws, voice="ryan")
            await send(ws, type="text", text="Hello there, ")
            await send(ws, type="flush")
            await first_audio(ws)
            before = worker_reads()
            await flood(ws, 50_000)
            await send(ws, type="text", text="and goodbye.")
            await send(ws, type="end")
            events, _audio = await collect(ws)
            return events, worker_reads() - before

    events, read = run(asyncio.wait_for(go(), 120))
    assert events[-1]["type"] == "done", events[-1]
    assert read < 1_000_000, read  # the flood as pipe messages: megabytes


def test_a_flood_after_the_end_costs_nothing(make_server: Any) -> None:
    """While an utterance whose text has ended waits for the only worker, its session floods
    (200,000 empty deltas and flushes): the front end holds a few entries, not the flood, and
    the next utterance speaks in turn. Text held for a next utterance counts against the
    session's text cap as it comes: past the cap it is refused at once, not when its turn
    comes."""
    psutil = pytest.importorskip("psutil")
    server = make_server(workers=1, max_batch=1, realtime_max_chars=200)
    front = psutil.Process(server.proc.pid)

    async def go() -> tuple[list[dict[str, Any]], bytes, int, list[dict[str, Any]]]:
        async with connect(ws_url(server)) as busy, \
                connect(ws_url(server), max_queue=None) as ws, connect(ws_url(server)) as capped:
            for c in (busy, ws, capped):
                await open_session(c, voice="ryan")
            await send(busy, type="text", text="Hello there, ")
            await send(busy, type="flush")
            await first_audio(busy)  # it holds the worker, waiting for more text
            before = front.memory_info().rss
            await send(ws, type="text", text=SENTENCE)
            await send(ws, type="end")
            await flood(ws, 100_000)
            await send(ws, type="text", text="Then the next one.")
            await send(ws, type="end")
            await send(capped, type="text", text=SENTENCE)
            await send(capped, type="end")
            await send(capped, type="text", text="x" * 150)  # past the cap of 200 in all
            refused: list[dict[str, Any]] = []
            async for msg in capped:  # at once: its utterance still waits for the worker
                if isinstance(msg, str):
                    refused.append(json.loads(msg))
                    if refused[-1]["type"] == "error":
                        break
            grown = front.memory_info().rss - before
            await send(busy, type="end")
            await collect(busy)
            await collect(ws)
            events, audio = await collect(ws)
            return events, audio, grown, refused

    events, audio, grown, refused = run(asyncio.wait_for(go(), 120))
    assert audio and events[-1]["usage"]["outcome"] in ("ok", "truncated_no_eos"), events[-1]
    assert grown < 30_000_000, grown  # held whole: ~100 MB
    assert refused[-1]["code"] == "too_long"
    assert "done" not in [ev["type"] for ev in refused]


def test_a_full_queue_closes_1013_and_is_counted(make_server: Any) -> None:
    """An utterance that finds the one worker busy and the queue full: an error event
    ``queue_full``, close 1013 (try again later), and the refusal counted as an HTTP one is."""
    server = make_server(workers=1, max_batch=1, queue_size=1)

    async def go() -> tuple[dict[str, Any], int | None]:
        async with connect(ws_url(server)) as busy, connect(ws_url(server)) as queued, \
                connect(ws_url(server)) as refused:
            for c in (busy, queued, refused):
                await open_session(c, voice="ryan")
            await send(busy, type="text", text="Hello there, ")
            await send(busy, type="flush")
            await first_audio(busy)  # it holds the worker, waiting for more text
            await send(queued, type="text", text="Waiting my turn.")
            await send(queued, type="end")
            assert json.loads(await queued.recv())["type"] == "utterance.started"
            await send(refused, type="text", text="No room for me.")
            await send(refused, type="end")
            err = await error_event(refused)
            with pytest.raises(ConnectionClosed):
                await refused.recv()
            await send(busy, type="end")
            await collect(busy)
            await collect(queued)
            return err, refused.close_code

    err, code = run(asyncio.wait_for(go(), 120))
    assert err["code"] == "queue_full" and code == 1013
    ms = server.metrics()
    assert metric(ms, "qtts_rejections_total", reason="queue_full") == 1.0
    assert metric(ms, "qtts_requests_total", route="/v1/tts/realtime", outcome="rejected") == 1
    (rec,) = server.wait_request_lines(lambda r: r.get("outcome") == "rejected")
    assert rec["route"] == "/v1/tts/realtime" and rec["status"] == 503


def test_start_policy_forms() -> None:
    """Every accepted form of ``start`` and what the engine makes of it."""
    from service.realtime import SessionSettings, min_tokens, parse

    for raw, tokens in (("immediate", 1), ("auto", 5), (1, 1), (7, 7), (2048, 2048)):
        m = parse(json.dumps({"type": "session", "start": raw}))
        assert isinstance(m, SessionSettings) and m.start == raw
        assert min_tokens(m.start, 5) == tokens
    assert parse(json.dumps({"type": "session"})).start == "auto"  # type: ignore[union-attr]


def test_a_bad_delta_leaves_the_sessions_sharing_its_worker_speaking(make_server: Any) -> None:
    """Text the tokenizer cannot take is refused at the door: it never reaches the batch
    where it would fail every session sharing the worker."""
    server = make_server(workers=1, realtime_min_tokens=3)

    async def go() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        async with connect(ws_url(server)) as speaking, connect(ws_url(server)) as hostile:
            for ws in (speaking, hostile):
                await open_session(ws, voice="ryan")
            await send(speaking, type="text", text=SENTENCE)
            await send(hostile, type="text", text="Hello there, ")
            await send(hostile, type="flush")
            await first_audio(hostile)
            # (more words after it: the text with the surrogate becomes stable, to be tokenized)
            await hostile.send(json.dumps({"type": "text", "text": "a\ud800b and more words "}))
            refused = await error_event(hostile)
            await send(speaking, type="end")
            events, _ = await collect(speaking)
            return events, refused

    events, refused = run(asyncio.wait_for(go(), 60))
    assert refused["field"] == "text"
    assert events[-1]["type"] == "done"
    assert events[-1]["usage"]["outcome"] in ("ok", "truncated_no_eos"), events[-1]
    assert "Traceback" not in server.log()



def test_a_session_whose_own_text_fails_in_the_batch_fails_alone(make_server: Any) -> None:
    """A fault inside the batch in one session's own text (``QTTS_TEST_FAULT=raise@text=1``:
    the worker raises taking the text of its second live job) ends that utterance with an
    error event and its done; the session sharing the worker speaks on to its own done, and
    the failed session's next utterance speaks."""
    server = make_server(workers=1, test_fault="raise@text=1")

    async def go() -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]],
                            list[dict[str, Any]]]:
        async with connect(ws_url(server)) as speaking, connect(ws_url(server)) as failing:
            for ws in (speaking, failing):
                await open_session(ws, voice="ryan")
            await send(speaking, type="text", text="Hello there, ")
            await send(speaking, type="flush")
            await first_audio(speaking)  # live job 0
            await send(failing, type="text", text="Hello there, ")  # live job 1
            await send(failing, type="flush")
            await send(failing, type="text", text="how are you today? ")
            failed = await error_event(failing)
            failed_done, _ = await collect(failing)
            await send(speaking, type="text", text=SENTENCE)
            await send(speaking, type="end")
            events, _ = await collect(speaking)
            await send(failing, type="text", text="Hello again.")  # live job 2
            await send(failing, type="end")
            again, audio = await collect(failing)
            assert audio
            return events, failed, failed_done, again

    events, failed, failed_done, again = run(asyncio.wait_for(go(), 90))
    assert failed["code"] == "synthesis_failed", failed
    assert failed["message"] == "internal error: InjectedFault"
    assert failed_done[-1]["usage"]["outcome"] == "error"
    for evs in (events, again):
        assert evs[-1]["type"] == "done"
        assert evs[-1]["usage"]["outcome"] in ("ok", "truncated_no_eos"), evs[-1]


def test_an_utterance_cancelled_while_queued_is_done(make_server: Any) -> None:
    """An utterance waiting for a worker (the only one is busy) and cancelled there gets its
    done at once, and the session's next utterance speaks once the worker is free."""
    server = make_server(workers=1, max_batch=1)

    async def go() -> tuple[list[dict[str, Any]], list[dict[str, Any]], bytes]:
        async with connect(ws_url(server)) as busy, connect(ws_url(server)) as queued:
            for ws in (busy, queued):
                await open_session(ws, voice="ryan")
            await send(busy, type="text", text="Hello there, ")
            await send(busy, type="flush")
            await first_audio(busy)
            await send(queued, type="text", text="Waiting in line. ")
            await send(queued, type="cancel")
            cancelled, audio = await asyncio.wait_for(collect(queued), 10)
            assert not audio
            await send(queued, type="text", text="Now it is my turn.")
            await send(queued, type="end")
            await send(busy, type="end")
            await collect(busy)
            later, audio = await collect(queued)
            return cancelled, later, audio

    cancelled, later, audio = run(asyncio.wait_for(go(), 90))
    assert cancelled[-1]["type"] == "done", cancelled
    assert cancelled[-1]["usage"]["outcome"] == "cancelled"
    assert cancelled[-1]["usage"]["frames"] == 0
    assert audio and later[-1]["usage"]["outcome"] in ("ok", "truncated_no_eos"), later[-1]


def test_auth_header_or_subprotocol_never_url(make_server: Any) -> None:
    s: Server = make_server(api_key=KEY)
    url = ws_url(s)

    async def go() -> None:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(url, additional_headers={"X-Request-Id": "rt-auth-1"}):
                pass
        # the HTTP routes' 401: its JSON error, the challenge and the request id
        r = refused.value.response
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        assert r.headers["X-Request-Id"] == "rt-auth-1"
        err = json.loads(r.body)["error"]
        assert (err["code"], err["field"]) == ("invalid_api_key", "authorization")
        with pytest.raises(InvalidStatus):
            async with connect(url + f"?api_key={KEY}"):
                pass
        with pytest.raises(InvalidStatus):
            async with connect(url, additional_headers={"Authorization": "Bearer wrong"}):
                pass
        async with connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            assert json.loads(await ws.recv())["type"] == "session.started"
        with pytest.raises(InvalidStatus):
            async with connect(url, additional_headers={"X-API-Key": "wrong"}):
                pass
        async with connect(url, additional_headers={"X-API-Key": KEY}) as ws:  # as HTTP takes it
            assert json.loads(await ws.recv())["type"] == "session.started"
        async with connect(url, subprotocols=["qtts.v1", f"bearer.{KEY}"]) as ws:  # type: ignore[list-item]
            assert ws.subprotocol == "qtts.v1"
            assert json.loads(await ws.recv())["type"] == "session.started"
        # the key alone as a subprotocol: answered with none, the client closed at once (1006,
        # no reason); now a 400 that says what to offer
        with pytest.raises(InvalidStatus) as refused:
            async with connect(url, subprotocols=[f"bearer.{KEY}"]):  # type: ignore[list-item]
                pass
        err = json.loads(refused.value.response.body)["error"]
        assert refused.value.response.status_code == 400
        assert (err["field"], err["code"]) == ("sec-websocket-protocol", "unsupported_subprotocol")
        assert "qtts.v1" in err["message"] and KEY not in err["message"]

    run(go())


def test_a_page_of_another_origin_cannot_open_a_session(rt_server: Server) -> None:
    """A browser opens a WebSocket to any server, with its page's Origin and no CORS check: on
    a server without an API key, any web page its user opened could speak (with the owner's
    stored voices) through it. The handshake is refused as the HTTP routes refuse such a
    page's POST (403 origin_not_allowed); the server's own pages (the playground) and clients
    that send no Origin are let in."""
    mine = rt_server.url.replace("ws://", "http://")

    async def go() -> tuple[Any, str, str]:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(ws_url(rt_server), origin="http://evil.example"):  # type: ignore[arg-type]
                pass
        async with connect(ws_url(rt_server), origin=mine) as ws:  # type: ignore[arg-type]
            own = json.loads(await ws.recv())["type"]
        async with connect(ws_url(rt_server)) as ws:
            none = json.loads(await ws.recv())["type"]
        return refused.value.response, own, none

    refusal, own, none = run(go())
    assert refusal.status_code == 403
    err = json.loads(refusal.body)["error"]
    assert (err["code"], err["field"]) == ("origin_not_allowed", "origin")
    assert own == none == "session.started"


def test_idle_session_is_closed(make_server: Any) -> None:
    s: Server = make_server(realtime_idle_seconds=1)

    async def go() -> tuple[dict[str, Any], int | None, str | None]:
        async with connect(ws_url(s)) as ws:
            await ws.recv()
            ev = json.loads(await ws.recv())  # nothing sent: the idle timeout speaks
            with pytest.raises(ConnectionClosed):
                await ws.recv()
            return ev, ws.close_code, ws.close_reason

    ev, code, reason = run(go())
    assert ev["type"] == "error" and ev["code"] == "idle_timeout"
    assert code == 1000 and reason == "idle_timeout"


def test_a_session_outlives_the_header_timeout(make_server: Any) -> None:
    """QTTS_HEADER_TIMEOUT bounds an HTTP request's headers; a WebSocket's upgrade request is
    complete, so the timer must not cut the session later (it used to, writing a 408 into
    the WebSocket stream)."""
    s: Server = make_server(header_timeout=1, shutdown_delay_seconds=0)

    async def go() -> list[dict[str, Any]]:
        async with connect(ws_url(s)) as ws:
            await ws.recv()
            await asyncio.sleep(2)  # the elapsed time is the point: past the header timeout
            await send(ws, type="session", voice="ryan", seed=4)
            await ws.recv()
            await send(ws, type="text", text="Still here.")
            await send(ws, type="end")
            return (await collect(ws))[0]

    assert run(go())[-1]["type"] == "done"


def test_sigterm_lets_a_speaking_session_finish(make_server: Any) -> None:
    """Drain: an utterance in flight when SIGTERM arrives still takes text and ends with done;
    then the session closes 1012 (service restart) and the server exits. (A seed: sampled
    without one, a random model may end its speech before the second text, and then the
    drain closes the idle session instead.)"""
    s: Server = make_server()
    texts = ("Hello there my friend, ", "this is the end.")

    async def go() -> tuple[list[dict[str, Any]], int | None]:
        async with connect(ws_url(s)) as ws:
            await open_session(ws, voice="ryan", start="immediate", seed=3)
            await send(ws, type="text", text=texts[0])
            await asyncio.sleep(0.3)
            s.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            await send(ws, type="text", text=texts[1])
            await send(ws, type="end")
            events, _ = await collect(ws)
            with pytest.raises(ConnectionClosed):
                await ws.recv()
            return events, ws.close_code

    events, code = run(go())
    assert events[-1]["type"] == "done"
    assert events[-1]["usage"]["outcome"] in ("ok", "truncated_no_eos")
    assert events[-1]["usage"]["characters"] == sum(map(len, texts))
    assert code == 1012
    assert s.proc.wait(30) in (0, -signal.SIGTERM)


def test_an_utterance_past_the_drain_limit_is_told_and_counted_timeout(make_server: Any
                                                                         ) -> None:
    """Drain past its limit with an utterance still speaking (its text never ends): the
    session gets an error event (draining) before its 1012 close, and the utterance is the
    server's timeout, not a client that went away."""
    s: Server = make_server(shutdown_delay_seconds=0, drain_seconds=1.5,
                            test_fault="sleep=0.2@chunk")

    async def go() -> tuple[list[dict[str, Any]], int | None]:
        async with connect(ws_url(s)) as ws:
            await open_session(ws, voice="ryan", start="immediate", seed=3)
            await send(ws, type="text", text="A sentence that goes on and on, ")
            await first_audio(ws)
            s.proc.send_signal(signal.SIGTERM)
            return await events_until_closed(ws), ws.close_code

    events, code = run(go())
    assert [e["code"] for e in events if e["type"] == "error"] == ["draining"]
    assert code == 1012
    assert s.proc.wait(30) == 1  # (the drain was not clean)
    outcomes = [r["outcome"] for r in s.request_lines() if r.get("route") == "/v1/tts/realtime"]
    assert outcomes == ["timeout"]
    assert "the client's connection closed" not in s.log()


def test_sigterm_closes_a_session_between_utterances_at_once(make_server: Any) -> None:
    """Drain: a session with nothing speaking closes 1012 when the drain begins, while the
    server still drains (readiness 503), not when the client next writes or the server
    exits."""
    s: Server = make_server(shutdown_delay_seconds=60, drain_seconds=60)

    async def go() -> tuple[str, int | None, Any]:
        async with connect(ws_url(s)) as ws:
            await open_session(ws, voice="ryan", seed=1)
            await send(ws, type="text", text="One sentence.")
            await send(ws, type="end")
            assert (await collect(ws))[0][-1]["type"] == "done"
            s.proc.send_signal(signal.SIGTERM)
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 30)
            # the close came from the drain: the server is still draining
            status = httpx.get(s.url + "/readyz", timeout=5).json()["status"]
            # and a session opened now is refused at its handshake, as POST /tts is
            with pytest.raises(InvalidStatus) as refused:
                async with connect(ws_url(s)):
                    pass
            return status, ws.close_code, refused.value.response

    status, code, refusal = run(go())
    assert code == 1012
    assert status == "draining"
    assert refusal.status_code == 503 and refusal.headers["Retry-After"] == "1"
    assert json.loads(refusal.body)["error"]["code"] == "draining"
    assert s.proc.poll() is None
    s.proc.send_signal(signal.SIGTERM)  # a second signal stops at once
    assert s.proc.wait(30) is not None


def test_opus_utterance_is_one_ogg_stream(rt_server: Server) -> None:
    async def go() -> tuple[list[dict[str, Any]], bytes]:
        async with connect(ws_url(rt_server)) as ws:
            await ws.recv()
            await send(ws, type="session", voice="ryan", format="opus", seed=2)
            updated = json.loads(await ws.recv())
            assert updated["settings"]["format"] == "opus"
            # the audio it announces is what comes (session.started said PCM)
            assert updated["audio"] == {"encoding": "ogg_opus", "sample_rate": 24000,
                                        "channels": 1}
            for w in words("Opus over a socket, word by word."):
                await send(ws, type="text", text=w)
                await asyncio.sleep(0.01)
            await send(ws, type="end")
            return await collect(ws)

    before = metric(rt_server.metrics(), "qtts_audio_seconds_total")
    events, audio = run(go())
    assert audio[:4] == b"OggS"
    seconds = events[-1]["usage"]["audio_seconds"]
    assert abs(decoded_seconds(audio, "opus") - seconds) < 0.1
    # the audio counter has the seconds handed to the socket (counted as pages go out)
    assert metric(rt_server.metrics(), "qtts_audio_seconds_total") - before == pytest.approx(
        seconds, abs=1e-3)



def test_a_client_that_stops_reading_is_cut_off(make_server: Any) -> None:
    """Backpressure: a client that stops reading is not buffered without bound. Once the audio
    waiting on the server passes QTTS_REALTIME_MAX_BUFFERED_SECONDS its utterance is cancelled;
    when the client reads again it finds the audio sent before, a ``client_too_slow`` error
    and the close 1008, and the worker is free for the next session.

    The client's socket keeps a small receive buffer and no compression (the synthetic model's
    clipped audio deflates ~6x), so what the kernel holds is the server's send buffer (up to
    ``tcp_wmem``'s maximum): utterances are queued until the audio overflows it and the cap.
    """
    s: Server = make_server(realtime_max_buffered_seconds=1, realtime_max_chars=10**6,
                               realtime_idle_seconds=5, shutdown_delay_seconds=0)
    wmem = Path("/proc/sys/net/ipv4/tcp_wmem")  # Linux; elsewhere assume its 4 MiB default
    wmem_max = int(wmem.read_text().split()[2]) if wmem.is_file() else 4 << 20
    text = "The quick brown fox jumps over the lazy dog, then rests in the sun. " * 30
    cut = "client reads too slowly"

    async def go() -> tuple[list[dict[str, Any]], int, int | None, str | None]:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", s.port))
        async with connect(ws_url(s), sock=sock, max_queue=1, compression=None,
                           max_size=None) as ws:
            await open_session(ws, voice="ryan", start="immediate", seed=1)
            # what the kernel can hold, in utterances of at least ~8 s of audio each
            for _ in range(4 + wmem_max // (8 * 48000)):
                await send(ws, type="text", text=text)
                await send(ws, type="end")
            # stop reading until the server cuts the session off (it logs it), or, were there
            # no cap, the session ends on its idle timeout once every utterance is spoken
            while cut not in s.log() and metric(s.metrics(), "qtts_realtime_sessions") > 0:
                await asyncio.sleep(0.1)
            assert cut in s.log()
            # read again, with a window that drains the kernel's megabytes in well under the
            # server's flush grace (a 4 KiB window crawls at one delayed ACK per segment)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            events, audio = [], 0
            with pytest.raises(ConnectionClosed):
                async for msg in ws:
                    if isinstance(msg, bytes):
                        audio += len(msg)
                    else:
                        events.append(json.loads(msg))
            return events, audio, ws.close_code, ws.close_reason

    events, audio, code, reason = run(go())
    assert (code, reason) == (1008, cut)
    assert events[-1]["type"] == "error" and events[-1]["code"] == "client_too_slow"
    # what was announced before the cut arrived whole: the dropped audio was never announced
    announced = sum(e["samples"] for e in events if e["type"] == "audio")
    assert audio == 2 * announced > 0
    ms = s.metrics()
    assert metric(ms, "qtts_realtime_sessions") == 0
    assert metric(ms, "qtts_requests_running") == 0

    # the worker is free, and a client that reads is never cut, though one chunk of the ramp
    # (16 frames, 1.28 s) is larger than the cap
    events, pcm = run(speak(s, text, voice="ryan", start="immediate", seed=1))
    # (its 30 sentences, spoken as the whole-text request speaks them: the random model ends
    # them or runs into the server's audio cap)
    assert events[-1]["type"] == "done"
    assert events[-1]["usage"]["outcome"] in ("ok", "truncated_no_eos")
    assert max(e["frames"] for e in events if e["type"] == "audio") == 16
    assert len(pcm) == 2 * 1920 * events[-1]["usage"]["frames"]


def test_an_opening_guess_waits_for_the_text_and_a_refuted_one_sends_nothing(
        rt_server: Server) -> None:
    """``immediate``: the first word alone, then 0.8 s of nothing. Speech starts on the word as
    it stands, but no audio comes before the next delta settles it: "Hello" holds, "Th" does
    not ("The" begins with another token in the test vocabulary) and starts over. The guess
    counter has both."""
    def guesses(result: str) -> float:
        return metric(rt_server.metrics(), "qtts_realtime_guesses_total", result=result)

    made, refuted = guesses("made"), guesses("refuted")

    async def utterance(ws: Any, first: str, rest: str
                        ) -> tuple[list[Any], list[dict[str, Any]], bytes]:
        await send(ws, type="text", text=first)
        early: list[Any] = []
        try:
            while True:
                early.append(await asyncio.wait_for(ws.recv(), 0.8))
        except TimeoutError:
            pass
        await send(ws, type="text", text=rest)
        await send(ws, type="end")
        events, audio = await collect(ws)
        return early, events, audio

    async def go() -> list[tuple[list[Any], list[dict[str, Any]], bytes]]:
        async with connect(ws_url(rt_server)) as ws:
            await open_session(ws, voice="ryan", start="immediate", seed=2)
            return [await utterance(ws, "Hello", " there, how are you?"),
                    await utterance(ws, "Th", "e quick brown fox.")]

    for early, events, audio in run(go()):
        assert not any(isinstance(m, bytes) for m in early), "audio before the text settled"
        assert not any(json.loads(m)["type"] == "audio.first" for m in early)
        assert events[-1]["type"] == "done"
        assert events[-1]["usage"]["outcome"] in ("ok", "truncated_no_eos")
        assert len(audio) == 2 * 1920 * events[-1]["usage"]["frames"] > 0
    assert (guesses("made") - made, guesses("refuted") - refuted) == (2, 1)


def test_identity_with_post_tts_for_a_text_of_several_segments(rt_server: Server) -> None:
    """A long text and then its end, two messages as most clients send them: the same samples
    as POST /tts (the start waits a moment for the end of a text that the whole-text request
    splits into segments; started live before the end came, it was one utterance with the live
    budget: other audio, three times in four). Twice, as that race is timing."""
    long = " ".join([SENTENCE] * 6)
    want = _post_stream(rt_server, long)
    for _ in range(2):
        events, got = run(speak(rt_server, long, voice="ryan", seed=11))
        assert events[-1]["usage"]["outcome"] in ("ok", "truncated_no_eos")
        assert len(got) == len(want) and got == want
