# The README's two commands: `make run` and `make test`. Everything else is what they need.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
QTTS := $(VENV)/bin/qtts
CACHE := $(or $(QTTS_CACHE_DIR),$(HOME)/.cache/qtts)
DEFAULT_MODEL := $(CACHE)/models/synthetic-full-q4_0-seed0/model.gguf
MODEL := $(or $(QTTS_MODEL),$(DEFAULT_MODEL))
PYTEST_ARGS ?=

.PHONY: run test native venv sysdeps parity-env model lint bench clean cuda-check deploy-tools

run: native model
	QTTS_MODEL=$(MODEL) $(QTTS) serve

test: native parity-env deploy-tools
	$(PY) -m pytest $(PYTEST_ARGS)

# Prometheus and busybox (Debian) and the npm schema validators the deploy tests use.
deploy-tools: venv
	bash deploy/ci/install-tools.sh

# OpenBLAS backs ggml's BLAS backend: the second real backend the scheduler tests split onto.
sysdeps:
	@if ! (command -v pkg-config >/dev/null && pkg-config --exists openblas); then \
		echo "installing libopenblas-dev pkg-config (Debian)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			libopenblas-dev pkg-config >/dev/null; \
	fi

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

native: sysdeps venv
	$(PY) native/build.py

# The official PyTorch reference (qwen-tts) for parity tests and benchmarks. qwen-tts itself
# goes in without its dependencies: they would pull a CUDA torch; the extra pins the CPU wheel.
$(VENV)/.parity: $(VENV)/.installed
	$(PIP) install -q -e '.[dev,parity]'
	$(PIP) install -q --no-deps qwen-tts==0.1.1
	touch $@

parity-env: $(VENV)/.parity

# The default model: a deterministic synthetic model of the released architecture (noise), at
# Q4_0: the weight type that serves in real time on 2 cores (README, "Choosing weights").
$(DEFAULT_MODEL): | venv
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
