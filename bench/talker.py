#!/usr/bin/env python3
"""Talker benchmark: text -> audio through our pipeline vs the official PyTorch reference.

Released 0.6B CustomVoice dimensions with the deterministic random weights of
``qtts make-model --size full`` (``make run``'s default model is the Q4_0 one), stored F16, Q8_0
and Q4_0.
For each: per-frame time split into talker step and code predictor, prefill, decoder time,
time to first audio (full-text and streaming-text prompts), RTF of text -> audio, the Python
share of graph time, and the memory-bandwidth bound per frame (weight bytes one frame reads /
measured DRAM read bandwidth) next to the measured time. Then the reference PyTorch model
(``Qwen3TTSForConditionalGeneration.generate`` + the reference decoder, float32) on the same
weights in the same run, and the ratio (reference time / our time; > 1 means we are faster).

    python bench/talker.py [--frames 24] [--threads 2] [--dtypes f16 q8_0 q4_0] [--no-reference]

The machine is shared with other jobs: the load average is printed; treat times as upper bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.models import synthetic_checkpoint, synthetic_gguf
from engine.backend import BackendSet
from engine.gguf_model import open_model
from engine.pipeline import Pipeline, StreamInfo, SynthesisRequest
from engine.talker.prompt import assistant_text

FRAME_S = 0.08
TEXT = ("Hello there! This is a short test of the streaming speech engine, "
        "reading one sentence aloud.")
# The default model has the real Qwen2 vocabulary: TEXT is 19 text tokens, SHORT 7 (before
# v2 the synthetic tokenizer made TEXT ~55 tokens and SHORT stood in for a real sentence).
SHORT = "Hello, how are you today?"


def model_paths(dtypes: list[str]) -> tuple[Path, dict[str, Path]]:
    """The synthetic full checkpoint and one GGUF per dtype (made once, cached)."""
    return synthetic_checkpoint("full"), {d: synthetic_gguf(d, "full") for d in dtypes}


def dram_bandwidth(threads: int, mib: int = 512) -> float:
    """Read bandwidth in GB/s: ``threads`` numpy threads summing disjoint slices (best of 3)."""
    a = np.ones(mib << 18, dtype=np.float32)  # mib MiB
    parts = np.array_split(a, threads)
    best = 0.0
    for _ in range(3):
        ts = [threading.Thread(target=np.add.reduce, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = max(best, a.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def frame_bytes(model: Any) -> dict[str, int]:
    """Weight bytes one frame reads: talker layers + norm + codec_head once; code-predictor
    layers 15 times; each code-predictor head once; (+ 16 embedding rows, negligible)."""
    talk = cp = heads = 0
    for name in model.tensor_names():
        n = model.tensor_info(name).nbytes
        if name.startswith("talk.blk.") or name in ("talk.output_norm.weight",
                                                     "talk.codec_head.weight"):
            talk += n
        elif name.startswith(("cp.blk.", "cp.output_norm", "cp.mtp_proj")):
            cp += n
        elif name.startswith("cp.head."):
            heads += n
    return {"talker": talk, "code_predictor": 15 * cp + heads, "total": talk + 15 * cp + heads}


def run_ours(path: Path, threads: int, frames: int) -> dict[str, Any]:
    model = open_model(path)
    backends = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": str(threads)})
    t0 = time.perf_counter()
    pipe = Pipeline(model, backends, precision="fast", kv_type="f16")
    # as a service worker starts: cached graphs, the talker cache reserved, every voice x
    # language prompt prefix pinned; then one request pages the weights in
    warm_s = pipe.warm_up()
    for _ in pipe.stream(SynthesisRequest("Warm up.", "aiden", "english", seed=1, max_frames=3)):
        pass
    load_s = time.perf_counter() - t0
    talker = pipe.talker
    assert talker is not None and pipe.prompts is not None
    res: dict[str, Any] = {"load_s": load_s, "warm_up_s": warm_s,
                           "pinned_prefixes": talker.pinned_prefixes,
                           "prompt_len": pipe.prompts.build(TEXT, "ryan", "english").length}
    # "first": the first request of this voice (its prefix pinned at warm-up); "uncached": the
    # same with no prefix kept (what a prompt with a new instruction costs), measured last
    runs = [("first", "full", frames, TEXT), ("short", "full", 2, SHORT),
            ("stream", "stream", 2, TEXT), ("uncached", "full", 2, TEXT)]
    for label, mode, n_frames, text in runs:
        if label == "uncached":
            talker.forget_prefixes()
        req = SynthesisRequest(text, "ryan", "english", text_mode=mode, seed=0,
                               max_frames=n_frames)
        before = talker.stats.copy()
        info = StreamInfo()
        chunks: list[Any] = []
        t0 = time.perf_counter()
        first = 0.0
        for c in pipe.stream(req, info=info):
            if not chunks:
                first = time.perf_counter() - t0
            chunks.append(c)
        wall = time.perf_counter() - t0
        res[f"ttfa_{label}_s"] = first
        res[f"prefill_positions_{label}"] = talker.last_prefill_positions
        res[f"prefill_{label}_s"] = chunks[0].timings.prefill
        if label != "first":
            continue
        stats = talker.stats - before
        n = sum(c.frames for c in chunks)
        tm = chunks[0].timings
        for c in chunks[1:]:
            tm = tm + c.timings
        dec = tm.quant + tm.preconv + tm.pretr + tm.upsample + tm.bigvgan
        res.update(
            frames=n, wall_s=wall, rtf=wall / (n * FRAME_S), prefill_s=tm.prefill,
            step_ms=tm.talker_step / max(1, n - 1) * 1e3, cp_ms=tm.code_predictor / n * 1e3,
            decoder_ms=dec / n * 1e3, build_share=stats.share(),
            overhead_share=stats.overhead_share(),
            build_ms_per_step=stats.build_s / max(1, n) * 1e3,
            outcome=info.outcome,
        )
    res["bytes"] = frame_bytes(model)
    pipe.close()
    return res


def run_reference(ckpt: Path, threads: int, frames: int) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen2TokenizerFast

    from tests.parity import reference as ref

    torch.set_num_threads(threads)
    r = ref.import_reference()
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration

    root = json.loads((ckpt / "config.json").read_text())
    root.pop("qtts_synthetic", None)
    with r.no_init_weights():
        model = Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**root))
    missing, unexpected = model.load_state_dict(load_file(ckpt / "model.safetensors"),
                                                strict=False)
    assert not unexpected and not [k for k in missing if k.startswith("talker.")], missing
    model = model.float().eval()
    dec = ref.load_reference_decoder(ckpt / "speech_tokenizer")
    tok = Qwen2TokenizerFast.from_pretrained(str(ckpt))
    ids = tok(assistant_text(TEXT), return_tensors="pt")["input_ids"]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        codes_list, _ = model.generate(
            input_ids=[ids], instruct_ids=[None], languages=["english"], speakers=["ryan"],
            non_streaming_mode=True, max_new_tokens=frames + 1)
    gen_s = time.perf_counter() - t0
    codes = codes_list[0].numpy().T
    t1 = time.perf_counter()
    ref.reference_decode(dec, codes)
    dec_s = time.perf_counter() - t1
    n = codes.shape[1]
    return {"frames": n, "generate_s": gen_s, "decode_s": dec_s, "wall_s": gen_s + dec_s,
            "frame_ms": gen_s / n * 1e3, "rtf": (gen_s + dec_s) / (n * FRAME_S),
            "ttfa_s": gen_s + dec_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", default=["f16", "q8_0", "q4_0"])
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results as JSON")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    print(f"# talker benchmark: 0.6B random weights, {args.threads} threads, {args.frames} "
          f"frames; load average at start {load0:.2f} on {os.cpu_count()} CPUs (shared machine)")
    ckpt, paths = model_paths(args.dtypes)
    bw = dram_bandwidth(args.threads)
    print(f"DRAM read bandwidth (numpy, {args.threads} threads): {bw:.1f} GB/s")
    results: dict[str, Any] = {"threads": args.threads, "bandwidth_gbs": bw, "ours": {}}
    for d in args.dtypes:
        results["ours"][d] = run_ours(paths[d], args.threads, args.frames)
    if not args.no_reference:
        results["reference"] = run_reference(ckpt, args.threads, args.frames)
    results["load_average_end"] = os.getloadavg()[0]

    print("\n| weights | talker step ms | code pred. ms | bound ms (bytes/BW) | decoder ms/frame "
          "| prefill ms (first request / uncached prefix) | first audio ms (first request / "
          "uncached prefix / short text / stream text) | RTF | vs reference | graph build share | "
          "Python share of step runs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ref_res = results.get("reference")
    for d, r in results["ours"].items():
        b = r["bytes"]
        bound = b["total"] / (bw * 1e9) * 1e3
        ratio = f"{ref_res['rtf'] / r['rtf']:.2f}x" if ref_res else "-"
        print(f"| {d} | {r['step_ms']:.1f} | {r['cp_ms']:.1f} | {bound:.1f} "
              f"({b['total'] / 1e6:.0f} MB) | {r['decoder_ms']:.1f} | "
              f"{r['prefill_s'] * 1e3:.0f} / {r['prefill_uncached_s'] * 1e3:.0f} | "
              f"{r['ttfa_first_s'] * 1e3:.0f} / {r['ttfa_uncached_s'] * 1e3:.0f} / "
              f"{r['ttfa_short_s'] * 1e3:.0f} / {r['ttfa_stream_s'] * 1e3:.0f} | "
              f"{r['rtf']:.2f} | {ratio} | {r['build_share'] * 100:.2f} % "
              f"({r['build_ms_per_step']:.2f} ms/frame) | {r['overhead_share'] * 100:.1f} % |")
    if ref_res:
        print(f"| reference f32 | {ref_res['frame_ms']:.0f} (step + code pred.) | | | "
              f"{ref_res['decode_s'] / ref_res['frames'] * 1e3:.1f} | | "
              f"{ref_res['ttfa_s'] * 1e3:.0f} (not streaming) | {ref_res['rtf']:.2f} | 1.00x | | |")
    first = next(iter(results["ours"].values()))
    print(f"\nprompt: {first['prompt_len']} positions ({first['prefill_positions_first']} "
          f"computed with the voice/language prefix pinned, "
          f"{first['prefill_positions_uncached']} without; short text: "
          f"{first['prefill_positions_short']}; streaming text: "
          f"{first['prefill_positions_stream']}); {args.frames} frames, sampling, seed 0")
    print(f"warm-up (graphs, talker cache, {first['pinned_prefixes']} prefixes pinned): "
          f"{first['warm_up_s']:.1f} s")
    print(f"load average at end {results['load_average_end']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=float))


if __name__ == "__main__":
    main()
