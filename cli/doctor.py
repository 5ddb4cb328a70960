"""`qtts doctor`: run a short decode on every backend the build sees and compare with the CPU.

For each backend: how many graph nodes it ran (the rest fell back to the CPU), the largest
difference from the CPU result, NaN/Inf counts, and the time. A backend that cannot be
initialised is listed with its error instead of aborting the report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from engine.backend import BackendSet, list_devices, register_rpc_servers
from engine.decoder import DecoderModel, decode
from engine.errors import QttsError
from engine.gguf_model import open_model
from engine.options import EngineOptions


@dataclass
class DoctorRow:
    """One backend's result."""

    backend: str
    device: str
    nodes_offloaded: int
    nodes_total: int
    max_abs_diff: float
    nan: int
    inf: int
    seconds: float
    error: str = ""


def run_doctor(model_path: str, options: EngineOptions, frames: int = 4,
               precision: str = "exact") -> list[DoctorRow]:
    """Decode ``frames`` seeded random frames on every device; the CPU result is the baseline."""
    model = open_model(model_path)
    model.require("decoder")
    cfg = model.decoder_config
    assert cfg is not None
    codes = np.random.default_rng(0).integers(0, cfg.codebook_size, (cfg.num_quantizers, frames))
    register_rpc_servers(options.rpc_servers)
    rows: list[DoctorRow] = []
    baseline: np.ndarray | None = None
    devices = sorted(list_devices(), key=lambda d: d.backend != "cpu")  # CPU first: baseline
    for dev in devices:
        try:
            bs = BackendSet.from_options(options.replace(backend=dev.backend,
                                                         device=str(dev.index)))
            bs.placement_log = []
            dec = DecoderModel.load(model, bs, precision)  # type: ignore[arg-type]
            started = time.perf_counter()
            audio, _ = decode(dec, codes)
            seconds = time.perf_counter() - started
        except QttsError as exc:
            rows.append(DoctorRow(dev.backend, dev.name, 0, 0, float("nan"), 0, 0, 0.0, str(exc)))
            continue
        if baseline is None:
            baseline = audio
        total = sum(sum(p.nodes_per_backend.values()) for p in bs.placement_log)
        on_cpu = sum(p.nodes_per_backend.get("CPU", 0) for p in bs.placement_log)
        offloaded = 0 if dev.backend == "cpu" else total - on_cpu
        rows.append(DoctorRow(
            dev.backend, dev.name, offloaded, total,
            float(np.abs(np.nan_to_num(audio) - baseline).max()),
            int(np.isnan(audio).sum()), int(np.isinf(audio).sum()), seconds))
        dec.close()
        bs.close()
    return rows


def doctor_table(rows: list[DoctorRow]) -> str:
    """The report as an aligned text table."""
    head = f"{'backend':<8} {'device':<24} {'offloaded':>14} {'max|d| vs cpu':>14} " \
           f"{'nan':>5} {'inf':>5} {'time s':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.error:
            lines.append(f"{r.backend:<8} {r.device:<24} error: {r.error}")
            continue
        lines.append(f"{r.backend:<8} {r.device:<24} {f'{r.nodes_offloaded}/{r.nodes_total}':>14} "
                     f"{r.max_abs_diff:>14.3g} {r.nan:>5} {r.inf:>5} {r.seconds:>8.3f}")
    return "\n".join(lines)
