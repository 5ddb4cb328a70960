"""Memory of a qtts pod, per weight type: what its Kubernetes requests/limits must hold.

For each model it starts `qtts serve` (bench/load.py's start_server) with
``--workers`` workers on 127.0.0.1, waits for /readyz, and reads /proc/<pid>/smaps_rollup of
the front end and of every worker (pids from /healthz):

  RSS        resident pages of the process, shared ones included
  PSS        proportional set: each shared page divided among the processes that map it; the
             sum over the pod's processes is the pod's real footprint
  private    pages only this process maps (the int8 and repacked weight copies, caches)

once idle (after warm-up) and at the peak while every slot of every worker serves a request
(``--max-batch`` per worker, the server's default unless given; ``--frames`` of audio each;
sampled every 0.1 s). The weights file's page cache is charged to
the pod's memory cgroup as well, which the PSS of the mapping counts.

It prints a markdown table and the memory limit the formula of docs/deploy.md ("Sizing")
gives for that pod:

  limit = 1.15 x (peak pod PSS) + 256 MiB, rounded up to 0.25 GiB

  python bench/memory.py --dtypes f16,q8_0,q4_0 --workers 2 --threads 2 --frames 125
  python bench/memory.py --model /models/model.gguf --workers 2        # your own model
  python bench/memory.py --dtypes f32 --size tiny --workers 2 --frames 8   # smoke run

``--dtypes`` uses the synthetic models of ``qtts make-model`` in $QTTS_CACHE_DIR/models (made
once when missing: ~40 s and 0.6-2 GB each at full size). Memory figures are not timing
figures: other load on the machine does not change them, only slows the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import request_body, start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from service.settings import Settings

GIB = 1024**3
MIB = 1024**2
HEADROOM = 1.15
FIXED_MARGIN = 256 * MIB


@dataclass
class Mem:
    rss: int = 0
    pss: int = 0
    private: int = 0


@dataclass
class Sample:
    front_end: Mem
    workers: list[Mem]

    @property
    def pod_pss(self) -> int:
        return self.front_end.pss + sum(w.pss for w in self.workers)


@dataclass
class Row:
    label: str
    file_bytes: int
    workers: int
    idle: Sample
    peak: Sample
    kind: str
    peak_seen: list[int] = field(default_factory=list)

    @property
    def limit_bytes(self) -> int:
        raw = HEADROOM * self.peak.pod_pss + FIXED_MARGIN
        quarter = GIB // 4
        return math.ceil(raw / quarter) * quarter


def smaps(pid: int) -> Mem:
    vals: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "kB":
                vals[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return Mem(rss=vals.get("Rss", 0), pss=vals.get("Pss", 0),
               private=vals.get("Private_Clean", 0) + vals.get("Private_Dirty", 0))


def worker_pids(url: str) -> list[int]:
    workers = httpx.get(url + "/healthz", timeout=10).json()["workers"]
    pids = [w["pid"] for w in workers if w["pid"] is not None]
    if len(pids) != len(workers):
        raise SystemExit(f"not every worker has a process: {workers}")
    return pids


def sample(front_pid: int, pids: list[int]) -> Sample:
    return Sample(smaps(front_pid), [smaps(p) for p in pids])


def peak_under_load(url: str, front_pid: int, pids: list[int], body: dict, n: int
                    ) -> tuple[Sample, int]:
    """``n`` requests at once; the sample with the largest pod PSS while they run."""
    best = sample(front_pid, pids)
    done = threading.Event()
    ok = [0]

    async def one(http: httpx.AsyncClient) -> None:
        async with http.stream("POST", url + "/tts", json=body) as r:
            await r.aread()
            if r.status_code == 200:
                ok[0] += 1
            else:
                print(f"# request: HTTP {r.status_code}", file=sys.stderr)

    async def all_requests() -> None:
        async with httpx.AsyncClient(timeout=600) as http:
            await asyncio.gather(*(one(http) for _ in range(n)))

    t = threading.Thread(target=lambda: (asyncio.run(all_requests()), done.set()))
    t.start()
    while not done.is_set():
        s = sample(front_pid, pids)
        if s.pod_pss > best.pod_pss:
            best = s
        time.sleep(0.1)
    t.join()
    return best, ok[0]


def synthetic_model(size: str, dtype: str) -> Path:
    cache = Path(os.environ.get("QTTS_CACHE_DIR") or Path.home() / ".cache" / "qtts")
    out = cache.expanduser() / "models" / f"synthetic-{size}-{dtype}-seed0-v2"
    model = out / "model.gguf"
    if not model.exists():
        print(f"# making {model}", file=sys.stderr, flush=True)
        qtts = Path(sys.executable).parent / "qtts"
        subprocess.run([str(qtts), "make-model", str(out), "--size", size, "--dtype", dtype,
                        "--seed", "0", "--no-progress"], check=True)
    return model


def measure(label: str, model: Path, workers: int, threads: int, frames: int,
            max_batch: int) -> Row:
    proc, url = start_server(str(model), workers, threads, queue=workers * max_batch,
                             max_batch=max_batch)
    try:
        time.sleep(2.0)  # let the warm-up's transient buffers go
        pids = worker_pids(url)
        idle = sample(proc.pid, pids)
        body, kind = request_body(url, "auto", frames, {})
        n = workers * max_batch  # every slot busy
        peak, ok = peak_under_load(url, proc.pid, pids, body, n)
        if ok != n:
            raise SystemExit(f"{label}: {n - ok} of {n} requests failed")
    finally:
        stop_server(proc)
    return Row(label, model.stat().st_size, workers, idle, peak, kind)


def gb(n: float) -> str:
    return f"{n / GIB:.2f}"


def table(rows: list[Row]) -> str:
    lines = [
        "| weights | file GiB | workers | front end PSS | per worker RSS | per worker PSS | "
        "per worker private | pod PSS idle | pod PSS peak | limit (formula) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n = len(r.idle.workers)
        mean = Mem(sum(w.rss for w in r.idle.workers) // n, sum(w.pss for w in r.idle.workers)
                   // n, sum(w.private for w in r.idle.workers) // n)
        lines.append(
            f"| {r.label} | {gb(r.file_bytes)} | {r.workers} | {gb(r.idle.front_end.pss)} | "
            f"{gb(mean.rss)} | {gb(mean.pss)} | {gb(mean.private)} | {gb(r.idle.pod_pss)} | "
            f"{gb(r.peak.pod_pss)} | {r.limit_bytes / GIB:.2f}Gi |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", default=[], help="a GGUF to measure (repeat)")
    ap.add_argument("--dtypes", default="", help="synthetic models to measure: f16,q8_0,q4_0")
    ap.add_argument("--size", choices=("full", "tiny"), default="full",
                    help="size of the synthetic models (full)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (2)")
    ap.add_argument("--threads", type=int, default=2, help="threads per worker (2)")
    ap.add_argument("--frames", type=int, default=125,
                    help="audio frames per request of the peak phase (125 = 10 s)")
    default_batch = int(Settings.model_fields["max_batch"].default)
    ap.add_argument("--max-batch", type=int, default=default_batch,
                    help=f"QTTS_MAX_BATCH: requests per worker at the peak ({default_batch}, "
                         "the server's default)")
    ap.add_argument("--json", type=Path, help="also write the raw samples here")
    args = ap.parse_args()
    models = [(Path(m).parent.name or m, Path(m)) for m in args.model]
    models += [(d, synthetic_model(args.size, d)) for d in args.dtypes.split(",") if d]
    if not models:
        ap.error("give --model or --dtypes")
    for _, m in models:
        if not m.is_file():
            ap.error(f"{m}: no such model file")
    rows = []
    for label, model in models:
        print(f"# {label}: {model}", file=sys.stderr, flush=True)
        rows.append(measure(label, model, args.workers, args.threads, args.frames,
                            args.max_batch))
    print(f"workers {args.workers} x threads {args.threads}, QTTS_MAX_BATCH {args.max_batch}, "
          f"peak: {args.max_batch} {rows[0].kind} request(s) of {args.frames} frames per "
          "worker at once; GiB")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([{**asdict(r), "limit_bytes": r.limit_bytes}
                                         for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
