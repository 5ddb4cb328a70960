"""The dashboard and the alerts against real data: a real Prometheus (the Debian binary) on
127.0.0.1 scrapes a real `qtts serve` on the tiny model (started through the container
entrypoint, as the image starts it) every second, while deploy/traffic.py sends it requests
(POST /tts with random codes [16, T], format pcm, some at once so that they queue).

Then every PromQL expression of the dashboard (Grafana's variables expanded as Grafana would)
must parse and return data, every alert expression must parse and every rule must load and
evaluate, the template variables' label_values() must find the server, and the Prometheus
adapter's rule must serve the HPA's metric.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.metrics import STAGES
from tests.deploy.conftest import ADAPTER_RULE, ALERTS, DEPLOY, PROM_CONFIG, ROOT, load_yaml
from tests.deploy.helpers import (
    PromError,
    Prometheus,
    expand,
    free_port,
    parse_label_values,
    sample_values,
    targets,
)

ENTRYPOINT = DEPLOY / "docker" / "entrypoint.sh"
NAMESPACE, POD = "qtts", "qtts-test-0"  # target labels the Kubernetes service discovery adds
DECODER_STAGES = ("quant", "preconv", "pretr", "upsample", "bigvgan")


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def qtts_serve_works() -> bool:
    qtts = Path(sys.executable).parent / "qtts"
    p = subprocess.run([str(qtts), "serve", "--help"], capture_output=True, timeout=60)
    return p.returncode == 0


@dataclass
class Stack:
    prom: Prometheus
    qtts_url: str
    instance: str
    text_ready: bool
    log_dir: Path
    traffic_end: float  # unix time when traffic.py returned


class QttsServer:
    """`qtts serve` started the way the container starts it: entrypoint.sh, then the command."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / "qtts.log"
        if qtts_serve_works():
            cmd = [str(Path(sys.executable).parent / "qtts"), "serve"]
        else:  # test_image_command_exists fails loudly; the dashboard checks still run
            cmd = [sys.executable, "-m", "cli", "serve"]
        env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "QTTS_MODEL": str(model),
            "QTTS_HOST": "127.0.0.1",
            "QTTS_PORT": str(self.port),
            "QTTS_WORKERS": "1",
            "QTTS_THREADS_PER_WORKER": "1",
            "QTTS_QUEUE_SIZE": "8",
            "QTTS_MAX_BATCH": "2",  # text requests batch: the batch panels have data
            "QTTS_BACKEND": "cpu",
            "QTTS_LOG_FORMAT": "json",
        }
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([str(ENTRYPOINT), *cmd], cwd=ROOT, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"qtts exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if _get(self.url + "/readyz")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"qtts not ready in {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def _finished_requests(url: str) -> int:
    """Sum of qtts_requests_total over every route and outcome, read from the server."""
    text = _get(url + "/metrics")[1].decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("qtts_requests_total{")))


