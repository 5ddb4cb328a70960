"""Kubernetes manifests: schema validation and the wiring between the objects.

Core kinds are validated by kubernetes-validate (PyPI; the Kubernetes OpenAPI schemas of each
release, bundled) in strict mode, against the oldest and newest releases we claim; the
prometheus-operator kinds (ServiceMonitor, PrometheusRule) by the CRD schemas of
@kubernetes-models/prometheus-operator (npm, deploy/ci/validate-crds.mjs).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.settings import Settings
from tests.deploy.conftest import DEPLOY, K8S, load_yaml, load_yaml_all

K8S_VERSIONS = ("1.28.0", "1.37.0")
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
Objects = dict[tuple[str, str], dict[str, Any]]


def _container(objs: Objects) -> dict[str, Any]:
    dep = objs[("Deployment", "qtts")]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c  # type: ignore[no-any-return]


def _env(objs: Objects) -> dict[str, str]:
    return {e["name"]: e["value"] for e in _container(objs)["env"]}


def test_kustomization_lists_every_manifest() -> None:
    kust = load_yaml(K8S / "kustomization.yaml")
    listed = set(kust["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk, f"listed {sorted(listed)} != files {sorted(on_disk)}"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_core_kinds_validate(version: str, k8s_objects: Objects) -> None:
    import kubernetes_validate
    from kubernetes_validate import SchemaNotFoundError

    checked = 0
    for (kind, name), obj in k8s_objects.items():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
            checked += 1
        except SchemaNotFoundError:
            assert kind in CRD_KINDS, f"{kind}/{name}: no schema in Kubernetes {version}"
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{kind}/{name} invalid for Kubernetes {version}: {e.message} "
                        f"at {'/'.join(str(p) for p in e.absolute_path)}")
    assert checked == len(k8s_objects) - len(CRD_KINDS)


def test_crd_kinds_validate(npm_tools: Path, k8s_objects: Objects) -> None:
    crs = [o for (kind, _), o in k8s_objects.items() if kind in CRD_KINDS]
    assert {o["kind"] for o in crs} == CRD_KINDS
    p = subprocess.run(
        ["node", str(DEPLOY / "ci" / "validate-crds.mjs")], input=json.dumps(crs),
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "QTTS_DEPLOY_TOOLS": str(npm_tools)},
    )
    results = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert p.returncode == 0 and len(results) == len(crs), f"{p.stdout}\n{p.stderr}"
    # and the validator does reject a bad one
    bad = json.loads(json.dumps(k8s_objects[("ServiceMonitor", "qtts")]))
    bad["spec"]["endpoints"][0]["interval"] = "every 15 seconds"
    p = subprocess.run(
        ["node", str(DEPLOY / "ci" / "validate-crds.mjs")], input=json.dumps([bad]),
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "QTTS_DEPLOY_TOOLS": str(npm_tools)},
    )
    assert p.returncode == 1 and "interval" in p.stdout


def test_kustomize_build() -> None:
    """`kubectl kustomize` renders the set (where kubectl exists; it is optional)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the kustomization is checked by file list only")
    p = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    docs = [d for d in yaml.safe_load_all(p.stdout) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["Namespace", "PersistentVolumeClaim", "Deployment", "Service",
                            "HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor",
                            "PrometheusRule"])
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "qtts", d["kind"]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == "qtts:0.1.0"


def test_selectors_and_ports_connect(k8s_objects: Objects) -> None:
    dep = k8s_objects[("Deployment", "qtts")]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    svc = k8s_objects[("Service", "qtts")]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    pdb = k8s_objects[("PodDisruptionBudget", "qtts")]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    container_ports = {p["name"]: p["containerPort"] for p in _container(k8s_objects)["ports"]}
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert svc_ports["http"]["targetPort"] in container_ports
    assert container_ports["http"] == int(_env(k8s_objects)["QTTS_PORT"])
    sm = k8s_objects[("ServiceMonitor", "qtts")]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] in svc_ports and ep["path"] == "/metrics"


