"""The schema of a qtts GGUF file: key names, typed configs, and the one tensor name table.

Everything that names something inside a qtts GGUF lives here, so the converter (which writes
the file) and the loader (which validates it) cannot drift apart:

* ``Keys`` — every metadata key the engine writes or reads.
* ``DecoderConfig`` / ``TalkerConfig`` / ``CodePredictorConfig`` / ``SpecialIds`` /
  ``GenerationDefaults`` — typed configs. Field names follow the HF ``config.json`` fields;
  each field's GGUF key and value kind is listed once in the ``*_KEYS`` tables.
* ``check_*`` — range and consistency checks shared by converter and loader (raise
  ``SchemaError`` with a one-line reason; callers wrap it into ``ConversionError`` /
  ``ModelFileError`` with the file name).
* ``decoder_tensor_specs`` / ``talker_tensor_specs`` — THE table mapping HF tensor names to GGUF
  names, with the shape each must have for a given config and its precision class.

Shapes are written PyTorch-style (``[out, in, k]``); the GGUF stores the same bytes with ``ne``
reversed (``ne0`` = last dimension).

Precision classes (``Kind``):

* ``F32`` — always F32: codebooks (``embed_sum``, ``usage``), norms, biases, SnakeBeta
  ``alpha``/``beta``, layer scales, ConvNeXt ``gamma``: every 1-D tensor.
* ``EMBED`` — token embeddings (talker text/codec embeddings, code-predictor embeddings): follow
  ``--dtype`` but never below F16 (F32, F16 or BF16; Q8_0/Q4_0 requests store F16).
* ``WEIGHT`` — conv and linear weights: follow ``--dtype``. A quantised type needs a row length
  (``ne0``, the last PyTorch dimension) divisible by its block size (32); other tensors fall back
  to F16 and the converter reports it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

ARCH = "qwen3-tts"
FORMAT_VERSION = 1

PART_DECODER = "decoder"
PART_TALKER = "talker"
# Voice cloning (Base models): the ECAPA-TDNN speaker encoder and the Mimi encoder of the
# speech tokenizer. Their schemas live in engine/speaker/schema.py and
# engine/codec_encoder/schema.py.
PART_SPEAKER = "speaker_encoder"
PART_CODEC_ENCODER = "codec_encoder"
ALL_PARTS = (PART_DECODER, PART_TALKER, PART_SPEAKER, PART_CODEC_ENCODER)

# ggml type ids (same values as gguf.GGMLQuantizationType) used by the engine.
GGML_F32 = 0
GGML_F16 = 1
GGML_Q4_0 = 2
GGML_Q8_0 = 8
GGML_BF16 = 30
GGML_TYPE_NAMES: dict[int, str] = {
    GGML_F32: "F32",
    GGML_F16: "F16",
    GGML_Q4_0: "Q4_0",
    GGML_Q8_0: "Q8_0",
    GGML_BF16: "BF16",
}
QUANT_BLOCK = 32  # block length of Q8_0 and Q4_0


class SchemaError(ValueError):
    """A config value or tensor that breaks the schema. The message is one line."""


class Keys:
    """Every GGUF metadata key of a qtts model file."""

    ARCHITECTURE = "general.architecture"
    NAME = "general.name"
    ALIGNMENT = "general.alignment"
    FILE_TYPE = "general.file_type"

    FORMAT_VERSION = "qtts.format_version"
    SYNTHETIC = "qtts.synthetic"

    PARTS = f"{ARCH}.parts"
    TTS_MODEL_TYPE = f"{ARCH}.tts_model_type"
    TTS_MODEL_SIZE = f"{ARCH}.tts_model_size"

    DECODER = f"{ARCH}.decoder."
    SPEAKER = f"{ARCH}.speaker_encoder."
    CODEC_ENCODER = f"{ARCH}.codec_encoder."
    TALKER = f"{ARCH}.talker."
    CODE_PREDICTOR = f"{ARCH}.code_predictor."
    TEXT = f"{ARCH}.text."
    GENERATION = f"{ARCH}.generation."

    # voices (optional arrays: absent = empty; names are lower-case)
    SPEAKER_NAMES = f"{ARCH}.talker.speaker_names"
    SPEAKER_IDS = f"{ARCH}.talker.speaker_ids"
    SPEAKER_DIALECTS = f"{ARCH}.talker.speaker_dialects"  # "" = no dialect
    LANGUAGE_NAMES = f"{ARCH}.talker.language_names"
    LANGUAGE_IDS = f"{ARCH}.talker.language_ids"

    # text tokenizer, stored like llama.cpp does for Qwen2 ("gpt2" BPE, pre "qwen2")
    TOKENIZER_MODEL = "tokenizer.ggml.model"
    TOKENIZER_PRE = "tokenizer.ggml.pre"
    TOKENIZER_TOKENS = "tokenizer.ggml.tokens"
    TOKENIZER_TOKEN_TYPE = "tokenizer.ggml.token_type"
    TOKENIZER_MERGES = "tokenizer.ggml.merges"
    TOKENIZER_EOS_ID = "tokenizer.ggml.eos_token_id"
    TOKENIZER_PAD_ID = "tokenizer.ggml.padding_token_id"
    TOKENIZER_ADD_BOS = "tokenizer.ggml.add_bos_token"


class VType(enum.Enum):
    """The kind of value a key holds (the writer picks the concrete GGUF type)."""

    U32 = "u32"
    F32 = "f32"
    BOOL = "bool"
    STR = "str"
    U32_ARRAY = "u32[]"


@dataclass(frozen=True)
class KeySpec:
    """One config field: dataclass attribute name, full GGUF key, value kind."""

    field: str
    key: str
    vtype: VType


def _ks(prefix: str, rows: Sequence[tuple[str, str, VType]]) -> tuple[KeySpec, ...]:
    return tuple(KeySpec(f, prefix + k, t) for f, k, t in rows)


# ---------------------------------------------------------------------------------------------
# Typed configs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecoderConfig:
    """Speech-tokenizer decoder config (``speech_tokenizer/config.json`` ``decoder_config``).

    ``sample_rate`` is the top-level ``output_sample_rate``, ``upsample_total`` the top-level
    ``decode_upsample_rate`` (samples per codec frame). ``layer_norm_eps`` (ConvNeXt LayerNorm)
    and ``codebook_eps`` (usage clamp) are code constants of the reference, stored for the engine.
    """

    codebook_size: int
    codebook_dim: int
    num_quantizers: int
    num_semantic_quantizers: int
    latent_dim: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    sliding_window: int
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    layer_norm_eps: float
    codebook_eps: float
    decoder_dim: int
    upsample_rates: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]
    sample_rate: int
    upsample_total: int

    @property
    def codebook_vector_dim(self) -> int:
        """Width of one codebook vector (half of ``codebook_dim``, rounded down as the reference
        does)."""
        return self.codebook_dim // 2

    def block_channels(self) -> list[tuple[int, int, int]]:
        """``(c_in, c_out, rate)`` of each upsampling block ``dec.blk.1..n``."""
        out = []
        for b, rate in enumerate(self.upsample_rates):
            out.append((self.decoder_dim >> b, self.decoder_dim >> (b + 1), rate))
        return out


DECODER_KEYS = _ks(
    Keys.DECODER,
    [
        ("codebook_size", "codebook_size", VType.U32),
        ("codebook_dim", "codebook_dim", VType.U32),
        ("num_quantizers", "num_quantizers", VType.U32),
        ("num_semantic_quantizers", "num_semantic_quantizers", VType.U32),
        ("latent_dim", "latent_dim", VType.U32),
        ("hidden_size", "hidden_size", VType.U32),
        ("num_hidden_layers", "num_layers", VType.U32),
        ("num_attention_heads", "num_heads", VType.U32),
        ("num_key_value_heads", "num_kv_heads", VType.U32),
        ("head_dim", "head_dim", VType.U32),
        ("intermediate_size", "intermediate_size", VType.U32),
        ("sliding_window", "sliding_window", VType.U32),
        ("rope_theta", "rope_theta", VType.F32),
        ("max_position_embeddings", "max_position_embeddings", VType.U32),
        ("rms_norm_eps", "rms_norm_eps", VType.F32),
        ("layer_norm_eps", "layer_norm_eps", VType.F32),
        ("codebook_eps", "codebook_eps", VType.F32),
        ("decoder_dim", "decoder_dim", VType.U32),
        ("upsample_rates", "upsample_rates", VType.U32_ARRAY),
        ("upsampling_ratios", "upsampling_ratios", VType.U32_ARRAY),
        ("sample_rate", "sample_rate", VType.U32),
        ("upsample_total", "upsample_total", VType.U32),
    ],
)


@dataclass(frozen=True)
class TalkerConfig:
    """Talker LLM config (root ``config.json`` ``talker_config``).

    ``vocab_size`` is the codec vocabulary (codebook-0 ids, then control/language/speaker ids).
    ``mrope_section`` / ``mrope_interleaved`` come from ``rope_scaling`` (with identical position
    rows M-RoPE equals plain 1-D RoPE). The ``codec_*`` ids are the talker control tokens.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_code_groups: int
    text_hidden_size: int
    text_vocab_size: int
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool
    codec_eos_token_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    codec_pad_id: int
    codec_bos_id: int


