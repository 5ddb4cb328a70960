"""``qtts clone-voice``: reference audio (+ transcript) -> a ``.qvoice`` file, and the voice
options of ``qtts synth`` (``--voice-file`` or ``--ref-audio`` / ``--ref-text``)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from cli.paths import output_file, positive_seconds, write_file
from engine.clone.audio import DEFAULT_MAX_SECONDS
from engine.errors import InputError
from engine.options import EngineOptions


def add_clone_voice_arguments(p: argparse.ArgumentParser) -> None:
    """Declare the ``clone-voice`` arguments."""
    p.add_argument("--model", required=True, help="a qtts GGUF of a Base model")
    p.add_argument("--audio", required=True,
                   help="reference speech (wav/flac/mp3/ogg/m4a, any rate; 1-30 s)")
    p.add_argument("--text", default=None, help="transcript of the reference (in-context mode)")
    p.add_argument("--x-vector-only", action="store_true",
                   help="speaker embedding only (no transcript; weaker likeness)")
    p.add_argument("--max-seconds", type=positive_seconds, default=DEFAULT_MAX_SECONDS,
                   help=f"longest reference accepted (default {DEFAULT_MAX_SECONDS:g})")
    p.add_argument("-o", "--out", required=True, help="output .qvoice file")


def add_synth_voice_arguments(p: argparse.ArgumentParser) -> None:
    """The cloned-voice options of ``qtts synth``."""
    p.add_argument("--voice-file", default=None, help="a .qvoice made by `qtts clone-voice`")
    p.add_argument("--ref-audio", default=None, help="clone from this reference audio now")
    p.add_argument("--ref-text", default=None, help="transcript of --ref-audio")
    p.add_argument("--x-vector-only", action="store_true",
                   help="with --ref-audio: speaker embedding only")


@contextmanager
def about(option: str, path: str, fields: tuple[str, ...]) -> Iterator[None]:
    """The engine's errors on ``fields`` as errors of the command line's ``option``, naming the
    file ``path`` (the engine names its own fields: ``ref_audio: is 0.99 s long``)."""
    try:
        yield
    except InputError as exc:
        if exc.field not in fields:
            raise
        problem = exc.problem if str(path) in exc.problem else f"{path}: {exc.problem}"
        raise InputError(option, problem) from None


def run_clone_voice(args: argparse.Namespace, options: EngineOptions) -> int:
    """Make the voice, write it, print a one-line summary; returns the exit status."""
    from engine.backend import BackendSet
    from engine.clone import voice_file
    from engine.clone.audio import load_reference
    from engine.clone.cloner import VoiceCloner, check_base
    from engine.clone.prompt import transcript_ids
    from engine.gguf_model import open_model
    from engine.talker.prompt import PromptBuilder

    out = output_file(args.out, "--out", (".qvoice",))
    if args.x_vector_only and args.text:
        raise InputError("text", "--x-vector-only uses no transcript; drop one of them")
    model = open_model(args.model)
    model.require("talker")
    with about("--model", args.model, ("ref_audio",)):
        check_base(model)
    builder = PromptBuilder(model)
    if not args.x_vector_only:
        try:
            transcript_ids(builder, args.text or "")
        except InputError as exc:  # the engine's field is ``ref_text``; here it is --text
            raise InputError("text", exc.problem) from None
    t0 = time.perf_counter()
    with about("--audio", args.audio, ("ref_audio",)):
        wav = load_reference(args.audio, args.max_seconds)
        cloner = VoiceCloner(model, BackendSet.from_options(options), builder)
        voice = cloner.make(wav, args.text, args.x_vector_only)
    cloner.close()
    write_file(out, voice_file.dumps(voice), "--out")
    mode = "in-context" if voice.icl else "x-vector only"
    frames = 0 if voice.ref_codes is None else voice.ref_codes.shape[0]
    print(f"qtts: wrote {out}: {mode} voice from {wav.size / 24000:.2f} s of audio "
          f"({frames} reference frames) in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    return 0


def check_voice_args(args: argparse.Namespace) -> None:
    """``synth``'s voice options that cannot go together, refused before any work."""
    if args.voice_file and args.ref_audio:
        raise InputError("voice_file", "give --voice-file or --ref-audio, not both")
    # (flags that would change nothing are refused, not quietly dropped: a .qvoice file holds
    # its transcript and mode whole)
    for flag, given in (("--ref-text", args.ref_text), ("--x-vector-only", args.x_vector_only)):
        if given and not args.ref_audio:
            raise InputError(flag.lstrip("-").replace("-", "_"), f"{flag} needs --ref-audio")
    if args.x_vector_only and args.ref_text:
        raise InputError("ref_text", "--x-vector-only uses no transcript; drop one of them")


def voice_from_args(args: argparse.Namespace, pipe: Any) -> Any:
    """The ``VoicePrompt`` ``synth`` was asked for (None for a named voice); the options were
    checked by :func:`check_voice_args`."""
    from engine.clone import voice_file

    if args.voice_file:
        voice = voice_file.load(args.voice_file, pipe.voice_fingerprint)
        with about("voice_file", args.voice_file, ("voice",)):
            pipe.pin_voice(voice)  # lays out its prompt: what the file holds is checked there
        return voice
    if args.ref_audio:
        with about("--ref-audio", args.ref_audio, ("ref_audio",)):
            return pipe.clone_voice(args.ref_audio, args.ref_text, args.x_vector_only)
    return None
