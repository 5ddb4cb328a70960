"""Fast mode's calibration kept on disk: measured once per model file and arithmetic (seconds
on the released size: an exact decode and a fast one per promotion), read back at every later
load of the same file on the same kind of CPU.

A record is one JSON file named by a hash of what the measurement depends on: the model file
(path, size, modification time), the target, and how fast mode computes here (backend, qtts's
conv kernels, BF16 and AMX, Winograd). Anything unreadable or stale is measured again; a folder
that cannot be written only costs the measurement at the next load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from engine.backend import BackendSet
from engine.decoder.precision import CALIBRATION_FRAMES, Calibration, bf16_layers, calibrate
from engine.decoder.weights import native_convs, rounds_to_bf16, winograd_f32
from engine.ggml import custom_ops

log = logging.getLogger(__name__)

# 2: on AMX, the layers kept out of BF16 run as split BF16 products, no longer F32 (records of
# version 1 measured the F32 ones)
VERSION = 2


def arithmetic(backends: BackendSet) -> dict[str, Any]:
    """What decides fast mode's rounding on these backends (the calibration's other input)."""
    native = native_convs(backends)
    return {
        "backend": backends.name,
        "native_convs": native,
        "variant": custom_ops.variant() if native else "",
        "bf16": rounds_to_bf16(backends),
        "amx": native and custom_ops.amx(),
        "winograd_f32": winograd_f32(backends),
        "winograd": backends.options.winograd,
    }


def record_name(model: Any, backends: BackendSet, target_db: float) -> str:
    """The record's file name for this model file, target and arithmetic."""
    st = Path(model.path).stat()
    ident = {
        "version": VERSION, "frames": CALIBRATION_FRAMES, "target_db": target_db,
        "path": str(Path(model.path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
        "arithmetic": arithmetic(backends),
    }  # fmt: skip
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
    return f"decoder-{digest[:32]}.json"


def _read(path: Path, model: Any) -> Calibration | None:
    try:
        rec = json.loads(path.read_text())
        layers = frozenset(str(x) for x in rec["f32_layers"])
        if not layers <= set(bf16_layers(model)):
            return None
        return Calibration(layers, float(rec["snr_db"]), float(rec["target_db"]),
                           int(rec["steps"]), float(rec["seconds"]), float(rec["clipped"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(path: Path, cal: Calibration) -> None:
    rec = {"f32_layers": sorted(cal.f32_layers), "snr_db": cal.snr_db,
           "target_db": cal.target_db, "steps": cal.steps, "seconds": cal.seconds,
           "clipped": cal.clipped}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".calibration.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, path)  # whole or not at all: two workers may measure at once
    except OSError as exc:
        log.warning("cannot keep the decoder's calibration in %s (%s): it is measured again "
                    "at the next start", path.parent, exc)


def calibration_for(model: Any, backends: BackendSet, target_db: float,
                    folder: Path | None) -> tuple[Calibration, bool]:
    """Fast mode's layer set for ``target_db`` on ``model``: the kept record in ``folder`` when
    there is one, else measured (``precision.calibrate``) and kept. Returns it and whether it
    was read back."""
    path = folder / record_name(model, backends, target_db) if folder is not None else None
    if path is not None and path.is_file():
        kept = _read(path, model)
        if kept is not None:
            return kept, True
    cal = calibrate(model, backends, target_db)
    if path is not None:
        _write(path, cal)
    return cal, False
