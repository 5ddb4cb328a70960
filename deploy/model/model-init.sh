#!/bin/sh
# qtts model init: copy the model GGUF into the pod's model volume and check its sha256.
# Runs as the init container of the qtts pod (deploy/k8s/base/deployment.yaml), in the model
# image (deploy/model/Dockerfile: busybox + the GGUF + this script). POSIX sh + sha256sum.
#
#   QTTS_MODEL_SHA256   required: the expected sha256 of the GGUF (64 hex digits)
#   QTTS_MODEL_SRC      the GGUF in the model image (default /model/model.gguf)
#   QTTS_MODEL_DEST     where the server reads it (default /models/model.gguf)
#   QTTS_MODEL_VERSION  a name for the logs (optional)
#
# The source is checked before anything is copied (a wrong model image or checksum fails in
# the time of one read, not after a copy), and the copy again before it is renamed into place:
# the server never sees a partial or unverified file. Exit 0: verified; 1: mismatch or I/O
# error; 2: bad configuration. Every failure is one line starting "qtts-model-init: FATAL".
set -eu

log() { printf 'qtts-model-init: %s\n' "$*" >&2; }
fatal() { code="$1"; shift; log "FATAL: $*"; exit "$code"; }

src="${QTTS_MODEL_SRC:-/model/model.gguf}"
dest="${QTTS_MODEL_DEST:-/models/model.gguf}"
want="${QTTS_MODEL_SHA256:-}"
version="${QTTS_MODEL_VERSION:-unversioned}"

[ -n "$want" ] || fatal 2 "QTTS_MODEL_SHA256 is not set (the model ConfigMap gives it)"
want="$(printf '%s' "$want" | tr 'A-F' 'a-f')"
case "$want" in
    *[!0-9a-f]*) fatal 2 "QTTS_MODEL_SHA256 '$want' is not a sha256 (64 hex digits)" ;;
esac
[ "${#want}" -eq 64 ] || fatal 2 "QTTS_MODEL_SHA256 '$want' is not a sha256 (64 hex digits)"
[ -f "$src" ] || fatal 1 "model $src not found in the model image (version $version)"

digest() { sha256sum "$1" | cut -d' ' -f1; }

got="$(digest "$src")" || fatal 1 "cannot read $src"
if [ "$got" != "$want" ]; then
    fatal 1 "sha256 mismatch for $src (version $version): expected $want, got $got;" \
        "the model image and QTTS_MODEL_SHA256 do not belong together, refusing to serve it"
fi

dir="$(dirname "$dest")"
mkdir -p "$dir" || fatal 1 "cannot create $dir"
if [ -f "$dest" ] && [ "$(digest "$dest")" = "$want" ]; then
    log "model $version already in place at $dest (sha256 $want)"
    exit 0
fi
tmp="$dest.partial.$$"
trap 'rm -f "$tmp"' EXIT
cp "$src" "$tmp" || fatal 1 "copying $src to $tmp failed (is the volume large enough?)"
copied="$(digest "$tmp")" || fatal 1 "cannot read $tmp"
[ "$copied" = "$want" ] || fatal 1 "sha256 mismatch after copying to $tmp: expected $want, got $copied"
chmod 0444 "$tmp"
mv -f "$tmp" "$dest"
trap - EXIT
log "model $version verified (sha256 $want, $(wc -c < "$dest") bytes) at $dest"
