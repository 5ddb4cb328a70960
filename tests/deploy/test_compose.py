"""deploy/docker-compose.yml: validated against the Compose specification's schema and linted
by dclint (npm), and its wiring checked: the files it mounts exist, Prometheus scrapes the qtts
service on its port, Grafana's provisioning reaches Prometheus and the dashboard folder."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from service.settings import Settings
from tests.deploy.conftest import DEPLOY, PROM_CONFIG, ROOT, load_yaml

COMPOSE = DEPLOY / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE)  # type: ignore[no-any-return]


def test_dclint(npm_tools: Path) -> None:
    dclint = npm_tools / "node_modules" / ".bin" / "dclint"
    version = subprocess.run([str(dclint), "--version"], capture_output=True, text=True,
                             timeout=60).stdout.strip()
    p = subprocess.run([str(dclint), str(COMPOSE), "--max-warnings", "0", "--color", "false"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"dclint {version}:\n{p.stdout}{p.stderr}"


def test_dclint_rejects_a_bad_file(npm_tools: Path, tmp_path: Path) -> None:
    """The schema check is live: an unknown service key fails."""
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(COMPOSE.read_text().replace("    stop_grace_period: 75s",
                                               "    stop_grace_period: 75s\n    bogus: 1"))
    dclint = npm_tools / "node_modules" / ".bin" / "dclint"
    p = subprocess.run([str(dclint), str(bad), "--color", "false"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode != 0 and "additional properties" in p.stdout


def _bind_sources(service: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for v in service.get("volumes", []):
        src, dst = v.split(":")[:2]
        if src.startswith((".", "/")):
            out.append((src, dst))
    return out


def test_services_and_mounts(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"qtts", "prometheus", "grafana"} <= set(services)
    for name, svc in services.items():
        for src, _ in _bind_sources(svc):
            assert (DEPLOY / src).exists(), f"{name}: {src} does not exist"
    build = services["qtts"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == ROOT / "Dockerfile"
    mounts = dict((dst, src) for src, dst in _bind_sources(services["grafana"]))
    prov = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "qtts.yml")
    path = prov["providers"][0]["options"]["path"]
    assert (DEPLOY / mounts[path]).resolve() == DEPLOY / "grafana" / "dashboards"
    assert (DEPLOY / mounts["/etc/grafana/provisioning"]).resolve() == (
        DEPLOY / "grafana" / "provisioning")
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{path}/qtts.json"
    prom_mounts = dict((dst, src) for src, dst in _bind_sources(services["prometheus"]))
    assert (DEPLOY / prom_mounts["/etc/prometheus"]).resolve() == PROM_CONFIG.parent
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    traffic = services["traffic"]
    assert any(src == "./traffic.py" for src, _ in _bind_sources(traffic))


def test_prometheus_and_grafana_reach_their_targets(compose: dict[str, Any]) -> None:
    prom = load_yaml(PROM_CONFIG)
    qtts_job = next(j for j in prom["scrape_configs"] if j["job_name"] == "qtts")
    (target,) = qtts_job["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert host in compose["services"]
    # the image listens on QTTS_PORT=8000 (Dockerfile); compose does not override it
    assert "QTTS_PORT" not in compose["services"]["qtts"]["environment"]
    assert port == "8000" and "QTTS_PORT=8000" in (ROOT / "Dockerfile").read_text()
    ds = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    url = urlparse(ds["datasources"][0]["url"])
    assert url.hostname in compose["services"] and url.port == 9090


def test_stop_grace_outlasts_the_drain(compose: dict[str, Any]) -> None:
    qtts = compose["services"]["qtts"]
    drain = float(qtts["environment"]["QTTS_DRAIN_SECONDS"])
    timeout = float(qtts["environment"]["QTTS_REQUEST_TIMEOUT"])
    audio = float(qtts["environment"]["QTTS_MAX_AUDIO_SECONDS"])
    grace = qtts["stop_grace_period"]
    assert grace.endswith("s") and float(grace[:-1]) >= drain + 10
    assert drain >= timeout >= audio, "a stop must not cut the longest request allowed"


def test_env_names_are_real(compose: dict[str, Any]) -> None:
    known = {f"QTTS_{n.upper()}" for n in Settings.model_fields}
    known |= {"QTTS_MODELS_DIR", "QTTS_SYNTHETIC_SIZE"}  # the entrypoint's own
    for name in compose["services"]["qtts"]["environment"]:
        assert name in known, f"{name} is not a qtts setting"
    entry = (DEPLOY / "docker" / "entrypoint.sh").read_text()
    assert "QTTS_MODELS_DIR" in entry and "QTTS_SYNTHETIC_SIZE" in entry


def test_voice_store_is_a_postgresql_service_with_a_volume(compose: dict[str, Any]) -> None:
    services = compose["services"]
    pg, qtts = services["postgres"], services["qtts"]
    assert pg["image"].startswith("postgres:")
    assert "voice-db:/var/lib/postgresql/data" in pg["volumes"] and "voice-db" in compose["volumes"]
    assert qtts["depends_on"]["postgres"]["condition"] == "service_healthy"
    url = urlparse(qtts["environment"]["QTTS_VOICE_DB"].replace("${QTTS_DB_PASSWORD:-qtts}",
                                                                 "pw"))
    db = "/" + pg["environment"]["POSTGRES_DB"]
    assert (url.scheme, url.hostname, url.port, url.path) == ("postgresql", "postgres", 5432, db)
    assert url.username == pg["environment"]["POSTGRES_USER"]
    assert Settings(voice_db=qtts["environment"]["QTTS_VOICE_DB"]).voice_db  # a URL qtts takes
