# syntax=docker/dockerfile:1
# qtts: streaming Qwen3-TTS HTTP service on ggml, CPU image (Dockerfile.cuda: the CUDA one).
#
#   docker build -t qtts:0.1.0 .
#   docker run --rm -p 8000:8000 -v qtts-models:/models --stop-timeout 45 qtts:0.1.0
#
# Reproducible inputs: the base image by digest, Debian packages by version, Python packages
# by the hashes of deploy/docker/requirements-py311.lock (deploy/docker/lock.py writes it),
# ggml by the sha256 of native/ggml.lock. Layers go from the slowest-changing to the fastest:
# locked dependencies, then native/ alone (a .py edit does not rebuild ggml), then the app,
# built into a wheel and installed from it (not editable; no source tree in the image).
# docs/deploy.md has the details.
#
# The image is portable (QTTS_PORTABLE=1): ggml's CPU backend is built once per x86-64 ISA level
# (GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS, the best one loaded at start) and qtts's kernels per
# ISA level behind one runtime dispatch, so it runs on any x86-64 CPU whatever the build host.
# --build-arg QTTS_PORTABLE=0 builds for the build host's CPU only (-march=native), and
# --build-arg QTTS_CPU_VARIANTS=haswell,sapphirerapids builds fewer ggml CPU variants (faster).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder

# `make sysdeps` (OpenBLAS backs ggml's BLAS backend) + the compiler and CMake the build needs
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        libopenblas-dev=0.3.21+ds-4 pkg-config=1.8.1-1 build-essential=12.9 cmake=3.25.1-1 \
 && rm -rf /var/lib/apt/lists/*

# the pinned ggml is built into this cache; engine/ggml/_native.json points at it by absolute
# path, so the runtime stage copies /opt/qtts to the same place
ENV QTTS_CACHE_DIR=/opt/qtts/cache \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src

# 1. every Python distribution, by hash: nothing else can be installed
COPY deploy/docker/requirements-py311.lock /tmp/requirements.lock
RUN python3 -m venv /opt/qtts/venv \
 && /opt/qtts/venv/bin/python -m pip install -q --no-deps --require-hashes \
        -r /tmp/requirements.lock

# 2. the native layer (`make native`): only native/ is in this layer's inputs
COPY native/ native/
ARG QTTS_GGML_BACKENDS=blas
ARG QTTS_PORTABLE=1
ARG QTTS_CPU_VARIANTS=all
RUN mkdir -p engine/ggml \
 && /opt/qtts/venv/bin/python native/build.py \
 && rm -rf "$QTTS_CACHE_DIR/downloads" "$QTTS_CACHE_DIR/src"

# 3. the app: a wheel (with the generated bindings of step 2), installed without its sources
COPY pyproject.toml README.md ./
COPY engine/ engine/
COPY service/ service/
COPY cli/ cli/
RUN /opt/qtts/venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w /tmp/wheels . \
 && /opt/qtts/venv/bin/python -m pip install -q --no-deps --no-index /tmp/wheels/qtts-*.whl \
 && /opt/qtts/venv/bin/python -m compileall -q /opt/qtts/venv/lib \
 && /opt/qtts/venv/bin/qtts info

# 4. the Qwen2 text vocabulary (make-model writes the synthetic default model's vocab.json +
# merges.txt from it): the pinned dashscope wheel, fetched by pip with its sha256 required
RUN /opt/qtts/venv/bin/python -m engine.tools.qwen_vocab

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
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        libopenblas0=0.3.21+ds-4 libgomp1=12.2.0-14+deb12u1 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 qtts \
 && useradd --system --uid 10001 --gid qtts --home-dir /home/qtts --create-home \
        --shell /usr/sbin/nologin qtts \
 && mkdir -p /models /data \
 && chown qtts:qtts /models /data

# the virtual environment (qtts installed from its wheel) and the native build's cache
COPY --from=builder /opt/qtts /opt/qtts
# the vocabulary where make-model looks for it as the qtts user: nothing is downloaded at start
COPY --from=builder --chown=10001:10001 /opt/qtts/cache/vocab /home/qtts/.cache/qtts/vocab
COPY --chmod=0755 deploy/docker/entrypoint.sh /usr/local/bin/qtts-entrypoint
COPY --chmod=0644 deploy/docker/healthcheck.py /usr/local/lib/qtts/healthcheck.py

ENV PATH=/opt/qtts/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    QTTS_HOST=0.0.0.0 \
    QTTS_PORT=8000 \
    QTTS_MODELS_DIR=/models \
    QTTS_DATA_DIR=/data \
    QTTS_LOG_FORMAT=json

USER 10001:10001
WORKDIR /home/qtts
# /data: the embedded voice store (SQLite) when no QTTS_VOICE_DB is given
VOLUME ["/models", "/data"]
EXPOSE 8000

# healthy = ready: GET /readyz answers 200 only while every worker is loaded, warm and alive
# (a server whose workers crash-loop is unhealthy). The start period covers making the
# synthetic default model (~40 s) and loading a large one.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "/usr/local/lib/qtts/healthcheck.py"]

# SIGTERM drains: new requests get 503, in-flight ones may finish for QTTS_DRAIN_SECONDS (30 s):
# give the container more than that to stop (docker run --stop-timeout 45, compose
# stop_grace_period; Kubernetes: deploy/k8s/base/deployment.yaml)
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/qtts-entrypoint"]
CMD ["qtts", "serve"]
