#!/usr/bin/env python3
"""Voice-cloning benchmark: prompt preparation and first audio of a stored cloned voice.

On the deterministic random Base model of ``qtts make-model --variant base`` (``--size 0.6b``:
released dims; ``tiny`` for a smoke run):

1. **Prompt preparation** for a ~10 s espeak-ng reference (decode + resample, speaker encoder,
   speech-tokenizer encoder), ours vs the official ``Qwen3TTSModel.create_voice_clone_prompt``
   (float32 PyTorch, same weights, same threads) in the same run; median of ``--repeats``
   after one warm-up each. Targets: >= 3x the reference and <= 300 ms on 2 threads.
2. **First audio of a stored voice**: the voice saved as ``.qvoice``, loaded, its prefix pinned
   (``Pipeline.pin_voice``; a server's worker prepares a voice it makes the same way, for the
   "auto" language: ``prepare_voice``), then time to the first chunk of a request at
   ``--dtype`` (default q4_0; the request names no text mode: streaming, as the reference
   clones). Target: <= 200 ms at 0.6B.

    python bench/clone.py [--size 0.6b] [--threads 2] [--dtype q4_0] [--seconds 10]
                          [--repeats 5] [--no-reference]
    python bench/clone.py --http ...   # the same over HTTP: create a voice, its first audio
                                       # (bench/clone_http.py)

The machine may be shared: the load average is printed; treat times as upper bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backend import BackendSet
from engine.clone import voice_file
from engine.clone.audio import decode, load_reference
from engine.clone.cloner import VoiceCloner
from engine.gguf_model import open_model
from engine.pipeline import Pipeline, SynthesisRequest
from engine.talker.prompt import PromptBuilder
from engine.tools.convert import convert
from engine.tools.make_model import make_model

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Streaming audio should start quickly, because the first chunk matters most.",
    "A voice can be cloned from a few seconds of clear speech and its transcript.",
    "Numbers like twelve, forty two and one hundred are read aloud as words.",
)
TEXT = "Hello, how are you today?"


def model_paths(size: str, dtype: str) -> tuple[Path, Path, Path]:
    """The synthetic Base checkpoint, its F32/F16 GGUF (for preparation) and the --dtype one."""
    cache = Path(os.environ.get("QTTS_CACHE_DIR") or "~/.cache/qtts").expanduser() / "models"
    ckpt = cache / f"synthetic-base-{size}-seed0"
    if not (ckpt / "model.gguf").is_file():
        make_model(ckpt, size=size, seed=0, variant="base", progress=False, keep_checkpoint=True)
    served = ckpt / "model.gguf" if dtype in ("f32", "f16") and size != "tiny" else (
        cache / f"synthetic-base-{size}-{dtype}-seed0.gguf")  # fmt: skip
    if not served.is_file():
        convert(ckpt, served, dtype=dtype, progress=False)
    return ckpt, ckpt / "model.gguf", served


def reference_audio(folder: Path, seconds: float) -> tuple[Path, str]:
    """~``seconds`` of espeak-ng speech as one WAV, and its transcript."""
    words, parts = [], []
    total = 0.0
    i = 0
    while total < seconds:
        text = SENTENCES[i % len(SENTENCES)]
        f = folder / f"s{i}.wav"
        subprocess.run(["espeak-ng", "-s", "150", "-w", str(f), text], check=True,
                       capture_output=True)  # fmt: skip
        d = decode(f)
        parts.append(d.samples)
        total += d.samples.size / d.sample_rate
        words.append(text)
        i += 1
    import soundfile as sf

    wav = np.concatenate(parts)[: int(seconds * d.sample_rate)]
    out = folder / "ref.wav"
    sf.write(out, wav, d.sample_rate)
    return out, " ".join(words)


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up: graph builds, allocations, lazy imports
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=["tiny", "0.6b", "1.7b"], default="0.6b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="q4_0")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--http", action="store_true",
                    help="over HTTP: create a voice, its first audio (bench/clone_http.py)")
    args = ap.parse_args()
    if args.http:
        from bench.clone_http import run

        run(args.size, args.threads, args.dtype, args.seconds, args.repeats)
        return 0
    print(f"load average: {os.getloadavg()}", file=sys.stderr)
    ckpt, prep_path, served_path = model_paths(args.size, args.dtype)
    backends = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": str(args.threads)})
    result: dict[str, Any] = {"size": args.size, "threads": args.threads, "dtype": args.dtype}
    with tempfile.TemporaryDirectory() as tmp:
        ref_path, transcript = reference_audio(Path(tmp), args.seconds)
        result["reference_seconds"] = round(decode(ref_path).samples.size / 22050, 2)

        # 1. prompt preparation (ours)
        model = open_model(prep_path)
        cloner = VoiceCloner(model, backends, PromptBuilder(model))
        wav = load_reference(ref_path)
        cloner.make(wav, transcript)  # loads the encoders once
        result["ours_decode_resample_s"] = median_time(lambda: load_reference(ref_path),
                                                       args.repeats)  # fmt: skip
        result["ours_speaker_encoder_s"] = median_time(lambda: cloner.x_vector(wav), args.repeats)
        result["ours_codec_encoder_s"] = median_time(lambda: cloner.codes(wav), args.repeats)
        result["ours_prepare_s"] = median_time(
            lambda: cloner.make(load_reference(ref_path), transcript), args.repeats)
        voice = cloner.make(wav, transcript)
        cloner.close()
        qv = Path(tmp) / "voice.qvoice"
        qv.write_bytes(voice_file.dumps(voice))

        # 2. first audio of the stored voice at --dtype (before the reference is loaded: torch's
        # idle OpenMP threads in this process would slow ours)
        served = open_model(served_path)
        pipe = Pipeline(served, backends)
        pipe.warm_up()
        stored = voice_file.load(qv, pipe.voice_fingerprint)
        pipe.pin_voice(stored)

        def first_chunk() -> None:
            for _chunk in pipe.stream(SynthesisRequest(TEXT, voice_prompt=stored, seed=0,
                                                       max_frames=4)):  # fmt: skip
                break

        result["first_audio_stored_voice_s"] = median_time(first_chunk, args.repeats)
        pipe.close()

        # 3. the reference's preparation, same weights, same threads, same run
        if not args.no_reference:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from tests.parity import reference as ref
            from tests.parity import reference_clone as rc

            torch = ref.import_reference().torch
            m = rc.load_model(str(ckpt))
            torch.set_num_threads(args.threads)
            # the reference as it runs on its own: numpy's BLAS (librosa's mel) at --threads,
            # not at the one thread our BackendSet left it (engine.backend.quiet_numpy_blas)
            threadpool_limits(args.threads, user_api="blas")
            import soundfile as sf

            raw, sr = sf.read(ref_path, dtype="float32")
            result["reference_prepare_s"] = median_time(
                lambda: m.create_voice_clone_prompt(ref_audio=(raw, sr), ref_text=transcript),
                args.repeats)  # fmt: skip
            result["speedup_vs_reference"] = round(
                result["reference_prepare_s"] / result["ours_prepare_s"], 2)

    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                      for k, v in result.items()}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
