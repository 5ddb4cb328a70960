#!/usr/bin/env python3
"""Per-op profile of voice-prompt preparation: the speaker encoder and the codec encoder.

Builds (once, cached) a small Base model whose two encoders have the released dims (ECAPA-TDNN
512 channels / enc_dim 1024, Mimi encoder 512 hidden, 8 layers), speaks ``--seconds`` of
espeak-ng speech and runs each encoder under a ggml eval callback that times every node (the
scheduler then computes node by node, so the total is a little above a plain run). Prints the
plain wall time of each encoder, then the time per op kind and the slowest nodes.

    python bench/clone_ops.py [--threads 2] [--seconds 10] [--top 15]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backend import BackendSet
from engine.codec_encoder.encoder import CodecEncoder
from engine.ggml.native import ffi, lib
from engine.gguf_model import open_model
from engine.speaker.encoder import SpeakerEncoder
from engine.tools.make_model import make_model

RELEASED_SPEAKER = {
    "enc_channels": [512, 512, 512, 512, 1536], "enc_kernel_sizes": [5, 3, 3, 3, 1],
    "enc_dilations": [1, 2, 3, 4, 1], "enc_attention_channels": 128, "enc_res2net_scale": 8,
    "enc_se_channels": 128,
}  # fmt: skip
RELEASED_MIMI = {
    "hidden_size": 512, "num_filters": 64, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2048, "codebook_dim": 256,
    "vector_quantization_hidden_dimension": 256, "upsample_groups": 512,
}  # fmt: skip
TEXT = ("The quick brown fox jumps over the lazy dog. Streaming audio should start quickly, "
        "because the first chunk matters most. A voice can be cloned from a few seconds of "
        "clear speech and its transcript.")  # fmt: skip


def encoder_model() -> Path:
    cache = Path(os.environ.get("QTTS_CACHE_DIR") or "~/.cache/qtts").expanduser() / "models"
    folder = cache / "synthetic-base-encoders-released-seed0"
    if not (folder / "model.gguf").is_file():
        make_model(folder, "tiny", seed=0, variant="base", progress=False,
                   overrides={"talker": {"hidden_size": 1024}, "speaker": RELEASED_SPEAKER,
                              "mimi": RELEASED_MIMI})  # fmt: skip
    return folder / "model.gguf"


def speech(seconds: float) -> np.ndarray:
    import soundfile as sf
    import soxr

    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "s.wav"
        subprocess.run(["espeak-ng", "-s", "150", "-w", str(f), TEXT], check=True,
                       capture_output=True)  # fmt: skip
        wav, sr = sf.read(str(f), dtype="float32")
    wav = np.asarray(soxr.resample(wav, sr, 24000, quality="HQ"), dtype=np.float32)
    n = int(seconds * 24000)
    return np.resize(wav, n).astype(np.float32)


def cpu_seconds() -> float:
    """CPU time of this process (all threads): less inflated than wall time when others
    share the cores."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class NodeTimer:
    """Eval callback: the time between two callbacks is the compute time of the node (process
    CPU time: wall time is meaningless on a shared machine)."""

    def __init__(self, sched: Any) -> None:
        self.sched = sched
        self.rows: list[tuple[str, str, float]] = []
        self._t = 0.0
        self._cb = ffi.callback("ggml_backend_sched_eval_callback", self._on)

    def __enter__(self) -> NodeTimer:
        lib.ggml_backend_sched_set_eval_callback(self.sched, self._cb, ffi.NULL)
        self._t = cpu_seconds()
        return self

    def __exit__(self, *exc: object) -> None:
        lib.ggml_backend_sched_set_eval_callback(self.sched, ffi.NULL, ffi.NULL)

    def _on(self, t: Any, ask: bool, _user: Any) -> bool:
        now = cpu_seconds()
        if ask:
            self._t = now
            return True
        op = ffi.string(lib.ggml_op_desc(t)).decode()
        shape = "x".join(str(int(t.ne[i])) for i in range(lib.ggml_n_dims(t)))
        srcs = []
        for i in range(3):
            s = t.src[i]
            if s != ffi.NULL:
                srcs.append("x".join(str(int(s.ne[j])) for j in range(lib.ggml_n_dims(s))))
        self.rows.append((op, f"{shape} <- {', '.join(srcs)}", now - self._t))
        self._t = cpu_seconds()
        return True


def report(name: str, rows: list[tuple[str, str, float]], top: int) -> None:
    by_op: dict[str, list[float]] = defaultdict(list)
    for op, _shape, dt in rows:
        by_op[op].append(dt)
    total = sum(dt for _o, _s, dt in rows)
    print(f"\n== {name}: {len(rows)} nodes, {total * 1e3:.1f} ms process CPU node by node")
    for op, ts in sorted(by_op.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {op:14s} {len(ts):4d} nodes {sum(ts) * 1e3:8.1f} ms "
              f"({100 * sum(ts) / total:4.1f}%)")  # fmt: skip
    print(f"  slowest {top} nodes:")
    for op, shape, dt in sorted(rows, key=lambda r: -r[2])[:top]:
        print(f"    {dt * 1e3:7.2f} ms  {op:12s} {shape}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--only", choices=["speaker", "codec"], default=None)
    ap.add_argument("--no-ops", action="store_true", help="only the plain timings")
    args = ap.parse_args()
    print(f"load average: {os.getloadavg()}", file=sys.stderr)
    backends = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": str(args.threads)})
    wav = speech(args.seconds)
    model = open_model(encoder_model())
    encoders: list[tuple[str, Any, Any]] = []
    if args.only in (None, "speaker"):
        spk = SpeakerEncoder(model, backends)
        encoders.append(("speaker encoder", spk, spk.embed))
    if args.only in (None, "codec"):
        cod = CodecEncoder(model, backends)
        encoders.append(("codec encoder", cod, cod.encode))
    for name, _enc, fn in encoders:
        fn(wav)
        times, cpu = [], []
        for _ in range(args.repeats):
            c0, t0 = cpu_seconds(), time.perf_counter()
            fn(wav)
            times.append(time.perf_counter() - t0)
            cpu.append(cpu_seconds() - c0)
        print(f"{name}: wall median {statistics.median(times) * 1e3:.1f} ms of {args.repeats} "
              f"({', '.join(f'{t * 1e3:.0f}' for t in times)}); process CPU min "
              f"{min(cpu) * 1e3:.0f} ms (/ threads = {min(cpu) * 1e3 / args.threads:.0f})")
    for name, _enc, fn in [] if args.no_ops else encoders:
        with NodeTimer(backends.sched) as timer:
            fn(wav)
        report(name, timer.rows, args.top)
    for _name, enc, _fn in encoders:
        enc.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
