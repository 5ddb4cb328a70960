"""Hostile texts against a real server: time per request and the worker's peak and settled RSS.

Starts ``python -m cli serve`` (one worker) on 127.0.0.1 at a free port with the model,
waits for /readyz, sends one warm-up request and reads the worker's steady RSS, then sends each
hostile text once (streaming pcm, ``max_seconds`` as the attack did) while sampling the
worker's RSS every 10 ms. Per text it prints the answer's status, the tokens, the wall time,
the peak RSS over steady, and the RSS once the worker is idle again. Texts:

  emoji/cjk/combining @chars   the character cap (4096) of each: on a byte-level tokenizer
                               several tokens per character, so usually over the token cap:
                               a 400 at once
  emoji/cjk/combining @tokens  the most characters within the token cap: served
  prose @tokens                sentences of English within the token cap (several segments)

Targets (issue 20, 0.6B Q4_0): each answered in <= 10 s, peak <= steady + 0.5 GB, settled
within 10 % of steady. Exit code 1 when a target is missed (``--no-check`` to only print).

  python bench/hostile.py --model ~/.cache/qtts/models/<0.6B-q4_0>/model.gguf
  python bench/hostile.py --model /tmp/tiny/model.gguf --max-seconds 1      # smoke
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.gguf_model import open_model  # noqa: E402

CHAR_CAP = 4096
UNITS = {"emoji": "\U0001f600", "cjk": "\u4e00", "combining": "e\u0301"}
PROSE = ("The committee met on Tuesday to review the budget. Several members asked why the "
         "costs had risen so sharply, and the chair promised a full report by Friday. ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def texts(model: Path, token_cap: int) -> list[tuple[str, str, int]]:
    m = open_model(model)
    tok = m.tokenizer()
    m.close()

    def n(s: str) -> int:
        return len(tok.encode(s).ids)

    def fit(unit: str) -> str:
        lo, hi = 1, max(1, token_cap)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if n(unit * mid) <= token_cap else (lo, mid - 1)
        return unit * lo

    out = []
    for name, u in UNITS.items():
        t = u * (CHAR_CAP // len(u))
        out.append((f"{name} @chars", t, n(t)))
        t = fit(u)
        out.append((f"{name} @tokens", t, n(t)))
    t = fit(PROSE)
    out.append(("prose @tokens", t, n(t)))
    return out


class RssSampler:
    """Peak RSS of one process, sampled every ``period`` seconds on a thread."""

    def __init__(self, pid: int, period: float = 0.01) -> None:
        self.proc = psutil.Process(pid)
        self.period = period
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(self.period)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


def worker(url: str) -> dict[str, Any]:
    (w,) = httpx.get(url + "/healthz", timeout=5).json()["workers"]
    return dict(w)


def wait_idle(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while worker(url)["state"] != "idle" and time.monotonic() < deadline:
        time.sleep(0.02)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--voice", default=None, help="default: the model's first voice")
    ap.add_argument("--max-seconds", type=float, default=1.0, help="max_seconds of each request")
    ap.add_argument("--token-cap", type=int, default=2048, help="QTTS_MAX_TEXT_TOKENS")
    ap.add_argument("--threads", type=int, default=0, help="QTTS_THREADS_PER_WORKER (0: auto)")
    ap.add_argument("--budget-seconds", type=float, default=10.0)
    ap.add_argument("--budget-peak-gb", type=float, default=0.5)
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()

    m = open_model(args.model)
    voice = args.voice or (sorted(m.speakers)[0] if m.speakers else None)
    m.close()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "QTTS_MODEL": str(args.model), "QTTS_PORT": str(port),
           "QTTS_HOST": "127.0.0.1", "QTTS_WORKERS": "1", "QTTS_LOG_LEVEL": "warning",
           "QTTS_MAX_TEXT_TOKENS": str(args.token_cap)}
    if args.threads:
        env["QTTS_THREADS_PER_WORKER"] = str(args.threads)
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve"], cwd=ROOT, env=env,
                            start_new_session=True)
    failed = []
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                print(f"server exited with {proc.returncode}", file=sys.stderr)
                return 2
            try:
                if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                print("server not ready", file=sys.stderr)
                return 2
            time.sleep(0.2)

        def post(text: str) -> tuple[int, float, int]:
            body = {"text": text, "voice": voice, "format": "pcm",
                    "max_seconds": args.max_seconds}
            t0 = time.monotonic()
            n = 0
            with httpx.stream("POST", url + "/tts", json=body, timeout=600) as r:
                for piece in r.iter_raw():
                    n += len(piece)
            return r.status_code, time.monotonic() - t0, n

        post("Warm up, please.")
        wait_idle(url)
        pid = int(worker(url)["pid"])
        steady = psutil.Process(pid).memory_info().rss
        print(f"model {args.model}  voice {voice}  max_seconds {args.max_seconds}  "
              f"steady worker RSS {steady / 2**20:.0f} MB")
        print(f"{'text':<20} {'chars':>6} {'tokens':>6} {'status':>6} {'seconds':>8} "
              f"{'audio s':>8} {'peak +MB':>9} {'after %':>8}")
        for name, text, n_tok in texts(args.model, args.token_cap):
            sampler = RssSampler(pid)
            status, seconds, nbytes = post(text)
            wait_idle(url)
            peak = sampler.stop()
            after = psutil.Process(pid).memory_info().rss
            pct = 100.0 * (after - steady) / steady
            print(f"{name:<20} {len(text):>6} {n_tok:>6} {status:>6} {seconds:>8.2f} "
                  f"{nbytes / 48000:>8.2f} {(peak - steady) / 2**20:>9.0f} {pct:>+8.1f}")
            if status >= 500 or seconds > args.budget_seconds:
                failed.append(f"{name}: status {status}, {seconds:.1f} s")
            if peak - steady > args.budget_peak_gb * 2**30:
                failed.append(f"{name}: peak +{(peak - steady) / 2**20:.0f} MB")
            if abs(pct) > 10:
                failed.append(f"{name}: settled {pct:+.1f} % from steady")
            if int(worker(url)["pid"]) != pid:
                failed.append(f"{name}: the worker was replaced")
                break
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    for f in failed:
        print("MISSED:", f)
    return 1 if failed and not args.no_check else 0


if __name__ == "__main__":
    sys.exit(main())
