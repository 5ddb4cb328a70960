"""`qtts decode`: codes from a .npy file -> a 24 kHz float WAV, offline or streamed."""

from __future__ import annotations

import sys
import time
import zipfile
from typing import Any

import numpy as np

from cli.paths import output_file, write_wav
from engine.errors import InputError
from engine.options import EngineOptions


def load_codes(path: str, n_quantizers: int) -> np.ndarray[Any, Any]:
    """Read codes [Q, T]; a [T, Q] array is transposed (and said so). One-line errors."""
    try:
        arr = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise InputError("codes", f"{path}: no such file") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        # (numpy ends an empty file with EOFError, and one that starts like a zip archive
        # without being one with BadZipFile)
        raise InputError("codes", f"{path}: not a readable .npy array ({exc})") from None
    if not isinstance(arr, np.ndarray):  # an .npz archive: several arrays, which one?
        arr.close()
        raise InputError("codes", f"{path}: an .npz archive; give one array saved as .npy")
    if arr.ndim == 2 and arr.shape[0] != n_quantizers and arr.shape[1] == n_quantizers:
        print(f"qtts: {path}: codes given as [T, {n_quantizers}] {list(arr.shape)}; transposed "
              f"to [{n_quantizers}, T]", file=sys.stderr)
        arr = arr.T
    return np.asarray(arr)


def run_decode(model_path: str, codes_path: str, out_path: str, stream_chunk: int,
               precision: str, options: EngineOptions) -> int:
    """Decode and write the WAV; returns the exit status."""
    from engine.backend import BackendSet
    from engine.decoder import DecoderModel, StreamingDecoder, decode, validate_codes
    from engine.gguf_model import open_model

    out = output_file(out_path, "--out", (".wav",))
    if stream_chunk < 0:
        raise InputError("--stream-chunk", f"{stream_chunk}: must be >= 1 (or 0: not streamed)")
    model = open_model(model_path)
    model.require("decoder")
    cfg = model.decoder_config
    assert cfg is not None
    codes = validate_codes(load_codes(codes_path, cfg.num_quantizers), cfg.num_quantizers,
                           cfg.codebook_size)
    dec = DecoderModel.load(model, BackendSet.from_options(options), precision)  # type: ignore[arg-type]
    started = time.perf_counter()
    if stream_chunk > 0:
        sd = StreamingDecoder(dec)
        pieces = [sd.push(codes[:, s : s + stream_chunk])[0]
                  for s in range(0, codes.shape[1], stream_chunk)]
        audio = np.concatenate(pieces)
    else:
        audio, timings = decode(dec, codes)
        if options.profile:
            timings.report("decode")
    elapsed = time.perf_counter() - started
    write_wav(out, audio, dec.sample_rate, "--out")
    seconds = audio.size / dec.sample_rate
    print(f"qtts: wrote {out_path}: {seconds:.2f} s of audio in {elapsed:.2f} s "
          f"(RTF {elapsed / seconds:.3f}, {dec.precision})", file=sys.stderr)
    return 0
