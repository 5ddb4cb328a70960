"""Helpers of the deploy tests: dashboard walking, Grafana variable expansion, a Prometheus
process on loopback and its HTTP API."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------- dashboard


@dataclass
class Target:
    panel_id: int
    panel_title: str
    panel_type: str
    ref_id: str
    expr: str
    instant: bool

    @property
    def name(self) -> str:
        return f"panel {self.panel_id} '{self.panel_title}' target {self.ref_id}"


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    for p in dashboard["panels"]:
        yield p
        yield from p.get("panels", [])


def targets(dashboard: dict[str, Any]) -> list[Target]:
    out = []
    for p in iter_panels(dashboard):
        for t in p.get("targets", []):
            out.append(Target(p["id"], p.get("title", ""), p["type"], t["refId"], t["expr"],
                              bool(t.get("instant")) and not t.get("range")))
    return out


# Grafana's global variables, as the tests evaluate them: Prometheus scrapes every second here,
# so $__rate_interval (max(4 x scrape interval, interval + scrape interval)) is a few seconds;
# 30 s keeps every request the test sent inside the window.
GLOBALS = {"__rate_interval": "30s", "__interval": "2s", "__range": "1m"}
_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def expand(expr: str, values: dict[str, str]) -> str:
    """Replace $var / ${var} (template and global variables) by values; unknown ones fail."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name in values:
            return values[name]
        if name in GLOBALS:
            return GLOBALS[name]
        raise KeyError(f"variable ${name} in {expr!r} has no value")

    return _VAR.sub(sub, expr)


def variables_used(text: str) -> set[str]:
    return {m.group(1) or m.group(2) for m in _VAR.finditer(text)}


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.*),\s*)?(\w+)\s*\)\s*$")


def parse_label_values(query: str) -> tuple[str | None, str]:
    """``label_values(selector, label)`` -> (selector or None, label)."""
    m = _LABEL_VALUES.match(query)
    if not m:
        raise ValueError(f"not a label_values() query: {query!r}")
    return m.group(1), m.group(2)


# ------------------------------------------------------------------------------- prometheus


class PromError(RuntimeError):
    pass


class Prometheus:
    """A Prometheus server on 127.0.0.1 (the Debian binary) and its HTTP API."""

    def __init__(self, binary: str, config: Path, data_dir: Path, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={data_dir}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h",
             "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.proc.returncode}):\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"prometheus not ready in {timeout}s:\n{self.log()}")

    def api(self, path: str, **params: str | list[str]) -> Any:
        """GET /api/v1/<path>; returns ``data``; raises PromError with Prometheus's message."""
        query = urllib.parse.urlencode(params, doseq=True)
        url = f"{self.url}/api/v1/{path}?{query}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise PromError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]  # type: ignore[no-any-return]

    def query_range(self, expr: str, seconds: float, step: str = "1s") -> list[dict[str, Any]]:
        end = time.time()
        data = self.api("query_range", query=expr, start=str(end - seconds), end=str(end),
                        step=step)
        return data["result"]  # type: ignore[no-any-return]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def sample_values(result: list[dict[str, Any]]) -> list[float]:
    """Every sample value of an instant or range query result."""
    vals = []
    for series in result:
        points = series.get("values") or [series["value"]]
        vals += [float(v) for _, v in points]
    return vals
