"""``qtts convert``: a released Qwen3-TTS checkpoint folder -> one qtts GGUF file.

Input layouts (docs/architecture.md, The model file):

* a full model folder (``config.json`` with ``model_type = "qwen3_tts"``): the talker and code
  predictor come from ``model.safetensors``, the decoder from ``speech_tokenizer/``, the text
  tokenizer from ``vocab.json`` / ``merges.txt`` / ``tokenizer_config.json``, sampling defaults from
  ``generation_config.json``;
* a speech-tokenizer folder on its own (``model_type = "qwen3_tts_tokenizer_12hz"``): a
  decoder-only GGUF (usable for ``qtts decode`` and ``codes`` requests, not for text).

Either ``model.safetensors`` may be shards with ``model.safetensors.index.json`` instead
(``CheckpointTensors``).

Voice cloning needs two more parts, kept by default for Base checkpoints (``tts_model_type =
"base"``): ``speaker_encoder`` (``speaker_encoder.*``, ECAPA-TDNN) and ``codec_encoder`` (the Mimi
``encoder.*`` tensors of ``speech_tokenizer/``, its first 16 codebooks). ``--parts`` leaves them
out of a serving GGUF that only speaks stored voices; other checkpoints skip them.

Conversion streams tensor by tensor in row chunks (peak memory ~ one chunk, not the model);
safetensors are parsed here (F32, F16 and BF16 payloads) with plain file reads.

Precision policy (see ``engine.gguf_schema``): 1-D tensors, codebooks, norms, biases, snake
parameters and layer scales stay F32; embeddings follow ``--dtype`` but never below F16; other
talker weights follow ``--dtype``; decoder weights follow ``--decoder-dtype``, F32 unless asked
(the decoder's rounding errors are amplified by its snakes: BF16 decoder weights leave ~30 dB
of waveform SNR on O(1) weights, see docs/performance.md; fast mode rounds the layers it runs in
BF16 at load anyway, so F32 costs only file size); a quantised type that does not fit a
tensor's row length falls back to F16 for that tensor and is reported.

Documented error of a stored type against the F32 source (``max_abs_error``):

* F32: exact.   F16: ``|e| <= 2^-11 |x| + 2^-24``.   BF16: ``|e| <= 2^-8 |x|``.
* Q8_0: per 32-value block, ``|e| <= max|block| / 127``.
* Q4_0: per 32-value block, ``|e| <= max|block| / 8``  (the clamp of the top level).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES

from engine.codec_encoder.schema import (
    CODEC_ENCODER_KEYS,
    CodecEncoderConfig,
    codec_encoder_tensor_specs,
    parse_codec_encoder_config,
    skipped_encoder_tensor,
)
from engine.dtypes import (
    BF16_EXPONENT,
    F16_EXPONENT,
    bf16_to_f32,
    block_scales,
    f32_to_bf16,
    finite_bits,
    finite_f32,
)
from engine.errors import ConversionError
from engine.gguf_schema import (
    ALL_PARTS,
    ARCH,
    CODE_PREDICTOR_KEYS,
    DECODER_KEYS,
    DECODER_SKIPPED_HF,
    ENCODER_HF_PREFIX,
    FORMAT_VERSION,
    GENERATION_KEYS,
    GGML_BF16,
    GGML_F16,
    GGML_F32,
    GGML_Q4_0,
    GGML_Q8_0,
    GGML_TYPE_NAMES,
    PART_CODEC_ENCODER,
    PART_DECODER,
    PART_SPEAKER,
    PART_TALKER,
    QUANT_BLOCK,
    SPEAKER_ENCODER_HF_PREFIX,
    SPECIAL_KEYS,
    TALKER_KEYS,
    CodePredictorConfig,
    DecoderConfig,
    GenerationDefaults,
    Keys,
    KeySpec,
    Kind,
    SchemaError,
    SpecialIds,
    TalkerConfig,
    TensorSpec,
    Voices,
    VType,
    check_decoder_config,
    check_generation,
    check_talker_config,
    decoder_tensor_specs,
    talker_tensor_specs,
)
from engine.speaker.schema import (
    SPEAKER_KEYS,
    SpeakerEncoderConfig,
    check_speaker_config,
    parse_speaker_config,
    speaker_tensor_specs,
)
from engine.tokenizer_gguf import TokenizerData, read_hf_tokenizer, tokenizer_kv

log = logging.getLogger("qtts.convert")

DTYPES: dict[str, int] = {
    "f32": GGML_F32,
    "f16": GGML_F16,
    "bf16": GGML_BF16,
    "q8_0": GGML_Q8_0,
    "q4_0": GGML_Q4_0,
}
# llama.cpp general.file_type values for the "mostly X" of each --dtype
_FILE_TYPE = {GGML_F32: 0, GGML_F16: 1, GGML_Q4_0: 2, GGML_Q8_0: 7, GGML_BF16: 32}

TOKENIZER_MODEL_TYPE = "qwen3_tts_tokenizer_12hz"
TTS_MODEL_TYPE = "qwen3_tts"
SYNTHETIC_MARKER = "qtts_synthetic"  # config.json field written by `qtts make-model`

CHUNK_ELEMS = 4 << 20  # elements per conversion chunk (16 MiB of f32)


# ---------------------------------------------------------------------------------------------
# Error bounds of the stored types
# ---------------------------------------------------------------------------------------------


def max_abs_error(ggml_type: int, x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Per-element bound on ``|stored - x|`` for type ``ggml_type`` (see module docstring)."""
    a = np.abs(x.astype(np.float32))
    if ggml_type == GGML_F32:
        return np.zeros_like(a)
    if ggml_type == GGML_F16:
        return a * np.float32(2.0**-11) + np.float32(2.0**-24)
    if ggml_type == GGML_BF16:
        return a * np.float32(2.0**-8)
    if ggml_type in (GGML_Q8_0, GGML_Q4_0):
        blocks = a.reshape(-1, QUANT_BLOCK)
        amax = blocks.max(axis=1, keepdims=True)
        div = 127.0 if ggml_type == GGML_Q8_0 else 8.0
        # the f16-rounded block scale adds at most 2^-10 relative
        bound = amax * np.float32((1.0 + 2.0**-10) / div) + np.float32(1e-12)
        return np.broadcast_to(bound, blocks.shape).reshape(a.shape)
    raise ValueError(f"no error bound for ggml type {ggml_type}")