# The fields both Qwen3 stacks (talker, code predictor) store, under the same key names.
_STACK_KEYS: list[tuple[str, str, VType]] = [
    ("vocab_size", "vocab_size", VType.U32),
    ("hidden_size", "hidden_size", VType.U32),
    ("intermediate_size", "intermediate_size", VType.U32),
    ("num_hidden_layers", "num_layers", VType.U32),
    ("num_attention_heads", "num_heads", VType.U32),
    ("num_key_value_heads", "num_kv_heads", VType.U32),
    ("head_dim", "head_dim", VType.U32),
    ("rms_norm_eps", "rms_norm_eps", VType.F32),
    ("rope_theta", "rope_theta", VType.F32),
    ("max_position_embeddings", "max_position_embeddings", VType.U32),
    ("num_code_groups", "num_code_groups", VType.U32),
]

TALKER_KEYS = _ks(
    Keys.TALKER,
    [
        *_STACK_KEYS,
        ("text_hidden_size", "text_hidden_size", VType.U32),
        ("text_vocab_size", "text_vocab_size", VType.U32),
        ("mrope_section", "mrope_section", VType.U32_ARRAY),
        ("mrope_interleaved", "mrope_interleaved", VType.BOOL),
        ("codec_eos_token_id", "codec_eos_token_id", VType.U32),
        ("codec_think_id", "codec_think_id", VType.U32),
        ("codec_nothink_id", "codec_nothink_id", VType.U32),
        ("codec_think_bos_id", "codec_think_bos_id", VType.U32),
        ("codec_think_eos_id", "codec_think_eos_id", VType.U32),
        ("codec_pad_id", "codec_pad_id", VType.U32),
        ("codec_bos_id", "codec_bos_id", VType.U32),
    ],
)


