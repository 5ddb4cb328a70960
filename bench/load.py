"""Load test of the HTTP service: N concurrent streaming clients for a fixed time.

For each worker count it starts ``python -m cli serve`` on 127.0.0.1 (a free port), waits
for /readyz, runs the clients, then stops the server. Each client loops: POST /tts (streaming
pcm), read to the end, repeat. Printed per run:

  ttfa p50/p95   client-side time from sending the request to the first audio byte
                 (queue wait included)
  rtf            server-side synthesis wall time / audio duration (qtts_rtf mean), and the
                 client-side request time / audio duration (mean), for comparison
  audio s/s      seconds of audio received by all clients per wall-clock second
  rejected       503 answers (queue full), counted, not retried at once
  stream gaps    stalls a client playing the audio as it came heard (qtts_stream_gaps_total),
  waited s       and how long it waited in them, summed (qtts_stream_gap_seconds_total)

Requests are text requests (``--frames`` caps their audio via ``max_seconds``) when the model
has a talker, else ``codes`` requests of ``--frames`` random codec frames (``--mode``). They
speak the model's first built-in voice; a Base model has none, so a voice is cloned for the
run (``POST /v1/audio/voices``, ~10 s of espeak-ng speech) and the load is of that stored
in-context voice.

  python bench/load.py --model ~/.cache/qtts/models/synthetic-full-q4_0-seed0-v2/model.gguf \
      --workers 1,2 --clients 4 --seconds 30 --frames 50
  python bench/load.py --model ... --workers 1 --max-batch 1,4 --threads 2 --clients 4 \
      --seconds 25 --frames 50 --queue 4        # batching: one worker, 4 streams at once
  python bench/load.py --url http://127.0.0.1:8000 --clients 8      # an already running server

Clients start together and ask for equal lengths, so without ``--stagger`` they run in
lockstep: every request boundary brings all the prefills and first chunks at once, the
hardest case for gaps. ``--stagger`` starts client i at i/N of a request's audio, and
``--think S`` pauses a client a random while (exponential, mean S seconds, seeded per client)
between its requests: closer to users who do not all press play at once.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BYTES_PER_SECOND = 24000 * 2


@dataclass
class Result:
    ttfa: list[float] = field(default_factory=list)
    wall_rtf: list[float] = field(default_factory=list)
    audio_seconds: float = 0.0
    ok: int = 0
    rejected: int = 0
    errors: int = 0


async def client(url: str, body: dict, until: float, res: Result, headers: dict[str, str],
                 start: float = 0.0, think: float = 0.0, seed: int = 0) -> None:
    """Requests one after another until ``until``: from ``start`` seconds on, each after a
    pause drawn from an exponential of mean ``think`` seconds (0: none)."""
    rng = np.random.default_rng(seed)
    await asyncio.sleep(start)
    opening = True  # this client's first request goes at ``start``, without a pause
    async with httpx.AsyncClient(timeout=120) as http:
        while time.monotonic() < until:
            if think > 0 and not opening:
                await asyncio.sleep(min(float(rng.exponential(think)),
                                        max(0.0, until - time.monotonic())))
                if time.monotonic() >= until:
                    break
            opening = False
            t0 = time.monotonic()
            first = None
            n = 0
            try:
                async with http.stream("POST", url + "/tts", json=body, headers=headers) as r:
                    if r.status_code == 503:
                        res.rejected += 1
                        await r.aread()
                        await asyncio.sleep(float(r.headers.get("retry-after", "1")) * 0.25)
                        continue
                    if r.status_code != 200:
                        res.errors += 1
                        await r.aread()
                        continue
                    async for piece in r.aiter_raw():
                        if first is None and piece:
                            first = time.monotonic() - t0
                        n += len(piece)
            except httpx.HTTPError:
                res.errors += 1
                continue
            seconds = n / BYTES_PER_SECOND
            res.ok += 1
            res.audio_seconds += seconds
            if first is not None:
                res.ttfa.append(first)
            if seconds > 0:
                res.wall_rtf.append((time.monotonic() - t0) / seconds)


def scrape(url: str, headers: dict[str, str]) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(qtts_rtf_(?:sum|count)|qtts_stream_gap(?:s|_seconds)_total"
                     r"|qtts_batch_size_(?:sum|count))\s+(\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


TEXT = ("The quick brown fox jumps over the lazy dog, and then it runs far away into the "
        "forest, where nobody can find it again.")


def bench_voice(url: str, headers: dict[str, str], model: dict[str, Any]) -> str | None:
    """The voice the requests speak in: the model's first built-in voice; on a Base model
    (none built in) a voice cloned for the run from ~10 s of espeak-ng speech, so the load is
    of a stored in-context voice."""
    voices = httpx.get(url + "/v1/audio/voices", headers=headers, timeout=10).json()
    if voices["voices"]:
        return str(voices["voices"][0])
    if model.get("model_type") != "base":
        return None
    from bench.clone import reference_audio

    with tempfile.TemporaryDirectory() as tmp:
        ref, transcript = reference_audio(Path(tmp), 10.0)
        r = httpx.post(url + "/v1/audio/voices", headers=headers, timeout=120,
                       data={"name": f"bench-load-{time.time_ns()}", "transcript": transcript},
                       files={"audio_sample": ("ref.wav", ref.read_bytes(), "audio/wav")})
    r.raise_for_status()
    print(f"# cloned voice {r.json()['id']} for the run", file=sys.stderr, flush=True)
    return str(r.json()["id"])


def request_body(url: str, mode: str, frames: int, headers: dict[str, str]) -> tuple[dict, str]:
    """A text request when the server can speak text (mode auto|text), else codes."""
    model = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()["data"][0]
    if mode == "text" or (mode == "auto" and model.get("text")):
        voice = bench_voice(url, headers, model)
        return ({"text": TEXT, "voice": voice, "format": "pcm", "seed": 1,
                 "max_seconds": frames / 12.5}, "text")
    rng = np.random.default_rng(0)
    return {"codes": rng.integers(0, 2048, size=(16, frames)).tolist(), "format": "pcm"}, "codes"


async def run_load(url: str, clients: int, seconds: float, frames: int,
                   headers: dict[str, str], mode: str = "auto", stagger: bool = False,
                   think: float = 0.0) -> tuple[Result, dict[str, float]]:
    body, kind = request_body(url, mode, frames, headers)
    print(f"# {url}: {kind} requests", file=sys.stderr, flush=True)
    before = scrape(url, headers)
    res = Result()
    until = time.monotonic() + seconds
    t0 = time.monotonic()
    # staggered: client i starts i/N of a request's audio after the first
    step = frames / 12.5 / clients if stagger else 0.0
    await asyncio.gather(*(client(url, body, until, res, headers, i * step, think, i)
                           for i in range(clients)))
    wall = time.monotonic() - t0
    after = scrape(url, headers)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    d["wall"] = wall
    return res, d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: str | Path, workers: int, threads: int, queue: int | None = None,
                 max_batch: int | None = None, settings: dict[str, str] | None = None,
                 log: Path | None = None
                 ) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``python -m cli serve`` on a free loopback port and wait for /readyz.

    ``queue``: QTTS_QUEUE_SIZE and ``max_batch``: QTTS_MAX_BATCH (None: the server's
    defaults); ``settings``: more variables
    (QTTS_DATA_DIR, QTTS_BACKEND, ...); ``log``: a file for the server's output (else its
    stdout is dropped and its stderr told when it exits early)."""
    port = free_port()
    env = {**os.environ, "QTTS_MODEL": str(model), "QTTS_PORT": str(port),
           "QTTS_HOST": "127.0.0.1", "QTTS_WORKERS": str(workers),
           "QTTS_THREADS_PER_WORKER": str(threads), "QTTS_LOG_LEVEL": "warning",
           **(settings or {})}
    if max_batch is not None:
        env["QTTS_MAX_BATCH"] = str(max_batch)
    if queue is not None:
        env["QTTS_QUEUE_SIZE"] = str(queue)
    if log is None:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "serve"], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    else:
        with log.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "cli", "serve"], cwd=ROOT, env=env,
                                    stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            said = (log.read_text(errors="replace") if log is not None
                    else proc.stderr.read().decode() if proc.stderr else "")
            raise SystemExit(f"server exited: {said}")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not become ready")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the server drains and exits), then kill after a minute."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def row(label: str, res: Result, d: dict[str, float]) -> str:
    p50 = np.percentile(res.ttfa, 50) * 1000 if res.ttfa else float("nan")
    p95 = np.percentile(res.ttfa, 95) * 1000 if res.ttfa else float("nan")
    rtf = d.get("qtts_rtf_sum", 0) / d["qtts_rtf_count"] if d.get("qtts_rtf_count") else float(
        "nan")
    wall_rtf = float(np.mean(res.wall_rtf)) if res.wall_rtf else float("nan")
    aps = res.audio_seconds / d["wall"]
    gaps = int(d.get("qtts_stream_gaps_total", 0))
    waited = d.get("qtts_stream_gap_seconds_total", 0.0)
    steps = d.get("qtts_batch_size_count", 0)
    batch = f"{d.get('qtts_batch_size_sum', 0) / steps:.2f}" if steps else "-"
    return (f"| {label} | {res.ok} | {p50:.0f} | {p95:.0f} | {rtf:.3f} | {wall_rtf:.3f} | "
            f"{aps:.2f} | {res.rejected} | {res.errors} | {gaps} | {waited:.2f} | {batch} |")


