"""`qtts doctor`: every backend the build sees decodes the same audio as the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine.backend import built_backends
from tests.engine.rpc import rpc_server


def test_doctor_compares_every_backend_with_the_cpu(stress_gguf: Path) -> None:
    env = dict(os.environ)
    with rpc_server() as endpoint:
        env["QTTS_RPC_SERVERS"] = endpoint
        res = subprocess.run([sys.executable, "-m", "cli", "doctor", "--model",
                              str(stress_gguf), "--frames", "3"], env=env, capture_output=True,
                             text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = {line.split()[0]: line.split() for line in res.stdout.splitlines()[2:]}
    expected = {"cpu", *(b for b in ("blas", "rpc") if b in built_backends())}
    assert set(rows) == expected
    assert rows["cpu"][2].startswith("0/")
    for name, cols in rows.items():
        offloaded, total = map(int, cols[2].split("/"))
        assert total > 100
        # summation order differs between backends (OpenBLAS vs ggml GEMMs); a faulty kernel is
        # off by O(1) on audio in [-1, 1]
        assert float(cols[3]) <= 1e-3, name  # max |diff| vs the CPU
        assert cols[4] == cols[5] == "0"  # no NaN / Inf
        if name == "rpc":
            assert offloaded > total // 2  # the decoder really ran on the second backend
