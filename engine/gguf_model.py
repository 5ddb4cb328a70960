"""Open and validate a qtts GGUF file; typed access to its config, tensors and tokenizer.

``open_model(path)`` memory-maps the file read-only (CPU workers then share the weight pages) and,
before anything computes, checks: magic, version, every header field against the file size,
the architecture, every required key and its type, the config value ranges, and every tensor's
presence, shape and type against what the stored config implies (``engine.gguf_schema``).
Any problem raises ``ModelFileError(path, problem)``, e.g.
``model.gguf: tensor dec.blk.1.tconv.weight has shape [1536, 768, 15], expected [1536, 768, 16]``.

The header parser is our own (not ``gguf.GGUFReader``): every count and length is checked against
the bytes that remain before it is used, so a damaged file fails fast with a clear message
instead of allocating or looping on garbage.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

from engine.codec_encoder.schema import (
    CODEC_ENCODER_KEYS,
    CodecEncoderConfig,
    check_codec_encoder_config,
    codec_encoder_tensor_specs,
)
from engine.dtypes import (
    BF16_EXPONENT,
    F16_EXPONENT,
    block_scales,
    finite_bits,
    finite_f32,
    to_f32,
)
from engine.errors import ModelFileError
from engine.gguf_schema import (
    ALL_PARTS,
    ALLOWED_TYPES,
    ARCH,
    CODE_PREDICTOR_KEYS,
    DECODER_KEYS,
    FORMAT_VERSION,
    GENERATION_KEYS,
    GGML_BF16,
    GGML_F16,
    GGML_F32,
    GGML_TYPE_NAMES,
    PART_CODEC_ENCODER,
    PART_DECODER,
    PART_SPEAKER,
    PART_TALKER,
    QUANT_BLOCK,
    SPECIAL_KEYS,
    TALKER_KEYS,
    CodePredictorConfig,
    DecoderConfig,
    GenerationDefaults,
    Keys,
    KeySpec,
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
    voices_from_arrays,
)
from engine.speaker.schema import (
    SPEAKER_KEYS,
    SpeakerEncoderConfig,
    check_speaker_config,
    speaker_tensor_specs,
)
from engine.tokenizer_gguf import (
    TOKEN_UNUSED,
    TOKENIZER_MODEL,
    build_tokenizer,
    check_tokenizer_arrays,
)

__all__ = [
    "CodePredictorConfig",
    "DecoderConfig",
    "GenerationDefaults",
    "GgufModel",
    "SpecialIds",
    "TalkerConfig",
    "TensorInfo",
    "open_model",
]

log = logging.getLogger("qtts.model")

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32
MAX_NAME = 63  # GGML_MAX_NAME - 1
MAX_DIMS = 4
_MAX_COUNT = 1 << 24
_MAX_STRING = 1 << 24

# GGUF value types
_U8, _I8, _U16, _I16, _U32, _I32, _F32, _BOOL, _STR, _ARR, _U64, _I64, _F64 = range(13)
_SCALAR_FMT = {
    _U8: "<B", _I8: "<b", _U16: "<H", _I16: "<h", _U32: "<I", _I32: "<i", _F32: "<f",
    _BOOL: "<B", _U64: "<Q", _I64: "<q", _F64: "<d",
}  # fmt: skip
_SCALAR_NP = {
    _U8: "<u1", _I8: "<i1", _U16: "<u2", _I16: "<i2", _U32: "<u4", _I32: "<i4", _F32: "<f4",
    _BOOL: "<u1", _U64: "<u8", _I64: "<i8", _F64: "<f8",
}  # fmt: skip
_INT_TYPES = frozenset({_U8, _I8, _U16, _I16, _U32, _I32, _U64, _I64})
_FLOAT_TYPES = frozenset({_F32, _F64})
_TYPE_NAMES = [
    "UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "FLOAT32", "BOOL", "STRING",
    "ARRAY", "UINT64", "INT64", "FLOAT64",
]  # fmt: skip

T = TypeVar("T")


class _Bad(Exception):
    """Internal: one-line reason a file is invalid (wrapped into ModelFileError)."""


@dataclass(frozen=True)
class _Value:
    vtype: int
    value: Any
    sub: int = -1  # array element type


class TensorInfo(NamedTuple):
    """Where a tensor lives: ggml type, ``ne`` (ggml order), absolute file offset, byte count."""

    ggml_type: int
    ne: tuple[int, ...]
    offset: int
    nbytes: int


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0
        self.end = len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.end:
            raise _Bad(f"file ends inside {what} (truncated or corrupt)")

    def scalar(self, vtype: int, what: str) -> Any:
        fmt = _SCALAR_FMT[vtype]
        size = struct.calcsize(fmt)
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        if vtype == _BOOL:
            if v > 1:
                raise _Bad(f"{what} is a bool with value {v}")
            return bool(v)
        return v

    def u32(self, what: str) -> int:
        return int(self.scalar(_U32, what))

    def u64(self, what: str) -> int:
        return int(self.scalar(_U64, what))

    def string(self, what: str, limit: int = _MAX_STRING) -> str:
        n = self.u64(what)
        if n > limit:
            raise _Bad(f"{what} has length {n}, more than {limit}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Bad(f"{what} is not valid UTF-8") from None

    def value(self, vtype: int, what: str) -> _Value:
        if vtype in _SCALAR_FMT:
            return _Value(vtype, self.scalar(vtype, what))
        if vtype == _STR:
            return _Value(vtype, self.string(what))
        if vtype == _ARR:
            sub = self.u32(what + " element type")
            count = self.u64(what + " length")
            if sub == _ARR:
                raise _Bad(f"{what} is a nested array (not used by qtts)")
            if sub in _SCALAR_NP:
                size = np.dtype(_SCALAR_NP[sub]).itemsize
                if count > _MAX_COUNT:
                    raise _Bad(f"{what} has {count} elements, too many")
                self.need(count * size, what)
                arr = np.frombuffer(self.buf, dtype=_SCALAR_NP[sub], count=count, offset=self.pos)
                self.pos += count * size
                if sub == _BOOL and (arr > 1).any():
                    raise _Bad(f"{what} holds a bool that is neither 0 nor 1")
                return _Value(vtype, arr.tolist(), sub)
            if sub == _STR:
                if count > _MAX_COUNT or count * 8 > self.end - self.pos:
                    raise _Bad(f"{what} has {count} strings, more than the file can hold")
                items = [self.string(f"{what}[{i}]") for i in range(count)]
                return _Value(vtype, items, sub)
            raise _Bad(f"{what} has unknown element type {sub}")
        raise _Bad(f"{what} has unknown value type {vtype}")


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _fmt_shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _type_name(t: int) -> str:
    if t in GGML_TYPE_NAMES:
        return GGML_TYPE_NAMES[t]
    try:
        return GGMLQuantizationType(t).name
    except ValueError:
        return str(t)


class GgufModel:
    """A validated qtts GGUF, memory-mapped read-only.

    Attributes: ``path``; ``parts`` ({"decoder", "talker"} subset); ``synthetic``;
    ``decoder_config`` (None without the decoder part); ``talker_config`` /
    ``code_predictor_config`` / ``special_ids`` / ``generation_defaults`` (None without the talker
    part); ``speakers`` (name -> codec id), ``languages`` (name -> codec id), ``dialects``
    (speaker -> dialect language name); ``tts_model_type`` / ``tts_model_size`` ("" if absent);
    ``metadata`` (every key -> raw value); ``data_offset`` (absolute offset of the tensor data);
    ``mmap`` (``np.memmap`` of the whole file, uint8, read-only).
    """

    path: Path
    parts: frozenset[str]
    synthetic: bool
    decoder_config: DecoderConfig | None
    talker_config: TalkerConfig | None
    code_predictor_config: CodePredictorConfig | None
    special_ids: SpecialIds | None
    generation_defaults: GenerationDefaults | None
    speakers: dict[str, int]
    languages: dict[str, int]
    dialects: dict[str, str]
    tts_model_type: str
    tts_model_size: str
    speaker_config: SpeakerEncoderConfig | None
    codec_encoder_config: CodecEncoderConfig | None
    data_offset: int

    def __init__(self, path: Path, mm: np.memmap[Any, np.dtype[np.uint8]]) -> None:
        self.path = path
        self._mm: np.memmap[Any, np.dtype[np.uint8]] | None = mm
        self._tensors: dict[str, TensorInfo] = {}
        self._kv: dict[str, _Value] = {}
        self._tokenizer: Any = None
        self.decoder_config = None
        self.talker_config = None
        self.code_predictor_config = None
        self.special_ids = None
        self.generation_defaults = None
        self.speaker_config = None
        self.codec_encoder_config = None
        self.speakers, self.languages, self.dialects = {}, {}, {}
        self.tts_model_type = self.tts_model_size = ""
        self.synthetic = False

    # -- public API -------------------------------------------------------------------------

    @property
    def mmap(self) -> np.memmap[Any, np.dtype[np.uint8]]:
        """The read-only memory map of the whole file (uint8)."""
        if self._mm is None:
            raise ModelFileError(str(self.path), "model is closed")
        return self._mm

    def tensor_names(self) -> list[str]:
        """All tensor names, in file order."""
        return list(self._tensors)

    def tensor_info(self, name: str) -> TensorInfo:
        """``(ggml_type, ne, absolute offset, nbytes)`` of tensor ``name``."""
        try:
            return self._tensors[name]
        except KeyError:
            raise ModelFileError(str(self.path), f"no tensor named {name}") from None

    def tensor(self, name: str) -> npt.NDArray[Any]:
        """Read-only zero-copy view of a tensor in its stored dtype, PyTorch-order shape.

        F32 -> float32, F16 -> float16, BF16 -> uint16 (raw bits), quantised types -> uint8
        rows of ``ne0 / block * block_bytes`` bytes.
        """
        info = self.tensor_info(name)
        raw = self.mmap[info.offset : info.offset + info.nbytes]
        shape = tuple(reversed(info.ne))
        if info.ggml_type == GGML_F32:
            return raw.view(np.float32).reshape(shape)
        if info.ggml_type == GGML_F16:
            return raw.view(np.float16).reshape(shape)
        if info.ggml_type == GGML_BF16:
            return raw.view(np.uint16).reshape(shape)
        blk, size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        return raw.reshape(*shape[:-1], shape[-1] // blk * size)

    def tensor_f32(self, name: str) -> npt.NDArray[np.float32]:
        """A float32 copy of a tensor (dequantised), PyTorch-order shape."""
        info = self.tensor_info(name)
        return to_f32(self.tensor(name), info.ggml_type, tuple(reversed(info.ne)))

    def require(self, part: str) -> None:
        """Raise a clear ``ModelFileError`` unless the file has ``part`` ("decoder"/"talker")."""
        if part in self.parts:
            return
        if part == PART_TALKER and PART_DECODER in self.parts:
            raise ModelFileError(
                str(self.path),
                "is a decoder-only model: it has no text tokenizer or talker, so it can decode "
                "codes but cannot synthesise text (convert the full model folder)",
            )
        raise ModelFileError(
            str(self.path),
            f"has no {part} part (it holds: {', '.join(sorted(self.parts))}); convert the full "
            "model folder",
        )

    def tokenizer(self) -> Any:
        """The text tokenizer as a ``tokenizers.Tokenizer`` (talker models only)."""
        self.require(PART_TALKER)
        if self._tokenizer is None:
            tokens = self._kv[Keys.TOKENIZER_TOKENS].value
            types = self._kv[Keys.TOKENIZER_TOKEN_TYPE].value
            merges = self._kv[Keys.TOKENIZER_MERGES].value
            try:
                self._tokenizer = build_tokenizer(tokens, types, merges)
            except Exception as exc:  # tokenizers raises plain Exceptions on bad data
                raise ModelFileError(
                    str(self.path), f"stored tokenizer cannot be built ({exc})"
                ) from None
        return self._tokenizer

    @property
    def metadata(self) -> dict[str, Any]:
        """Every metadata key with its raw value."""
        return {k: v.value for k, v in self._kv.items()}

    def close(self) -> None:
        """Drop this object's reference to the map (views handed out stay valid)."""
        self._mm = None
        self._tokenizer = None

    def __enter__(self) -> GgufModel:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GgufModel({str(self.path)!r}, parts={sorted(self.parts)}, "
            f"tensors={len(self._tensors)}, synthetic={self.synthetic})"
        )

    # -- parsing and validation -------------------------------------------------------------

    def _parse(self) -> None:
        mm = self.mmap
        buf = memoryview(mm)  # type: ignore[arg-type]
        cur = _Cursor(buf)
        cur.need(4, "the magic")
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise _Bad(f"not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
        cur.pos = 4
        version = cur.u32("the version")
        if version != GGUF_VERSION:
            raise _Bad(f"unsupported GGUF version {version} (expected {GGUF_VERSION})")
        n_tensors = cur.u64("the tensor count")
        n_kv = cur.u64("the key count")
        if n_kv > _MAX_COUNT or n_kv * 13 > cur.end - cur.pos:
            raise _Bad(f"header claims {n_kv} keys, more than the file can hold")
        if n_tensors > _MAX_COUNT or n_tensors * 25 > cur.end - cur.pos:
            raise _Bad(f"header claims {n_tensors} tensors, more than the file can hold")
        for i in range(n_kv):
            key = cur.string(f"key #{i}", 1 << 16)
            vtype = cur.u32(f"the type of key {key}")
            if key in self._kv:
                raise _Bad(f"key {key} appears twice")
            self._kv[key] = cur.value(vtype, f"key {key}")
        alignment = DEFAULT_ALIGNMENT
        if Keys.ALIGNMENT in self._kv:
            a = self._kv[Keys.ALIGNMENT]
            if a.vtype != _U32 or not 1 <= a.value <= 1 << 16 or a.value & (a.value - 1):
                raise _Bad(f"{Keys.ALIGNMENT} = {a.value!r} is not a power of two")
            alignment = int(a.value)
        raw_infos: list[tuple[str, tuple[int, ...], int, int]] = []
        names: set[str] = set()
        for i in range(n_tensors):
            name = cur.string(f"tensor name #{i}", 1 << 16)
            if not name or len(name.encode()) > MAX_NAME:
                raise _Bad(f"tensor name #{i} {name[:80]!r} is empty or longer than {MAX_NAME}")
            if name in names:
                raise _Bad(f"tensor {name} appears twice")
            names.add(name)
            n_dims = cur.u32(f"tensor {name} dims")
            if not 1 <= n_dims <= MAX_DIMS:
                raise _Bad(f"tensor {name} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
            ne = tuple(cur.u64(f"tensor {name} shape") for _ in range(n_dims))
            if any(not 1 <= d <= 1 << 40 for d in ne):
                raise _Bad(f"tensor {name} has an invalid shape {_fmt_shape(ne[::-1])}")
            gtype = cur.u32(f"tensor {name} type")
            offset = cur.u64(f"tensor {name} offset")
            raw_infos.append((name, ne, gtype, offset))
        data_offset = _align(cur.pos, alignment)
        size = len(buf)
        if n_tensors and data_offset > size:
            raise _Bad(f"file ends before the tensor data (truncated: {size} bytes)")
        self.data_offset = data_offset
        spans: list[tuple[int, int, str]] = []
        for name, ne, gtype, offset in raw_infos:
            try:
                qt = GGMLQuantizationType(gtype)
                blk, tsize = GGML_QUANT_SIZES[qt]
            except (ValueError, KeyError):
                raise _Bad(f"tensor {name} has unknown type {gtype}") from None
            if ne[0] % blk:
                raise _Bad(
                    f"tensor {name}: type {_type_name(gtype)} needs a row length divisible by "
                    f"{blk}, got {ne[0]}"
                )
            nbytes = math.prod(ne) // blk * tsize
            if offset % alignment:
                raise _Bad(f"tensor {name} data offset {offset} is not {alignment}-aligned")
            start = data_offset + offset
            if start + nbytes > size:
                raise _Bad(
                    f"tensor {name} data ({nbytes} bytes at {start}) runs past the end of the "
                    f"file ({size} bytes; truncated?)"
                )
            spans.append((start, start + nbytes, name))
            self._tensors[name] = TensorInfo(gtype, ne, start, nbytes)
        spans.sort()
        for (_, e0, n0), (s1, _, n1) in itertools.pairwise(spans):
            if s1 < e0:
                raise _Bad(f"tensors {n0} and {n1} overlap")

    # typed key access ---------------------------------------------------------------------

    def _get(self, key: str, kind: str, default: Any = ..., /) -> Any:
        v = self._kv.get(key)
        if v is None:
            if default is ...:
                raise _Bad(f"required key {key} is missing")
            return default
        ok: Callable[[_Value], bool]
        want = {
            "int": "an integer", "float": "a number", "bool": "a bool", "str": "a string",
            "int[]": "an integer array", "str[]": "a string array",
        }[kind]  # fmt: skip
        if kind == "int":
            ok = lambda x: x.vtype in _INT_TYPES  # noqa: E731
        elif kind == "float":
            ok = lambda x: x.vtype in _FLOAT_TYPES or x.vtype in _INT_TYPES  # noqa: E731
        elif kind == "bool":
            ok = lambda x: x.vtype == _BOOL  # noqa: E731
        elif kind == "str":
            ok = lambda x: x.vtype == _STR  # noqa: E731
        elif kind == "int[]":
            ok = lambda x: x.vtype == _ARR and x.sub in _INT_TYPES  # noqa: E731
        else:
            ok = lambda x: x.vtype == _ARR and x.sub == _STR  # noqa: E731
        if not ok(v):
            got = _TYPE_NAMES[v.vtype] if v.vtype < len(_TYPE_NAMES) else str(v.vtype)
            if v.vtype == _ARR and 0 <= v.sub < len(_TYPE_NAMES):
                got = f"ARRAY of {_TYPE_NAMES[v.sub]}"
            raise _Bad(f"key {key} has type {got}, expected {want}")
        if kind == "float":
            if v.vtype == _F32:  # shortest decimal that round-trips in f32: 0.9, not 0.8999...
                return float(str(np.float32(v.value)))
            return float(v.value)
        return v.value

    def _config(self, cls: Callable[..., T], specs: Sequence[KeySpec]) -> T:
        kinds = {
            VType.U32: "int", VType.F32: "float", VType.BOOL: "bool", VType.STR: "str",
            VType.U32_ARRAY: "int[]",
        }  # fmt: skip
        values: dict[str, Any] = {}
        for s in specs:
            v = self._get(s.key, kinds[s.vtype])
            values[s.field] = tuple(v) if s.vtype is VType.U32_ARRAY else v
        return cls(**values)

    def _validate(self) -> None:
        arch = self._get(Keys.ARCHITECTURE, "str")
        if arch != ARCH:
            raise _Bad(f"architecture is {arch!r}, expected {ARCH!r}")
        fv = self._get(Keys.FORMAT_VERSION, "int")
        if fv != FORMAT_VERSION:
            raise _Bad(f"qtts format version {fv} is not supported (expected {FORMAT_VERSION})")
        parts = self._get(Keys.PARTS, "str[]")
        bad = [p for p in parts if p not in ALL_PARTS]
        if bad or not parts or len(set(parts)) != len(parts):
            raise _Bad(f"{Keys.PARTS} = {parts!r} is not a subset of {list(ALL_PARTS)}")
        self.parts = frozenset(parts)
        self.synthetic = bool(self._get(Keys.SYNTHETIC, "bool", False))
        specs: list[TensorSpec] = []
        try:
            if PART_DECODER in self.parts:
                self.decoder_config = self._config(DecoderConfig, DECODER_KEYS)
                check_decoder_config(self.decoder_config)
                specs += decoder_tensor_specs(self.decoder_config)
            if PART_TALKER in self.parts:
                self._validate_talker()
                assert self.talker_config and self.code_predictor_config
                specs += talker_tensor_specs(self.talker_config, self.code_predictor_config)
            if PART_SPEAKER in self.parts:
                if self.talker_config is None:
                    raise SchemaError("the speaker_encoder part needs the talker part")
                self.speaker_config = self._config(SpeakerEncoderConfig, SPEAKER_KEYS)
                check_speaker_config(self.speaker_config, self.talker_config.hidden_size)
                specs += speaker_tensor_specs(self.speaker_config)
            if PART_CODEC_ENCODER in self.parts:
                self.codec_encoder_config = self._config(CodecEncoderConfig, CODEC_ENCODER_KEYS)
                check_codec_encoder_config(self.codec_encoder_config)
                specs += codec_encoder_tensor_specs(self.codec_encoder_config)
        except SchemaError as exc:
            raise _Bad(str(exc)) from None
        self._check_tensors(specs)

    def _validate_talker(self) -> None:
        t = self._config(TalkerConfig, TALKER_KEYS)
        cp = self._config(CodePredictorConfig, CODE_PREDICTOR_KEYS)
        special = self._config(SpecialIds, SPECIAL_KEYS)
        gen = self._config(GenerationDefaults, GENERATION_KEYS)
        names = self._get(Keys.SPEAKER_NAMES, "str[]", [])
        voices: Voices = voices_from_arrays(
            names,
            self._get(Keys.SPEAKER_IDS, "int[]", []),
            self._get(Keys.SPEAKER_DIALECTS, "str[]", [""] * len(names)),
            self._get(Keys.LANGUAGE_NAMES, "str[]", []),
            self._get(Keys.LANGUAGE_IDS, "int[]", []),
        )
        check_talker_config(t, cp, special, voices, self.decoder_config)
        check_generation(gen)
        model = self._get(Keys.TOKENIZER_MODEL, "str")
        if model != TOKENIZER_MODEL:
            raise _Bad(f"{Keys.TOKENIZER_MODEL} is {model!r}, expected {TOKENIZER_MODEL!r}")
        tokens = self._get(Keys.TOKENIZER_TOKENS, "str[]")
        types = self._get(Keys.TOKENIZER_TOKEN_TYPE, "int[]")
        merges = self._get(Keys.TOKENIZER_MERGES, "str[]")
        check_tokenizer_arrays(tokens, types, merges, t.text_vocab_size)
        for s in SPECIAL_KEYS:
            idx = getattr(special, s.field)
            if types[idx] == TOKEN_UNUSED:
                raise _Bad(f"{s.key} = {idx} is not a token of the stored tokenizer")
        self.talker_config, self.code_predictor_config = t, cp
        self.special_ids, self.generation_defaults = special, gen
        self.speakers, self.languages = dict(voices.speakers), dict(voices.languages)
        self.dialects = dict(voices.dialects)
        self.tts_model_type = self._get(Keys.TTS_MODEL_TYPE, "str", "")
        self.tts_model_size = self._get(Keys.TTS_MODEL_SIZE, "str", "")

    def _check_values(self) -> None:
        """Every weight finite: one NaN anywhere spreads through every later step (the
        decoder's clamp then writes it as full-scale DC, the sampler finds no candidate), so a
        damaged file is refused here, by name. Reductions over cache-sized pieces: ~0.2 s
        for the released 0.6B at Q4_0, whose pages the loaders read anyway."""
        for name, info in self._tensors.items():
            raw = self.mmap[info.offset : info.offset + info.nbytes]
            if info.ggml_type == GGML_F32:
                ok = finite_f32(raw.view(np.float32))
            elif info.ggml_type in (GGML_F16, GGML_BF16):
                ok = finite_bits(raw.view(np.uint16), F16_EXPONENT
                                 if info.ggml_type == GGML_F16 else BF16_EXPONENT)
            else:
                ok = finite_bits(block_scales(raw, info.ggml_type), F16_EXPONENT)
            if not ok:
                raise _Bad(f"tensor {name} holds NaN or infinite values (a damaged file)")

    def _check_tensors(self, specs: Sequence[TensorSpec]) -> None:
        want = {s.name: s for s in specs}
        for name in self._tensors:
            if name not in want:
                raise _Bad(f"unexpected tensor {name} (not part of this model's layout)")
        for s in specs:
            info = self._tensors.get(s.name)
            if info is None:
                raise _Bad(f"tensor {s.name} is missing")
            shape = tuple(reversed(info.ne))
            if shape != s.shape:
                raise _Bad(
                    f"tensor {s.name} has shape {_fmt_shape(shape)}, expected {_fmt_shape(s.shape)}"
                )
            allowed = ALLOWED_TYPES[s.kind]
            if info.ggml_type not in allowed:
                names = ", ".join(sorted(_type_name(t) for t in allowed))
                raise _Bad(
                    f"tensor {s.name} has type {_type_name(info.ggml_type)}, expected one of "
                    f"{names}"
                )
            if info.ggml_type not in (GGML_F32, GGML_F16, GGML_BF16) and s.shape[-1] % QUANT_BLOCK:
                raise _Bad(
                    f"tensor {s.name}: type {_type_name(info.ggml_type)} needs a row length "
                    f"divisible by {QUANT_BLOCK}, got {s.shape[-1]}"
                )


def open_model(path: str | os.PathLike[str]) -> GgufModel:
    """Open, map and fully validate a qtts GGUF. Raises ``ModelFileError`` on any problem."""
    p = Path(path)
    display = str(path)
    try:
        size = p.stat().st_size
        if not p.is_file():
            raise ModelFileError(display, "is not a regular file")
        if size < 24:
            raise ModelFileError(display, f"file is too short to be a GGUF ({size} bytes)")
        mm = np.memmap(p, dtype=np.uint8, mode="r")
    except FileNotFoundError:
        raise ModelFileError(display, "file not found") from None
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ModelFileError(display, f"cannot open ({reason})") from None
    model = GgufModel(p, mm)
    try:
        model._parse()
        model._validate()
        model._check_values()
    except _Bad as exc:
        model.close()
        raise ModelFileError(display, str(exc)) from None
    except (RecursionError, MemoryError, OverflowError, ValueError, struct.error) as exc:
        model.close()  # defensive: any parse slip on damaged bytes is still one clean error
        raise ModelFileError(display, f"corrupt file ({type(exc).__name__}: {exc})") from None
    if model.synthetic:
        log.warning(
            "%s is a synthetic random-weight model (qtts make-model): its audio is noise, "
            "not speech",
            display,
        )
    return model
