"""The Grafana dashboard and provisioning, statically.

No maintained offline validator of Grafana dashboards exists on the package registries
(@grafana/schema ships TypeScript types only), so this checks the rules of the dashboard model
of the schemaVersion the JSON declares (39: Grafana 10.3 - 11.x) that Grafana enforces or that
make a dashboard silently wrong: uid format, unique panel ids and refIds, a grid that fits 24
columns without overlaps, a datasource and a unit on every panel, every variable defined, every
metric selector filtered by $job and $instance, and every service metric on a panel. The
expressions themselves are evaluated by a real Prometheus in test_live.py.
"""

from __future__ import annotations

import re
from typing import Any

from service.metrics import STAGES, Metrics
from tests.deploy.conftest import DASHBOARD, DEPLOY, PROM_CONFIG, load_yaml
from tests.deploy.helpers import iter_panels, parse_label_values, targets, variables_used

SCHEMA_VERSION = 39
PANEL_TYPES = {"row", "timeseries", "stat", "table", "heatmap", "gauge", "bargauge", "text"}
# Grafana unit ids used by this dashboard (pkg/valueformats): custom ones are "suffix:<text>"
UNITS = {"none", "short", "s", "ms", "percent", "percentunit", "reqps", "cps", "ops", "bytes"}
UID = re.compile(r"^[a-zA-Z0-9_-]{1,40}$")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def test_top_level(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] == SCHEMA_VERSION
    assert isinstance(dashboard["title"], str) and dashboard["title"]
    assert UID.match(dashboard["uid"]), dashboard["uid"]
    assert dashboard.get("id") is None, "a provisioned dashboard must not carry a database id"
    assert isinstance(dashboard["version"], int)
    assert isinstance(dashboard["editable"], bool)
    assert isinstance(dashboard["tags"], list)
    assert set(dashboard["time"]) == {"from", "to"}
    assert isinstance(dashboard["annotations"]["list"], list)
    assert isinstance(dashboard["templating"]["list"], list)
    assert isinstance(dashboard["panels"], list) and dashboard["panels"]


def test_dashboard_uids_are_unique() -> None:
    """Grafana refuses a second dashboard with a uid (or a title in a folder) already taken."""
    import json

    docs = [json.loads(p.read_text()) for p in sorted(DASHBOARD.parent.glob("*.json"))]
    uids = [d["uid"] for d in docs]
    titles = [d["title"] for d in docs]
    assert len(uids) == len(set(uids)) and len(titles) == len(set(titles))
    ds = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    ds_uids = [d["uid"] for d in ds["datasources"]]
    assert len(ds_uids) == len(set(ds_uids))


def test_panel_ids_grid_and_types(dashboard: dict[str, Any]) -> None:
    ids: list[int] = []
    cells: dict[tuple[int, int], int] = {}
    for p in iter_panels(dashboard):
        assert isinstance(p["id"], int), p
        ids.append(p["id"])
        assert p["type"] in PANEL_TYPES, f"panel {p['id']}: unknown type {p['type']}"
        assert p.get("title"), f"panel {p['id']} has no title"
        g = p["gridPos"]
        assert all(isinstance(g[k], int) and g[k] >= 0 for k in ("h", "w", "x", "y")), p["id"]
        assert g["w"] >= 1 and g["h"] >= 1 and g["x"] + g["w"] <= 24, f"panel {p['id']}: {g}"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panels {cells[(x, y)]} and {p['id']} overlap"
                cells[(x, y)] = p["id"]
    assert len(ids) == len(set(ids)), "panel ids are not unique"


def test_every_panel_has_datasource_unit_and_queries(dashboard: dict[str, Any]) -> None:
    for p in iter_panels(dashboard):
        if p["type"] == "row":
            assert p.get("panels", []) == [] or p.get("collapsed"), p["id"]
            continue
        name = f"panel {p['id']} '{p['title']}'"
        assert p.get("description"), f"{name}: no description"
        assert p.get("datasource") == DATASOURCE, f"{name}: datasource {p.get('datasource')}"
        unit = p["fieldConfig"]["defaults"].get("unit")
        assert unit, f"{name}: no unit"
        assert unit in UNITS or unit.startswith(("suffix:", "prefix:")), f"{name}: unit {unit}"
        if p["type"] == "heatmap":
            assert p["options"]["yAxis"]["unit"] == unit
        ts = p.get("targets", [])
        assert ts, f"{name}: no query"
        refs = [t["refId"] for t in ts]
        assert len(refs) == len(set(refs)), f"{name}: duplicate refIds {refs}"
        for t in ts:
            assert t.get("datasource") == DATASOURCE, f"{name} {t['refId']}: datasource"
            assert t.get("expr", "").strip(), f"{name} {t['refId']}: empty expr"


