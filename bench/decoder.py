#!/usr/bin/env python3
"""Decoder benchmark: our ggml decoder vs the official PyTorch reference, same weights, same run.

Both decode the same codes with the same random released-size weights on the same number of
threads; repetitions alternate between the two so background load hits both alike, and the
minimum of each is reported. Prints per-stage times, RTF (compute seconds / audio seconds) and
the ratio (reference time / our time: > 1 means we are faster), then streaming costs.

    python bench/decoder.py [--frames 31 125] [--threads 2] [--reps 3] [--size full]
        [--recipe default|stress] [--seed 0] [--all-bf16] [--amx-ab]

``--recipe stress`` benches the decoder whose every stage is O(1) (tests/parity/reference.py),
where fast mode's precision is measured; ``--all-bf16`` adds a fast-mode row without the layers
fast mode keeps in F32 (engine/decoder/precision.py), to show what they cost and buy.
``--amx-ab`` (on a CPU with AMX-BF16) adds a fast-mode row with the AMX tiles off
(``QTTS_AMX=0``: the AVX512-BF16 kernels and Winograd), interleaved with the others.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backend import BackendSet
from engine.decoder import DecoderModel, StreamingDecoder, decode
from engine.ggml import custom_ops
from engine.gguf_model import open_model
from engine.timings import DECODER_STAGES, StageTimings
from engine.tools.convert import convert
from tests.parity import reference as ref
from tests.parity.reference import snr_db

FRAME_SECONDS = 0.08


def best(times: list[float]) -> float:
    return min(times)


# The AMX switch of libqtts_ops is process-wide: set before each decode of a model that needs it.
AMX_OFF: set[str] = set()


def bench_offline(models: dict[str, DecoderModel], ref_model: Any, codes: np.ndarray, reps: int,
                  chunk: int) -> None:
    t = codes.shape[1]
    audio_s = t * FRAME_SECONDS
    ref_times: list[float] = []
    ours: dict[str, list[tuple[float, StageTimings]]] = {k: [] for k in models}
    wav_ref = None
    outs: dict[str, np.ndarray] = {}
    for _ in range(reps):
        start = time.perf_counter()
        wav_ref = ref.reference_decode(ref_model, codes)
        ref_times.append(time.perf_counter() - start)
        for name, m in models.items():
            custom_ops.set_amx(name not in AMX_OFF)
            start = time.perf_counter()
            outs[name], tm = decode(m, codes, chunk=chunk)
            ours[name].append((time.perf_counter() - start, tm))
    assert wav_ref is not None
    r = best(ref_times)
    print(f"\n## offline, {t} frames ({audio_s:.2f} s audio), decode chunk {chunk} frames")
    print(f"| decoder | {' | '.join(DECODER_STAGES)} | total s | RTF | ratio vs ref | SNR dB |")
    print(f"|---|{'---:|' * len(DECODER_STAGES)}---:|---:|---:|---:|")
    print(f"| reference (PyTorch) | {' | '.join('' for _ in DECODER_STAGES)} | {r:.3f} | "
          f"{r / audio_s:.3f} | 1.00 | |")
    for name, runs in ours.items():
        total, tm = min(runs, key=lambda x: x[0])
        stages = " | ".join(f"{v:.3f}" for v in tm.as_dict().values())
        print(f"| qtts {name} | {stages} | {total:.3f} | {total / audio_s:.3f} | "
              f"{r / total:.2f} | {snr_db(wav_ref, outs[name]):.1f} |")


def ramp(t: int, first: int, largest: int) -> list[int]:
    """Push sizes of the service's chunk ramp: 1, 2, 4, ... up to ``largest``, then steady."""
    sizes, n, done = [], first, 0
    while done < t:
        sizes.append(min(n, t - done))
        done += sizes[-1]
        n = min(2 * n, largest)
    return sizes


