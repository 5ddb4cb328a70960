"""The JSON log format holds for what Python itself prints: a warning (``warnings.warn``, numpy's
floating-point warnings) is a record, not two raw lines between the server's JSON ones; so are
the engine's debug lines."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx

from tests.service.helpers import ROOT, log_records

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


def test_the_engines_debug_lines_are_records_in_a_json_log(make_server: Any) -> None:
    """``QTTS_PROFILE`` and ``QTTS_DEBUG_BACKEND`` on a JSON-format server: their lines (a push's
    stage times, a graph's placement) are ``qtts.debug`` records, not raw lines that break the
    log for its reader."""
    server = make_server(log_format="json", profile=1, debug_backend=1)
    r = httpx.post(server.url + "/tts", timeout=60,
                   json={"text": "Hello there.", "voice": "ryan", "format": "pcm"})
    assert r.status_code == 200, r.text
    said = [rec["msg"] for rec in log_records(server) if rec["logger"] == "qtts.debug"]
    assert any(m.startswith("[qtts profile] push ") for m in said), said[:5]
    assert any(m.startswith("[qtts backend] nodes: CPU=") for m in said), said[:5]