def test_probes_point_at_the_real_paths(k8s_objects: Objects) -> None:
    c = _container(k8s_objects)
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    ports = {p["name"] for p in c["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in ports
    # the startup probe allows the model load + warm-up
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 120


def test_graceful_termination_outlasts_the_drain(k8s_objects: Objects) -> None:
    spec = k8s_objects[("Deployment", "qtts")]["spec"]["template"]["spec"]
    env = _env(k8s_objects)
    drain = float(env.get("QTTS_DRAIN_SECONDS", Settings.model_fields["drain_seconds"].default))
    pre_stop = _container(k8s_objects)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert spec["terminationGracePeriodSeconds"] > drain + float(pre_stop[1])


def test_resources_threads_and_volume(k8s_objects: Objects) -> None:
    c = _container(k8s_objects)
    env = _env(k8s_objects)
    req = c["resources"]["requests"]
    assert req["cpu"] and req["memory"] and c["resources"]["limits"]["memory"]
    cpus = float(req["cpu"])
    threads = int(env["QTTS_WORKERS"]) * int(env["QTTS_THREADS_PER_WORKER"])
    assert threads <= cpus, f"{threads} compute threads on {cpus} requested CPUs"
    model_dir = os.path.dirname(env["QTTS_MODEL"])
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert model_dir in mounts and mounts[model_dir]["readOnly"]
    vols = {v["name"]: v for v in k8s_objects[("Deployment", "qtts")]["spec"]["template"]
            ["spec"]["volumes"]}
    claim = vols[mounts[model_dir]["name"]]["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in k8s_objects


def test_env_names_are_real_settings(k8s_objects: Objects) -> None:
    known = {f"QTTS_{n.upper()}" for n in Settings.model_fields}
    for name in _env(k8s_objects):
        assert name in known, f"{name} is not a service setting (service/settings.py)"


def test_security_context_matches_the_image(k8s_objects: Objects) -> None:
    dockerfile = (DEPLOY.parent / "Dockerfile").read_text()
    user = next(line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER "))
    uid, gid = (int(x) for x in user.split(":"))
    sc = k8s_objects[("Deployment", "qtts")]["spec"]["template"]["spec"]["securityContext"]
    assert sc["runAsNonRoot"] and sc["runAsUser"] == uid and sc["runAsGroup"] == gid
    assert "EXPOSE 8000" in dockerfile


def test_hpa_targets_the_deployment_on_queue_depth(k8s_objects: Objects) -> None:
    hpa = k8s_objects[("HorizontalPodAutoscaler", "qtts")]
    ref = hpa["spec"]["scaleTargetRef"]
    dep = k8s_objects[("Deployment", "qtts")]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == (
        dep["apiVersion"], dep["kind"], dep["metadata"]["name"])
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert metrics["Pods"]["pods"]["metric"]["name"] == "qtts_requests_waiting"
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    assert _container(k8s_objects)["resources"]["requests"]["cpu"], "CPU utilization needs it"
    assert hpa["spec"]["minReplicas"] >= 2, "the PDB's minAvailable 1 needs 2 replicas"
    pdb = k8s_objects[("PodDisruptionBudget", "qtts")]
    assert pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"]


def test_adapter_rule_serves_the_hpa_metric(k8s_objects: Objects) -> None:
    values = load_yaml(K8S / "prometheus-adapter" / "values.yaml")
    (rule,) = values["rules"]["custom"]
    hpa = k8s_objects[("HorizontalPodAutoscaler", "qtts")]
    name = next(m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]
                if m["type"] == "Pods")
    assert rule["name"]["as"] == name
    assert rule["seriesQuery"].startswith("qtts_requests_waiting{")
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                              "pod": {"resource": "pod"}}
    for key in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
        assert key in rule["metricsQuery"]
    # (rendered and evaluated against a live Prometheus in test_live.py)


def test_manifests_parse_as_single_documents() -> None:
    for path in K8S.rglob("*.yaml"):
        assert len(load_yaml_all(path)) == 1, path
