#!/usr/bin/env python3
"""Step times per batch size: batched talker step, code-predictor pass and decoder pushes.

For each batch size B: B sessions of one sentence each are prefilled into their own caches,
then ``--steps`` rounds of one batched talker step (``BatchedTalker.step``) and one batched
code-predictor pass (15 graphs); then each session's frames go through its own streaming
decoder in pushes of ``--chunk`` frames (the ramp's steady state; the decoder runs per
session), counted per round (push time / chunk). Printed per B: milliseconds per round for each
stage, the same per session, and audio seconds per second the round rate gives (B x 80 ms per
round). Where a stage's per-session time stops falling as B grows it is
compute-bound (docs/performance.md keeps the table).

    python bench/batch.py --model ~/.cache/qtts/models/synthetic-full-q4_0-seed0-v2/model.gguf \
        --batch 1 2 3 4 6 --steps 32 --threads 2
    python bench/batch.py --batch 1 2 --steps 4 --chunk 2      # smoke run (a tiny model)
    python bench/batch.py --backend cuda --model ... --batch 1 2 4 8 16   # on a GPU
    python bench/batch.py --model ... --memory --batch 1 4 --positions 1024

``--pushes N ...``: the decoder pushes of B streams at once, N frames each, one after another
(``StreamingDecoder.push``) against together (``push_together``, one graph per stage, here at
any N: the service joins chunks up to ``JOIN_MAX_FRAMES``), the median of ``--steps`` pushes
after three warm-up ones, alternating:

    python bench/batch.py --model ... --batch 2 3 4 --pushes 1 2 4 8 16 --steps 8

``--memory``: the resident set of this process with B live sessions of the real batch loop
(``BatchRunner``), each with a talker cache of ``--positions`` positions (the first session
borrows the model's own cache, as in a worker), after a few rounds; then again after they were
cancelled. Per extra session = (RSS at the largest B - RSS at B=1) / (B - 1).

The machine is shared with other jobs: the load average is printed; treat times as upper bounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backend import BackendSet
from engine.decoder import StreamingDecoder, push_together, streaming
from engine.gguf_model import open_model
from engine.pipeline import Pipeline
from engine.talker.batch import BatchedTalker, StepRow

FRAME_S = 0.08
TEXT = "Hello there! This is a short test of the streaming speech engine."


def pushes(pipe: Pipeline, batch: int, frames: int, reps: int) -> tuple[float, float]:
    """Median ms of ``batch`` streams' pushes of ``frames`` frames: one after another, and
    together in one graph (``JOIN_MAX_FRAMES`` lifted for it); random codes, the two
    alternating."""
    rng = np.random.default_rng(0)
    cfg = pipe.decoder.cfg
    apart = [StreamingDecoder(pipe.decoder) for _ in range(batch)]
    joint = [StreamingDecoder(pipe.decoder) for _ in range(batch)]
    times: dict[str, list[float]] = {"apart": [], "together": []}
    for rep in range(reps + 3):
        codes = [rng.integers(0, cfg.codebook_size, (cfg.num_quantizers, frames))
                 for _ in range(batch)]
        t0 = time.perf_counter()
        for sd, c in zip(apart, codes, strict=True):
            sd.push(c)
        limit, streaming.JOIN_MAX_FRAMES = streaming.JOIN_MAX_FRAMES, frames
        t1 = time.perf_counter()
        push_together(joint, codes)
        t2 = time.perf_counter()
        streaming.JOIN_MAX_FRAMES = limit
        if rep >= 3:
            times["apart"].append(t1 - t0)
            times["together"].append(t2 - t1)
    return (1e3 * float(np.median(times["apart"])), 1e3 * float(np.median(times["together"])))


def measure(pipe: Pipeline, batch: int, steps: int, chunk: int) -> dict[str, float]:
    """Median milliseconds per round of each stage with ``batch`` sessions."""
    talker = pipe.talker
    assert talker is not None and pipe.prompts is not None
    bt = BatchedTalker(talker)
    voices: list[str | None] = list(pipe.voices) or [None]
    sessions: list[dict[str, Any]] = []
    try:
        for i in range(batch):
            prompt = pipe.prompts.build(TEXT, voices[i % len(voices)], None)
            cache = talker.new_cache(prompt.length + steps + 2)
            chunks = talker.prefill_chunks(prompt, cache=cache)
            while True:
                try:
                    next(chunks)
                except StopIteration as stop:
                    pre = stop.value
                    break
            sessions.append({"prompt": prompt, "cache": cache, "pre": pre,
                             "sd": StreamingDecoder(pipe.decoder)})
        hidden = np.stack([s["pre"].hidden for s in sessions])
        c0 = [1 for _ in sessions]
        times: dict[str, list[float]] = {"talker": [], "code_predictor": [], "decoder": []}
        frames: list[list[np.ndarray]] = [[] for _ in sessions]
        for k in range(steps + 1):  # the first round builds graphs: not counted
            t0 = time.perf_counter()
            codes = bt.predict(hidden, c0, [lambda lg, j: int(np.argmax(lg))] * batch)
            t1 = time.perf_counter()
            rows = [StepRow(s["cache"], np.concatenate([[c0[i]], codes[i]]).astype(np.int32),
                            s["pre"].pad, s["prompt"].length + k)
                    for i, s in enumerate(sessions)]
            _, hidden = bt.step(rows)
            t2 = time.perf_counter()
            for i, r in enumerate(rows):
                frames[i].append(r.codes)
            if k:
                times["code_predictor"].append(t1 - t0)
                times["talker"].append(t2 - t1)
        block = [np.stack(f, 1) for f in frames]
        for s, b in zip(sessions, block, strict=True):
            s["sd"].push(b[:, :chunk])  # graphs and history: not counted
        for start in range(chunk, block[0].shape[1] - chunk + 1, chunk):
            t0 = time.perf_counter()
            for s, b in zip(sessions, block, strict=True):
                s["sd"].push(b[:, start : start + chunk])
            times["decoder"].append((time.perf_counter() - t0) / chunk)
        out = {name: float(np.median(v)) * 1e3 for name, v in times.items()}
        out["round"] = sum(out.values())
        out["audio_s_per_s"] = batch * FRAME_S / (out["round"] / 1e3)
        return out
    finally:
        for s in sessions:
            s["cache"].close()
        bt.close()


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory(pipe: Pipeline, batch: int, positions: int, rounds: int) -> dict[str, float]:
    """RSS (MB) before, with ``batch`` live sessions of ``positions`` cache positions, after."""
    from engine.batching import BatchRunner
    from engine.pipeline import SynthesisRequest

    assert pipe.talker is not None and pipe.prompts is not None
    text, voice = TEXT * 8, next(iter(pipe.voices), None)
    prompt_len = pipe.prompts.build(text, voice, None).length
    gc.collect()
    before = rss_mb()
    runner = BatchRunner(pipe, batch)
    sids = [runner.submit(SynthesisRequest(text, voice=voice, seed=i,
                                           max_frames=positions - prompt_len))
            for i in range(batch)]
    for _ in range(rounds):
        runner.step()
    live = rss_mb()
    for sid in sids:
        runner.cancel(sid)
    runner.step()
    runner.close()
    del runner
    gc.collect()
    pipe.release()
    return {"before": before, "live": live, "after": rss_mb()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF with a talker (default: --size)")
    ap.add_argument("--size", default="tiny", choices=["tiny"],
                    help="without --model: make a synthetic model of this size (smoke runs)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 3, 4, 6])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--chunk", type=int, default=16, help="frames per decoder push")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--json", default=None, help="also write the results as JSON")
    ap.add_argument("--memory", action="store_true", help="resident set per session instead")
    ap.add_argument("--positions", type=int, default=1024,
                    help="--memory: talker cache positions per session")
    ap.add_argument("--pushes", type=int, nargs="+", default=None, metavar="N",
                    help="decoder pushes of N frames per stream: apart vs together instead")
    args = ap.parse_args()
    if args.model is None:
        from engine.tools.make_model import make_model

        scratch = tempfile.TemporaryDirectory(prefix="qtts-bench-batch-")
        make_model(scratch.name, size=args.size, seed=0, progress=False, dtype="q4_0")
        args.model = str(Path(scratch.name) / "model.gguf")
    backends = BackendSet.from_env({"QTTS_BACKEND": args.backend,
                                    "QTTS_THREADS": str(args.threads)})
    pipe = Pipeline(open_model(args.model), backends, precision="fast", kv_type="f16")
    pipe.warm_up(pin_prefixes=True)
    print(f"model {args.model}  backend {args.backend}  threads {args.threads}  "
          f"load {os.getloadavg()[0]:.2f}")
    if args.pushes:
        print(f"{'B':>3} {'frames':>7} {'one after another ms':>21} {'together ms':>12} "
              f"{'ratio':>6}   (the service joins up to {streaming.JOIN_MAX_FRAMES} frames)")
        for b in args.batch:
            for n in args.pushes:
                apart, together = pushes(pipe, b, n, max(args.steps, 3))
                print(f"{b:>3} {n:>7} {apart:>21.1f} {together:>12.1f} "
                      f"{apart / together:>6.2f}")
        pipe.close()
        return 0
    if args.memory:
        mem = {b: memory(pipe, b, args.positions, 4) for b in args.batch}
        print(f"{'B':>3} {'RSS before MB':>14} {'live MB':>9} {'after MB':>9}")
        for b, m in mem.items():
            print(f"{b:>3} {m['before']:>14.0f} {m['live']:>9.0f} {m['after']:>9.0f}")
        lo, hi = min(mem), max(mem)
        if hi > lo:
            per = (mem[hi]["live"] - mem[lo]["live"]) / (hi - lo)
            print(f"per extra session at {args.positions} positions: {per:.0f} MB")
        pipe.close()
        return 0
    print(f"{'B':>3} {'talker ms':>10} {'cp ms':>8} {'decoder ms':>11} {'round ms':>9} "
          f"{'per session ms':>15} {'audio s/s':>10}")
    results = {}
    for b in args.batch:
        r = measure(pipe, b, max(args.steps, 2 * args.chunk), args.chunk)
        results[b] = r
        print(f"{b:>3} {r['talker']:>10.1f} {r['code_predictor']:>8.1f} {r['decoder']:>11.1f} "
              f"{r['round']:>9.1f} {r['round'] / b:>15.1f} {r['audio_s_per_s']:>10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    pipe.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
