"""Prometheus config and alert rules: promtool checks and unit tests, and the alerts the issue
asks for. (Their expressions are evaluated against a live Prometheus in test_live.py.)"""

from __future__ import annotations

import re
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
    assert "SUCCESS: 13 rules found" in out, out


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
    from service.metrics import RTF_BUCKETS, TTFA_BUCKETS

    names = {r["alert"] for r in alert_rules}
    assert names == {
        "QttsErrorRate", "QttsQueueSaturated", "QttsTimeToFirstAudioHigh", "QttsStreamGaps",
        "QttsRealTimeFactorHigh", "QttsWorkerRestarts", "QttsNoWorkersAlive", "QttsTargetDown",
        "QttsTargetsAbsent", "QttsPodNotReady", "QttsRolloutStuck", "QttsAutoscalerAtMax",
        "QttsMemoryNearLimit"}
    exprs = {r["alert"]: " ".join(r["expr"].split()) for r in alert_rules}
    # users feel 503s: the error rate counts the refusals
    assert 'qtts_rejections_total{reason=~"queue_full|not_ready|draining"}' in (
        exprs["QttsErrorRate"])
    # thresholds sit on bucket edges: counted, not interpolated
    assert 'qtts_time_to_first_audio_seconds_bucket{le="2.0"}' in exprs["QttsTimeToFirstAudioHigh"]
    assert 2.0 in TTFA_BUCKETS
    assert 'qtts_rtf_bucket{le="1.0"}' in exprs["QttsRealTimeFactorHigh"] and 1.0 in RTF_BUCKETS
    assert "qtts_stream_gaps_total" in exprs["QttsStreamGaps"]
    # gaps over every request that could stream (truncated_no_eos, cancelled, ... too), not
    # only the ok ones: else gaps with no ok request read +Inf
    assert 'rate(qtts_requests_total{outcome!="rejected"}[10m])' in exprs["QttsStreamGaps"]
    assert exprs["QttsTargetsAbsent"].startswith("absent(up{")
    assert "qtts_worker_restarts_total" in exprs["QttsWorkerRestarts"]
    assert "qtts_workers_alive" in exprs["QttsNoWorkersAlive"]
    # no alert on a single refusal: rates of refusals are shares of all attempts -- requests
    # not refused plus every refusal (some, e.g. realtime handshakes, are not requests), so the
    # share never passes 1
    for name in ("QttsErrorRate", "QttsQueueSaturated"):
        assert ('/ ( sum by (job) (rate(qtts_requests_total{outcome!="rejected"}[5m])) '
                '+ sum by (job) (rate(qtts_rejections_total[5m])) )') in exprs[name], name
    for r in alert_rules:
        assert r["labels"]["severity"] in {"warning", "critical"}, r["alert"]
        ann = r["annotations"]
        assert ann.get("summary") and ann.get("description"), r["alert"]
        assert ann.get("runbook_url") == f"docs/deploy.md#{r['alert'].lower()}", r["alert"]


def test_runbook_links_reach_a_section() -> None:
    """Every runbook_url anchor is a heading of docs/deploy.md (GitHub's slug rule)."""
    doc = (DEPLOY.parent / "docs" / "deploy.md").read_text()
    slugs = set()
    fenced = False
    for line in doc.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif line.startswith("#") and not fenced:
            title = line.lstrip("#").strip().lower()
            slugs.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    for r in load_yaml(ALERTS)["groups"][0]["rules"]:
        anchor = r["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor in slugs, f"{r['alert']}: no section #{anchor} in docs/deploy.md"


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
