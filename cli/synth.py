"""``qtts synth`` (text -> WAV through the streaming pipeline) and ``qtts voices``."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from cli.clone import add_synth_voice_arguments, check_voice_args, voice_from_args
from cli.paths import count, output_file, write_npy, write_wav
from engine.options import EngineOptions


def add_synth_arguments(p: argparse.ArgumentParser) -> None:
    """Declare the ``synth`` arguments."""
    p.add_argument("text", help="text to speak")
    p.add_argument("--model", required=True, help="a qtts GGUF with the talker part")
    p.add_argument("-o", "--out", required=True, help="output .wav (32-bit float, 24 kHz)")
    p.add_argument("--voice", default=None, help="speaker name (see `qtts voices`)")
    p.add_argument("--language", default=None, help="language name or auto (default auto)")
    p.add_argument("--instruct", default=None, help="style instruction (1.7B / VoiceDesign)")
    p.add_argument("--seed", type=count(0), default=None,
                   help="random seed (reproducible sampling)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (no sampling)")
    p.add_argument("--text-mode", choices=["full", "stream"], default=None,
                   help="full: whole text in the prompt; stream: one token per frame (default: "
                   "stream for a cloned voice, as the reference clones, else full)")
    p.add_argument("--max-frames", type=count(1), default=None,
                   help="frame budget (default: 40 + 12 per text token)")
    p.add_argument("--save-codes", default=None, help="also write the codes [16, T] as .npy")
    p.add_argument("--precision", choices=["exact", "fast"], default="fast",
                   help="decoder precision (exact: F32 everywhere)")
    p.add_argument("--kv-type", choices=["f16", "f32"], default="f16", help="KV cache type")
    p.add_argument("--chunk", type=count(1), default=8, help="largest chunk of the ramp, in frames")
    add_synth_voice_arguments(p)


def run_synth(args: argparse.Namespace, options: EngineOptions) -> int:
    """Synthesize, write the WAV (and codes), print a one-line summary; returns exit status."""
    from engine.backend import BackendSet
    from engine.gguf_model import open_model
    from engine.pipeline import Pipeline, StreamInfo, SynthesisRequest

    out = output_file(args.out, "--out", (".wav",))
    codes_out = output_file(args.save_codes, "--save-codes", (".npy",)) if args.save_codes else None
    check_voice_args(args)
    model = open_model(args.model)
    model.require("talker")
    backends = BackendSet.from_options(options)
    pipe = Pipeline(model, backends, precision=args.precision, kv_type=args.kv_type,
                    chunk_max_frames=args.chunk)
    try:
        voice = voice_from_args(args, pipe)
    except BaseException:
        pipe.close()
        raise
    req = SynthesisRequest(text=args.text, voice=args.voice, language=args.language,
                           instruct=args.instruct, text_mode=args.text_mode, seed=args.seed,
                           greedy=args.greedy, max_frames=args.max_frames,
                           voice_prompt=voice)
    info = StreamInfo()
    pieces: list[np.ndarray[Any, Any]] = []
    t0 = time.perf_counter()
    first = 0.0
    for chunk in pipe.stream(req, info=info):
        if not pieces:
            first = time.perf_counter() - t0
        pieces.append(chunk.audio)
    elapsed = time.perf_counter() - t0
    audio = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
    write_wav(out, audio, pipe.sample_rate, "--out")
    if codes_out is not None:
        codes = (np.concatenate(info.codes, axis=1) if info.codes
                 else np.zeros((16, 0), dtype=np.int32))
        write_npy(codes_out, codes, "--save-codes")
    seconds = audio.size / pipe.sample_rate
    rtf = f"{elapsed / seconds:.3f}" if seconds else "n/a"
    print(f"qtts: wrote {out}: {info.frames} frames, {seconds:.2f} s of audio in {elapsed:.2f} s "
          f"(RTF {rtf}, first audio {first * 1e3:.0f} ms, seed {info.seed}, {info.outcome})",
          file=sys.stderr)
    if info.outcome == "truncated_no_eos":
        # a synthetic model's random weights never pick end-of-speech: more frames would only
        # be more noise, so the advice is for real models alone
        advice = ("the model has random weights and never ends by itself" if model.synthetic
                  else "the audio is truncated (raise --max-frames)")
        print(f"qtts: warning: the frame budget ({info.budget} frames) ran out before the model "
              f"ended the speech; {advice}", file=sys.stderr)
    pipe.close()
    return 0


def run_voices(model_path: str) -> int:
    """Print the speakers, languages and instruction support of a model."""
    from engine.gguf_model import open_model
    from engine.talker.prompt import PromptBuilder

    model = open_model(model_path)
    model.require("talker")
    pb = PromptBuilder(model)
    print(f"model: {model.tts_model_type or 'custom_voice'} {model.tts_model_size or ''}".rstrip())
    if model.tts_model_type == "base":
        print("voices: none built in; clone one from reference audio (`qtts clone-voice`)")
    else:
        print("voices:")
    for v in pb.voices:
        dialect = pb.catalog.dialects.get(v)
        print(f"  {v}" + (f"  (speaks {dialect} for chinese/auto)" if dialect else ""))
    print("languages: " + ", ".join(pb.languages))
    print("instructions: " + ("honoured" if pb.honours_instruct else "not supported"))
    return 0
