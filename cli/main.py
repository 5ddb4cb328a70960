"""The ``qtts`` command line: convert, make-model, info, decode, synth, clone-voice, tokenize,
serve.

Each subcommand is two small functions: ``_add_<name>(subparsers)`` declares its arguments and
``_cmd_<name>(args) -> int`` runs it. ``main`` maps every ``QttsError`` to one line
``qtts: <message>`` on stderr and exit status 2 — never a traceback. The commands that run the
engine read its options from the environment here (``EngineOptions.from_env``), once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from cli.paths import count, output_file
from engine.errors import QttsError
from engine.options import EngineOptions

Handler = Callable[[argparse.Namespace], int]
SubParsers = Any  # argparse._SubParsersAction (private type)

EXIT_ERROR = 2


# ---------------------------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------------------------


def _add_convert(sub: SubParsers) -> None:
    from engine.tools.convert import DTYPES

    p = sub.add_parser(
        "convert",
        help="convert a Qwen3-TTS checkpoint folder (or a speech-tokenizer folder) to GGUF",
        description="Convert a released Qwen3-TTS checkpoint folder to one qtts GGUF file.",
    )
    p.add_argument("model_dir", help="HF checkpoint folder (or its speech_tokenizer/ folder)")
    p.add_argument("out", help="output .gguf path")
    p.add_argument("--dtype", choices=list(DTYPES), default="f16",
                   help="talker weight type (f16)")
    p.add_argument("--decoder-dtype", choices=list(DTYPES), default="f32",
                   help="decoder weight type (f32; others cost waveform SNR, the report says how "
                   "much)")
    p.add_argument(
        "--parts", default=None, help="comma list of parts: decoder, talker, speaker_encoder, "
        "codec_encoder (the last two: Base checkpoints' cloning; default: all present)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_convert)


def _cmd_convert(args: argparse.Namespace) -> int:
    from engine.tools.convert import convert

    # a .gguf name, as every command that reads a model takes (convert() itself writes any
    # name: scripts convert to a temporary name and rename it)
    out = output_file(args.out, "out", (".gguf",))
    report = convert(
        args.model_dir, out, dtype=args.dtype, parts=args.parts, progress=not args.no_progress,
        decoder_dtype=args.decoder_dtype,
    )
    for line in report.summary_lines():
        print(f"qtts: {line}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# make-model
# ---------------------------------------------------------------------------------------------


def _add_make_model(sub: SubParsers) -> None:
    from engine.tools.convert import DTYPES
    from engine.tools.make_model import RECIPES, SIZES, VARIANTS

    p = sub.add_parser(
        "make-model",
        help="write a deterministic random-weight model (HF layout + model.gguf) for tests",
        description=(
            "Write a random-weight checkpoint in the released HF layout and convert it to "
            "OUT_DIR/model.gguf (the checkpoint is removed unless --keep-checkpoint). Its audio "
            "is noise, not speech."
        ),
    )
    p.add_argument("out_dir", help="output folder")
    p.add_argument(
        "--size", choices=SIZES, required=True,
        help="tiny (tests), 0.6b (= full) or 1.7b (released dims)",
    )
    p.add_argument("--seed", type=count(0), default=0, help="random seed (0)")
    p.add_argument(
        "--variant", choices=VARIANTS, default="custom_voice",
        help="custom_voice (named speakers), base (voice cloning) or voice_design",
    )
    p.add_argument(
        "--dtype", choices=list(DTYPES), default=None,
        help="GGUF talker weight type (f16 full, f32 tiny)"
    )
    p.add_argument("--decoder-dtype", choices=list(DTYPES), default="f32",
                   help="decoder weight type (f32)")
    p.add_argument(
        "--recipe", choices=RECIPES, default="default",
        help="weight recipe: default (small residual branches), or stress (every stage O(1): "
        "loud unclipped output, working attention; what tests use to see a broken stage)",
    )
    p.add_argument(
        "--keep-checkpoint", action="store_true",
        help="also keep the HF-layout checkpoint in OUT_DIR (as large again; for qtts convert)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_make_model)


def _cmd_make_model(args: argparse.Namespace) -> int:
    from engine.tools.make_model import make_model

    report = make_model(
        args.out_dir,
        size=args.size,
        seed=args.seed,
        variant=args.variant,
        dtype=args.dtype,
        progress=not args.no_progress,
        decoder_dtype=args.decoder_dtype,
        keep_checkpoint=args.keep_checkpoint,
        recipe=args.recipe,
    )
    for line in report.summary_lines():
        print(f"qtts: {line}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# info
# ---------------------------------------------------------------------------------------------


def _add_info(sub: SubParsers) -> None:
    p = sub.add_parser("info", help="ggml version and build options, devices, chosen backend")
    p.add_argument("--model", default=None,
                   help="also measure this model's fast-mode decoder SNR against exact mode")
    p.add_argument("--target", type=float, default=35.0,
                   help="fast-mode SNR target for --model, dB (35)")
    p.set_defaults(func=_cmd_info)


def _cmd_info(args: argparse.Namespace) -> int:
    from cli.info import decoder_precision_lines, info_lines

    print("\n".join(info_lines(EngineOptions.from_env())))
    if args.model is not None:
        print("\n".join(decoder_precision_lines(args.model, args.target,
                                                 EngineOptions.from_env())))
    return 0


# ---------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------


def _add_decode(sub: SubParsers) -> None:
    p = sub.add_parser("decode", help="codes [16, T] (.npy) -> 24 kHz mono float WAV")
    p.add_argument("--model", required=True, help="a qtts GGUF with the decoder part")
    p.add_argument("--codes", required=True, help=".npy int array [16, T] (or [T, 16])")
    p.add_argument("--out", required=True, help="output .wav (32-bit float)")
    p.add_argument(
        "--stream-chunk",
        type=int,
        default=0,
        help="decode through the streaming path, N frames per push (0: offline)",
    )
    p.add_argument(
        "--precision",
        choices=["exact", "fast"],
        default="fast",
        help="exact: F32 everywhere (parity); fast: BF16 wave-generator weights",
    )
    p.set_defaults(func=_cmd_decode)


def _cmd_decode(args: argparse.Namespace) -> int:
    from cli.decode import run_decode

    return run_decode(args.model, args.codes, args.out, args.stream_chunk, args.precision,
                      EngineOptions.from_env())


# ---------------------------------------------------------------------------------------------
# doctor
# ---------------------------------------------------------------------------------------------


def _add_doctor(sub: SubParsers) -> None:
    p = sub.add_parser("doctor", help="decode on every backend the build sees; compare with CPU")
    p.add_argument("--model", required=True, help="a qtts GGUF with the decoder part")
    p.add_argument("--frames", type=_doctor_frames, default=4,
                   help="codec frames to decode, at most a request's frame cap (default 4)")
    p.set_defaults(func=_cmd_doctor)


def _doctor_frames(text: str) -> int:
    """``--frames``: 1 up to the frames one request may have. More adds nothing to the
    comparison of backends and runs for minutes; 0 or fewer made an empty or a failed decode.
    (The cap is imported here, when the option is given: not on every ``qtts`` start.)"""
    from engine.talker.generate import DEFAULT_MAX_FRAMES_CAP

    return count(1, DEFAULT_MAX_FRAMES_CAP)(text)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from cli.doctor import doctor_table, run_doctor

    rows = run_doctor(args.model, EngineOptions.from_env(), frames=args.frames)
    print(doctor_table(rows))
    return 1 if any(r.error or r.nan or r.inf for r in rows) else 0


# ---------------------------------------------------------------------------------------------
# synth / voices  (text -> speech; the logic lives in cli/synth.py)
# ---------------------------------------------------------------------------------------------


def _add_synth(sub: SubParsers) -> None:
    from cli.synth import add_synth_arguments

    p = sub.add_parser(
        "synth",
        help="text -> 24 kHz float WAV (talker + code predictor + decoder, streamed)",
        description="Speak TEXT with a voice of the model; writes a 32-bit float WAV.",
    )
    add_synth_arguments(p)
    p.set_defaults(func=_cmd_synth)


def _cmd_synth(args: argparse.Namespace) -> int:
    from cli.synth import run_synth

    return run_synth(args, EngineOptions.from_env())


def _add_voices(sub: SubParsers) -> None:
    p = sub.add_parser("voices", help="list a model's voices and languages")
    p.add_argument("--model", required=True, help="a qtts GGUF with the talker part")
    p.set_defaults(func=_cmd_voices)


def _add_clone_voice(sub: SubParsers) -> None:
    from cli.clone import add_clone_voice_arguments

    p = sub.add_parser(
        "clone-voice",
        help="clone a voice from reference audio into a .qvoice file (Base models)",
        description=(
            "Encode reference speech (and its transcript) with a Base model's speaker encoder "
            "and speech-tokenizer encoder into a small .qvoice file for `qtts synth "
            "--voice-file`. The file only works with the model it was made with."
        ),
    )
    add_clone_voice_arguments(p)
    p.set_defaults(func=_cmd_clone_voice)


def _cmd_clone_voice(args: argparse.Namespace) -> int:
    from cli.clone import run_clone_voice

    return run_clone_voice(args, EngineOptions.from_env())


def _cmd_voices(args: argparse.Namespace) -> int:
    from cli.synth import run_voices

    return run_voices(args.model)


def _add_tokenize(sub: SubParsers) -> None:
    p = sub.add_parser("tokenize", help="a prompt's text token ids (and pieces) under a model")
    p.add_argument("--model", required=True, help="a qtts GGUF with the talker part")
    p.add_argument("text", nargs="?", default=None, help="the text (default: read stdin)")
    p.add_argument("--json", action="store_true", help='one JSON object {"count", "ids"}')
    p.add_argument("--tokens", action="store_true", help="the piece of text each id stands for")
    p.set_defaults(func=_cmd_tokenize)


def _cmd_tokenize(args: argparse.Namespace) -> int:
    from cli.tokenize import run_tokenize

    return run_tokenize(args.model, args.text, args.json, args.tokens)


# ---------------------------------------------------------------------------------------------
# serve           (the HTTP service lives in service/; the engine never imports it)
# ---------------------------------------------------------------------------------------------


def _add_serve(sub: SubParsers) -> None:
    from cli.serve import add_serve_parser

    add_serve_parser(sub).set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from cli.serve import run_serve

    return run_serve(args)


# Every subcommand's argument declarer, in help order. Add new ones here.
SUBCOMMANDS: list[Callable[[SubParsers], None]] = [
    _add_convert,
    _add_make_model,
    _add_info,
    _add_decode,
    _add_synth,
    _add_clone_voice,
    _add_voices,
    _add_tokenize,
    _add_doctor,
    _add_serve,
]


def build_parser() -> argparse.ArgumentParser:
    """The full ``qtts`` argument parser."""
    parser = argparse.ArgumentParser(prog="qtts", description="Qwen3-TTS speech synthesis on ggml")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="qtts: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("gguf").setLevel(logging.DEBUG if verbose else logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``qtts`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    func: Handler = args.func
    try:
        return func(args)
    except QttsError as exc:
        print(f"qtts: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        # the reader went away (`qtts tokenize ... | head`): nothing more to say, and the
        # interpreter's flush at exit must not fail on the closed pipe again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("qtts: interrupted", file=sys.stderr)
        return 130