@dataclass(frozen=True)
class CodePredictorConfig:
    """Code-predictor config (``talker_config.code_predictor_config``).

    ``has_mtp_projection`` says whether ``cp.mtp_proj.{weight,bias}`` exist (the reference uses
    an identity when the talker and code-predictor widths are equal).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_code_groups: int
    has_mtp_projection: bool


CODE_PREDICTOR_KEYS = _ks(
    Keys.CODE_PREDICTOR,
    [
        *_STACK_KEYS,
        ("has_mtp_projection", "has_mtp_projection", VType.BOOL),
    ],
)


@dataclass(frozen=True)
class SpecialIds:
    """Text-vocabulary special ids from the root ``config.json``."""

    im_start_token_id: int
    im_end_token_id: int
    tts_pad_token_id: int
    tts_bos_token_id: int
    tts_eos_token_id: int


SPECIAL_KEYS = _ks(
    Keys.TEXT,
    [
        ("im_start_token_id", "im_start_token_id", VType.U32),
        ("im_end_token_id", "im_end_token_id", VType.U32),
        ("tts_pad_token_id", "tts_pad_token_id", VType.U32),
        ("tts_bos_token_id", "tts_bos_token_id", VType.U32),
        ("tts_eos_token_id", "tts_eos_token_id", VType.U32),
    ],
)


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults (``generation_config.json``; the released values where a key is absent)."""

    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    min_new_tokens: int = 2
    max_new_tokens: int = 2048
    subtalker_dosample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0


GENERATION_KEYS = _ks(
    Keys.GENERATION,
    [
        ("do_sample", "do_sample", VType.BOOL),
        ("temperature", "temperature", VType.F32),
        ("top_k", "top_k", VType.U32),
        ("top_p", "top_p", VType.F32),
        ("repetition_penalty", "repetition_penalty", VType.F32),
        ("min_new_tokens", "min_new_tokens", VType.U32),
        ("max_new_tokens", "max_new_tokens", VType.U32),
        ("subtalker_dosample", "subtalker_dosample", VType.BOOL),
        ("subtalker_temperature", "subtalker_temperature", VType.F32),
        ("subtalker_top_k", "subtalker_top_k", VType.U32),
        ("subtalker_top_p", "subtalker_top_p", VType.F32),
    ],
)


@dataclass(frozen=True)
class Voices:
    """Speakers (name -> codec id), languages (name -> codec id), dialect speakers."""

    speakers: dict[str, int] = field(default_factory=dict)
    languages: dict[str, int] = field(default_factory=dict)
    dialects: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Range / consistency checks (shared by converter and loader)
# ---------------------------------------------------------------------------------------------

_MAX_DIM = 1 << 20


def _pos(name: str, value: int, hi: int = _MAX_DIM) -> None:
    if not 1 <= value <= hi:
        raise SchemaError(f"{name} = {value} is out of range [1, {hi}]")


def _eps(name: str, value: float) -> None:
    if not (math.isfinite(value) and 0.0 < value <= 0.1):
        raise SchemaError(f"{name} = {value} is out of range (0, 0.1]")


def _theta(name: str, value: float) -> None:
    if not (math.isfinite(value) and 1.0 <= value <= 1e9):
        raise SchemaError(f"{name} = {value} is out of range [1, 1e9]")


def _heads(prefix: str, heads: int, kv: int, head_dim: int) -> None:
    _pos(f"{prefix}num_attention_heads", heads, 1024)
    _pos(f"{prefix}num_key_value_heads", kv, 1024)
    _pos(f"{prefix}head_dim", head_dim, 4096)
    if heads % kv:
        raise SchemaError(
            f"{prefix}num_attention_heads = {heads} is not a multiple of num_key_value_heads = {kv}"
        )
    if head_dim % 2:
        raise SchemaError(f"{prefix}head_dim = {head_dim} must be even (RoPE)")


def check_decoder_config(c: DecoderConfig) -> None:
    """Raise ``SchemaError`` if a decoder config value is out of range or inconsistent."""
    p = "decoder_config."
    _pos(p + "codebook_size", c.codebook_size, 1 << 16)
    _pos(p + "codebook_dim", c.codebook_dim, 1 << 16)
    if c.codebook_dim < 2:
        raise SchemaError(f"{p}codebook_dim = {c.codebook_dim}: a codebook vector is half of it")
    _pos(p + "num_quantizers", c.num_quantizers, 64)
    _pos(p + "num_semantic_quantizers", c.num_semantic_quantizers, c.num_quantizers)
    for name in ("latent_dim", "hidden_size", "intermediate_size", "decoder_dim"):
        _pos(p + name, getattr(c, name), 1 << 16)
    _pos(p + "num_hidden_layers", c.num_hidden_layers, 256)
    _heads(p, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    _pos(p + "sliding_window", c.sliding_window, 1 << 20)
    _pos(p + "max_position_embeddings", c.max_position_embeddings, 1 << 24)
    _theta(p + "rope_theta", c.rope_theta)
    _eps(p + "rms_norm_eps", c.rms_norm_eps)
    _eps("layer_norm_eps", c.layer_norm_eps)
    _eps("codebook_eps", c.codebook_eps)
    if not 1 <= len(c.upsample_rates) <= 8:
        raise SchemaError(f"{p}upsample_rates has {len(c.upsample_rates)} entries, expected 1..8")
    if not 0 <= len(c.upsampling_ratios) <= 8:
        raise SchemaError(f"{p}upsampling_ratios has {len(c.upsampling_ratios)} entries")
    for r in (*c.upsample_rates, *c.upsampling_ratios):
        _pos(p + "upsample rate", r, 64)
    n = len(c.upsample_rates)
    if c.decoder_dim >> n < 1:  # each upsampling block halves it, rounding down
        raise SchemaError(
            f"{p}decoder_dim = {c.decoder_dim} leaves no channels after {n} upsampling blocks"
        )
    total = math.prod(c.upsample_rates) * math.prod(c.upsampling_ratios)
    if total != c.upsample_total:
        raise SchemaError(
            f"decode_upsample_rate = {c.upsample_total} does not match the decoder's rates "
            f"(product of upsample_rates and upsampling_ratios = {total})"
        )
    _pos("output_sample_rate", c.sample_rate, 384000)


def _check_transformer(p: str, c: TalkerConfig | CodePredictorConfig) -> None:
    _pos(p + "vocab_size", c.vocab_size, 1 << 20)
    _pos(p + "hidden_size", c.hidden_size, 1 << 16)
    _pos(p + "intermediate_size", c.intermediate_size, 1 << 18)
    _pos(p + "num_hidden_layers", c.num_hidden_layers, 512)
    _heads(p, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    _eps(p + "rms_norm_eps", c.rms_norm_eps)
    _theta(p + "rope_theta", c.rope_theta)
    _pos(p + "max_position_embeddings", c.max_position_embeddings, 1 << 24)
    _pos(p + "num_code_groups", c.num_code_groups, 64)
    if c.num_code_groups < 2:
        raise SchemaError(f"{p}num_code_groups = {c.num_code_groups} must be at least 2")


def check_talker_config(
    t: TalkerConfig,
    cp: CodePredictorConfig,
    special: SpecialIds,
    voices: Voices,
    decoder: DecoderConfig | None = None,
) -> None:
    """Raise ``SchemaError`` if talker / code-predictor / id values are out of range."""
    _check_transformer("talker_config.", t)
    _check_transformer("code_predictor_config.", cp)
    _pos("talker_config.text_hidden_size", t.text_hidden_size, 1 << 16)
    _pos("talker_config.text_vocab_size", t.text_vocab_size, 1 << 22)
    if cp.num_code_groups != t.num_code_groups:
        raise SchemaError(
            f"code_predictor_config.num_code_groups = {cp.num_code_groups} differs from "
            f"talker_config.num_code_groups = {t.num_code_groups}"
        )
    if sum(t.mrope_section) != t.head_dim // 2 or any(s < 0 for s in t.mrope_section):
        raise SchemaError(
            f"talker_config.rope_scaling.mrope_section {list(t.mrope_section)} does not sum to "
            f"head_dim/2 = {t.head_dim // 2}"
        )
    n_codes = cp.vocab_size
    if t.vocab_size <= n_codes:
        raise SchemaError(
            f"talker_config.vocab_size = {t.vocab_size} leaves no room for control ids above "
            f"the {n_codes} codebook ids"
        )
    if decoder is not None:
        if decoder.num_quantizers != t.num_code_groups:
            raise SchemaError(
                f"decoder num_quantizers = {decoder.num_quantizers} differs from "
                f"talker_config.num_code_groups = {t.num_code_groups}"
            )
        if decoder.codebook_size != cp.vocab_size:
            raise SchemaError(
                f"decoder codebook_size = {decoder.codebook_size} differs from "
                f"code_predictor_config.vocab_size = {cp.vocab_size}"
            )
    for name in (
        "codec_eos_token_id",
        "codec_think_id",
        "codec_nothink_id",
        "codec_think_bos_id",
        "codec_think_eos_id",
        "codec_pad_id",
        "codec_bos_id",
    ):
        v = getattr(t, name)
        if not n_codes <= v < t.vocab_size:
            raise SchemaError(
                f"talker_config.{name} = {v} is out of range [{n_codes}, {t.vocab_size})"
            )
    for kind, table in (("codec_language_id", voices.languages), ("spk_id", voices.speakers)):
        for name, v in table.items():
            if not name:
                raise SchemaError(f"talker_config.{kind} has an empty name")
            if not n_codes <= v < t.vocab_size:
                raise SchemaError(
                    f"talker_config.{kind}[{name!r}] = {v} is out of range "
                    f"[{n_codes}, {t.vocab_size})"
                )
    for spk, dialect in voices.dialects.items():
        if spk not in voices.speakers:
            raise SchemaError(f"talker_config.spk_is_dialect names unknown speaker {spk!r}")
        if dialect not in voices.languages:
            raise SchemaError(
                f"talker_config.spk_is_dialect[{spk!r}] = {dialect!r} is not a language in "
                "codec_language_id"
            )
    for name in (spec.field for spec in SPECIAL_KEYS):
        v = getattr(special, name)
        if not 0 <= v < t.text_vocab_size:
            raise SchemaError(f"{name} = {v} is out of range [0, {t.text_vocab_size})")


def check_generation(g: GenerationDefaults) -> None:
    """Raise ``SchemaError`` if a sampling default is out of range."""
    for name in ("temperature", "subtalker_temperature"):
        v = getattr(g, name)
        if not (math.isfinite(v) and 0.0 < v <= 100.0):
            raise SchemaError(f"generation_config {name} = {v} is out of range (0, 100]")
    for name in ("top_p", "subtalker_top_p"):
        v = getattr(g, name)
        if not (math.isfinite(v) and 0.0 < v <= 1.0):
            raise SchemaError(f"generation_config {name} = {v} is out of range (0, 1]")
    for name in ("top_k", "subtalker_top_k"):
        v = getattr(g, name)
        if not 0 <= v <= 1 << 20:
            raise SchemaError(f"generation_config {name} = {v} is out of range [0, 2^20]")
    if not (math.isfinite(g.repetition_penalty) and 0.0 < g.repetition_penalty <= 100.0):
        raise SchemaError(
            f"generation_config repetition_penalty = {g.repetition_penalty} is out of range"
        )
    _pos("generation_config max_new_tokens", g.max_new_tokens, 1 << 20)
    if not 0 <= g.min_new_tokens <= g.max_new_tokens:
        raise SchemaError(
            f"generation_config min_new_tokens = {g.min_new_tokens} is out of range "
            f"[0, max_new_tokens = {g.max_new_tokens}]"
        )


# ---------------------------------------------------------------------------------------------
# The tensor name table
# ---------------------------------------------------------------------------------------------


class Kind(enum.Enum):
    """Precision class of a tensor (see the module docstring)."""

    F32 = "f32"
    EMBED = "embed"
    WEIGHT = "weight"


ALLOWED_TYPES: dict[Kind, frozenset[int]] = {
    Kind.F32: frozenset({GGML_F32}),
    Kind.EMBED: frozenset({GGML_F32, GGML_F16, GGML_BF16}),
    Kind.WEIGHT: frozenset({GGML_F32, GGML_F16, GGML_BF16, GGML_Q8_0, GGML_Q4_0}),
}


@dataclass(frozen=True)
class TensorSpec:
    """One row of the name table.

    ``name``: GGUF name; ``hf_name``: full name in the HF safetensors file; ``shape``: stored
    shape (PyTorch order); ``hf_shape``: shape in the HF file (differs only where the converter
    squeezes); ``kind``: precision class; ``part``: "decoder" or "talker".
    """

    name: str
    hf_name: str
    shape: tuple[int, ...]
    hf_shape: tuple[int, ...]
    kind: Kind
    part: str


# HF tensors the converter knows and skips (never an error).
DECODER_SKIPPED_HF = (
    "decoder.quantizer.rvq_first.input_proj.weight",  # encode only
    "decoder.quantizer.rvq_rest.input_proj.weight",  # encode only
)
ENCODER_HF_PREFIX = "encoder."  # Mimi encoder: part "codec_encoder" (voice cloning)
SPEAKER_ENCODER_HF_PREFIX = "speaker_encoder."  # ECAPA-TDNN: part "speaker_encoder"


class Table:
    def __init__(self, part: str, hf_prefix: str) -> None:
        self.part = part
        self.hf_prefix = hf_prefix
        self.rows: list[TensorSpec] = []

    def add(
        self,
        name: str,
        hf: str,
        shape: Sequence[int],
        kind: Kind,
        hf_shape: Sequence[int] | None = None,
    ) -> None:
        shp = tuple(int(s) for s in shape)
        hshp = shp if hf_shape is None else tuple(int(s) for s in hf_shape)
        self.rows.append(TensorSpec(name, self.hf_prefix + hf, shp, hshp, kind, self.part))


def decoder_tensor_specs(c: DecoderConfig) -> list[TensorSpec]:
    """Every decoder tensor for config ``c`` (HF names carry the ``decoder.`` prefix)."""
    t = Table(PART_DECODER, "decoder.")
    F, W = Kind.F32, Kind.WEIGHT
    cbd = c.codebook_vector_dim
    nsem = c.num_semantic_quantizers
    for q in range(c.num_quantizers):
        if q < nsem:
            hf = f"quantizer.rvq_first.vq.layers.{q}._codebook"
        else:
            hf = f"quantizer.rvq_rest.vq.layers.{q - nsem}._codebook"
        t.add(f"dec.rvq.cb.{q}.embed_sum", f"{hf}.embedding_sum", [c.codebook_size, cbd], F)
        t.add(f"dec.rvq.cb.{q}.usage", f"{hf}.cluster_usage", [c.codebook_size], F)
    for which, short in (("rvq_first", "first_proj"), ("rvq_rest", "rest_proj")):
        t.add(
            f"dec.rvq.{short}.weight",
            f"quantizer.{which}.output_proj.weight",
            [c.codebook_dim, cbd],
            W,
            hf_shape=[c.codebook_dim, cbd, 1],
        )
    lat, hid = c.latent_dim, c.hidden_size
    t.add("dec.pre_conv.weight", "pre_conv.conv.weight", [lat, c.codebook_dim, 3], W)
    t.add("dec.pre_conv.bias", "pre_conv.conv.bias", [lat], F)
    t.add("dec.pretr.in_proj.weight", "pre_transformer.input_proj.weight", [hid, lat], W)
    t.add("dec.pretr.in_proj.bias", "pre_transformer.input_proj.bias", [hid], F)
    q_dim = c.num_attention_heads * c.head_dim
    kv_dim = c.num_key_value_heads * c.head_dim
    for layer in range(c.num_hidden_layers):
        hf = f"pre_transformer.layers.{layer}."
        g = f"dec.pretr.blk.{layer}."
        t.add(g + "attn_norm.weight", hf + "input_layernorm.weight", [hid], F)
        t.add(g + "attn_q.weight", hf + "self_attn.q_proj.weight", [q_dim, hid], W)
        t.add(g + "attn_k.weight", hf + "self_attn.k_proj.weight", [kv_dim, hid], W)
        t.add(g + "attn_v.weight", hf + "self_attn.v_proj.weight", [kv_dim, hid], W)
        t.add(g + "attn_out.weight", hf + "self_attn.o_proj.weight", [hid, q_dim], W)
        t.add(g + "attn_scale", hf + "self_attn_layer_scale.scale", [hid], F)
        t.add(g + "ffn_norm.weight", hf + "post_attention_layernorm.weight", [hid], F)
        t.add(g + "ffn_gate.weight", hf + "mlp.gate_proj.weight", [c.intermediate_size, hid], W)
        t.add(g + "ffn_up.weight", hf + "mlp.up_proj.weight", [c.intermediate_size, hid], W)
        t.add(g + "ffn_down.weight", hf + "mlp.down_proj.weight", [hid, c.intermediate_size], W)
        t.add(g + "ffn_scale", hf + "mlp_layer_scale.scale", [hid], F)
    t.add("dec.pretr.norm.weight", "pre_transformer.norm.weight", [hid], F)
    t.add("dec.pretr.out_proj.weight", "pre_transformer.output_proj.weight", [lat, hid], W)
    t.add("dec.pretr.out_proj.bias", "pre_transformer.output_proj.bias", [lat], F)
    for i, ratio in enumerate(c.upsampling_ratios):
        hf = f"upsample.{i}."
        g = f"dec.up.{i}."
        t.add(g + "tconv.weight", hf + "0.conv.weight", [lat, lat, ratio], W)
        t.add(g + "tconv.bias", hf + "0.conv.bias", [lat], F)
        t.add(g + "dwconv.weight", hf + "1.dwconv.conv.weight", [lat, 1, 7], W)
        t.add(g + "dwconv.bias", hf + "1.dwconv.conv.bias", [lat], F)
        t.add(g + "norm.weight", hf + "1.norm.weight", [lat], F)
        t.add(g + "norm.bias", hf + "1.norm.bias", [lat], F)
        t.add(g + "pwconv1.weight", hf + "1.pwconv1.weight", [4 * lat, lat], W)
        t.add(g + "pwconv1.bias", hf + "1.pwconv1.bias", [4 * lat], F)
        t.add(g + "pwconv2.weight", hf + "1.pwconv2.weight", [lat, 4 * lat], W)
        t.add(g + "pwconv2.bias", hf + "1.pwconv2.bias", [lat], F)
        t.add(g + "gamma", hf + "1.gamma", [lat], F)
    t.add("dec.conv_in.weight", "decoder.0.conv.weight", [c.decoder_dim, lat, 7], W)
    t.add("dec.conv_in.bias", "decoder.0.conv.bias", [c.decoder_dim], F)
    blocks = c.block_channels()
    for b, (cin, cout, rate) in enumerate(blocks, start=1):
        hf = f"decoder.{b}.block."
        g = f"dec.blk.{b}."
        t.add(g + "snake.alpha", hf + "0.alpha", [cin], F)
        t.add(g + "snake.beta", hf + "0.beta", [cin], F)
        t.add(g + "tconv.weight", hf + "1.conv.weight", [cin, cout, 2 * rate], W)
        t.add(g + "tconv.bias", hf + "1.conv.bias", [cout], F)
        for r in range(3):
            hr = f"{hf}{r + 2}."
            gr = f"{g}res.{r}."
            t.add(gr + "snake1.alpha", hr + "act1.alpha", [cout], F)
            t.add(gr + "snake1.beta", hr + "act1.beta", [cout], F)
            t.add(gr + "conv1.weight", hr + "conv1.conv.weight", [cout, cout, 7], W)
            t.add(gr + "conv1.bias", hr + "conv1.conv.bias", [cout], F)
            t.add(gr + "snake2.alpha", hr + "act2.alpha", [cout], F)
            t.add(gr + "snake2.beta", hr + "act2.beta", [cout], F)
            t.add(gr + "conv2.weight", hr + "conv2.conv.weight", [cout, cout, 1], W)
            t.add(gr + "conv2.bias", hr + "conv2.conv.bias", [cout], F)
    n = len(blocks)
    c_out = blocks[-1][1]
    t.add("dec.snake_out.alpha", f"decoder.{n + 1}.alpha", [c_out], F)
    t.add("dec.snake_out.beta", f"decoder.{n + 1}.beta", [c_out], F)
    t.add("dec.conv_out.weight", f"decoder.{n + 2}.conv.weight", [1, c_out, 7], W)
    t.add("dec.conv_out.bias", f"decoder.{n + 2}.conv.bias", [1], F)
    return t.rows


def _qwen3_layer(
    t: Table,
    g: str,
    hf: str,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    inter: int,
) -> None:
    F, W = Kind.F32, Kind.WEIGHT
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    t.add(g + "attn_norm.weight", hf + "input_layernorm.weight", [hidden], F)
    t.add(g + "attn_q.weight", hf + "self_attn.q_proj.weight", [q_dim, hidden], W)
    t.add(g + "attn_k.weight", hf + "self_attn.k_proj.weight", [kv_dim, hidden], W)
    t.add(g + "attn_v.weight", hf + "self_attn.v_proj.weight", [kv_dim, hidden], W)
    t.add(g + "attn_out.weight", hf + "self_attn.o_proj.weight", [hidden, q_dim], W)
    t.add(g + "attn_q_norm.weight", hf + "self_attn.q_norm.weight", [head_dim], F)
    t.add(g + "attn_k_norm.weight", hf + "self_attn.k_norm.weight", [head_dim], F)
    t.add(g + "ffn_norm.weight", hf + "post_attention_layernorm.weight", [hidden], F)
    t.add(g + "ffn_gate.weight", hf + "mlp.gate_proj.weight", [inter, hidden], W)
    t.add(g + "ffn_up.weight", hf + "mlp.up_proj.weight", [inter, hidden], W)
    t.add(g + "ffn_down.weight", hf + "mlp.down_proj.weight", [hidden, inter], W)


def talker_tensor_specs(t: TalkerConfig, cp: CodePredictorConfig) -> list[TensorSpec]:
    """Every talker + code-predictor tensor (HF names carry the ``talker.`` prefix)."""
    tb = Table(PART_TALKER, "talker.")
    F, E, W = Kind.F32, Kind.EMBED, Kind.WEIGHT
    h, th = t.hidden_size, t.text_hidden_size
    tb.add("talk.text_embd.weight", "model.text_embedding.weight", [t.text_vocab_size, th], E)
    tb.add("talk.text_proj.fc1.weight", "text_projection.linear_fc1.weight", [th, th], W)
    tb.add("talk.text_proj.fc1.bias", "text_projection.linear_fc1.bias", [th], F)
    tb.add("talk.text_proj.fc2.weight", "text_projection.linear_fc2.weight", [h, th], W)
    tb.add("talk.text_proj.fc2.bias", "text_projection.linear_fc2.bias", [h], F)
    tb.add("talk.codec_embd.weight", "model.codec_embedding.weight", [t.vocab_size, h], E)
    for layer in range(t.num_hidden_layers):
        _qwen3_layer(
            tb,
            f"talk.blk.{layer}.",
            f"model.layers.{layer}.",
            h,
            t.num_attention_heads,
            t.num_key_value_heads,
            t.head_dim,
            t.intermediate_size,
        )
    tb.add("talk.output_norm.weight", "model.norm.weight", [h], F)
    tb.add("talk.codec_head.weight", "codec_head.weight", [t.vocab_size, h], W)
    n_groups = t.num_code_groups - 1
    for j in range(n_groups):
        tb.add(
            f"cp.codec_embd.{j}.weight",
            f"code_predictor.model.codec_embedding.{j}.weight",
            [cp.vocab_size, h],
            E,
        )
    if cp.has_mtp_projection:
        tb.add(
            "cp.mtp_proj.weight",
            "code_predictor.small_to_mtp_projection.weight",
            [cp.hidden_size, h],
            W,
        )
        tb.add(
            "cp.mtp_proj.bias", "code_predictor.small_to_mtp_projection.bias", [cp.hidden_size], F
        )
    for layer in range(cp.num_hidden_layers):
        _qwen3_layer(
            tb,
            f"cp.blk.{layer}.",
            f"code_predictor.model.layers.{layer}.",
            cp.hidden_size,
            cp.num_attention_heads,
            cp.num_key_value_heads,
            cp.head_dim,
            cp.intermediate_size,
        )
    tb.add("cp.output_norm.weight", "code_predictor.model.norm.weight", [cp.hidden_size], F)
    for j in range(n_groups):
        tb.add(
            f"cp.head.{j}.weight",
            f"code_predictor.lm_head.{j}.weight",
            [cp.vocab_size, cp.hidden_size],
            W,
        )
    return tb.rows


def voices_from_arrays(
    names: Sequence[str],
    ids: Sequence[int],
    dialects: Sequence[str],
    lang_names: Sequence[str],
    lang_ids: Sequence[int],
) -> Voices:
    """Build ``Voices`` from the stored parallel arrays (raises ``SchemaError`` on mismatch)."""
    if len(names) != len(ids):
        raise SchemaError(f"{len(names)} speaker names but {len(ids)} speaker ids")
    if dialects and len(dialects) != len(names):
        raise SchemaError(f"{len(names)} speaker names but {len(dialects)} dialect entries")
    if len(lang_names) != len(lang_ids):
        raise SchemaError(f"{len(lang_names)} language names but {len(lang_ids)} language ids")
    speakers = dict(zip(names, ids, strict=True))
    languages = dict(zip(lang_names, lang_ids, strict=True))
    if len(speakers) != len(names):
        raise SchemaError("duplicate speaker name")
    if len(languages) != len(lang_names):
        raise SchemaError("duplicate language name")
    dia = {n: d for n, d in zip(names, dialects, strict=False) if d}
    return Voices(speakers=speakers, languages=languages, dialects=dia)


def config_to_kv(obj: object, specs: Sequence[KeySpec]) -> Mapping[str, tuple[VType, object]]:
    """``{key: (vtype, value)}`` of a config dataclass, following its key table."""
    return {s.key: (s.vtype, getattr(obj, s.field)) for s in specs}
