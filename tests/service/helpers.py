"""Helpers of the service tests: the server subprocess, metrics parsing, audio checks."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
FRAME_SAMPLES = 1920


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One ``python -m cli serve`` subprocess."""

    def __init__(self, model: Path, log_dir: Path, **env: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        full_env = {
            **os.environ,
            "QTTS_MODEL": str(model),
            "QTTS_HOST": "127.0.0.1",
            "QTTS_PORT": str(self.port),
            "QTTS_WORKERS": "1",
            "QTTS_THREADS_PER_WORKER": "1",
            "QTTS_LOG_FORMAT": "json",
            "QTTS_BACKEND": "cpu",
            "QTTS_DATA_DIR": str(log_dir / f"data-{self.port}"),
        }
        full_env.update({f"QTTS_{k.upper()}": str(v) for k, v in env.items()})
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "serve"], cwd=ROOT, env=full_env,
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def request_lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log().splitlines():
            if line.startswith("{"):
                rec = json.loads(line)
                if rec.get("logger") == "qtts.request":
                    out.append(rec)
        return out

    def wait_request_lines(self, match: Callable[[dict[str, Any]], bool], count: int = 1,
                           timeout: float = 30.0) -> list[dict[str, Any]]:
        """The request log lines that ``match``, once there are ``count`` of them, or those there
        are at ``timeout`` (a line is written just after its response's last byte, so it may
        trail the client by a moment)."""
        deadline = time.monotonic() + timeout
        while True:
            lines = [rec for rec in self.request_lines() if match(rec)]
            if len(lines) >= count or time.monotonic() > deadline:
                return lines
            time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=5).text)

    def workers(self) -> list[dict[str, Any]]:
        return httpx.get(self.url + "/healthz", timeout=5).json()["workers"]  # type: ignore[no-any-return]

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def serving(model: Path, log_dir: Path, **env: Any) -> Iterator[Server]:
    """A fixture body: yields a ready ``Server`` on ``model`` with ``env``'s settings and stops
    it at the end (``yield from serving(...)``)."""
    s = Server(model, log_dir, **env)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def server_starter(model: Path, log_dir: Path) -> Iterator[Callable[..., Server]]:
    """A fixture body: yields ``start(**settings)``, which starts a ready ``Server`` on
    ``model``; every server started is stopped at the end."""
    servers: list[Server] = []

    def start(**env: Any) -> Server:
        s = Server(model, log_dir, **env)
        servers.append(s)
        s.wait_ready()
        return s

    yield start
    for s in servers:
        s.stop()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (labels as printed)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def metric(ms: dict[str, float], name: str, **labels: str) -> float:
    """Value of one series; labels may be given in any order."""
    for key, v in ms.items():
        if key == name and not labels:
            return v
        if key.startswith(name + "{"):
            got = dict(re.findall(r'(\w+)="([^"]*)"', key[len(name):]))
            if got == labels:
                return v
    raise KeyError(f"{name}{labels} not in metrics")


def codes(frames: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2048, size=(16, frames)).tolist()  # type: ignore[no-any-return]


def decoded_seconds(data: bytes, fmt: str) -> float:
    """Duration of an encoded response, decoded by ffmpeg (PyAV); pcm by arithmetic."""
    if fmt == "pcm":
        assert len(data) % 2 == 0
        return len(data) / 2 / 24000
    import av

    with av.open(io.BytesIO(data)) as c:
        n, rate = 0, 0
        for frame in c.decode(audio=0):
            n += frame.samples
            rate = frame.sample_rate
    assert rate > 0, f"{fmt}: no audio decoded"
    return n / rate


def wait_metric(server: Server, name: str, value: float, timeout: float = 5.0,
                **labels: str) -> dict[str, float]:
    """Poll /metrics until ``name{labels} == value`` (the request line and counters are
    written just after a response's last byte); returns the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        ms = server.metrics()
        if metric(ms, name, **labels) == value or time.monotonic() > deadline:
            return ms
        time.sleep(0.05)


def log_records(server: Server, skip: int = 0) -> list[dict[str, Any]]:
    """The records of a JSON-format server's log past its first ``skip`` lines, after checking
    that each of those lines is one (a raw line breaks the log for its reader)."""
    lines = server.log().splitlines()[skip:]
    assert all(line.startswith("{") for line in lines), [x for x in lines if x[:1] != "{"]
    return [json.loads(line) for line in lines]


def tracebacks_logged(server: Server, words: str) -> list[dict[str, Any]]:
    """The worker's error records whose message holds ``words``, each with its traceback inside
    the JSON record (``exc``), after checking that every log line is JSON: the worker printed
    tracebacks raw onto stderr, lines that broke a JSON log."""
    records = [r for r in log_records(server) if words in r["msg"]]
    assert all(r["logger"] == "qtts.worker" and r["level"] == "error"
               and "InjectedFault" in r["exc"] for r in records), records
    return records