def bench_streaming(m: DecoderModel, codes: np.ndarray, chunk_sizes: list[int], reps: int,
                    offline_chunk: int) -> None:
    t = codes.shape[1]
    offline = best([_timed(lambda: decode(m, codes, chunk=offline_chunk)) for _ in range(reps)])
    print(f"\n## streaming ({m.precision}), {t} frames; offline {offline:.3f} s")
    print("| pushes (frames) | total s | cost vs offline | first chunk ms | per-push ms |")
    print("|---|---:|---:|---:|---:|")
    plans = [(str(n), [n] * ((t + n - 1) // n)) for n in chunk_sizes]
    plans.append(("ramp 1,2,4,8,8,...", ramp(t, 1, 8)))
    plans.append(("ramp 1,2,4,8,16,16,...", ramp(t, 1, 16)))
    for label, sizes in plans:
        runs = []
        for _ in range(reps):
            sd = StreamingDecoder(m)
            start = time.perf_counter()
            first = None
            pos = 0
            for n in sizes:
                sd.push(codes[:, pos : pos + n])
                pos += n
                if first is None:
                    first = time.perf_counter() - start
            runs.append((time.perf_counter() - start, first or 0.0))
        total, first = min(runs)
        print(f"| {label} | {total:.3f} | {total / offline:.2f} | {first * 1e3:.0f} | "
              f"{total / len(sizes) * 1e3:.0f} |")


def bench_row_split(model: Any, threads: int, codes: np.ndarray, reps: int) -> None:
    """Cost on the CPU of splitting matmuls for row-limited accelerators (QTTS_MAX_MATMUL_ROWS).

    With stock ggml ops only (QTTS_CUSTOM_OPS=0): that is the graph an accelerator runs, where
    every conv is a set of matmuls.
    """
    t = codes.shape[1]
    print(f"\n## row-split policy on the CPU, stock ggml ops (QTTS_CUSTOM_OPS=0), {t} frames")
    print("| QTTS_MAX_MATMUL_ROWS | decode s | cost vs unsplit |")
    print("|---:|---:|---:|")
    base = None
    for rows in ("", "1024"):
        env = {"QTTS_BACKEND": "cpu", "QTTS_THREADS": str(threads), "QTTS_CUSTOM_OPS": "0",
               "QTTS_MAX_MATMUL_ROWS": rows}
        m = DecoderModel.load(model, BackendSet.from_env(env), "fast")
        secs = best([_timed(lambda m=m: decode(m, codes)) for _ in range(reps)])
        base = base or secs
        print(f"| {rows or 'unlimited'} | {secs:.3f} | {secs / base:.2f} |")
        m.close()


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="full", choices=["tiny", "full"])
    ap.add_argument("--frames", type=int, nargs="+", default=[31, 125])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=None, help="offline push size (frames)")
    ap.add_argument("--stream", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--backend", default="cpu", help="QTTS_BACKEND for our decoder (cpu, cuda)")
    ap.add_argument("--recipe", default="default", choices=ref.RECIPES,
                    help="random-weight recipe (stress: every stage O(1))")
    ap.add_argument("--seed", type=int, default=0, help="weight seed")
    ap.add_argument("--all-bf16", action="store_true",
                    help="also bench fast mode with every layer in BF16")
    ap.add_argument("--amx-ab", action="store_true",
                    help="also bench fast mode with the AMX tiles off (QTTS_AMX=0)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    print(f"# decoder benchmark: {args.size} random weights ({args.recipe}, seed {args.seed}), "
          f"{args.threads} threads, min of {args.reps}; load average at start "
          f"{os.getloadavg()[0]:.2f}; kernels {custom_ops.variant()}, BF16 convs on "
          f"{'AMX tiles' if custom_ops.amx() else 'AVX512-BF16 / portable C'}")
    folder = ref.make_reference_tokenizer_dir(ref.default_cache_dir(), args.size, args.seed,
                                              args.recipe)
    ref_model = ref.load_reference_decoder(folder)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / "decoder.gguf"
        convert(folder, gguf, dtype="f32", progress=False)
        model = open_model(gguf)
        backends = BackendSet.from_env({"QTTS_BACKEND": args.backend,
                                        "QTTS_THREADS": str(args.threads)})
        models = {p: DecoderModel.load(model, backends, p) for p in ("exact", "fast")}  # type: ignore[arg-type]
        if args.all_bf16:
            models["fast all-BF16"] = DecoderModel.load(model, backends, "fast",
                                                        f32_layers=frozenset())
        if args.amx_ab:
            if not custom_ops.amx():
                raise SystemExit("--amx-ab: the BF16 convs do not run on AMX tiles here "
                                 f"(kernels: {custom_ops.variant()})")
            off = BackendSet.from_env({"QTTS_BACKEND": args.backend, "QTTS_AMX": "0",
                                       "QTTS_THREADS": str(args.threads)})
            models["fast, QTTS_AMX=0"] = DecoderModel.load(model, off, "fast")
            AMX_OFF.add("fast, QTTS_AMX=0")
            custom_ops.set_amx(True)
        from engine.decoder.streaming import DEFAULT_OFFLINE_CHUNK

        chunk = args.chunk or DEFAULT_OFFLINE_CHUNK
        for t in args.frames:
            codes = ref.random_codes(t, seed=1)
            bench_offline(models, ref_model, codes, args.reps, chunk)
        codes = ref.random_codes(max(args.frames), seed=1)
        custom_ops.set_amx(True)
        for m in (models["exact"], models["fast"]):
            bench_streaming(m, codes, args.stream, max(1, args.reps - 1), chunk)
        bench_row_split(model, args.threads, ref.random_codes(min(args.frames), seed=1),
                        args.reps)


if __name__ == "__main__":
    main()
