"""The house rules of the layout (docs/architecture.md): the engine reads no environment below
its edge, and no service module grows past what one reader holds in mind."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICE_MODULE_LINES = 400
# the engine's edge: its options are read here, once, and passed down
ENGINE_EDGE = {ROOT / "engine" / "options.py"}


def test_only_the_engine_edge_reads_the_environment() -> None:
    readers = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in sorted((ROOT / "engine").rglob("*.py")) if p not in ENGINE_EDGE
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"os\.environ|getenv", line)
    ]
    assert readers == [], "read the environment in engine/options.py and pass it down"


def test_no_service_module_is_too_long() -> None:
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "service").rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > SERVICE_MODULE_LINES}
    assert long == {}, f"split these modules (over {SERVICE_MODULE_LINES} lines)"
