#!/usr/bin/env python3
"""Weights bench: what each weight type costs and gives, as a first-time user meets it.

For the synthetic model (released 0.6B dimensions, ``make run``'s default model family) stored
F16, Q8_0 and Q4_0:

* size of the GGUF;
* served: a real ``qtts serve`` per (weight type, threads per worker), one worker, the README's
  text example (read from README.md) run as written with curl (wall time), then the same
  request streamed by a client: time to first audio, RTF (wall / audio seconds), stream gaps
  (from /metrics) and the time from start to ready (load + warm-up);
* fidelity against the F32 weights: the talker and code predictor teacher-forced on the F32
  model's greedy codes for the README sentence (minimum cosine of the logits, code-predictor
  argmax agreement), and those codes decoded in exact and in serving (fast) precision against
  the F32 weights' exact decode (SNR).

    python bench/weights.py [--size full|tiny] [--dtypes f16 q8_0 q4_0] [--threads 1 2]
                            [--reps 2] [--fidelity-frames 16] [--json out.json] [--readme]

Prints the detailed tables and the README's "choosing weights" table (at the default threads:
usable CPUs / 1 worker); ``--readme`` writes that table into README.md. The machine may be
shared: the load average is printed; treat times as upper bounds. ``--size tiny`` is a smoke
run, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench.models import synthetic_gguf
from engine.backend import BackendSet
from engine.gguf_model import open_model
from engine.pipeline import CodesRequest, Pipeline
from engine.talker import PromptBuilder, TalkerModel
from engine.talker.sampling import suppress_mask, talker_scores
from tests.service.doc_examples import Example, examples
from tests.service.helpers import Server, metric

WAV_HEADER = 44
BYTES_PER_SECOND = 2 * 24000  # s16le mono 24 kHz


def readme_text_example() -> Example:
    """The README's text-to-speech curl command (the one a newcomer runs first)."""
    for e in examples(("README.md",)):
        if e.program == "curl" and "/tts" in e.text and '"text"' in e.text:
            return e
    raise SystemExit("README.md has no text example (curl ... /tts with a text body)")


def request_body(example: Example) -> dict[str, Any]:
    words = shlex.split(example.text)
    return json.loads(words[words.index("-d") + 1])  # type: ignore[no-any-return]


# -- served --------------------------------------------------------------------------------------


def stream_once(url: str, body: dict[str, Any]) -> dict[str, float]:
    """One streamed request: first audio (past the WAV header), wall time, audio seconds."""
    t0 = time.perf_counter()
    first, n = 0.0, 0
    with httpx.stream("POST", url + "/tts", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise SystemExit(f"POST /tts answered {r.status_code}: {r.read()[:300]!r}")
        for chunk in r.iter_bytes():
            n += len(chunk)
            if not first and n > WAV_HEADER:
                first = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    audio = (n - WAV_HEADER) / BYTES_PER_SECOND
    return {"ttfa_s": first, "wall_s": wall, "audio_s": audio, "rtf": wall / audio}


def served(path: Path, threads: int, reps: int, example: Example) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="qtts-weights-") as tmp:
        t0 = time.perf_counter()
        server = Server(path, Path(tmp), threads_per_worker=threads, log_format="json")
        try:
            server.wait_ready(timeout=900)
            ready_s = time.perf_counter() - t0
            walls = []
            for _ in range(reps):  # the README command as written (address aside)
                t1 = time.perf_counter()
                run = subprocess.run(["bash", "-c", example.at("127.0.0.1", server.port)],
                                     cwd=tmp, capture_output=True, timeout=900)
                walls.append(time.perf_counter() - t1)
                if run.returncode != 0:
                    raise SystemExit(f"the README example failed: {run.stderr.decode()}")
            streams = [stream_once(server.url, request_body(example)) for _ in range(reps)]
            gaps = metric(server.metrics(), "qtts_stream_gaps_total")
        finally:
            server.stop()
    return {
        "ready_s": ready_s, "readme_wall_s": statistics.median(walls),
        "ttfa_s": statistics.median(s["ttfa_s"] for s in streams),
        "rtf": statistics.median(s["rtf"] for s in streams),
        "audio_s": streams[0]["audio_s"], "stream_gaps": gaps,
    }


# -- fidelity ------------------------------------------------------------------------------------


