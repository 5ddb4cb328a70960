"""The JSON log format holds for what Python itself prints: a warning (``warnings.warn``, numpy's
floating-point warnings) is a record, not two raw lines between the server's JSON ones."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.service.helpers import ROOT

PROGRAM = """
import warnings
import numpy as np
from service.logs import setup_logging
setup_logging("json", "info")
warnings.warn("the weights look odd")
np.float32(3e38) * np.float32(10)  # an overflow: numpy's RuntimeWarning
"""


def test_python_warnings_are_json_records() -> None:
    run = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    assert all(line.startswith("{") for line in lines), lines
    records = [json.loads(line) for line in lines]
    said = [r["msg"] for r in records if r["logger"] == "py.warnings"]
    assert len(said) == 2 and all(r["level"] == "warning" for r in records), records
    assert "UserWarning: the weights look odd" in said[0]
    assert "RuntimeWarning: overflow" in said[1]
