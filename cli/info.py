"""`qtts info`: what the native layer is and what this machine offers it."""

from __future__ import annotations

import os
from typing import Any

from engine.backend import BackendSet, built_backends, list_devices
from engine.errors import BackendError
from engine.ggml import ffi, lib, native_info


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


def info_lines(env: dict[str, str] | None = None) -> list[str]:
    """Human-readable lines: ggml version and options, devices, the chosen backend, threads."""
    info: dict[str, Any] = native_info()
    lines = [
        f"ggml {ffi.string(lib.ggml_version()).decode()} (commit "
        f"{ffi.string(lib.ggml_commit()).decode()}) from {info['ggml_name']}",
        f"  build: {info['prefix']}",
        f"  options: {' '.join(o for o in info['cmake_options'] if not o.startswith('-DCMAKE_'))}",
        f"  backends built: {', '.join(built_backends())}",
        f"  fused qtts kernels: {'yes' if info.get('ops_lib') else 'no'}",
        "devices:",
    ]
    for d in list_devices():
        lines.append(f"  {d.backend}:{d.index}  {d.name}  ({d.description})")
    cpu = [name for name, value in backend_features("CPU") if value == "1"]
    lines.append(f"CPU features: {' '.join(cpu)}")
    e = dict(os.environ) if env is None else env
    try:
        bs = BackendSet.from_env(e)
        chosen = f"{bs.name}:{bs.choice.device.index} ({bs.choice.device.description})"
        lines.append(f"chosen backend: {chosen}  [QTTS_BACKEND={e.get('QTTS_BACKEND', 'auto')}]")
        lines.append(f"threads: {bs.threads}")
        bs.close()
    except BackendError as exc:
        lines.append(f"chosen backend: none: {exc}")
    return lines
