#!/usr/bin/env python3
"""Demo traffic for a qtts server, so that the dashboard has live data.

Standard library only (runs in the qtts image or any Python >= 3.11). Waits for /readyz, then
sends synthesis requests: random codec frames to POST /tts (decoder path), and, when the
served model can speak text, text to POST /v1/audio/speech. Every ``--burst-every``-th round
sends ``--burst`` requests at once, so queue depth and queue wait show up too. Bounded:
``--count`` rounds (0 = until stopped), never faster than ``--interval``.

    python3 deploy/traffic.py --url http://127.0.0.1:8000 --count 20
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

N_CODEBOOKS = 16
CODEBOOK_SIZE = 2048
SAMPLE_RATE = 24000
TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Streaming speech synthesis on ggml.",
    "Time to first audio is what a listener notices first.",
)


def _get_json(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None


def wait_ready(base: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if _get_json(base + "/readyz", 2.0)[0] == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"traffic: {base} not ready after {timeout:.0f} s")
        time.sleep(1.0)


def post(base: str, path: str, body: dict[str, Any], timeout: float) -> tuple[int, int, float]:
    """POST a synthesis request and read the stream; returns (status, bytes, seconds)."""
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), method="POST",
        headers={"content-type": "application/json"},
    )
    t0 = time.monotonic()
    n = 0
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status = r.status
            while chunk := r.read(65536):
                n += len(chunk)
    except urllib.error.HTTPError as e:
        status = e.code
        e.read()
    except OSError:
        status = 0
    return status, n, time.monotonic() - t0


class Traffic:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base = args.url.rstrip("/")
        self.rng = random.Random(args.seed)
        self.lock = threading.Lock()
        self.statuses: dict[int, int] = {}
        self.voices: list[str] = []
        self.model_id = "qtts"

    def discover(self) -> None:
        """Use text requests only when the model can speak text (GET /v1/models)."""
        if self.args.no_text:
            return
        status, models = _get_json(self.base + "/v1/models")
        if status != 200 or not models or not models.get("data"):
            return
        info = models["data"][0]
        self.model_id = str(info.get("id", "qtts"))
        if info.get("text"):
            _, voices = _get_json(self.base + "/v1/audio/voices")
            self.voices = list((voices or {}).get("voices") or [])

    def one(self) -> None:
        with self.lock:
            use_text = bool(self.voices) and self.rng.random() < 0.5
            frames = self.rng.randint(self.args.min_frames, self.args.max_frames)
            codes = [[self.rng.randrange(CODEBOOK_SIZE) for _ in range(frames)]
                     for _ in range(N_CODEBOOKS)]
            text = self.rng.choice(TEXTS)
            voice = self.rng.choice(self.voices) if self.voices else ""
        if use_text:
            path = "/v1/audio/speech"
            body: dict[str, Any] = {"model": self.model_id, "input": text, "voice": voice,
                                    "response_format": "pcm", "max_seconds": self.args.max_seconds}
        else:
            path = "/tts"
            body = {"codes": codes, "format": "pcm"}
        status, n, secs = post(self.base, path, body, self.args.timeout)
        with self.lock:
            self.statuses[status] = self.statuses.get(status, 0) + 1
        if not self.args.quiet:
            audio = n / 2 / SAMPLE_RATE if status == 200 else 0.0
            print(f"traffic: {path} {status} audio={audio:.2f}s wall={secs:.2f}s", flush=True)

    def run(self) -> int:
        self.discover()
        rounds = 0
        while self.args.count == 0 or rounds < self.args.count:
            started = time.monotonic()
            rounds += 1
            burst = self.args.burst_every > 0 and rounds % self.args.burst_every == 0
            if burst:
                threads = [threading.Thread(target=self.one) for _ in range(self.args.burst)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            else:
                self.one()
            time.sleep(max(0.0, self.args.interval - (time.monotonic() - started)))
        print(f"traffic: {rounds} rounds, statuses {dict(sorted(self.statuses.items()))}",
              flush=True)
        return 0 if self.statuses.get(200) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="qtts base URL")
    p.add_argument("--count", type=int, default=0, help="rounds to send (0: until stopped)")
    p.add_argument("--interval", type=float, default=2.0, help="least seconds between rounds")
    p.add_argument("--burst", type=int, default=4, help="requests sent at once in a burst round")
    p.add_argument("--burst-every", type=int, default=10, help="every Nth round is a burst")
    p.add_argument("--min-frames", type=int, default=8, help="fewest codec frames (12.5/s)")
    p.add_argument("--max-frames", type=int, default=50, help="most codec frames")
    p.add_argument("--max-seconds", type=float, default=4.0, help="audio cap of text requests")
    p.add_argument("--no-text", action="store_true", help="codes requests only")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for /readyz")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no line per request")
    args = p.parse_args(argv)
    wait_ready(args.url.rstrip("/"), args.ready_timeout)
    return Traffic(args).run()


if __name__ == "__main__":
    sys.exit(main())
