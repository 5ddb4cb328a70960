#!/usr/bin/env python3
"""Portable build vs native build on this machine: one bench script, run in both, alternating.

The repo's own binding is the native build (``make native``: -march=native). A copy of the
package is bound to the portable build (QTTS_PORTABLE=1: ggml's CPU backend per ISA level, the
best one loaded at run time; qtts's kernels per ISA level behind one dispatch). The given bench
script runs in the native tree, then in the portable copy, ``--rounds`` times, so background load
hits both alike; compare the "qtts" rows of the two (target: the portable build within 5 %).

    python bench/portable.py [--rounds 2] [--variants haswell,sapphirerapids] -- \\
        bench/decoder.py --frames 125 --reps 5
    python bench/portable.py -- bench/talker.py --no-reference --frames 48

--variants is QTTS_CPU_VARIANTS of the portable build ("all": every ggml x86-64 variant, as the
Docker image has them; a long build the first time). On a given CPU ggml loads the same variant
from any subset that holds the best one for it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VARIANTS = "haswell,sapphirerapids"  # the Makefile's native-portable default


def portable_copy(dest: Path, variants: str) -> Path:
    """Copy the package (and the benches with what they import) and build it portable."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "_ggml_cffi.py", "_native.json")
    for name in ("engine", "native", "cli", "service", "bench", "tests"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, dest / name, ignore=ignore)
    env = {**os.environ, "QTTS_PORTABLE": "1", "QTTS_CPU_VARIANTS": variants}
    subprocess.run([sys.executable, str(dest / "native" / "build.py")], env=env, check=True)
    return dest


def run(tree: Path, label: str, bench: list[str]) -> None:
    print(f"\n# ===== {label} build ({tree}) =====", flush=True)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, *_entry(tree), "info"], env=env, check=True, cwd=tree)
    subprocess.run([sys.executable, str(tree / bench[0]), *bench[1:]], env=env, check=True,
                   cwd=tree)


def _entry(tree: Path) -> list[str]:
    return ["-m", "cli"] if (tree / "cli" / "__main__.py").exists() else ["-m", "engine.cli"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="native, portable, native, ...")
    ap.add_argument("--variants", default=os.environ.get("QTTS_CPU_VARIANTS") or DEFAULT_VARIANTS)
    ap.add_argument("bench", nargs=argparse.REMAINDER,
                    help="-- then the bench script (relative to the repo) and its arguments")
    args = ap.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench or not (REPO / bench[0]).is_file():
        ap.error("give the bench script after --, e.g. -- bench/decoder.py --frames 125")
    with tempfile.TemporaryDirectory(prefix="qtts-portable-") as tmp:
        portable = portable_copy(Path(tmp), args.variants)
        for r in range(args.rounds):
            print(f"\n# ---------- round {r + 1} of {args.rounds} ----------", flush=True)
            run(REPO, "native", bench)
            run(portable, "portable", bench)


if __name__ == "__main__":
    main()
