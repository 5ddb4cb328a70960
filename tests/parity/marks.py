"""What every parity test module carries: the ``parity`` mark, and a skip naming what is missing
when the official reference (torch, transformers, qwen-tts) is not installed (``make test``
installs it, so there the skip fails the session: tests/allowed_skips.py)."""

from __future__ import annotations

import importlib.util

import pytest

MISSING = [m for m in ("torch", "transformers", "qwen_tts") if importlib.util.find_spec(m) is None]
PARITY_MARKS = [
    pytest.mark.parity,
    pytest.mark.skipif(
        bool(MISSING),
        reason=(
            f"PARITY REFERENCE NOT INSTALLED (missing: {', '.join(MISSING)}): run "
            "`make parity-env` (`pip install -e '.[parity]' && pip install --no-deps "
            "qwen-tts==0.1.1`) to run the parity tests"
        ),
    ),
]