def test_variables(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert len(variables) == len(dashboard["templating"]["list"]), "variable names repeat"
    assert {"datasource", "job", "instance", "stage"} <= set(variables)
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    used: set[str] = set()
    for t in targets(dashboard):
        used |= variables_used(t.expr)
    for v in variables.values():
        if v["type"] == "query":
            used |= variables_used(v["definition"])
            assert v["datasource"] == DATASOURCE
            assert v["query"] == v["definition"], "the query is the plain label_values() string"
            parse_label_values(v["definition"])
            assert v["includeAll"] and v["allValue"] == ".*"
    used |= {"datasource"}
    undefined = {u for u in used if not u.startswith("__")} - set(variables)
    assert not undefined, f"undefined variables {undefined}"
    assert set(variables) <= used, f"unused variables {set(variables) - used}"


_SELECTOR = re.compile(r"\b(qtts_[a-z_]+)(\{[^}]*\})?")


def test_every_selector_is_filtered_by_job_and_instance(dashboard: dict[str, Any]) -> None:
    for t in targets(dashboard):
        for m in _SELECTOR.finditer(t.expr):
            matchers = m.group(2) or ""
            assert 'job=~"$job"' in matchers and 'instance=~"$instance"' in matchers, (
                f"{t.name}: {m.group(0)} is not filtered by $job and $instance")


def test_every_service_metric_is_on_the_dashboard(dashboard: dict[str, Any]) -> None:
    registry = Metrics().registry
    # the service's own metrics (process_* is the standard process collector of the front end)
    names = {m.name for m in registry.collect() if m.name.startswith("qtts_")}
    assert len(names) >= 13  # the issue names 13; the service adds qtts_rejections_total
    text = " ".join(t.expr for t in targets(dashboard))
    missing = [n for n in sorted(names) if not re.search(rf"\b{n}(_total|_bucket|_sum|_count)?\b",
                                                         text)]
    assert not missing, f"metrics without a panel: {missing}"


def test_issue_panels(dashboard: dict[str, Any]) -> None:
    ts = targets(dashboard)
    by_type = {p["type"] for p in iter_panels(dashboard)}
    assert "heatmap" in by_type
    heat = [t for t in ts if t.panel_type == "heatmap"]
    assert heat and all("qtts_stage_seconds_bucket" in t.expr for t in heat)
    # per-stage p50/p95/p99, by stage
    for q in ("0.5", "0.95", "0.99"):
        assert any(f"histogram_quantile({q}," in t.expr and "qtts_stage_seconds_bucket" in t.expr
                   and "stage" in t.expr.split("by (")[1] for t in ts), q
    for metric in ("qtts_time_to_first_audio_seconds_bucket", "qtts_request_queue_seconds_bucket",
                   "qtts_request_duration_seconds_bucket", "qtts_rtf_bucket"):
        qs = {t.expr.split(",")[0] for t in ts if metric in t.expr}
        assert {"histogram_quantile(0.5", "histogram_quantile(0.95"} <= qs, metric
    assert any("sum by (outcome)" in t.expr for t in ts)
    assert any("qtts_audio_seconds_total" in t.expr and "rate(" in t.expr for t in ts)
    assert any("qtts_build_info" in t.expr for t in ts)
    assert len(STAGES) == 9


def test_provisioning_matches_dashboard_and_prometheus(dashboard: dict[str, Any]) -> None:
    ds = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus"
    var = next(v for v in dashboard["templating"]["list"] if v["name"] == "datasource")
    assert var["current"]["value"] == source["uid"], "dashboard default datasource uid"
    prom = load_yaml(PROM_CONFIG)
    assert source["jsonData"]["timeInterval"] == prom["global"]["scrape_interval"]
    prov = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "qtts.yml")
    (provider,) = prov["providers"]
    assert provider["type"] == "file"
    assert DASHBOARD.parent.name == "dashboards"
    # compose mounts deploy/grafana/dashboards at the provider's path (test_compose checks it)
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_panels_are_documented(dashboard: dict[str, Any]) -> None:
    doc = (DEPLOY.parent / "docs" / "deploy.md").read_text()
    missing = [p["title"] for p in iter_panels(dashboard)
               if p["type"] != "row" and p["title"] not in doc]
    assert not missing, f"docs/deploy.md does not explain panels {missing}"


def test_variables_survive_every_worker_failing(dashboard: dict[str, Any]) -> None:
    """qtts_build_info is empty until a worker has loaded: variables drawn from it would leave
    the dashboard blank exactly when every worker fails. They come from a gauge the server
    exports from its first scrape."""
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            assert "qtts_build_info" not in v["definition"], v["name"]
            assert "qtts_build_info" not in v["query"], v["name"]
    job = next(v for v in dashboard["templating"]["list"] if v["name"] == "job")
    assert parse_label_values(job["definition"]) == ("qtts_workers_alive", "job")