def talker_trace(model: Any, backends: BackendSet, text: str, voice: str, language: str,
                 frames: int, codes: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Talker and code-predictor logits for ``frames`` frames: greedy, or teacher-forced on
    ``codes`` [16, frames] (so every weight type sees the same past)."""
    prompt = PromptBuilder(model).build(text, voice, language)
    talker = TalkerModel(model, backends, "f32")
    talker.reserve(prompt.length + frames + 1)
    pre = talker.prefill(prompt)
    logits, hidden = pre.logits, pre.hidden
    supp = suppress_mask(logits.shape[-1], talker.eos_id)
    t_out, cp_out, picked = [], [], []
    for k in range(frames):
        t_out.append(logits)
        if codes is not None:
            c0 = int(codes[0, k])
        else:  # greedy, never EOS: the frames compared are all speech frames
            scores = talker_scores(logits, [], 1.0, 0, talker.eos_id, supp)
            scores[talker.eos_id] = -np.inf
            c0 = int(np.argmax(scores))
        row: list[np.ndarray] = []

        def choose(lg: np.ndarray, j: int, k: int = k, row: list[np.ndarray] = row) -> int:
            row.append(lg)
            return int(codes[j + 1, k]) if codes is not None else int(np.argmax(lg))

        rest = talker.predict(hidden, c0, choose)
        column = np.concatenate([[c0], rest]).astype(np.int32)
        cp_out.append(np.stack(row))
        picked.append(column)
        text_add = pre.trailing[k] if k < pre.trailing.shape[0] else pre.pad
        logits, hidden = talker.step(column, text_add, prompt.length + k)
    talker.close()
    return {"talker": np.stack(t_out), "cp": np.stack(cp_out), "codes": np.stack(picked, 1)}


def min_cos(a: np.ndarray, b: np.ndarray) -> float:
    a = a.reshape(-1, a.shape[-1]).astype(np.float64)
    b = b.reshape(-1, b.shape[-1]).astype(np.float64)
    c = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return float(c.min())


def decode(model: Any, backends: BackendSet, codes: np.ndarray, precision: str) -> np.ndarray:
    pipe = Pipeline(model, backends, precision=precision)
    audio = np.concatenate([c.audio for c in pipe.stream(CodesRequest(codes))])
    pipe.close()
    return audio


def snr_db(ref: np.ndarray, x: np.ndarray) -> float:
    noise = float(np.sum((ref.astype(np.float64) - x) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(float(np.sum(ref**2.0)) / noise)


def fidelity(paths: dict[str, Path], f32: Path, threads: int, frames: int, text: str,
             voice: str, language: str) -> dict[str, dict[str, float]]:
    backends = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": str(threads)})
    ref_model = open_model(f32)
    ref = talker_trace(ref_model, backends, text, voice, language, frames)
    ref_audio = decode(ref_model, backends, ref["codes"], "exact")
    out = {}
    for d, path in paths.items():
        model = open_model(path)
        tf = talker_trace(model, backends, text, voice, language, frames, ref["codes"])
        agree = float(np.mean(np.argmax(tf["cp"], -1) == np.argmax(ref["cp"], -1)))
        out[d] = {
            "talker_cos_min": min_cos(tf["talker"], ref["talker"]),
            "cp_cos_min": min_cos(tf["cp"], ref["cp"]),
            "cp_argmax_agree": agree,
            # the weights' own effect (both exact), and as served (fast precision)
            "decoder_snr_exact_db": snr_db(ref_audio,
                                           decode(model, backends, ref["codes"], "exact")),
            "decoder_snr_db": snr_db(ref_audio, decode(model, backends, ref["codes"], "fast")),
        }
    return out


# -- report --------------------------------------------------------------------------------------

README_BEGIN = "<!-- weights-table: written by `python bench/weights.py --readme` -->"
README_END = "<!-- weights-table: end -->"


def readme_table(res: dict[str, Any], paths: dict[str, Path], args: argparse.Namespace) -> str:
    """The README's "choosing weights" table at the default threads (usable CPUs / 1 worker)."""
    cpus = res["cpus"]
    shown = cpus if cpus in args.threads else max(args.threads)
    rows = [
        "| weights | GGUF size | RTF | first audio | README example | fidelity vs F32: talker "
        "logits cos (min) / code predictor argmax agreement |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for d, path in paths.items():
        r, f = res["served"][f"{d}/{shown}"], res["fidelity"][d]
        rows.append(
            f"| {d.upper()} | {path.stat().st_size / 1e9:.2f} GB | {r['rtf']:.2f} | "
            f"{r['ttfa_s'] * 1e3:.0f} ms | {r['readme_wall_s']:.1f} s ({r['audio_s']:.1f} s) | "
            f"{f['talker_cos_min']:.4f} / {f['cp_argmax_agree']:.0%} |"
        )
    rows.append(
        f"\n`python bench/weights.py` on {time.strftime('%Y-%m-%d')}: one worker x {shown} "
        f"thread(s) on {cpus} CPUs (load average {res['load_average_start']:.2f} at start); "
        "README example = wall time of the README's text example run with curl (its audio "
        f"length); fidelity over {args.fidelity_frames} frames teacher-forced on the F32 "
        "model's codes. The decoder is stored F32 in every weight type, so its fidelity does "
        "not depend on this choice (fast mode against exact: docs/performance.md)."
    )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=["full", "tiny"], default="full")
    ap.add_argument("--dtypes", nargs="+", default=["f16", "q8_0", "q4_0"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2],
                    help="threads per worker to serve with (one server each)")
    ap.add_argument("--reps", type=int, default=2, help="requests per server (median)")
    ap.add_argument("--fidelity-frames", type=int, default=16)
    ap.add_argument("--json", default=None, help="also write the results as JSON")
    ap.add_argument("--readme", action="store_true",
                    help="write the choosing-weights table into README.md (full model only)")
    args = ap.parse_args()
    cpus = len(os.sched_getaffinity(0))
    print(f"# weights bench: synthetic {args.size} model, load average at start "
          f"{os.getloadavg()[0]:.2f} on {cpus} CPUs")
    example = readme_text_example()
    body = request_body(example)
    print(f"README text example ({example.doc}:{example.line}): {json.dumps(body)}")
    paths = {d: synthetic_gguf(d, args.size) for d in args.dtypes}
    f32 = synthetic_gguf("f32", args.size)
    res: dict[str, Any] = {"size": args.size, "cpus": cpus, "served": {}, "fidelity": {},
                           "load_average_start": os.getloadavg()[0]}
    for d, path in paths.items():
        for t in args.threads:
            res["served"][f"{d}/{t}"] = served(path, t, args.reps, example)
            print(f"  served {d} x {t} thread(s): {res['served'][f'{d}/{t}']}", flush=True)
    res["fidelity"] = fidelity(paths, f32, max(args.threads), args.fidelity_frames,
                               body["text"], body.get("voice", "ryan"),
                               body.get("language", "english"))
    res["load_average_end"] = os.getloadavg()[0]

    print("\n| weights | threads | ready s | README example wall s | first audio ms | RTF "
          "| audio s | stream gaps |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for key, r in res["served"].items():
        d, t = key.split("/")
        print(f"| {d} | {t} | {r['ready_s']:.1f} | {r['readme_wall_s']:.2f} | "
              f"{r['ttfa_s'] * 1e3:.0f} | {r['rtf']:.2f} | {r['audio_s']:.1f} | "
              f"{r['stream_gaps']:.0f} |")
    print(f"\nfidelity against F32, {args.fidelity_frames} frames teacher-forced on the F32 "
          "model's greedy codes:\n")
    print("| weights | talker logits cos (min) | code pred. logits cos (min) "
          "| code pred. argmax agree | decoder SNR dB: exact / fast (served) |")
    print("|---|---:|---:|---:|---:|")
    for d, f in res["fidelity"].items():
        print(f"| {d} | {f['talker_cos_min']:.4f} | {f['cp_cos_min']:.4f} | "
              f"{f['cp_argmax_agree']:.3f} | {f['decoder_snr_exact_db']:.1f} / "
              f"{f['decoder_snr_db']:.1f} |")
    table = readme_table(res, paths, args)
    print("\nREADME table:\n\n" + table)
    print(f"\nload average at end {res['load_average_end']:.2f}")
    if args.readme:
        if args.size != "full":
            raise SystemExit("--readme takes the full model's numbers (--size full)")
        path = Path(__file__).resolve().parents[1] / "README.md"
        text = path.read_text(encoding="utf-8")
        start, end = text.find(README_BEGIN), text.find(README_END)
        if start < 0 or end < start:
            raise SystemExit("README.md: the weights-table markers are missing")
        path.write_text(text[: start + len(README_BEGIN)] + "\n" + table + "\n" + text[end:],
                        encoding="utf-8")
        print("README.md: weights table updated")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=float))


if __name__ == "__main__":
    main()
