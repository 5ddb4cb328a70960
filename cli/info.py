"""`qtts info`: what the native layer is and what this machine offers it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.backend import BackendSet, built_backends, list_devices
from engine.errors import BackendError
from engine.ggml import custom_ops, ffi, lib, native_info
from engine.ggml.native import loaded_from
from engine.options import EngineOptions


def backend_features(reg_name: str) -> list[tuple[str, str]]:
    """The (name, value) features a backend registry reports (e.g. CPU ISA extensions)."""
    reg = lib.ggml_backend_reg_by_name(reg_name.encode())
    if reg == ffi.NULL:
        return []
    fn = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_get_features")
    if fn == ffi.NULL:
        return []
    feats = ffi.cast("ggml_backend_get_features_t", fn)(reg)
    out: list[tuple[str, str]] = []
    i = 0
    while feats[i].name != ffi.NULL:
        out.append((ffi.string(feats[i].name).decode(), ffi.string(feats[i].value).decode()))
        i += 1
    return out


def flavour(info: dict[str, Any]) -> str:
    """Which of native/build.py's two builds this is, in words."""
    if info.get("portable"):
        cpu = info.get("cpu_variants", "all")
        names = cpu if isinstance(cpu, str) else ", ".join(cpu)
        return (f"portable (QTTS_PORTABLE=1; ggml CPU variants: {names}; the best variant this "
                "CPU runs is chosen at load)")
    return "native (-march=native: only for CPUs with the build machine's instruction sets)"


def cpu_backend_file() -> str | None:
    """The file ggml's CPU backend was loaded from: in the portable build, the variant ggml
    chose for this CPU (libggml-cpu-haswell.so, ...)."""
    reg = lib.ggml_backend_reg_by_name(b"CPU")
    if reg == ffi.NULL:
        return None
    path = loaded_from(reg)
    return None if path is None else Path(path).name


def kernel_lines() -> list[str]:
    """The qtts kernels' variant and what each op runs in it."""
    if not custom_ops.available():
        return ["qtts kernels: not built (stock ggml ops only)"]
    lines = [f"qtts kernels: {custom_ops.variant()} "
             f"(built: {', '.join(custom_ops.variants())})"]
    for op, path in custom_ops.kernel_paths().items():
        lines.append(f"  {op}: {path}")
    return lines


def info_lines(options: EngineOptions) -> list[str]:
    """Human-readable lines: ggml version and options, devices, the chosen backend, threads."""
    info: dict[str, Any] = native_info()
    lines = [
        f"ggml {ffi.string(lib.ggml_version()).decode()} (commit "
        f"{ffi.string(lib.ggml_commit()).decode()}) from {info['ggml_name']}",
        f"  build: {info['prefix']}",
        f"  options: {' '.join(o for o in info['cmake_options'] if not o.startswith('-DCMAKE_'))}",
        f"  backends built: {', '.join(built_backends())}",
        f"  flavour: {flavour(info)}",
        "devices:",
    ]
    for d in list_devices():
        lines.append(f"  {d.backend}:{d.index}  {d.name}  ({d.description})")
    lines.append(f"CPU backend: {cpu_backend_file() or 'unknown'}")
    cpu = [name for name, value in backend_features("CPU") if value == "1"]
    lines.append(f"CPU features: {' '.join(cpu)}")
    if custom_ops.available():
        custom_ops.set_amx(options.amx)  # QTTS_AMX, as a decoder load applies it
    lines += kernel_lines()
    try:
        bs = BackendSet.from_options(options)
        chosen = f"{bs.name}:{bs.choice.device.index} ({bs.choice.device.description})"
        lines.append(f"chosen backend: {chosen}  [QTTS_BACKEND={options.backend}]")
        lines.append(f"threads: {bs.threads}")
        bs.close()
    except BackendError as exc:
        lines.append(f"chosen backend: none: {exc}")
    return lines


def decoder_precision_lines(model_path: str, target_db: float,
                            options: EngineOptions | None = None) -> list[str]:
    """`qtts info --model`: what fast mode measures on this model's decoder, against exact mode,
    and which layers the calibration keeps in F32 to hold ``target_db``."""
    from engine.decoder.precision import CALIBRATION_FRAMES, calibrate, default_f32
    from engine.gguf_model import open_model

    model = open_model(model_path)
    try:
        model.require("decoder")
        bs = BackendSet.from_options(options)
        try:
            default = default_f32(model)
            cal = calibrate(model, bs, target_db)
        finally:
            bs.close()
    finally:
        model.close()
    extra = sorted(cal.f32_layers - default)
    return [
        f"decoder fast mode ({model_path}): SNR {cal.snr_db:.1f} dB against exact mode on "
        f"{CALIBRATION_FRAMES} frames of random codes (target {target_db:g}: "
        f"{'met' if cal.met else 'NOT met'}; measured in {cal.seconds:.1f} s)",
        f"  layers kept in F32: {len(cal.f32_layers)} ({len(default)} by default"
        + (f"; calibration adds {', '.join(extra)}" if extra else "") + ")",
    ]
