"""The benches' synthetic models, made once and cached in ``$QTTS_CACHE_DIR/models``.

``synthetic-{size}-seed{seed}-v2-checkpoint/`` is the HF-layout checkpoint (``qtts make-model
--keep-checkpoint``), kept because the reference PyTorch model and every weight type are made
from it; ``synthetic-{size}-{dtype}-seed{seed}-v2/model.gguf`` is one GGUF per weight type, the
same file ``qtts make-model --dtype DTYPE`` writes (so ``make run``'s default model is one of
them). Files appear by rename, so an interrupted run leaves nothing half-written behind.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.tools.convert import convert
from engine.tools.make_model import make_checkpoint

# Bumped when make-model's output changes (v2: the real Qwen2 vocabulary, F32 decoder), so a
# cache made by an older version is not taken for the current one.
GENERATION = "v2"


def models_dir() -> Path:
    return Path(os.environ.get("QTTS_CACHE_DIR") or "~/.cache/qtts").expanduser() / "models"


def synthetic_checkpoint(size: str = "full", seed: int = 0) -> Path:
    """The synthetic checkpoint folder (HF layout), made if missing."""
    folder = models_dir() / f"synthetic-{size}-seed{seed}-{GENERATION}-checkpoint"
    if not (folder / "model.safetensors").is_file():
        scratch = folder.with_name(folder.name + ".partial")
        shutil.rmtree(scratch, ignore_errors=True)
        make_checkpoint(scratch, size, seed, progress=False)
        shutil.rmtree(folder, ignore_errors=True)
        scratch.rename(folder)
    return folder


def synthetic_gguf(dtype: str, size: str = "full", seed: int = 0) -> Path:
    """The synthetic model's GGUF at ``dtype``, converted from the checkpoint if missing."""
    path = models_dir() / f"synthetic-{size}-{dtype}-seed{seed}-{GENERATION}" / "model.gguf"
    if not path.is_file():
        ckpt = synthetic_checkpoint(size, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name("model.gguf.partial")
        convert(ckpt, partial, dtype=dtype, progress=False)
        partial.rename(path)
    return path
