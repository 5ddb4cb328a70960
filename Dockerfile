# syntax=docker/dockerfile:1
# qtts: streaming Qwen3-TTS HTTP service on ggml.
#
#   docker build -t qtts:0.1.0 .
#   docker run --rm -p 8000:8000 -v qtts-models:/models --stop-timeout 45 qtts:0.1.0
#
# Stage 1 builds the native layer exactly as `make native` does (the Makefile's `sysdeps`, `venv`
# and `native` recipes, without the dev extra); stage 2 is a slim runtime with only the shared
# libraries the build links against. docs/deploy.md has the details (model volume, settings).
#
# Note: native/build.py builds ggml and qtts's kernels for the build host's CPU (-march=native);
# build the image on (or for) the oldest CPU generation it will run on.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder

# `make sysdeps` (OpenBLAS backs ggml's BLAS backend) + the compiler and CMake the build needs
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        libopenblas-dev pkg-config build-essential cmake \
 && rm -rf /var/lib/apt/lists/*

# the pinned ggml is built into this cache; engine/ggml/_native.json points at it by absolute
# path, so the runtime stage copies /opt/qtts to the same place
ENV QTTS_CACHE_DIR=/opt/qtts/cache \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /opt/qtts/app
COPY . .

# `make venv` (without the dev extra) and `make native`
ARG QTTS_GGML_BACKENDS=blas
# hadolint ignore=DL3013
RUN python3 -m venv .venv \
 && .venv/bin/python -m pip install -q --upgrade pip \
 && .venv/bin/python -m pip install -q -e . \
 && .venv/bin/python native/build.py \
 && .venv/bin/python -m compileall -q engine service cli \
 && rm -rf "$QTTS_CACHE_DIR/downloads" "$QTTS_CACHE_DIR/src" \
 && .venv/bin/qtts info

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="qtts" \
      org.opencontainers.image.description="Streaming Qwen3-TTS speech-synthesis HTTP service on ggml" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.documentation="docs/deploy.md" \
      org.opencontainers.image.base.name="python:3.11-slim-bookworm"

# the shared libraries of the native build: OpenBLAS (with gfortran) and OpenMP
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        libopenblas0 libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 qtts \
 && useradd --system --uid 10001 --gid qtts --home-dir /home/qtts --create-home \
        --shell /usr/sbin/nologin qtts \
 && mkdir -p /models \
 && chown qtts:qtts /models

COPY --from=builder /opt/qtts /opt/qtts
COPY --chmod=0755 deploy/docker/entrypoint.sh /usr/local/bin/qtts-entrypoint
COPY --chmod=0644 deploy/docker/healthcheck.py /usr/local/lib/qtts/healthcheck.py

ENV PATH=/opt/qtts/app/.venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    QTTS_HOST=0.0.0.0 \
    QTTS_PORT=8000 \
    QTTS_MODELS_DIR=/models \
    QTTS_LOG_FORMAT=json

USER 10001:10001
WORKDIR /home/qtts
VOLUME ["/models"]
EXPOSE 8000

# liveness: the process serves HTTP (readiness, /readyz, is for load balancers and Kubernetes);
# the start period covers making the synthetic default model (~40 s) and loading a large one
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "/usr/local/lib/qtts/healthcheck.py"]

# SIGTERM drains: new requests get 503, in-flight ones may finish for QTTS_DRAIN_SECONDS (30 s):
# give the container more than that to stop (docker run --stop-timeout 45, compose
# stop_grace_period, Kubernetes terminationGracePeriodSeconds)
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/qtts-entrypoint"]
CMD ["qtts", "serve"]
