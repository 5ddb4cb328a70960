"""Realtime benchmark: a simulated LLM writes an answer into ``WS /v1/tts/realtime``.

Starts ``python -m cli serve`` on 127.0.0.1 (or uses ``--url``), then for each session count
(``--sessions 1,3``) runs that many sessions at once. Each session sends a ``--words``-word
answer as text deltas at ``--tokens-per-second`` (one delta per word piece, a word counted as
~1.3 tokens like an LLM's BPE), then ``end``, for each start policy (``--policies
immediate,auto``), and reads the audio. Printed per run (one row per policy):

  first audio ms    from the first text delta sent to the first audio byte received
  gaps after 1 s    stalls: audio chunks that arrived after the audio already received had
                    played out (counted from 1 s of audio on). The client plays from its first
                    byte and, when it runs dry, waits for the next chunk and plays on from
                    there, as a player does (service.playback: the service's
                    qtts_stream_gaps_total counts with the same clock)
  worst gap ms      the longest such stall
  stalled ms        all the stalls together (what a listener waited in all)
  behind ms         from the end message to the last audio byte (how far speech trails text)

With ``--first-audio N`` each policy first runs N utterances one after another on each
session's connection that stop at their first audio (``cancel``), the sessions' utterances
started together, and prints the first audio's p50 / max and the server's stage times of that
first chunk (from its ``audio`` event): one long run is one sample of first audio per session,
these are N per session.

  python bench/realtime.py --model ~/.cache/qtts/models/synthetic-full-q4_0-seed0/model.gguf \
      --sessions 1,3 --threads 2
  python bench/realtime.py --model ... --sessions 3 --max-batch 3 --threads 2   # one worker
  python bench/realtime.py --url http://127.0.0.1:8000 --voice ryan
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from websockets.asyncio.client import connect

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.load import start_server
from service.playback import PlaybackClock
from service.settings import Settings

BYTES_PER_SECOND = 24000 * 2
TOKENS_PER_WORD = 1.3
WORDS = ("so the short answer is that it depends on what you want to do with it but in most "
         "cases you will be fine if you start small, measure what matters, and only then make "
         "it faster; the rest is a matter of taste and of the time you have left for it today "
         "and tomorrow as well").split()


@dataclass
class Run:
    first_audio: list[float] = field(default_factory=list)
    gaps: int = 0
    worst_gap: float = 0.0
    stalled: float = 0.0
    behind: list[float] = field(default_factory=list)
    audio_seconds: float = 0.0
    errors: int = 0


def word_pieces(words: int, first: int = 0) -> list[str]:
    """The answer's text deltas: ``words`` words from WORDS[first], each after the first with
    its leading space, as an LLM's tokens come."""
    return [("" if i == 0 else " ") + WORDS[(first + i) % len(WORDS)] for i in range(words)]


async def open_session(ws: Any, voice: str, policy: str) -> None:
    """The server's hello, our session settings, its answer."""
    await ws.recv()
    start: str | int = int(policy) if policy.isdigit() else policy
    await ws.send(json.dumps({"type": "session", "voice": voice, "start": start}))
    await ws.recv()


async def send_text(ws: Any, pieces: list[str], delay: float) -> None:
    """The deltas, ``delay`` seconds apart (an LLM writing at its pace)."""
    for p in pieces:
        await ws.send(json.dumps({"type": "text", "text": p}))
        await asyncio.sleep(delay)


async def session(url: str, headers: dict[str, str], voice: str, policy: str, words: int,
                  tps: float, run: Run) -> None:
    pieces = word_pieces(words)
    delay = TOKENS_PER_WORD / tps
    async with connect(url, additional_headers=headers, max_size=None) as ws:
        await open_session(ws, voice, policy)

        async def writer() -> float:
            await send_text(ws, pieces, delay)
            await ws.send(json.dumps({"type": "end"}))
            return time.perf_counter()

        t0 = time.perf_counter()
        wtask = asyncio.create_task(writer())
        player = PlaybackClock()
        received = 0.0  # seconds of audio received
        last = 0.0
        async for msg in ws:
            now = time.perf_counter()
            if isinstance(msg, bytes):
                if not player.started:
                    run.first_audio.append(now - t0)
                waited = player.wait(now)
                if waited > 0.0 and received >= 1.0:
                    run.gaps += 1
                    run.worst_gap = max(run.worst_gap, waited)
                    run.stalled += waited
                player.hand_over(now, len(msg) / BYTES_PER_SECOND)
                received += len(msg) / BYTES_PER_SECOND
                last = now
                continue
            ev = json.loads(msg)
            if ev["type"] == "error":
                run.errors += 1
            if ev["type"] in ("done", "error"):
                break
        end_sent = await wtask
        run.behind.append(max(0.0, last - end_sent))
        run.audio_seconds += received


