#!/usr/bin/env bash
# The prepared GPU check (issue 8): run it on a machine with an NVIDIA GPU, from the repo root.
# Builds ggml with CUDA (one architecture; QTTS_CUDA_ARCH, default 90 = H100/H200), then runs
# `qtts doctor`, the decoder parity tests and the decoder benchmark on the GPU, writing
# everything to ${OUT:-gpu-check}/. Paste the results into docs/gpu.md with the date.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check}
mkdir -p "$out"
make venv sysdeps parity-env >/dev/null
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
start=$(date +%s)
QTTS_GGML_BACKENDS=blas,rpc,cuda .venv/bin/python native/build.py > "$out/build.log" 2>&1
echo "cuda build seconds: $(( $(date +%s) - start ))" | tee "$out/build-time.txt"
.venv/bin/qtts info > "$out/info.txt"
model=$(.venv/bin/python -c "
from tests.parity import reference as r
print(r.make_reference_tokenizer_dir(r.default_cache_dir(), 'full', 0))")
.venv/bin/qtts convert "$model" "$out/decoder-f32.gguf" --dtype f32 > /dev/null
.venv/bin/qtts doctor --model "$out/decoder-f32.gguf" --frames 8 | tee "$out/doctor.txt"
QTTS_TEST_BACKEND=cuda .venv/bin/python -m pytest -q tests/parity/test_decoder_parity.py \
    2>&1 | tee "$out/parity.txt"
.venv/bin/python bench/decoder.py --backend cuda --frames 31 125 --reps 3 2>&1 \
    | grep -v Warn | tee "$out/bench-decoder.txt"
# the batched talker / code predictor (issue 17): step times per batch size on the GPU, and
# the batched == alone test there
talker=$(.venv/bin/python -c "
from bench.models import synthetic_gguf
print(synthetic_gguf('q4_0', 'full'))")
.venv/bin/python bench/batch.py --backend cuda --model "$talker" --batch 1 2 4 8 16 \
    --steps 32 --threads 4 2>&1 | grep -v Warn | tee "$out/bench-batch.txt"
# back to the CPU build for everything else
.venv/bin/python native/build.py > /dev/null
