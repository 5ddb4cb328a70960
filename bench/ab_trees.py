#!/usr/bin/env python3
"""Interleaved A/B of two checkouts of qtts on the same GGUF: is a speed change the code's?

Each tree runs in a worker process of its own (its venv, its ``engine`` on ``sys.path``) that
loads the model once; then the driver sends the same job to every worker in turn, round after
round (the order reversed every other round), so a machine whose speed drifts (a shared VM)
slows both alike. Per job and tree: wall time and the worker's CPU time (``time.process_time``,
every thread of the worker), then medians and the paired ratio of each tree against the first.

    python bench/ab_trees.py --tree base=/path/to/old/checkout --tree main=. \\
        --model synthetic-full-q4_0-seed0-v2/model.gguf [--threads 2] [--rounds 8] \\
        [--job step --job cp --job req --job dec-exact --job dec-fast]

Jobs: ``step`` the talker step at a fixed position (median of 8), ``cp`` one frame of the code
predictor (15 passes, median of 4), ``req`` one text request of ``--frames`` frames through the
pipeline (talker step / code predictor / decoder ms per frame from its timings), ``dec-exact``
and ``dec-fast`` an offline decode of ``--dec-frames`` frames of fixed random codes. Only APIs
that every tree since e1f0e4b has are used, so an old checkout runs unchanged. Both trees read
the same file: a comparison of two trees' own bench scripts also compares their models (the
benches' synthetic model changed with its vocabulary; docs/performance.md).

With ``--threads 1`` the CPU time is the work itself, free of ggml's thread barriers, which
spin-wait and inflate both wall and CPU time when the machine has other runnable work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TEXT = ("Hello there! This is a short test of the streaming speech engine, "
        "reading one sentence aloud.")
JOBS = ("step", "cp", "req", "dec-exact", "dec-fast")


# -- worker (runs inside one tree) -------------------------------------------------------------

def worker(model_path: str, threads: int, frames: int, dec_frames: int) -> None:
    import numpy as np

    from engine.backend import BackendSet
    from engine.gguf_model import open_model
    from engine.pipeline import Pipeline, SynthesisRequest

    model = open_model(model_path)
    backends = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": str(threads)})
    pipe = Pipeline(model, backends, precision="fast", kv_type="f16")
    pipe.warm_up()
    for _ in pipe.stream(SynthesisRequest("Warm up.", "aiden", "english", seed=1, max_frames=3)):
        pass
    talker = pipe.talker
    assert talker is not None and pipe.prompts is not None
    hidden = np.random.default_rng(0).standard_normal(
        talker.weights.talker_shape.hidden).astype(np.float32)
    frame_codes = np.zeros(16, np.int32)
    talker.reserve(512)
    exact: Any = None
    codes = np.random.default_rng(1).integers(0, 2048, (16, dec_frames)).astype(np.int32)
    prompt_len = pipe.prompts.build(TEXT, "ryan", "english").length
    print(json.dumps({"ready": True, "prompt_len": prompt_len}), flush=True)

    def timed(fn: Any, reps: int) -> dict[str, float]:
        walls = []
        c0 = time.process_time()
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - t0)
        return {"ms": statistics.median(walls) * 1e3,
                "cpu_ms": (time.process_time() - c0) / reps * 1e3}

    for line in sys.stdin:
        job = line.strip()
        if job == "quit":
            return
        out: dict[str, float]
        if job == "step":
            out = timed(lambda: talker.step(frame_codes, hidden, 100), 8)
        elif job == "cp":
            out = timed(lambda: talker.predict(hidden, 5, lambda _lg, _j: 7), 4)
        elif job == "req":
            c0, t0 = time.process_time(), time.perf_counter()
            chunks = list(pipe.stream(SynthesisRequest(TEXT, "ryan", "english", seed=0,
                                                       max_frames=frames)))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            n = sum(c.frames for c in chunks)
            tm = chunks[0].timings
            for c in chunks[1:]:
                tm = tm + c.timings
            dec = tm.quant + tm.preconv + tm.pretr + tm.upsample + tm.bigvgan
            out = {"ms": wall * 1e3, "cpu_ms": cpu * 1e3, "rtf": wall / (n * 0.08),
                   "step_ms": tm.talker_step / max(1, n - 1) * 1e3,
                   "cp_ms": tm.code_predictor / n * 1e3, "dec_ms": dec / n * 1e3}
        elif job in ("dec-exact", "dec-fast"):
            from engine.decoder import DecoderModel, decode

            if job == "dec-exact" and exact is None:
                exact = DecoderModel.load(model, backends, "exact")
            m = exact if job == "dec-exact" else pipe.decoder
            out = timed(lambda m=m: decode(m, codes), 1)
        else:
            raise SystemExit(f"unknown job {job!r}")
        print(json.dumps(out), flush=True)


# -- driver ------------------------------------------------------------------------------------

def start(name: str, tree: Path, args: argparse.Namespace) -> subprocess.Popen[str]:
    python = tree / ".venv" / "bin" / "python"
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.Popen(
        [str(python if python.exists() else sys.executable), str(Path(__file__).resolve()),
         "--worker", "--model", args.model, "--threads", str(args.threads),
         "--frames", str(args.frames), "--dec-frames", str(args.dec_frames)],
        cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"tree {name} ({tree}): the worker exited before it was ready")
    print(f"{name}: {tree} {line.strip()}", flush=True)
    return proc


def ask(proc: subprocess.Popen[str], job: str) -> dict[str, float]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(job + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"a worker exited during job {job}")
    return dict(json.loads(line))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                    help="a checkout to compare (two or more; the first is the baseline)")
    ap.add_argument("--model", required=False, help="the GGUF every tree loads")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--frames", type=int, default=24, help="frames of a req job")
    ap.add_argument("--dec-frames", type=int, default=31, help="frames of a dec-* job")
    ap.add_argument("--job", action="append", choices=JOBS, default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        ap.error("--model is required")
    if args.worker:
        worker(args.model, args.threads, args.frames, args.dec_frames)
        return
    trees = []
    for spec in args.tree:
        name, _, path = spec.partition("=")
        if not path or not Path(path).is_dir():
            ap.error(f"--tree {spec!r}: expected NAME=PATH of a checkout")
        trees.append((name, Path(path).resolve()))
    if len(trees) < 2:
        ap.error("give at least two --tree")
    jobs = args.job or ["step", "cp", "req"]
    print(f"# A/B: {', '.join(n for n, _ in trees)}; {args.model}; {args.threads} threads; "
          f"load average {os.getloadavg()[0]:.2f}")
    procs = [start(name, tree, args) for name, tree in trees]
    results: list[dict[str, list[dict[str, float]]]] = [{j: [] for j in jobs} for _ in trees]
    for r in range(args.rounds):
        order = list(range(len(trees)))
        if r % 2:
            order.reverse()
        for job in jobs:
            for i in order:
                results[i][job].append(ask(procs[i], job))
        print(f"round {r}: " + "; ".join(
            f"{trees[i][0]} " + " ".join(f"{job}={results[i][job][-1]['ms']:.1f}"
                                         for job in jobs) for i in range(len(trees))),
              flush=True)
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("quit\n")
        p.stdin.flush()
        p.wait()
    print(f"\nload average at end {os.getloadavg()[0]:.2f}; medians (ms), and each tree's "
          f"median paired ratio to {trees[0][0]} (< 1: faster)")
    for job in jobs:
        keys = list(results[0][job][0])
        print(f"\n| {job} | " + " | ".join(keys) + " |")
        print("|---|" + "---:|" * len(keys))
        for i, (name, _) in enumerate(trees):
            rows = results[i][job]
            med = [statistics.median(o[k] for o in rows) for k in keys]
            cells = [f"{v:.2f}" for v in med]
            if i:
                base = results[0][job]
                pairs = list(zip(base, rows, strict=True))
                ratios = [statistics.median(b[k] and o[k] / b[k] for b, o in pairs) for k in keys]
                cells = [f"{c} ({q:.3f})" for c, q in zip(cells, ratios, strict=True)]
            print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
