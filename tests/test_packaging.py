"""The package metadata builds without setuptools deprecation warnings (seen at every install)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_metadata_builds_without_setuptools_deprecations(tmp_path: Path) -> None:
    script = (
        "import sys; from setuptools import build_meta as b; "
        "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))"
    )
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "SetuptoolsDeprecationWarning" not in run.stdout + run.stderr
    dist = tmp_path / run.stdout.strip().splitlines()[-1]
    metadata = (dist / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata
