"""``.qvoice`` files: a cloned voice kept for later (x-vector, reference codes and transcript
ids, the model fingerprint), and the fingerprint itself.

The file is a NumPy ``.npz`` (no pickles): ``meta`` (a JSON string: format version, mode,
fingerprint, transcript), ``x_vector`` [hidden] float32, and in ICL mode ``ref_codes`` [T, 16]
int32 and ``ref_ids`` int32. A voice is only meaningful for the talker it was made with: the
fingerprint hashes the talker config and its F32 tensors (norms), which every conversion of one
checkpoint stores identically whatever ``--dtype`` and ``--parts``, so a voice made with the
Base GGUF works with a lean serving GGUF of the same model and is refused by any other.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import stat
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.clone.prompt import VoicePrompt
from engine.errors import InputError
from engine.gguf_schema import PART_TALKER, Kind, talker_tensor_specs

FORMAT = "qtts-voice"
VERSION = 1
FIELD = "voice_file"
MAX_BYTES = 64 << 20


def model_fingerprint(model: Any) -> str:
    """Hex SHA-256 naming the talker a voice belongs to (module docstring)."""
    model.require(PART_TALKER)
    h = hashlib.sha256(b"qtts-voice-fingerprint-v1\0")
    h.update(json.dumps(dataclasses.asdict(model.talker_config), sort_keys=True).encode())
    h.update(model.tts_model_type.encode() + b"\0")
    for spec in talker_tensor_specs(model.talker_config, model.code_predictor_config):
        if spec.kind is Kind.F32:
            h.update(spec.name.encode() + b"\0")
            h.update(np.ascontiguousarray(model.tensor_f32(spec.name)).tobytes())
    return h.hexdigest()


def dumps(voice: VoicePrompt) -> bytes:
    """``voice`` as the bytes of a ``.qvoice`` file (what ``load`` reads back)."""
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "mode": "icl" if voice.icl else "x_vector",
        "fingerprint": voice.fingerprint,
        "ref_text": voice.ref_text,
    }
    arrays: dict[str, Any] = {
        "meta": np.asarray(json.dumps(meta)),
        "x_vector": np.asarray(voice.x_vector, dtype=np.float32),
    }
    if voice.icl:
        arrays["ref_codes"] = np.asarray(voice.ref_codes, dtype=np.int32)
        arrays["ref_ids"] = np.asarray(voice.ref_ids, dtype=np.int32)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _read_file(p: Path, name: str) -> bytes:
    """The file's bytes, once it is known to be a regular file of a voice file's size (a
    device such as /dev/zero would be read until memory runs out)."""
    st = p.stat()
    if not stat.S_ISREG(st.st_mode):
        raise InputError(FIELD, f"{name}: not a regular file")
    if st.st_size > MAX_BYTES:
        raise InputError(FIELD, f"{name} is {st.st_size} bytes; not a qtts voice file")
    return p.read_bytes()


def _ints(a: npt.NDArray[Any]) -> npt.NDArray[np.int32]:
    if a.dtype.kind not in "iu":
        raise ValueError("not integers")
    # (a cast would wrap 2**32 + 5 to 5, an id that passes every later check)
    if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
        raise ValueError("integers past int32")
    return np.asarray(a, dtype=np.int32)


def load(src: str | os.PathLike[str] | bytes, fingerprint: str | None = None) -> VoicePrompt:
    """Read a voice; with ``fingerprint``, refuse one made for another model."""
    name = "the voice file" if isinstance(src, bytes) else str(src)
    try:
        raw = src if isinstance(src, bytes) else _read_file(Path(src), name)
    except FileNotFoundError:
        raise InputError(FIELD, f"{name}: file not found") from None
    except OSError as exc:
        raise InputError(FIELD, f"{name}: cannot read ({exc.strerror or exc})") from None
    if len(raw) > MAX_BYTES:
        raise InputError(FIELD, f"{name} is {len(raw)} bytes; not a qtts voice file")
    try:
        # the members' unpacked sizes, before numpy unpacks them: a compressed member can hold
        # gigabytes of zeros in a few megabytes (zipfile never reads past a member's stated size)
        with zipfile.ZipFile(io.BytesIO(raw)) as zf:
            unpacked = sum(info.file_size for info in zf.infolist())
        if unpacked > MAX_BYTES:
            raise InputError(FIELD, f"{name} unpacks to {unpacked} bytes; not a qtts voice file")
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            xv = np.asarray(z["x_vector"], dtype=np.float32)
            # (ids are integers as written: float codes were cut to integers silently)
            codes = _ints(z["ref_codes"]) if "ref_codes" in z else None
            ids = _ints(z["ref_ids"]) if "ref_ids" in z else None
    except (OSError, EOFError, ValueError, KeyError, MemoryError, zipfile.BadZipFile,
            json.JSONDecodeError):
        raise InputError(FIELD, f"{name} is not a qtts voice file") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise InputError(FIELD, f"{name} is not a qtts voice file")
    if meta.get("version") != VERSION:
        raise InputError(FIELD, f"{name} has voice-file version {meta.get('version')!r}; "
                         f"this qtts reads version {VERSION}")  # fmt: skip
    if meta.get("mode") not in ("icl", "x_vector") or not isinstance(
            meta.get("fingerprint"), str):
        raise InputError(FIELD, f"{name} is damaged (no mode or model fingerprint)")
    icl = meta.get("mode") == "icl"
    if xv.ndim != 1 or not np.isfinite(xv).all() or (icl and (
            codes is None or ids is None or codes.ndim != 2 or codes.shape[1] != 16
            or codes.shape[0] < 1 or ids.ndim != 1 or ids.size < 1
            or codes.min() < 0 or codes.max() > 2047)):  # fmt: skip
        raise InputError(FIELD, f"{name} is damaged (bad x-vector or reference codes)")
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        theirs = str(meta.get("fingerprint"))[:12]
        raise InputError(FIELD, f"{name} was made for another model (fingerprint {theirs}..., "
                         f"this model is {fingerprint[:12]}...); clone the voice again with "
                         "this model")  # fmt: skip
    return VoicePrompt(
        x_vector=xv,
        ref_codes=codes if icl else None,
        ref_ids=ids if icl else None,
        ref_text=meta.get("ref_text") if isinstance(meta.get("ref_text"), str) else None,
        fingerprint=str(meta.get("fingerprint")),
    )
