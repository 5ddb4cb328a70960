"""Prometheus config and alert rules: promtool checks and unit tests, and the alerts the issue
asks for. (Their expressions are evaluated against a live Prometheus in test_live.py.)"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.conftest import ALERTS, DEPLOY, K8S_BASE, PROM_CONFIG, load_yaml


def run(cmd: list[str], cwd: Path | None = None) -> str:
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{' '.join(cmd)} failed ({p.returncode}):\n{out}"
    return out


def test_promtool_check_config(promtool: str) -> None:
    out = run([promtool, "check", "config", str(PROM_CONFIG)])
    assert "SUCCESS" in out and "1 rule files found" in out, out


def test_promtool_check_rules(promtool: str) -> None:
    out = run([promtool, "check", "rules", str(ALERTS)])
    assert "SUCCESS: 7 rules found" in out, out


def test_promtool_rule_unit_tests(promtool: str) -> None:
    """deploy/prometheus/alerts_test.yml: every alert fires on a made-up series (exact labels
    and annotations) and stays quiet on a healthy one."""
    out = run([promtool, "test", "rules", "alerts_test.yml"], cwd=ALERTS.parent)
    assert "SUCCESS" in out, out
    tested = {
        t["alertname"]
        for case in load_yaml(ALERTS.parent / "alerts_test.yml")["tests"]
        for t in case.get("alert_rule_test", [])
    }
    names = {r["alert"] for g in load_yaml(ALERTS)["groups"] for r in g["rules"]}
    assert names <= tested, f"alerts without a unit test: {sorted(names - tested)}"


def test_alerts_cover_the_issue(alert_rules: list[dict[str, Any]]) -> None:
    names = {r["alert"] for r in alert_rules}
    for required in ("QttsQueueSaturated", "QttsTimeToFirstAudioHigh", "QttsWorkerRestarts",
                     "QttsErrorRate", "QttsNoWorkersAlive"):
        assert required in names
    exprs = {r["alert"]: r["expr"] for r in alert_rules}
    assert "qtts_time_to_first_audio_seconds_bucket" in exprs["QttsTimeToFirstAudioHigh"]
    assert "0.95" in exprs["QttsTimeToFirstAudioHigh"]
    assert "qtts_worker_restarts_total" in exprs["QttsWorkerRestarts"]
    assert "qtts_workers_alive" in exprs["QttsNoWorkersAlive"]
    assert "qtts_requests_total" in exprs["QttsErrorRate"]
    for r in alert_rules:
        assert r["labels"]["severity"] in {"warning", "critical"}, r["alert"]
        assert r["annotations"].get("summary") and r["annotations"].get("description"), r["alert"]


def test_alert_names_are_documented(alert_rules: list[dict[str, Any]]) -> None:
    doc = (DEPLOY.parent / "docs" / "deploy.md").read_text()
    missing = [r["alert"] for r in alert_rules if r["alert"] not in doc]
    assert not missing, f"docs/deploy.md does not explain {missing}"


def test_prometheusrule_equals_alerts_file(promtool: str, tmp_path: Path) -> None:
    """The operator's PrometheusRule carries exactly the groups of alerts.yml, and they pass
    promtool as they are written there."""
    pr = load_yaml(K8S_BASE / "prometheusrule.yaml")
    assert pr["kind"] == "PrometheusRule"
    assert pr["spec"] == load_yaml(ALERTS), "deploy/k8s/base/prometheusrule.yaml != alerts.yml"
    out = tmp_path / "rules.yml"
    out.write_text(yaml.safe_dump(pr["spec"]))
    run([promtool, "check", "rules", str(out)])


def test_config_scrapes_qtts() -> None:
    cfg = load_yaml(PROM_CONFIG)
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    qtts = jobs["qtts"]
    assert qtts.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in qtts["static_configs"] for t in sc["targets"]]
    assert targets == ["qtts:8000"], targets
    assert cfg["rule_files"] == ["alerts.yml"]
