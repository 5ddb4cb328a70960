# The README's two commands: `make run` and `make test`. Everything else is what they need.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
QTTS := $(VENV)/bin/qtts
CACHE := $(or $(QTTS_CACHE_DIR),$(HOME)/.cache/qtts)
DEFAULT_MODEL := $(CACHE)/models/synthetic-full-q4_0-seed0-v2/model.gguf
MODEL := $(or $(QTTS_MODEL),$(DEFAULT_MODEL))
PYTEST_ARGS ?=

VOCAB := $(CACHE)/vocab/qwen2/source.sha256

.PHONY: run test native native-portable venv sysdeps test-sysdeps parity-env model vocab lint bench \
	clean cuda-check deploy-tools

run: native model
	QTTS_MODEL=$(MODEL) $(QTTS) serve

# Random test order: pytest-randomly prints its seed, `PYTEST_ARGS=--randomly-seed=N` repeats an
# order. A skip that tests/allowed_skips.py does not list fails the run (QTTS_STRICT_SKIPS).
test: native native-portable parity-env deploy-tools test-sysdeps vocab
	QTTS_STRICT_SKIPS=1 QTTS_CPU_VARIANTS=$(PORTABLE_CPU_VARIANTS) $(PY) -m pytest -p randomly $(PYTEST_ARGS)

# Prometheus and busybox (Debian) and the npm schema validators the deploy tests use.
deploy-tools: venv
	bash deploy/ci/install-tools.sh

# OpenBLAS backs ggml's BLAS backend: the second real backend the scheduler tests split onto;
# espeak-ng speaks the reference audio of the voice-cloning tests.
sysdeps:
	@if ! (command -v pkg-config >/dev/null && pkg-config --exists openblas); then \
		echo "installing libopenblas-dev pkg-config (Debian)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			libopenblas-dev pkg-config >/dev/null; \
	fi
	@# espeak-ng speaks the real test sentences the voice-cloning tests encode
	@if ! command -v espeak-ng >/dev/null; then \
		echo "installing espeak-ng (Debian)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			espeak-ng >/dev/null; \
	fi

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# `make native` keeps native tuning (-march=native: this machine's instruction sets only); the
# portable build (QTTS_PORTABLE=1, any x86-64 CPU, what the Docker image ships) is cached apart.
native: sysdeps venv
	$(PY) native/build.py

# Warms the cache with the portable build for the emulated-CPU test (binding left as it is):
# ggml's CPU backend as the x64 baseline, haswell (what the test's emulated CPU loads) and one
# AVX-512 variant, not all 14 (the Docker image builds all). tests/engine/test_portable_build.py uses
# the same QTTS_CPU_VARIANTS, so keep the two in step.
PORTABLE_CPU_VARIANTS ?= haswell,sapphirerapids
native-portable: sysdeps venv
	QTTS_PORTABLE=1 QTTS_CPU_VARIANTS=$(PORTABLE_CPU_VARIANTS) $(PY) native/build.py --no-binding

# The test suite's system tools (Debian): chromium for the playground's browser test (driven by
# Playwright's Python package, never its own browser download) and qemu-user, which runs the
# portable build on an emulated CPU without AVX-512; PostgreSQL, whose server the voice-store
# tests start themselves (initdb into a temporary folder).
test-sysdeps:
	@missing=""; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v qemu-x86_64 >/dev/null || missing="$$missing qemu-user"; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	if [ -n "$$missing" ]; then \
		if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
			echo "installing$$missing (Debian)"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
				$$missing >/dev/null; \
		else \
			echo "cannot install$$missing here (needs root and apt-get): their tests skip"; \
		fi; \
	fi

# The official PyTorch reference (qwen-tts) for parity tests and benchmarks. qwen-tts itself
# goes in without its dependencies: they would pull a CUDA torch; the extra pins the CPU wheel.
$(VENV)/.parity: $(VENV)/.installed
	$(PIP) install -q -e '.[dev,parity]'
	$(PIP) install -q --no-deps qwen-tts==0.1.1
	touch $@

parity-env: $(VENV)/.parity

# The real Qwen2 text vocabulary: the pinned dashscope wheel, fetched once by pip (sha256
# checked) into the cache; make-model writes vocab.json + merges.txt from it. Never at run time.
$(VOCAB): | venv
	$(PY) -m engine.tools.qwen_vocab

vocab: $(VOCAB)

# The default model: a deterministic synthetic model of the released architecture (noise) with
# the real text vocabulary, at Q4_0: the weight type that serves in real time on 2 cores
# (README, "Choosing weights").
$(DEFAULT_MODEL): | venv $(VOCAB)
	$(QTTS) make-model $(dir $(DEFAULT_MODEL)) --size full --dtype q4_0 --seed 0

model: native
	@if [ -z "$(QTTS_MODEL)" ]; then $(MAKE) --no-print-directory $(DEFAULT_MODEL); fi

# Compile check of the CUDA backend (nvcc here, no GPU needed). 23 minutes on 2 cores (measured)
# the first time, then cached by (ggml version, options, compiler) like every native build:
# run it when native/ggml.lock or native/build.py change. Not part of `make test`.
cuda-check: sysdeps venv
	QTTS_GGML_BACKENDS=blas,rpc,cuda $(PY) native/build.py
	QTTS_GGML_BACKENDS=blas,rpc $(PY) native/build.py

lint: venv
	$(VENV)/bin/ruff check engine service cli tests bench native deploy
	$(VENV)/bin/mypy engine service cli

bench: native parity-env model
	$(PY) bench/decoder.py
	$(PY) bench/talker.py
	$(PY) bench/load.py --model $(MODEL)
	$(PY) bench/weights.py
	$(PY) bench/memory.py --dtypes f16,q8_0,q4_0 --workers 2 --threads 2

clean:
	rm -rf $(VENV) engine/ggml/_ggml_cffi.py engine/ggml/_native.json .pytest_cache