HEADER = ("| run | requests ok | TTFA p50 ms | TTFA p95 ms | RTF (server) | RTF (client) | "
          "audio s/s | rejected | errors | stream gaps | waited s | mean batch |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("QTTS_MODEL"), help="GGUF to serve")
    ap.add_argument("--url", default=None, help="bench this running server instead")
    ap.add_argument("--workers", default="1,2", help="comma list of worker counts (1,2)")
    ap.add_argument("--threads", type=int, default=0,
                    help="threads per worker (0: the server's default, CPUs / workers)")
    ap.add_argument("--clients", type=int, default=4, help="concurrent streaming clients (4)")
    ap.add_argument("--seconds", type=float, default=20.0, help="load duration per run (20)")
    ap.add_argument("--frames", type=int, default=50, help="codec frames per request (50 = 4 s)")
    ap.add_argument("--queue", type=int, default=2, help="QTTS_QUEUE_SIZE of started servers")
    ap.add_argument("--max-batch", default="default",
                    help="comma list of QTTS_MAX_BATCH values, each run per worker count "
                         "('default': the server's)")
    ap.add_argument("--mode", choices=("auto", "codes", "text"), default="auto",
                    help="request kind: text when the model has a talker (auto), or codes")
    ap.add_argument("--stagger", action="store_true",
                    help="start client i at i/N of a request's audio, not all at once")
    ap.add_argument("--think", type=float, default=0.0,
                    help="mean seconds a client pauses between its requests (exponential; 0)")
    ap.add_argument("--api-key", default=os.environ.get("QTTS_API_KEY"))
    args = ap.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    print(f"clients={args.clients} seconds={args.seconds:g} frames/request={args.frames} "
          f"({args.frames / 12.5:g} s audio) cpus={os.cpu_count()}"
          + (" staggered" if args.stagger else "")
          + (f" think={args.think:g} s" if args.think else ""))
    print(HEADER)
    if args.url:
        res, d = asyncio.run(run_load(args.url, args.clients, args.seconds, args.frames, headers,
                                      args.mode, args.stagger, args.think))
        print(row(args.url, res, d))
        return 0
    if not args.model:
        ap.error("--model (or QTTS_MODEL) is required without --url")
    runs = [(int(w), None if b == "default" else int(b)) for w in args.workers.split(",")
            for b in args.max_batch.split(",")]
    for w, b in runs:
        threads = args.threads or max(1, ((os.cpu_count() or 1) - 1) // w)
        with tempfile.TemporaryDirectory() as data:  # its voice store: this run's own
            proc, url = start_server(args.model, w, threads, args.queue, b,
                                     settings={"QTTS_DATA_DIR": data})
            try:
                res, d = asyncio.run(run_load(url, args.clients, args.seconds, args.frames,
                                              headers, args.mode, args.stagger, args.think))
                label = (f"{w} worker(s) x {threads} thread(s), batch "
                         + (str(b) if b is not None else "default"))
                print(row(label, res, d), flush=True)
            finally:
                stop_server(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