def _test_config(port: int) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml, pointed at the test server and scraping every second."""
    cfg = load_yaml(PROM_CONFIG)
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(ALERTS)]
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "qtts"]
    (static,) = job["static_configs"]
    static["targets"] = [f"127.0.0.1:{port}"]
    static["labels"] = {**static.get("labels", {}), "namespace": NAMESPACE, "pod": POD}
    cfg["scrape_configs"] = [job]
    return cfg  # type: ignore[no-any-return]


def _realtime_utterance(url: str) -> None:
    """One utterance over WS /v1/tts/realtime (traffic.py speaks HTTP only)."""
    from websockets.sync.client import connect

    with connect(url.replace("http://", "ws://") + "/v1/tts/realtime") as ws:
        assert json.loads(ws.recv())["type"] == "session.started"
        ws.send(json.dumps({"type": "session", "voice": "ryan", "seed": 1}))
        assert json.loads(ws.recv())["type"] == "session.updated"
        for word in ("Hello", " from", " the", " dashboard."):
            ws.send(json.dumps({"type": "text", "text": word}))
        ws.send(json.dumps({"type": "end"}))
        while True:
            msg = ws.recv(timeout=60)
            if isinstance(msg, str) and json.loads(msg)["type"] in ("done", "error"):
                assert json.loads(msg)["type"] == "done", msg
                return


@pytest.fixture(scope="module")
def stack(tiny_gguf: Path, prometheus_bin: str, promtool: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("deploy-live")
    server = QttsServer(tiny_gguf, tmp)
    prom: Prometheus | None = None
    try:
        server.wait_ready()
        config = tmp / "prometheus.yml"
        config.write_text(yaml.safe_dump(_test_config(server.port)))
        check = subprocess.run([promtool, "check", "config", str(config)], capture_output=True,
                               text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
        prom = Prometheus(prometheus_bin, config, tmp / "tsdb", tmp / "prometheus.log")
        prom.wait_ready()
        instance = f"127.0.0.1:{server.port}"
        _wait(lambda: prom is not None and prom.query(f'up{{instance="{instance}"}} == 1'),
              20, "Prometheus never scraped qtts", prom)

        # traffic: single requests and bursts of 3 (1 worker: they queue), then a bad request
        p = subprocess.run(
            [sys.executable, str(DEPLOY / "traffic.py"), "--url", server.url, "--count", "6",
             "--interval", "0.2", "--burst", "3", "--burst-every", "3", "--min-frames", "4",
             "--max-frames", "16", "--quiet", "--ready-timeout", "30", "--timeout", "60"],
            capture_output=True, text=True, timeout=120,
        )
        assert p.returncode == 0, f"traffic.py failed:\n{p.stdout}{p.stderr}\n{server.log()}"
        _realtime_utterance(server.url)  # the dashboard's realtime row
        traffic_end = time.time()
        bad = urllib.request.Request(server.url + "/tts", data=b'{"codes": [[1]]}',
                                     headers={"content-type": "application/json"})
        try:
            urllib.request.urlopen(bad, timeout=10)
            pytest.fail("a request with one code row was accepted")
        except urllib.error.HTTPError as e:
            assert 400 <= e.code < 500, e.code
        assert "statuses {200: 10}" in p.stdout, p.stdout  # 6 rounds, 2 of them bursts of 3
        total = _finished_requests(server.url)
        # 10 from traffic.py, the realtime utterance (a request of its route) and the bad one
        assert total == 12, f"{total} requests counted, 12 sent:\n{server.log()}"
        _wait(lambda: prom is not None and prom.query(f"sum(qtts_requests_total) == {total}"),
              20, "Prometheus never saw the requests", prom)
        _wait(lambda: prom is not None and all(
            r["health"] != "unknown" for g in prom.api("rules")["groups"] for r in g["rules"]),
            10, "rules never evaluated", prom)
        models = json.loads(_get(server.url + "/v1/models")[1])
        yield Stack(prom, server.url, instance, bool(models["data"][0].get("text")), tmp,
                    traffic_end)
    finally:
        if prom is not None:
            prom.stop()
        server.stop()


def _wait(cond: Any, timeout: float, what: str, prom: Prometheus | None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.25)
    raise TimeoutError(f"{what} in {timeout}s\n{prom.log() if prom else ''}")


# ---------------------------------------------------------------------------------- tests


def test_image_command_exists() -> None:
    """The image runs `qtts serve` (Dockerfile CMD, k8s args): the console script must have it."""
    assert qtts_serve_works(), "`qtts serve` is not a subcommand of the qtts console script"


def test_qtts_target_is_up(stack: Stack) -> None:
    active = stack.prom.api("targets")["activeTargets"]
    (t,) = [t for t in active if t["labels"]["job"] == "qtts"]
    assert t["health"] == "up", t
    assert t["scrapeUrl"].endswith("/metrics")


def _values(stack: Stack, mode: str) -> dict[str, str]:
    if mode == "all":  # Grafana's "All" with allValue ".*"
        return {"job": ".*", "instance": ".*", "stage": ".*", "datasource": "prometheus"}
    return {"job": "qtts", "instance": stack.instance, "stage": "(bigvgan|talker_step)",
            "datasource": "prometheus"}


# Panels whose values need a Base model cloning voices; the stack serves the CustomVoice tiny
# model (the realtime row needs its built-in voices). Their queries still run here; the metric
# itself is observed by tests/service/test_voices_http.py.
NEEDS_BASE_MODEL = {"Voice clone latency by stage"}


@pytest.mark.parametrize("mode", ["all", "selected"])
def test_every_dashboard_query_returns_data(stack: Stack, dashboard: dict[str, Any],
                                            mode: str) -> None:
    values = _values(stack, mode)
    problems = []
    for t in targets(dashboard):
        expr = expand(t.expr, values)
        try:
            result = stack.prom.query(expr)
            if not t.instant:
                result_range = stack.prom.query_range(expr, 20)
                if not result_range:
                    problems.append(f"{t.name}: range query returned no series\n  {expr}")
        except PromError as e:
            problems.append(f"{t.name}: {e}\n  {expr}")
            continue
        vals = sample_values(result)
        if t.panel_title in NEEDS_BASE_MODEL:
            continue  # (it parsed and evaluated; its values need a Base model: see above)
        if not vals:
            problems.append(f"{t.name}: no series\n  {expr}")
        elif not any(math.isfinite(v) for v in vals):
            problems.append(f"{t.name}: only NaN/Inf {vals}\n  {expr}")
    assert not problems, "\n".join(problems)


def test_stage_panels_show_every_stage(stack: Stack, dashboard: dict[str, Any]) -> None:
    values = _values(stack, "all")
    stage_quantiles = [t for t in targets(dashboard)
                       if "qtts_stage_seconds_bucket" in t.expr and "histogram_quantile" in t.expr]
    assert len(stage_quantiles) == 3
    idle = set()
    for t in stage_quantiles:
        result = stack.prom.query(expand(t.expr, values))
        by_stage = {r["metric"]["stage"]: float(r["value"][1]) for r in result}
        assert set(by_stage) == set(STAGES), f"{t.name}: stages {sorted(by_stage)}"
        for s in DECODER_STAGES:
            assert math.isfinite(by_stage[s]) and by_stage[s] > 0, f"{t.name}: {s} {by_stage}"
        idle |= {s for s, v in by_stage.items() if not math.isfinite(v)}
    # codes requests run the decoder only; text requests (when the model can speak text,
    # traffic.py sends some) run the talker too; pcm needs no encoder
    talker = {"prefill", "talker_step", "code_predictor"}
    allowed_idle = {"encode"} if stack.text_ready else talker | {"encode"}
    assert idle <= allowed_idle, f"stages without data: {sorted(idle)}"


def test_variable_queries_find_the_server(stack: Stack, dashboard: dict[str, Any]) -> None:
    values = _values(stack, "all")
    found: dict[str, list[str]] = {}
    for v in dashboard["templating"]["list"]:
        if v["type"] != "query":
            continue
        selector, label = parse_label_values(v["definition"])
        params: dict[str, Any] = {}
        if selector:
            params["match[]"] = [expand(selector, values)]
        found[v["name"]] = stack.prom.api(f"label/{label}/values", **params)
    assert found["job"] == ["qtts"]
    assert found["instance"] == [stack.instance]
    assert set(found["stage"]) == set(STAGES)


def test_alert_expressions_parse_and_rules_evaluate(stack: Stack,
                                                    alert_rules: list[dict[str, Any]]) -> None:
    for r in alert_rules:
        try:
            stack.prom.query(r["expr"])
        except PromError as e:
            pytest.fail(f"{r['alert']}: {e}")
    loaded = {r["name"]: r for g in stack.prom.api("rules")["groups"] for r in g["rules"]}
    assert set(loaded) == {r["alert"] for r in alert_rules}
    for name, r in loaded.items():
        assert r["health"] == "ok", f"{name}: {r.get('lastError')}"
    # a healthy server raises no alert. Speed-based ones (first audio, stream gaps, RTF) may go
    # pending on a loaded test machine -- their `for` keeps them from firing -- and are left out:
    # speed is the machine's, not the server's health
    speed = {"QttsTimeToFirstAudioHigh", "QttsStreamGaps", "QttsRealTimeFactorHigh"}
    alerts = stack.prom.api("alerts")["alerts"]
    assert not [a for a in alerts if a["state"] == "firing"], alerts
    assert not [a for a in alerts if a["labels"]["alertname"] not in speed], alerts


def test_adapter_rule_serves_utilisation_per_pod(stack: Stack) -> None:
    """The HPA's metric, as the Prometheus adapter asks for it, from the live server."""
    (rule,) = load_yaml(ADAPTER_RULE)["rules"]["custom"]
    series = stack.prom.api("series", **{"match[]": [rule["seriesQuery"]]})
    assert {(s["namespace"], s["pod"]) for s in series} == {(NAMESPACE, POD)}
    # what the adapter sends for GET .../namespaces/qtts/pods/*/qtts_utilisation
    query = (rule["metricsQuery"]
             .replace("<<.Series>>", "qtts_capacity")
             .replace("<<.LabelMatchers>>", f'namespace="{NAMESPACE}",pod=~"{POD}"')
             .replace("<<.GroupBy>>", "pod"))
    result = stack.prom.query(query)
    assert [r["metric"] for r in result] == [{"pod": POD}]
    # (running + waiting) / capacity: at most (capacity 2 + the queue of 8) / 2
    assert 0 <= float(result[0]["value"][1]) <= (2 + 8) / 2
    assert stack.prom.query(f'qtts_capacity{{pod="{POD}"}} == 2'), "1 worker x max_batch 2"
    # as it was when the traffic ended, against the raw samples of that minute averaged here
    at = f"{stack.traffic_end:.3f}"
    at_end = stack.prom.api("query", query=query, time=at)["result"]
    assert [r["metric"] for r in at_end] == [{"pod": POD}]

    def mean_of(metric: str) -> float:
        (series,) = stack.prom.api("query", query=f'{metric}{{pod="{POD}"}}[1m]',
                                   time=at)["result"]
        return sum(float(v) for _, v in series["values"]) / len(series["values"])

    expected = (mean_of("qtts_requests_running") + mean_of("qtts_requests_waiting")) / 2
    assert math.isclose(float(at_end[0]["value"][1]), expected, rel_tol=1e-9, abs_tol=1e-12)


def test_probe_paths_and_container_healthcheck(stack: Stack) -> None:
    assert _get(stack.qtts_url + "/healthz")[0] == 200
    assert _get(stack.qtts_url + "/readyz")[0] == 200
    port = stack.qtts_url.rsplit(":", 1)[1]
    p = subprocess.run([sys.executable, str(DEPLOY / "docker" / "healthcheck.py")],
                       capture_output=True, text=True, timeout=30,
                       env={**os.environ, "QTTS_PORT": port})
    assert p.returncode == 0, p.stderr