async def first_audio(url: str, headers: dict[str, str], voice: str, policy: str, n: int,
                      tps: float, times: list[float], stages: dict[str, list[float]],
                      together: asyncio.Barrier | None = None) -> None:
    """N utterances, each cancelled at its first audio: appends the seconds from the first
    delta to the first audio byte to ``times``, and the server's stage ms of each first chunk
    to ``stages``. Sessions that share ``together`` start each utterance at the same moment."""
    delay = TOKENS_PER_WORD / tps
    async with connect(url, additional_headers=headers, max_size=None) as ws:
        await open_session(ws, voice, policy)
        for u in range(n):
            if together is not None:
                await together.wait()
            t0 = time.perf_counter()
            wtask = asyncio.create_task(send_text(ws, word_pieces(12, u), delay))
            got = False
            async for msg in ws:
                if isinstance(msg, bytes):
                    if not got:
                        got = True
                        times.append(time.perf_counter() - t0)
                        wtask.cancel()
                        await ws.send(json.dumps({"type": "cancel"}))
                    continue
                ev = json.loads(msg)
                if ev["type"] == "audio" and ev.get("seq") == 0:
                    for k, v in ev.get("timings_ms", {}).items():
                        stages.setdefault(k, []).append(float(v))
                if ev["type"] in ("done", "error"):
                    break
            if not wtask.done():
                wtask.cancel()


async def first_audios(url: str, headers: dict[str, str], voice: str, policy: str,
                       sessions: int, n: int,
                       tps: float) -> tuple[list[float], dict[str, list[float]]]:  # fmt: skip
    """``first_audio`` on ``sessions`` connections at once, their utterances started together."""
    times: list[float] = []
    stages: dict[str, list[float]] = {}
    together = asyncio.Barrier(sessions) if sessions > 1 else None
    await asyncio.gather(*(first_audio(url, headers, voice, policy, n, tps, times, stages,
                                       together) for _ in range(sessions)))
    return times, stages


async def bench(url: str, headers: dict[str, str], voice: str, policy: str, sessions: int,
                words: int, tps: float) -> Run:
    run = Run()
    await asyncio.gather(*(session(url, headers, voice, policy, words, tps, run)
                           for _ in range(sessions)))
    return run


def fmt(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{np.percentile(values, 50) * 1000:.0f} / {max(values) * 1000:.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.environ.get("QTTS_MODEL"), help="GGUF to serve")
    ap.add_argument("--url", default=None, help="bench this running server (http://host:port)")
    ap.add_argument("--sessions", default="1,3", help="concurrent sessions, comma-separated")
    ap.add_argument("--threads", type=int, default=0, help="threads per worker (0: default)")
    default_batch = int(Settings.model_fields["max_batch"].default)
    ap.add_argument("--max-batch", type=int, default=default_batch,
                    help="QTTS_MAX_BATCH: ceil(sessions / B) workers share them (1: one worker "
                    f"per session; default {default_batch}, the server's)")
    ap.add_argument("--words", type=int, default=60)
    ap.add_argument("--tokens-per-second", type=float, default=30.0)
    ap.add_argument("--policies", default="immediate,auto", help="start policies to compare")
    ap.add_argument("--voice", default="ryan")
    ap.add_argument("--api-key", default=os.environ.get("QTTS_API_KEY"))
    ap.add_argument("--first-audio", type=int, default=0, metavar="N",
                    help="also N utterances per policy stopped at their first audio")
    args = ap.parse_args()
    counts = [int(x) for x in args.sessions.split(",")]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    print(f"{args.words} words at {args.tokens_per_second:g} tokens/s; max batch "
          f"{args.max_batch}; load average at start {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} CPUs")
    print("| sessions | start | first audio ms p50 / max | gaps after 1 s | worst gap ms | "
          "stalled ms | behind ms p50 / max | audio s | errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in counts:
        proc = None
        url = args.url
        if url is None:
            if not args.model:
                ap.error("--model (or QTTS_MODEL) is required without --url")
            workers = -(-n // args.max_batch)
            proc, url = start_server(args.model, workers, args.threads, 2, args.max_batch)
        ws_url = url.replace("http://", "ws://") + "/v1/tts/realtime"
        try:
            for policy in args.policies.split(",") if args.first_audio else []:
                times, stages = asyncio.run(first_audios(ws_url, headers, args.voice, policy, n,
                                                         args.first_audio,
                                                         args.tokens_per_second))
                split = ", ".join(f"{k} {np.median(v):.1f}" for k, v in stages.items() if v)
                print(f"| {n} | {policy}: {len(times)} utterances stopped at first audio | "
                      f"{fmt(times)} | server ms, first chunk (median): {split} | | | | | |",
                      flush=True)
            for policy in args.policies.split(","):
                run = asyncio.run(bench(ws_url, headers, args.voice, policy, n, args.words,
                                        args.tokens_per_second))
                print(f"| {n} | {policy} | {fmt(run.first_audio)} | {run.gaps} | "
                      f"{run.worst_gap * 1000:.0f} | {run.stalled * 1000:.0f} | "
                      f"{fmt(run.behind)} | "
                      f"{run.audio_seconds:.1f} | {run.errors} |", flush=True)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