# ---------------------------------------------------------------------------------------------
# safetensors: a streaming reader and writer (no torch, no safetensors package)
# ---------------------------------------------------------------------------------------------

_ST_DTYPES: dict[str, tuple[str, int]] = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2)}
_ST_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
_MAX_ST_HEADER = 256 << 20


@dataclass(frozen=True)
class StEntry:
    """One tensor of a safetensors file: dtype string, shape, absolute byte range."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """Header of a safetensors file plus chunked reads as float32. Raises ``ConversionError``."""

    def __init__(self, path: Path, display: str | None = None) -> None:
        self.path = path
        self.display = display or str(path)
        try:
            size = path.stat().st_size
            with path.open("rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise self._err("file is too short to be a safetensors file")
                (n,) = struct.unpack("<Q", head)
                if n > _MAX_ST_HEADER or 8 + n > size:
                    raise self._err(f"header length {n} does not fit the file ({size} bytes)")
                raw = f.read(n)
        except FileNotFoundError:
            raise self._err("file is missing") from None
        except OSError as exc:
            raise self._err(f"cannot read ({exc.strerror or exc})") from None
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise self._err("header is not valid JSON") from None
        if not isinstance(header, dict):
            raise self._err("header is not a JSON object")
        start = 8 + n
        self.entries: dict[str, StEntry] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if not isinstance(info, dict):
                raise self._err(f"header entry {name!r} is not an object")
            dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
            if (
                not isinstance(dtype, str)
                or not isinstance(shape, list)
                or not all(isinstance(s, int) and s >= 0 for s in shape)
                or not isinstance(offs, list)
                or len(offs) != 2
                or not all(isinstance(o, int) for o in offs)
            ):
                raise self._err(f"header entry {name!r} is malformed")
            b, e = start + offs[0], start + offs[1]
            if not start <= b <= e <= size:
                raise self._err(f"tensor {name} data lies outside the file")
            item = _ST_ITEMSIZE.get(dtype)
            if item is not None and e - b != math.prod(shape) * item:
                raise self._err(
                    f"tensor {name} has {e - b} bytes, expected {math.prod(shape) * item} "
                    f"for {dtype} {shape}"
                )
            self.entries[name] = StEntry(dtype, tuple(shape), b, e)

    def _err(self, problem: str) -> ConversionError:
        return ConversionError(self.display, problem)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        """Tensor names in file order of the header."""
        return list(self.entries)

    def read_f32(self, name: str, start: int, count: int) -> npt.NDArray[np.float32]:
        """``count`` elements from flat index ``start`` of tensor ``name``, as float32."""
        e = self.entries[name]
        if e.dtype not in _ST_DTYPES:
            raise self._err(f"tensor {name} has dtype {e.dtype}; only F32, F16, BF16 are read")
        np_dtype, item = _ST_DTYPES[e.dtype]
        raw = self._read(e.begin + start * item, count, np_dtype)
        if e.dtype == "BF16":
            return bf16_to_f32(raw.astype(np.uint16, copy=False))
        return raw.astype(np.float32, copy=False)

    def read_bf16_bits(self, name: str, start: int, count: int) -> npt.NDArray[np.uint16]:
        """Raw bf16 bit patterns (tensor must be BF16)."""
        e = self.entries[name]
        raw = self._read(e.begin + start * 2, count, "<u2")
        return raw.astype(np.uint16, copy=False)

    def _read(self, offset: int, count: int, np_dtype: str) -> npt.NDArray[Any]:
        try:
            with self.path.open("rb") as f:
                arr = np.fromfile(f, dtype=np.dtype(np_dtype), count=count, offset=offset)
        except OSError as exc:
            raise self._err(f"cannot read ({exc.strerror or exc})") from None
        if arr.size != count:
            raise self._err("file ends early (truncated?)")
        return arr


SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class CheckpointTensors:
    """A folder's tensors: ``model.safetensors``, or else the shards that
    ``model.safetensors.index.json`` lists (``save_pretrained`` with a ``max_shard_size`` below
    the model's size, as fine-tuning scripts and F32 saves of the 1.7B model do). The single
    file wins when both are there, as in ``transformers``. Raises ``ConversionError``."""

    def __init__(self, folder: Path, label: str = "") -> None:
        single, index = folder / SAFETENSORS_FILE, folder / SAFETENSORS_INDEX
        weight_map: dict[str, str] = {}
        if single.is_file() or not index.is_file():
            self.display = f"{label}{SAFETENSORS_FILE}"
            files = [SafetensorsFile(single, self.display)]
        else:
            self.display = f"{label}{SAFETENSORS_INDEX}"
            weight_map = self._weight_map(index)
            files = [SafetensorsFile(folder / shard, f"{label}{shard}")
                     for shard in dict.fromkeys(weight_map.values())]
        self._file_of: dict[str, SafetensorsFile] = {}
        for st in files:
            for name in st.names():
                other = self._file_of.setdefault(name, st)
                if other is not st:
                    raise ConversionError(
                        self.display, f"tensor {name} is in both {other.display} and {st.display}")
        # with shards: every tensor where the index says it is, none that it leaves out
        for name, shard in weight_map.items():
            held = self._file_of.get(name)
            if held is None or held.display != f"{label}{shard}":
                raise ConversionError(self.display, f"tensor {name} is not in {shard}")
        if weight_map and len(weight_map) != len(self._file_of):
            name = next(n for n in self._file_of if n not in weight_map)
            raise ConversionError(self._file_of[name].display,
                                  f"tensor {name} is not in {SAFETENSORS_INDEX}")

    def _weight_map(self, index: Path) -> dict[str, str]:
        weight_map = _load_json(index, self.display).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ConversionError(self.display, "weight_map is missing, empty or not names "
                                  "to file names")
        for shard in weight_map.values():
            # a file beside the index, never a path that leads elsewhere
            if Path(shard).name != shard or shard.startswith(".") or "\\" in shard:
                raise ConversionError(self.display, f"shard {shard!r} is not a file name")
        return weight_map

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def names(self) -> list[str]:
        """Tensor names, file by file in header order."""
        return list(self._file_of)

    def file_of(self, name: str) -> SafetensorsFile | None:
        """The file holding tensor ``name``."""
        return self._file_of.get(name)

    def display_of(self, name: str) -> str:
        """The file an error about tensor ``name`` names: its own, else the checkpoint's."""
        st = self._file_of.get(name)
        return self.display if st is None else st.display


class SafetensorsWriter:
    """Streaming safetensors writer: declare all tensors, then write their data in order."""

    def __init__(self, path: Path, tensors: Sequence[tuple[str, str, Sequence[int]]]) -> None:
        """``tensors``: ``(name, dtype, shape)`` in write order; dtype F32, F16 or BF16."""
        self.path = path
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        self._order: list[tuple[str, int]] = []
        off = 0
        for name, dtype, shape in tensors:
            nbytes = math.prod(shape) * _ST_DTYPES[dtype][1]
            header[name] = {
                "dtype": dtype,
                "shape": list(shape),
                "data_offsets": [off, off + nbytes],
            }
            self._order.append((name, nbytes))
            off += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self._f: IO[bytes] = path.open("wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._i = 0
        self._left = self._order[0][1] if self._order else 0

    def write(self, data: npt.NDArray[Any]) -> None:
        """Append the next bytes of the current tensor (any number of chunks per tensor)."""
        buf = np.ascontiguousarray(data)
        self._skip_empty()
        if self._i >= len(self._order) or buf.nbytes > self._left:
            raise ValueError("chunk overruns the declared tensor data")
        self._f.write(buf.data)
        self._left -= buf.nbytes
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self._i < len(self._order) and self._left == 0:
            self._i += 1
            self._left = self._order[self._i][1] if self._i < len(self._order) else 0

    def close(self) -> None:
        """Finish the file; raises if some declared data was not written."""
        self._f.close()
        self._skip_empty()
        if self._i < len(self._order):
            raise ValueError(f"tensor {self._order[self._i][0]} was not fully written")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Finish the file, or remove it when the writing failed. With an error in flight (a
        full disk, Ctrl-C) the file is incomplete: checking it would raise a ValueError in
        place of that error, which is the one to report."""
        if exc_type is not None:
            self._discard()
            return
        try:
            self.close()
        except BaseException:  # (the last bytes did not reach the disk: no file either)
            self._discard()
            raise

    def _discard(self) -> None:
        """Close and remove the unfinished file; raises nothing over the error that ends it."""
        with contextlib.suppress(OSError):
            self._f.close()  # (flushing to a full disk fails again)
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# HF config parsing
# ---------------------------------------------------------------------------------------------

_MISSING = object()


def _load_json(path: Path, display: str) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConversionError(display, "file is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConversionError(display, f"is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ConversionError(display, "is not a JSON object")
    return obj


def _get_int(d: dict[str, Any], key: str, where: str, default: Any = _MISSING) -> int:
    v = d.get(key, _MISSING)
    if v is _MISSING or v is None:
        if default is _MISSING:
            raise SchemaError(f"{where}{key} is missing")
        return int(default)
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise SchemaError(f"{where}{key} = {v!r} is not an integer")
    return v


def _get_float(d: dict[str, Any], key: str, where: str, default: Any = _MISSING) -> float:
    v = d.get(key, _MISSING)
    if v is _MISSING or v is None:
        if default is _MISSING:
            raise SchemaError(f"{where}{key} is missing")
        return float(default)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise SchemaError(f"{where}{key} = {v!r} is not a number")
    return float(v)


def _get_bool(d: dict[str, Any], key: str, where: str, default: Any = _MISSING) -> bool:
    v = d.get(key, _MISSING)
    if v is _MISSING or v is None:
        if default is _MISSING:
            raise SchemaError(f"{where}{key} is missing")
        return bool(default)
    if not isinstance(v, bool):
        raise SchemaError(f"{where}{key} = {v!r} is not true/false")
    return v


def _get_int_list(d: dict[str, Any], key: str, where: str) -> tuple[int, ...]:
    v = d.get(key)
    if v is None:
        raise SchemaError(f"{where}{key} is missing")
    if not isinstance(v, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in v
    ):
        raise SchemaError(f"{where}{key} = {v!r} is not a list of integers")
    return tuple(v)


def _get_dict(d: dict[str, Any], key: str, where: str, required: bool = True) -> dict[str, Any]:
    v = d.get(key)
    if v is None:
        if required:
            raise SchemaError(f"{where}{key} is missing")
        return {}
    if not isinstance(v, dict):
        raise SchemaError(f"{where}{key} is not an object")
    return v


def _expect(d: dict[str, Any], key: str, where: str, allowed: Iterable[Any]) -> None:
    if key in d and d[key] not in tuple(allowed):
        raise SchemaError(f"{where}{key} = {d[key]!r} is not supported")


def parse_decoder_config(top: dict[str, Any]) -> DecoderConfig:
    """``DecoderConfig`` from a speech-tokenizer ``config.json`` (raises ``SchemaError``)."""
    dc = _get_dict(top, "decoder_config", "")
    w = "decoder_config."
    _expect(dc, "hidden_act", w, ["silu"])
    _expect(dc, "attention_bias", w, [False])
    cfg = DecoderConfig(
        codebook_size=_get_int(dc, "codebook_size", w),
        codebook_dim=_get_int(dc, "codebook_dim", w),
        num_quantizers=_get_int(dc, "num_quantizers", w),
        num_semantic_quantizers=_get_int(dc, "num_semantic_quantizers", w, 1),
        latent_dim=_get_int(dc, "latent_dim", w),
        hidden_size=_get_int(dc, "hidden_size", w),
        num_hidden_layers=_get_int(dc, "num_hidden_layers", w),
        num_attention_heads=_get_int(dc, "num_attention_heads", w),
        num_key_value_heads=_get_int(dc, "num_key_value_heads", w),
        head_dim=_get_int(dc, "head_dim", w),
        intermediate_size=_get_int(dc, "intermediate_size", w),
        sliding_window=_get_int(dc, "sliding_window", w),
        rope_theta=_get_float(dc, "rope_theta", w, 10000.0),
        max_position_embeddings=_get_int(dc, "max_position_embeddings", w, 8000),
        rms_norm_eps=_get_float(dc, "rms_norm_eps", w, 1e-5),
        layer_norm_eps=1e-6,
        codebook_eps=1e-5,
        decoder_dim=_get_int(dc, "decoder_dim", w),
        upsample_rates=_get_int_list(dc, "upsample_rates", w),
        upsampling_ratios=_get_int_list(dc, "upsampling_ratios", w),
        sample_rate=_get_int(top, "output_sample_rate", "", 24000),
        upsample_total=_get_int(top, "decode_upsample_rate", "", 1920),
    )
    check_decoder_config(cfg)
    return cfg


def _codec_id(v: Any, where: str) -> int:
    if isinstance(v, list) and len(v) == 1:
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int):
        raise SchemaError(f"{where} = {v!r} is not an id")
    return v


def _lower_unique(table: dict[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in table.items():
        lk = k.lower()
        if lk in out:
            raise SchemaError(f"{where} names {k!r} twice (names are matched lower-cased)")
        out[lk] = v
    return out


def parse_talker_config(
    root: dict[str, Any], has_mtp_tensor: bool
) -> tuple[TalkerConfig, CodePredictorConfig, SpecialIds, Voices]:
    """Talker, code-predictor, special ids and voices from a root ``config.json``.

    Defaults are those of the reference config classes; fields without a code default are
    required. Raises ``SchemaError``.
    """
    tc = _get_dict(root, "talker_config", "")
    w = "talker_config."
    _expect(tc, "hidden_act", w, ["silu"])
    _expect(tc, "attention_bias", w, [False])
    rope = _get_dict(tc, "rope_scaling", w)
    hidden = _get_int(tc, "hidden_size", w, 1024)
    heads = _get_int(tc, "num_attention_heads", w, 16)
    talker = TalkerConfig(
        vocab_size=_get_int(tc, "vocab_size", w, 3072),
        hidden_size=hidden,
        intermediate_size=_get_int(tc, "intermediate_size", w, 2048),
        num_hidden_layers=_get_int(tc, "num_hidden_layers", w, 20),
        num_attention_heads=heads,
        num_key_value_heads=_get_int(tc, "num_key_value_heads", w, 2),
        head_dim=_get_int(tc, "head_dim", w, hidden // max(heads, 1)),
        rms_norm_eps=_get_float(tc, "rms_norm_eps", w, 1e-6),
        rope_theta=_get_float(tc, "rope_theta", w, 10000.0),
        max_position_embeddings=_get_int(tc, "max_position_embeddings", w, 32768),
        num_code_groups=_get_int(tc, "num_code_groups", w, 32),
        text_hidden_size=_get_int(tc, "text_hidden_size", w, 2048),
        text_vocab_size=_get_int(tc, "text_vocab_size", w),
        mrope_section=_get_int_list(rope, "mrope_section", w + "rope_scaling."),
        mrope_interleaved=_get_bool(rope, "interleaved", w + "rope_scaling."),
        codec_eos_token_id=_get_int(tc, "codec_eos_token_id", w, 4198),
        codec_think_id=_get_int(tc, "codec_think_id", w, 4202),
        codec_nothink_id=_get_int(tc, "codec_nothink_id", w, 4203),
        codec_think_bos_id=_get_int(tc, "codec_think_bos_id", w, 4204),
        codec_think_eos_id=_get_int(tc, "codec_think_eos_id", w, 4205),
        codec_pad_id=_get_int(tc, "codec_pad_id", w, 4196),
        codec_bos_id=_get_int(tc, "codec_bos_id", w, 4197),
    )
    cpc = _get_dict(tc, "code_predictor_config", w)
    wc = "code_predictor_config."
    _expect(cpc, "hidden_act", wc, ["silu"])
    _expect(cpc, "attention_bias", wc, [False])
    cp_hidden = _get_int(cpc, "hidden_size", wc, 1024)
    cp = CodePredictorConfig(
        vocab_size=_get_int(cpc, "vocab_size", wc, 2048),
        hidden_size=cp_hidden,
        intermediate_size=_get_int(cpc, "intermediate_size", wc, 3072),
        num_hidden_layers=_get_int(cpc, "num_hidden_layers", wc, 5),
        num_attention_heads=_get_int(cpc, "num_attention_heads", wc, 16),
        num_key_value_heads=_get_int(cpc, "num_key_value_heads", wc, 8),
        head_dim=_get_int(cpc, "head_dim", wc, 128),
        rms_norm_eps=_get_float(cpc, "rms_norm_eps", wc, 1e-6),
        rope_theta=_get_float(cpc, "rope_theta", wc, 10000.0),
        max_position_embeddings=_get_int(cpc, "max_position_embeddings", wc, 32768),
        num_code_groups=_get_int(cpc, "num_code_groups", wc, 32),
        has_mtp_projection=has_mtp_tensor or cp_hidden != hidden,
    )
    special = SpecialIds(
        im_start_token_id=_get_int(root, "im_start_token_id", "", 151644),
        im_end_token_id=_get_int(root, "im_end_token_id", "", 151645),
        tts_pad_token_id=_get_int(root, "tts_pad_token_id", "", 151671),
        tts_bos_token_id=_get_int(root, "tts_bos_token_id", "", 151672),
        tts_eos_token_id=_get_int(root, "tts_eos_token_id", "", 151673),
    )
    langs_raw = _lower_unique(_get_dict(tc, "codec_language_id", w), w + "codec_language_id")
    spk_raw = _lower_unique(_get_dict(tc, "spk_id", w, required=False), w + "spk_id")
    dia_raw = _lower_unique(
        _get_dict(tc, "spk_is_dialect", w, required=False), w + "spk_is_dialect"
    )
    languages = {k: _codec_id(v, f"{w}codec_language_id[{k!r}]") for k, v in langs_raw.items()}
    speakers = {k: _codec_id(v, f"{w}spk_id[{k!r}]") for k, v in spk_raw.items()}
    dialects: dict[str, str] = {}
    for k, v in dia_raw.items():
        if v is False or v is None:
            continue
        if not isinstance(v, str):
            raise SchemaError(f"{w}spk_is_dialect[{k!r}] = {v!r} is neither false nor a name")
        dialects[k] = v.lower()
    voices = Voices(speakers=speakers, languages=languages, dialects=dialects)
    return talker, cp, special, voices


def parse_generation_config(g: dict[str, Any]) -> GenerationDefaults:
    """Sampling defaults from ``generation_config.json`` (absent keys keep spec defaults)."""
    d = GenerationDefaults()
    w = "generation_config."
    out = GenerationDefaults(
        do_sample=_get_bool(g, "do_sample", w, d.do_sample),
        temperature=_get_float(g, "temperature", w, d.temperature),
        top_k=_get_int(g, "top_k", w, d.top_k),
        top_p=_get_float(g, "top_p", w, d.top_p),
        repetition_penalty=_get_float(g, "repetition_penalty", w, d.repetition_penalty),
        min_new_tokens=_get_int(g, "min_new_tokens", w, d.min_new_tokens),
        max_new_tokens=_get_int(g, "max_new_tokens", w, d.max_new_tokens),
        subtalker_dosample=_get_bool(g, "subtalker_dosample", w, d.subtalker_dosample),
        subtalker_temperature=_get_float(g, "subtalker_temperature", w, d.subtalker_temperature),
        subtalker_top_k=_get_int(g, "subtalker_top_k", w, d.subtalker_top_k),
        subtalker_top_p=_get_float(g, "subtalker_top_p", w, d.subtalker_top_p),
    )
    check_generation(out)
    return out


# ---------------------------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------------------------


@dataclass
class ConversionReport:
    """What ``convert`` did: output, parts, sizes, per-tensor fallbacks and skip notes."""

    out_path: Path
    parts: tuple[str, ...]
    dtype: str
    n_tensors: int = 0
    n_bytes: int = 0
    file_size: int = 0
    seconds: float = 0.0
    synthetic: bool = False
    fallbacks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    type_counts: dict[str, int] = field(default_factory=dict)

    def summary_lines(self) -> list[str]:
        """Human-readable report lines (the CLI prints these)."""
        lines = list(self.notes)
        if self.fallbacks:
            shown = ", ".join(f.split(":")[0] for f in self.fallbacks[:4])
            more = f", ... (+{len(self.fallbacks) - 4})" if len(self.fallbacks) > 4 else ""
            lines.append(
                f"{len(self.fallbacks)} tensors kept at F16 instead of {self.dtype.upper()} "
                f"(row length not a multiple of {QUANT_BLOCK}): {shown}{more}"
            )
        types = ", ".join(f"{k} {v}" for k, v in sorted(self.type_counts.items()))
        lines.append(
            f"wrote {self.out_path} ({self.file_size / 1e6:.1f} MB, {self.n_tensors} tensors: "
            f"{types}; parts: {','.join(self.parts)}) in {self.seconds:.1f} s"
        )
        if self.synthetic:
            lines.append("note: synthetic random-weight model: its audio is noise, not speech")
        return lines


@dataclass
class _Planned:
    spec: TensorSpec
    src: SafetensorsFile
    ggml_type: int
    nbytes: int


@dataclass
class _Source:
    """Everything read from the checkpoint folder before writing."""

    parts: tuple[str, ...]
    decoder: DecoderConfig | None = None
    codec_encoder: CodecEncoderConfig | None = None
    speaker: SpeakerEncoderConfig | None = None
    talker: TalkerConfig | None = None
    cp: CodePredictorConfig | None = None
    special: SpecialIds | None = None
    voices: Voices | None = None
    generation: GenerationDefaults | None = None
    tokenizer: TokenizerData | None = None
    tts_model_type: str = ""
    tts_model_size: str = ""
    synthetic: bool = False
    tensors: list[tuple[TensorSpec, SafetensorsFile]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _parse_parts(parts: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if parts is None:
        return None
    items = [p.strip() for p in (parts.split(",") if isinstance(parts, str) else parts)]
    items = [p for p in items if p]
    bad = [p for p in items if p not in ALL_PARTS]
    if bad or not items:
        raise ConversionError(
            "--parts",
            f"{','.join(bad) or '(empty)'} is not a part (choose from {','.join(ALL_PARTS)})",
        )
    return tuple(p for p in ALL_PARTS if p in items)


def _match_tensors(
    ck: CheckpointTensors, specs: Sequence[TensorSpec], skip: Callable[[str], bool]
) -> list[tuple[TensorSpec, SafetensorsFile]]:
    """Check the files hold exactly ``specs`` (plus skippable names) with the right shapes;
    each spec with the file that holds it."""
    want = {s.hf_name: s for s in specs}
    for name in ck.names():
        if name not in want and not skip(name):
            raise ConversionError(
                ck.display_of(name),
                f"unexpected tensor {name} (not in the Qwen3-TTS layout for this config)",
            )
    out = []
    for s in specs:
        st = ck.file_of(s.hf_name)
        if st is None:
            raise ConversionError(ck.display_of(s.hf_name), f"tensor {s.hf_name} is missing")
        e = st.entries[s.hf_name]
        if e.shape != s.hf_shape:
            raise ConversionError(
                st.display,
                f"tensor {s.hf_name} has shape {list(e.shape)}, expected {list(s.hf_shape)}",
            )
        if e.dtype not in _ST_DTYPES:
            raise ConversionError(
                st.display, f"tensor {s.hf_name} has dtype {e.dtype}; expected F32, F16 or BF16"
            )
        out.append((s, st))
    return out


def _read_decoder(folder: Path, label: str, src: _Source) -> None:
    """Decoder and/or codec-encoder tensors of a speech-tokenizer folder (per ``src.parts``)."""
    top = _load_json(folder / "config.json", f"{label}config.json")
    mt = top.get("model_type")
    if mt != TOKENIZER_MODEL_TYPE:
        raise ConversionError(
            f"{label}config.json",
            f"unknown speech-tokenizer model_type {mt!r} (expected {TOKENIZER_MODEL_TYPE!r})",
        )
    want_dec, want_enc = PART_DECODER in src.parts, PART_CODEC_ENCODER in src.parts
    try:
        src.decoder = parse_decoder_config(top)
        if want_enc:
            src.codec_encoder = parse_codec_encoder_config(top)
    except SchemaError as exc:
        raise ConversionError(f"{label}config.json", str(exc)) from None
    src.synthetic |= top.get(SYNTHETIC_MARKER) is True
    ck = CheckpointTensors(folder, label)
    enc_names = [n for n in ck.names() if n.startswith(ENCODER_HF_PREFIX)]
    if want_enc and not enc_names:
        raise ConversionError(
            ck.display,
            "has no encoder.* tensors (the Mimi encoder that voice cloning needs); leave "
            "codec_encoder out of --parts",
        )
    enc = src.codec_encoder
    specs: list[TensorSpec] = []
    if want_dec:
        specs += decoder_tensor_specs(src.decoder)
    if enc is not None:
        specs += codec_encoder_tensor_specs(enc)

    def skip(name: str) -> bool:
        if name.startswith(ENCODER_HF_PREFIX):
            return enc is None or skipped_encoder_tensor(name, enc)
        return name in DECODER_SKIPPED_HF or (not want_dec and name.startswith("decoder."))

    src.tensors += _match_tensors(ck, specs, skip)
    if enc is None and enc_names:
        src.notes.append(
            f"skipped {len(enc_names)} encoder.* tensors (Mimi encoder: needed only for "
            "voice cloning with a Base model)"
        )
    elif enc is None:
        src.notes.append("no encoder.* tensors (Mimi encoder is not needed for synthesis)")


def _read_talker(folder: Path, src: _Source, root: dict[str, Any]) -> None:
    ck = CheckpointTensors(folder)
    has_mtp = "talker.code_predictor.small_to_mtp_projection.weight" in ck
    try:
        talker, cp, special, voices = parse_talker_config(root, has_mtp)
        check_talker_config(talker, cp, special, voices, src.decoder)
    except SchemaError as exc:
        raise ConversionError("config.json", str(exc)) from None
    gen_path = folder / "generation_config.json"
    if gen_path.exists():
        try:
            src.generation = parse_generation_config(_load_json(gen_path, "generation_config.json"))
        except SchemaError as exc:
            raise ConversionError("generation_config.json", str(exc)) from None
    else:
        src.generation = GenerationDefaults()
        src.notes.append("no generation_config.json: using the reference sampling defaults")
    try:
        src.tokenizer = read_hf_tokenizer(folder, talker.text_vocab_size)
    except SchemaError as exc:
        raise ConversionError(str(folder), f"text tokenizer: {exc}") from None
    for name in (spec.field for spec in SPECIAL_KEYS):
        idx = getattr(special, name)
        if src.tokenizer.tokens[idx].startswith("[PAD"):
            raise ConversionError("config.json", f"{name} = {idx} is not a token of the tokenizer")
    src.talker, src.cp, src.special, src.voices = talker, cp, special, voices
    n_spk = [n for n in ck.names() if n.startswith(SPEAKER_ENCODER_HF_PREFIX)]
    specs = talker_tensor_specs(talker, cp)
    if PART_SPEAKER in src.parts:
        if not n_spk:
            raise ConversionError(
                ck.display,
                "has no speaker_encoder.* tensors (only Base models have the speaker encoder); "
                "leave speaker_encoder out of --parts",
            )
        try:
            src.speaker = parse_speaker_config(_get_dict(root, "speaker_encoder_config", ""))
            check_speaker_config(src.speaker, talker.hidden_size)
        except SchemaError as exc:
            raise ConversionError("config.json", str(exc)) from None
        specs = specs + speaker_tensor_specs(src.speaker)

    def skip(name: str) -> bool:
        return src.speaker is None and name.startswith(SPEAKER_ENCODER_HF_PREFIX)

    src.tensors += _match_tensors(ck, specs, skip)
    if n_spk and src.speaker is None:
        src.notes.append(
            f"skipped {len(n_spk)} speaker_encoder.* tensors (speaker encoder: needed only "
            "for voice cloning)"
        )


def read_checkpoint(model_dir: Path, parts: str | Sequence[str] | None = None) -> _Source:
    """Read and check configs, tokenizer and tensor headers of a checkpoint folder."""
    want = _parse_parts(parts)
    if not model_dir.is_dir():
        raise ConversionError(str(model_dir), "is not a folder")
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ConversionError(str(model_dir), "not a Qwen3-TTS model: no config.json")
    root = _load_json(cfg_path, "config.json")
    mt = root.get("model_type")
    if mt is None:
        raise ConversionError("config.json", "not a Qwen3-TTS model: no model_type")
    if mt == TOKENIZER_MODEL_TYPE:
        if want is not None and (PART_TALKER in want or PART_SPEAKER in want):
            raise ConversionError(
                str(model_dir),
                "is a speech-tokenizer folder: it has no talker or speaker encoder "
                "(use --parts decoder or decoder,codec_encoder)",
            )
        extra = PART_CODEC_ENCODER in want if want is not None else False
        src = _Source(parts=(PART_DECODER, PART_CODEC_ENCODER) if extra else (PART_DECODER,))
        _read_decoder(model_dir, "", src)
        src.notes.insert(0, "speech-tokenizer folder: writing a decoder-only GGUF (no text input)")
        return src
    if mt != TTS_MODEL_TYPE:
        raise ConversionError(
            "config.json",
            f"unknown model_type {mt!r} (expected {TTS_MODEL_TYPE!r} or {TOKENIZER_MODEL_TYPE!r})",
        )
    tt = root.get("tokenizer_type", TOKENIZER_MODEL_TYPE)
    if tt != TOKENIZER_MODEL_TYPE:
        raise ConversionError(
            "config.json", f"tokenizer_type {tt!r} is not supported (only {TOKENIZER_MODEL_TYPE})"
        )
    tts_type = str(root.get("tts_model_type") or "")
    # Only a Base model clones voices; the other kinds keep their GGUF lean by default.
    default = ALL_PARTS if tts_type == "base" else (PART_DECODER, PART_TALKER)
    src = _Source(parts=want or default)
    if PART_SPEAKER in src.parts and PART_TALKER not in src.parts:
        raise ConversionError("--parts", "speaker_encoder needs the talker part too")
    if src.parts == (PART_CODEC_ENCODER,):  # (no command reads a file of it alone)
        raise ConversionError("--parts", "codec_encoder needs the talker or the decoder part too")
    src.synthetic = root.get(SYNTHETIC_MARKER) is True
    src.tts_model_type = tts_type
    src.tts_model_size = str(root.get("tts_model_size") or "")
    if PART_DECODER in src.parts or PART_CODEC_ENCODER in src.parts:
        st_dir = model_dir / "speech_tokenizer"
        if not (st_dir / "config.json").is_file():
            raise ConversionError(
                str(model_dir),
                "speech_tokenizer/config.json is missing (use --parts talker to convert only "
                "the talker)",
            )
        _read_decoder(st_dir, "speech_tokenizer/", src)
    if PART_TALKER in src.parts:
        _read_talker(model_dir, src, root)
    return src


def _plan_type(spec: TensorSpec, want: int) -> tuple[int, str | None]:
    if spec.kind is Kind.F32:
        return GGML_F32, None
    quant = want in (GGML_Q8_0, GGML_Q4_0)
    if spec.kind is Kind.EMBED:
        return (GGML_F16 if quant else want), None
    if quant and spec.shape[-1] % QUANT_BLOCK:
        return GGML_F16, (
            f"{spec.name}: row length {spec.shape[-1]} is not a multiple of {QUANT_BLOCK}, "
            f"stored F16 instead of {GGML_TYPE_NAMES[want]}"
        )
    return want, None


def _nbytes(shape: Sequence[int], ggml_type: int) -> int:
    blk, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return math.prod(shape) // blk * size


def _add_kv(w: GGUFWriter, specs: Sequence[KeySpec], obj: object) -> None:
    for s in specs:
        v = getattr(obj, s.field)
        if s.vtype is VType.U32:
            w.add_uint32(s.key, int(v))
        elif s.vtype is VType.F32:
            w.add_float32(s.key, float(v))
        elif s.vtype is VType.BOOL:
            w.add_bool(s.key, bool(v))
        elif s.vtype is VType.STR:
            w.add_string(s.key, str(v))
        elif s.vtype is VType.U32_ARRAY:
            if v:
                w.add_key_value(
                    s.key, [int(x) for x in v], GGUFValueType.ARRAY, GGUFValueType.UINT32
                )
        else:  # pragma: no cover - exhaustive
            raise AssertionError(s.vtype)


def _write_metadata(w: GGUFWriter, src: _Source, want: int) -> None:
    w.add_uint32(Keys.FORMAT_VERSION, FORMAT_VERSION)
    w.add_bool(Keys.SYNTHETIC, src.synthetic)
    w.add_uint32(Keys.FILE_TYPE, _FILE_TYPE[want])
    w.add_key_value(Keys.PARTS, list(src.parts), GGUFValueType.ARRAY, GGUFValueType.STRING)
    if src.decoder is not None and PART_DECODER in src.parts:
        _add_kv(w, DECODER_KEYS, src.decoder)
    if src.codec_encoder is not None:
        _add_kv(w, CODEC_ENCODER_KEYS, src.codec_encoder)
    if src.speaker is not None:
        _add_kv(w, SPEAKER_KEYS, src.speaker)
    if src.talker is not None:
        assert src.cp and src.special and src.voices and src.generation and src.tokenizer
        name = "Qwen3-TTS " + " ".join(x for x in (src.tts_model_size, src.tts_model_type) if x)
        w.add_string(Keys.NAME, name)
        if src.tts_model_type:
            w.add_string(Keys.TTS_MODEL_TYPE, src.tts_model_type)
        if src.tts_model_size:
            w.add_string(Keys.TTS_MODEL_SIZE, src.tts_model_size)
        _add_kv(w, TALKER_KEYS, src.talker)
        _add_kv(w, CODE_PREDICTOR_KEYS, src.cp)
        _add_kv(w, SPECIAL_KEYS, src.special)
        _add_kv(w, GENERATION_KEYS, src.generation)
        v = src.voices
        arr, s_t, i_t = GGUFValueType.ARRAY, GGUFValueType.STRING, GGUFValueType.INT32
        if v.speakers:
            names = list(v.speakers)
            w.add_key_value(Keys.SPEAKER_NAMES, names, arr, s_t)
            w.add_key_value(Keys.SPEAKER_IDS, [v.speakers[n] for n in names], arr, i_t)
            w.add_key_value(Keys.SPEAKER_DIALECTS, [v.dialects.get(n, "") for n in names], arr, s_t)
        if v.languages:
            names = list(v.languages)
            w.add_key_value(Keys.LANGUAGE_NAMES, names, arr, s_t)
            w.add_key_value(Keys.LANGUAGE_IDS, [v.languages[n] for n in names], arr, i_t)
        for key, kind, value in tokenizer_kv(src.tokenizer):
            if kind == "str":
                w.add_string(key, str(value))
            elif kind == "bool":
                w.add_bool(key, bool(value))
            elif kind == "u32":
                w.add_uint32(key, int(value))  # type: ignore[call-overload]
            elif kind == "str[]":
                w.add_key_value(key, value, arr, s_t)
            elif kind == "i32[]":
                w.add_key_value(key, value, arr, i_t)
    else:
        w.add_string(Keys.NAME, "Qwen3-TTS-Tokenizer-12Hz decoder")


def _convert_chunk(p: _Planned, start_row: int, rows: int, row_len: int) -> npt.NDArray[Any]:
    spec, st = p.spec, p.src
    start, count = start_row * row_len, rows * row_len
    nonfinite = ConversionError(st.display, f"tensor {spec.hf_name} contains NaN or Inf values")
    if p.ggml_type == GGML_BF16 and st.entries[spec.hf_name].dtype == "BF16":
        bits = st.read_bf16_bits(spec.hf_name, start, count)
        if not finite_bits(bits, BF16_EXPONENT):
            raise nonfinite
        return bits
    x = st.read_f32(spec.hf_name, start, count)
    if not finite_f32(x):
        raise nonfinite
    if p.ggml_type == GGML_F32:
        return x
    if p.ggml_type == GGML_BF16:
        return f32_to_bf16(x)
    with np.errstate(over="ignore"):  # (an overflow is refused below, not warned about)
        if p.ggml_type == GGML_F16:
            y = x.astype(np.float16)
            ok = finite_bits(y.view(np.uint16), F16_EXPONENT)
        else:
            y = np.asarray(gguf_quants.quantize(x.reshape(rows, row_len),
                                                GGMLQuantizationType(p.ggml_type)))
            ok = finite_bits(block_scales(y, p.ggml_type), F16_EXPONENT)
    if not ok:
        # F16 values, or the F16 scales of 32-value blocks, past 65504
        kind = GGMLQuantizationType(p.ggml_type).name
        raise ConversionError(st.display, f"tensor {spec.hf_name} has values beyond what {kind} "
                              "can hold; use --dtype bf16 or f32")
    return y


# What a decoder weight type costs: waveform SNR against the F32 reference, exact mode, on the
# stress decoder (tests/parity, released size, 31 frames; docs/performance.md).
DECODER_DTYPE_COST = {
    "f16": "waveform SNR ~48 dB",
    "bf16": "waveform SNR ~30 dB (audible)",
    "q8_0": "waveform SNR not measured (quantised: expect less than BF16's ~30 dB)",
    "q4_0": "waveform SNR not measured (quantised: expect much less than BF16's ~30 dB)",
}


def convert(
    model_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    dtype: str = "f16",
    parts: str | Sequence[str] | None = None,
    progress: bool = True,
    decoder_dtype: str = "f32",
) -> ConversionReport:
    """Convert a checkpoint folder into one GGUF. Raises ``ConversionError`` with one line.

    ``dtype`` is the talker's weight type, ``decoder_dtype`` the decoder's (F32 by default: any
    other type costs waveform precision, and the report says how much).
    """
    t0 = time.perf_counter()
    if dtype not in DTYPES:
        raise ConversionError("--dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}")
    if decoder_dtype not in DTYPES:
        raise ConversionError("--decoder-dtype",
                              f"{decoder_dtype!r} is not one of {', '.join(DTYPES)}")
    want = DTYPES[dtype]
    want_dec = DTYPES[decoder_dtype]
    mdir, out = Path(model_dir), Path(out_path)
    if not out.parent.is_dir():
        raise ConversionError(str(out), "output folder does not exist")
    _refuse_an_input(out, mdir)
    src = read_checkpoint(mdir, parts)
    report = ConversionReport(out, src.parts, dtype, synthetic=src.synthetic, notes=src.notes)
    if decoder_dtype != "f32" and PART_DECODER in src.parts:
        report.notes.append(
            f"decoder weights stored {decoder_dtype.upper()}: "
            f"{DECODER_DTYPE_COST[decoder_dtype]} against F32 weights on O(1) weights "
            "(--decoder-dtype f32 keeps them exact; fast mode makes its own BF16 copies at load)")
    plan: list[_Planned] = []
    for spec, st in src.tensors:
        gtype, fb = _plan_type(spec, want_dec if spec.part == PART_DECODER else want)
        if fb:
            report.fallbacks.append(fb)
            log.debug("%s", fb)
        plan.append(_Planned(spec, st, gtype, _nbytes(spec.shape, gtype)))
        tname = GGML_TYPE_NAMES[gtype]
        report.type_counts[tname] = report.type_counts.get(tname, 0) + 1
    for note in src.notes:
        log.debug("%s", note)
    tmp = out.with_name(out.name + ".part")
    try:
        _write_gguf(tmp, src, plan, want, progress)
        os.replace(tmp, out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ConversionError(str(out), f"cannot write ({exc.strerror or exc})") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    report.n_tensors = len(plan)
    report.n_bytes = sum(p.nbytes for p in plan)
    report.file_size = out.stat().st_size
    report.seconds = time.perf_counter() - t0
    return report


def _refuse_an_input(out: Path, model_dir: Path) -> None:
    """Refuse an ``out`` that is (or leads to) a file of the checkpoint being converted: the
    GGUF would replace it (``qtts convert CK CK/model.safetensors`` destroyed its own input and
    said it had written a model). A GGUF there is no input: ``make-model --keep-checkpoint``
    writes ``model.gguf`` beside the checkpoint, and converting again replaces it."""
    if not out.exists():  # (only an existing file can be an input)
        return
    for folder in (model_dir, model_dir / "speech_tokenizer"):
        if not folder.is_dir():
            continue
        for f in folder.iterdir():
            if f.suffix.lower() != ".gguf" and f.is_file() and os.path.samefile(f, out):
                raise ConversionError(str(out), f"would replace {f.relative_to(model_dir)}, a "
                                      "file of the checkpoint being converted; write the GGUF "
                                      "to another file")


def _write_gguf(
    path: Path, src: _Source, plan: Sequence[_Planned], want: int, progress: bool
) -> None:
    from tqdm import tqdm

    w = GGUFWriter(path, ARCH)
    try:
        _write_metadata(w, src, want)
        for p in plan:
            w.add_tensor_info(
                p.spec.name,
                p.spec.shape,
                np.dtype(np.float32),
                p.nbytes,
                raw_dtype=GGMLQuantizationType(p.ggml_type),
            )
        w.write_header_to_file(path)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None
        fout = w.fout[0]
        w.write_padding(fout, fout.tell())
        total = sum(p.nbytes for p in plan)
        bar = tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="convert",
            disable=None if progress else True, leave=False,  # None: only on a TTY
        )  # fmt: skip
        with bar:
            for i, p in enumerate(plan, start=1):
                bar.set_postfix_str(f"tensor {i}/{len(plan)}", refresh=False)
                row_len = p.spec.shape[-1]
                n_rows = math.prod(p.spec.shape) // row_len
                step = max(1, CHUNK_ELEMS // row_len)
                written = 0
                for r0 in range(0, n_rows, step):
                    rows = min(step, n_rows - r0)
                    data = np.ascontiguousarray(_convert_chunk(p, r0, rows, row_len))
                    fout.write(data.data)
                    written += data.nbytes
                    bar.update(data.nbytes)
                if written != p.nbytes:  # pragma: no cover - internal consistency
                    raise AssertionError(f"{p.spec.name}: wrote {written}, planned {p.nbytes}")
                w.write_padding(fout, p.nbytes)
    finally:
        w.close()
