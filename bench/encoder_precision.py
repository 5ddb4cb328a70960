#!/usr/bin/env python3
"""Would a cheaper arithmetic keep the codec encoder's codes? A code-identity study.

Voice cloning encodes the reference audio into 16 codes per frame by nearest-codebook search
(issue 15: codes identical to the reference's). A faster conv arithmetic is only usable if no
code flips. This study runs the official reference encoder (``speech_tokenizer.encode``) as it
is and again with every ``Conv1d`` computed in an emulated arithmetic:

  bf16     one BF16 product (input and weight rounded to BF16, F32 sums): what the AMX tiles do
  bf16x3   the split product x_hi w_hi + x_lo w_hi + x_hi w_lo with x = x_hi + x_lo (each BF16),
           the same for w: three AMX products, ~2^-16 relative error instead of F32's 2^-24

and counts the codes that differ from the plain reference, with the reference's own margin at
each flipped decision: (d2 - d1) / d1, d1 and d2 the distances to the nearest and second nearest
codebook entry. It also prints our ggml encoder (F32, with the Winograd groups of
``ConvForm.wino``) against the reference, and how near the reference's closest decisions come to
a tie (the smallest margin of each clip).

Models: Base ``tiny`` talkers with the released Mimi encoder dims, per ``--seeds`` and
``--recipes`` (``default``; ``stress``: every stage O(1)), made in a temporary folder (or
``--folder``). Clips: espeak-ng's test sentences at 24 kHz, their concatenation, one quieter
female voice.

    python bench/encoder_precision.py [--seeds 6 11] [--recipes default stress]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backend import BackendSet
from engine.codec_encoder.encoder import CodecEncoder
from engine.gguf_model import open_model
from engine.tools.make_model import make_model
from tests.parity import reference as ref
from tests.parity import reference_clone as rc
from tests.parity.test_codec_encoder_parity import RELEASED_MIMI
from tests.speech import SENTENCES, speech_24k


def _split(t: Any) -> tuple[Any, Any]:
    hi = t.bfloat16().float()
    return hi, (t - hi).bfloat16().float()


def _bf16(conv: Any, x: Any) -> Any:
    return conv._conv_forward(_split(x)[0], _split(conv.weight)[0], conv.bias)


def _bf16x3(conv: Any, x: Any) -> Any:
    (xh, xl), (wh, wl) = _split(x), _split(conv.weight)
    y = conv._conv_forward(xh, wh, conv.bias)
    return y + conv._conv_forward(xl, wh, None) + conv._conv_forward(xh, wl, None)


ARITHMETICS: dict[str, Callable[[Any, Any], Any]] = {"bf16": _bf16, "bf16x3": _bf16x3}


@contextmanager
def conv_arithmetic(name: str | None) -> Iterator[None]:
    """Every ``torch.nn.Conv1d`` computed in arithmetic ``name`` (None: as it is)."""
    import torch

    plain = torch.nn.Conv1d.forward
    if name is not None:
        torch.nn.Conv1d.forward = ARITHMETICS[name]  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Conv1d.forward = plain  # type: ignore[method-assign]


@contextmanager
def margins(out: list[np.ndarray[Any, Any]]) -> Iterator[None]:
    """Records each codebook search's relative margin per vector, in call order (level by
    level: the split quantizer's semantic level, then the acoustic ones)."""
    from transformers.models.mimi import modeling_mimi as mm

    plain = mm.MimiEuclideanCodebook.quantize

    def quantize(self: Any, hidden: Any) -> Any:
        import torch

        d = torch.cdist(hidden[None].float(), self.embed[None].float(), p=2)[0]
        two = torch.topk(d, 2, dim=-1, largest=False).values.double().numpy()
        out.append((two[:, 1] - two[:, 0]) / np.maximum(two[:, 0], 1e-30))
        return plain(self, hidden)

    mm.MimiEuclideanCodebook.quantize = quantize  # type: ignore[method-assign]
    try:
        yield
    finally:
        mm.MimiEuclideanCodebook.quantize = plain  # type: ignore[method-assign]


def clips(tmp: Path) -> list[tuple[str, np.ndarray[Any, Any]]]:
    out = [(f"sentence {i}", speech_24k(tmp, s)) for i, s in enumerate(SENTENCES)]
    out.append(("sentences 0-2 joined", np.concatenate([w for _, w in out[:3]])))
    out.append(("sentence 0, en+f3, x0.3", speech_24k(tmp, SENTENCES[0], voice="en+f3") * 0.3))
    return out


def study(folder: Path, wavs: list[tuple[str, np.ndarray[Any, Any]]], cpu: BackendSet) -> None:
    tok = rc.load_model(str(folder)).model.speech_tokenizer
    with open_model(folder / "model.gguf") as m:
        ours = CodecEncoder(m, cpu)
        try:
            for label, wav in wavs:
                levels: list[np.ndarray[Any, Any]] = []
                with margins(levels):
                    want = np.asarray(tok.encode(wav, sr=24000).audio_codes[0].numpy())
                # the encoder searches all 32 levels and keeps the first 16
                margin = np.stack(levels[: want.shape[1]], axis=1)  # [frames, 16]
                cells = [f"{(ours.encode(wav) != want).sum()}"]
                for name in ARITHMETICS:
                    with conv_arithmetic(name):
                        got = np.asarray(tok.encode(wav, sr=24000).audio_codes[0].numpy())
                    flips = np.argwhere(got != want)
                    where = ", ".join(f"f{f} l{q} {margin[f, q]:.1e}" for f, q in flips[:3])
                    cells.append(f"{len(flips)}" + (f" ({where})" if where else ""))
                print(f"| {folder.name} | {label} | {want.size} | {margin.min():.1e} | "
                      f"{(margin < 1e-4).sum()} | " + " | ".join(cells) + " |", flush=True)
        finally:
            ours.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[6, 11])
    ap.add_argument("--recipes", nargs="+", default=["default", "stress"])
    ap.add_argument("--folder", type=Path, default=None, help="keep the models here")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    ref.import_reference()
    cpu = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": str(args.threads)})
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        root = args.folder or tmp
        wavs = clips(tmp)
        print("| model | clip | codes | smallest margin | margins < 1e-4 | ours (F32) flips | "
              + " | ".join(f"{a} flips (frame, level, reference margin)" for a in ARITHMETICS)
              + " |")
        print("|---|---|---:|---:|---:|---:|" + "---|" * len(ARITHMETICS))
        for recipe in args.recipes:
            for seed in args.seeds:
                folder = root / f"base-mimi-{recipe}-seed{seed}"
                if not (folder / "model.gguf").exists():
                    make_model(folder, "tiny", seed=seed, variant="base", progress=False,
                               keep_checkpoint=True, overrides={"mimi": RELEASED_MIMI},
                               recipe=recipe)
                study(folder, wavs, cpu)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
