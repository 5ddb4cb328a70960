#!/usr/bin/env python3
"""Where fast mode loses precision: per-stage SNR and per-layer sensitivity on a random decoder.

Decodes the same codes with the official reference, qtts exact (F32) and qtts fast (BF16 wave
generator), then prints

* every tapped stage's SNR, fast against exact (exact matches the reference to <= 1e-4, so this
  is the SNR against the reference at that stage), and the drop each stage adds;
  for fast mode with every layer in BF16 and with its default F32 set (precision.default_f32);
* with ``--sensitivity``: the final SNR when one more group of BF16 layers is kept in F32
  (the groups whose promotion gains most are the ones the stack amplifies);
* with ``--calibrate``: what the load-time calibration (engine/decoder/precision.py) chooses
  and the SNR it gets against the reference.

    python bench/decoder_precision.py [--size full] [--recipe stress] [--seeds 0 1]
        [--frames 31] [--sensitivity]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backend import BackendSet
from engine.decoder import DecoderModel, StreamingDecoder, decode
from engine.decoder.precision import bf16_layers, default_f32
from engine.gguf_model import open_model
from engine.tools.convert import convert
from tests.parity import reference as ref
from tests.parity.reference import snr_db


def captured(dec: DecoderModel, codes: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    sd = StreamingDecoder(dec, capture=True)
    wav, _ = sd.push(codes)
    return wav, sd.captured()


def groups(layers: list[str]) -> dict[str, frozenset[str]]:
    """Fast mode's BF16 layers grouped by stage: upsampler, conv_in, each block's tconv and
    residual units, conv_out."""
    out: dict[str, set[str]] = {}
    for name in layers:
        parts = name.split(".")
        if parts[1] == "up":
            key = "upsample pw"
        elif parts[1] == "blk":
            key = f"blk{parts[2]}.{parts[3] if parts[3] == 'tconv' else 'res' + parts[4]}"
        else:
            key = parts[1]
        out.setdefault(key, set()).add(name)
    return {k: frozenset(v) for k, v in out.items()}


def run(args: argparse.Namespace, seed: int, tmp: Path) -> None:
    folder = ref.make_reference_tokenizer_dir(ref.default_cache_dir(), args.size, seed,
                                              args.recipe)
    codes = ref.random_codes(args.frames, seed=1)
    ref_model = ref.load_reference_decoder(folder)
    wav_ref = ref.reference_decode(ref_model, codes)
    del ref_model
    gguf = tmp / f"{args.size}-{args.recipe}-{seed}.gguf"
    convert(folder, gguf, dtype=args.dtype, progress=False)
    model = open_model(gguf)
    bs = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": str(args.threads)})
    exact = DecoderModel.load(model, bs, "exact")
    wav_exact, taps_exact = captured(exact, codes)
    exact.close()
    default = default_f32(model)
    runs = {}
    # every layer kept out of BF16: F32, or on AMX split BF16 products (their own error)
    for label, layers in (("all BF16", frozenset()), ("default", default),
                          ("every layer kept", frozenset(bf16_layers(model)))):
        fast = DecoderModel.load(model, bs, "fast", f32_layers=layers)
        runs[label] = captured(fast, codes)
        fast.close()
    print(f"\n# {args.size} {args.recipe} seed {seed}, {args.frames} frames, {args.dtype} GGUF: "
          f"reference wav std {float(np.std(wav_ref)):.3f}, clipped "
          f"{float(np.mean(np.abs(wav_ref) >= 1.0)) * 100:.2f} %")
    print(f"exact vs reference: max |err| {float(np.abs(wav_exact - wav_ref).max()):.2e}, "
          f"SNR {snr_db(wav_ref, wav_exact):.1f} dB")
    print("\nfast-mode SNR (dB) at each stage against exact (= the reference to 1e-4); "
          "drop = what the stage loses")
    print("| stage | std | all BF16 | drop | default F32 set | drop | every layer kept | drop |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    prev: dict[str, float] = {}
    for name, e in taps_exact.items():
        cells = []
        for label, (_, taps) in runs.items():
            s = snr_db(e, taps[name])
            cells.append(f"{s:.1f} | {'' if label not in prev else f'{prev[label] - s:.1f}'}")
            prev[label] = s
        print(f"| {name} | {float(np.std(e)):.3f} | {' | '.join(cells)} |")
    cells = [f"{snr_db(wav_ref, w):.1f} | " for w, _ in runs.values()]
    print(f"| wav (vs reference) | {float(np.std(wav_ref)):.3f} | {' | '.join(cells)} |")
    base = snr_db(wav_ref, runs["default"][0])
    if args.sensitivity:
        print("\n| also kept in F32 (beyond the default set) | final SNR dB | gain dB |"
              "\n|---|---:|---:|")
        for key, layers in groups([x for x in bf16_layers(model) if x not in default]).items():
            m = DecoderModel.load(model, bs, "fast", f32_layers=default | layers)
            w, _ = decode(m, codes)
            m.close()
            s = snr_db(wav_ref, w)
            print(f"| {key} ({len(layers)}) | {s:.1f} | {s - base:+.1f} |")
    if args.calibrate:
        from engine.decoder.precision import calibrate

        started = time.perf_counter()
        result = calibrate(model, bs, target_db=args.target, frames=args.calibration_frames)
        secs = time.perf_counter() - started
        m = DecoderModel.load(model, bs, "fast", f32_layers=result.f32_layers)
        w, _ = decode(m, codes)
        m.close()
        print(f"\ncalibrated fast ({secs:.1f} s): {len(result.f32_layers)} layer(s) in F32 "
              f"{sorted(result.f32_layers)}; calibration SNR {result.snr_db:.1f} dB, "
              f"SNR vs reference {snr_db(wav_ref, w):.1f} dB")
    model.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="full", choices=ref.SIZES)
    ap.add_argument("--recipe", default="stress", choices=ref.RECIPES)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--frames", type=int, default=31)
    ap.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target", type=float, default=None, help="calibration target dB")
    ap.add_argument("--sensitivity", action="store_true")
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--calibration-frames", type=int, default=16)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            run(args, seed, Path(tmp))


if __name__ == "__main__":
    main()
