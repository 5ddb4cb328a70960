"""Schema of the codec-encoder part: the speech tokenizer's Mimi encoder (for voice cloning).

The reference (``Qwen3TTSTokenizerV2Encoder``) is transformers' ``MimiModel`` without its decoder
halves: a SEANet conv encoder (causal convs, constant padding), a causal transformer (LayerNorm,
RoPE, GELU MLP, layer scales), a stride-2 downsampling conv (replicate padding) and a split
residual VQ. qtts keeps only the first ``encoder_valid_num_quantizers`` (16) codebooks: residual
quantisation is sequential, so the first 16 codes do not depend on the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.gguf_schema import (
    ENCODER_HF_PREFIX,
    PART_CODEC_ENCODER,
    Keys,
    KeySpec,
    Kind,
    SchemaError,
    Table,
    TensorSpec,
    VType,
)

CODEBOOK_EPS = 1e-5  # MimiEuclideanCodebook's usage clamp (code constant)


@dataclass(frozen=True)
class CodecEncoderConfig:
    """The Mimi ``encoder_config`` plus the tokenizer's top-level encode settings.

    ``num_quantizers`` is the number of codebooks kept (``encoder_valid_num_quantizers``);
    ``frame_samples`` is ``encode_downsample_rate`` (samples per output frame).
    """

    hidden_size: int
    num_filters: int
    num_residual_layers: int
    upsampling_ratios: tuple[int, ...]
    kernel_size: int
    last_kernel_size: int
    residual_kernel_size: int
    dilation_growth_rate: int
    compress: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    codebook_size: int
    codebook_dim: int
    num_quantizers: int
    num_semantic_quantizers: int
    downsample_kernel: int
    sample_rate: int
    frame_samples: int

    def seanet_convs(self) -> list[tuple[str, int, int, int, int, int]]:
        """``(hf layer path, c_in, c_out, kernel, stride, dilation)`` of every SEANet conv."""
        out = [("layers.0", 1, self.num_filters, self.kernel_size, 1, 1)]
        idx, scale = 1, 1
        for ratio in reversed(self.upsampling_ratios):
            dim = scale * self.num_filters
            hidden = dim // self.compress
            for j in range(self.num_residual_layers):
                dil = self.dilation_growth_rate**j
                out.append(
                    (f"layers.{idx}.block.1", dim, hidden, self.residual_kernel_size, 1, dil)
                )
                out.append((f"layers.{idx}.block.3", hidden, dim, 1, 1, 1))
                idx += 1
            idx += 1  # ELU
            out.append((f"layers.{idx}", dim, dim * 2, ratio * 2, ratio, 1))
            idx += 1
            scale *= 2
        idx += 1  # ELU
        out.append((f"layers.{idx}", scale * self.num_filters, self.hidden_size,
                    self.last_kernel_size, 1, 1))  # fmt: skip
        return out


CODEC_ENCODER_KEYS: tuple[KeySpec, ...] = tuple(
    KeySpec(f, Keys.CODEC_ENCODER + f, t)
    for f, t in (
        ("hidden_size", VType.U32),
        ("num_filters", VType.U32),
        ("num_residual_layers", VType.U32),
        ("upsampling_ratios", VType.U32_ARRAY),
        ("kernel_size", VType.U32),
        ("last_kernel_size", VType.U32),
        ("residual_kernel_size", VType.U32),
        ("dilation_growth_rate", VType.U32),
        ("compress", VType.U32),
        ("num_hidden_layers", VType.U32),
        ("num_attention_heads", VType.U32),
        ("num_key_value_heads", VType.U32),
        ("head_dim", VType.U32),
        ("intermediate_size", VType.U32),
        ("norm_eps", VType.F32),
        ("rope_theta", VType.F32),
        ("codebook_size", VType.U32),
        ("codebook_dim", VType.U32),
        ("num_quantizers", VType.U32),
        ("num_semantic_quantizers", VType.U32),
        ("downsample_kernel", VType.U32),
        ("sample_rate", VType.U32),
        ("frame_samples", VType.U32),
    )
)

# transformers.MimiConfig defaults (the released encoder_config equals them)
_MIMI_DEFAULTS: dict[str, Any] = {
    "sampling_rate": 24000, "audio_channels": 1, "hidden_size": 512, "num_filters": 64,
    "num_residual_layers": 1, "upsampling_ratios": [8, 6, 5, 4], "kernel_size": 7,
    "last_kernel_size": 3, "residual_kernel_size": 3, "dilation_growth_rate": 2,
    "use_causal_conv": True, "pad_mode": "constant", "compress": 2, "codebook_size": 2048,
    "codebook_dim": 256, "num_quantizers": 32, "use_conv_shortcut": False,
    "vector_quantization_hidden_dimension": 256, "num_semantic_quantizers": 1,
    "num_hidden_layers": 8, "intermediate_size": 2048, "num_attention_heads": 8,
    "num_key_value_heads": 8, "head_dim": None, "hidden_act": "gelu", "norm_eps": 1e-5,
    "rope_theta": 10000.0, "attention_bias": False, "frame_rate": None, "rope_scaling": None,
}  # fmt: skip


def parse_codec_encoder_config(top: dict[str, Any]) -> CodecEncoderConfig:
    """Config from a speech-tokenizer ``config.json`` (raises ``SchemaError``)."""
    raw = top.get("encoder_config")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SchemaError("encoder_config is not an object")
    d = {**_MIMI_DEFAULTS, **raw}
    w = "encoder_config."
    fixed: tuple[tuple[str, Any], ...] = (
        ("use_causal_conv", True), ("pad_mode", "constant"), ("use_conv_shortcut", False),
        ("hidden_act", "gelu"), ("attention_bias", False), ("audio_channels", 1),
        ("rope_scaling", None),
    )  # fmt: skip
    for key, want in fixed:
        if d.get(key) != want:
            raise SchemaError(f"{w}{key} = {d.get(key)!r} is not supported (expected {want!r})")

    def i(key: str, src: dict[str, Any] = d, where: str = w) -> int:
        v = src.get(key)
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise SchemaError(f"{where}{key} = {v!r} is not an integer")
        return v

    def f(key: str) -> float:
        v = d.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise SchemaError(f"{w}{key} = {v!r} is not a number")
        return float(v)

    ratios = d.get("upsampling_ratios")
    if not isinstance(ratios, list) or not all(isinstance(r, int) for r in ratios) or not ratios:
        raise SchemaError(f"{w}upsampling_ratios = {ratios!r} is not a list of integers")
    hidden, heads = i("hidden_size"), i("num_attention_heads")
    head_dim = d.get("head_dim") or (hidden // max(heads, 1))
    sr = i("sampling_rate")
    hop = math.prod(ratios)
    encodec_rate = math.ceil(sr / hop)
    fr = d.get("frame_rate")
    frame_rate = float(fr) if isinstance(fr, int | float) and not isinstance(fr, bool) else None
    frame_samples = (
        i("encode_downsample_rate", top, "") if "encode_downsample_rate" in top else 1920
    )
    if frame_rate is None:
        frame_rate = sr / frame_samples
    if frame_rate == encodec_rate:
        raise SchemaError(f"{w}frame_rate = {frame_rate}: an encoder without downsampling")
    vq_hidden = i("vector_quantization_hidden_dimension")
    cb_dim = i("codebook_dim")
    if vq_hidden != cb_dim or vq_hidden == hidden:
        raise SchemaError(
            f"{w}vector_quantization_hidden_dimension = {vq_hidden} must equal codebook_dim "
            f"= {cb_dim} and differ from hidden_size = {hidden}"
        )
    valid = (
        i("encoder_valid_num_quantizers", top, "") if "encoder_valid_num_quantizers" in top else 16
    )
    if valid > i("num_quantizers"):
        raise SchemaError(
            f"encoder_valid_num_quantizers = {valid} exceeds {w}num_quantizers "
            f"= {i('num_quantizers')}"
        )
    cfg = CodecEncoderConfig(
        hidden_size=hidden,
        num_filters=i("num_filters"),
        num_residual_layers=i("num_residual_layers"),
        upsampling_ratios=tuple(ratios),
        kernel_size=i("kernel_size"),
        last_kernel_size=i("last_kernel_size"),
        residual_kernel_size=i("residual_kernel_size"),
        dilation_growth_rate=i("dilation_growth_rate"),
        compress=i("compress"),
        num_hidden_layers=i("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=i("num_key_value_heads"),
        head_dim=int(head_dim),
        intermediate_size=i("intermediate_size"),
        norm_eps=f("norm_eps"),
        rope_theta=f("rope_theta"),
        codebook_size=i("codebook_size"),
        codebook_dim=cb_dim,
        num_quantizers=valid,
        num_semantic_quantizers=i("num_semantic_quantizers"),
        downsample_kernel=2 * int(encodec_rate / frame_rate),
        sample_rate=sr,
        frame_samples=frame_samples,
    )
    check_codec_encoder_config(cfg)
    return cfg


def check_codec_encoder_config(c: CodecEncoderConfig) -> None:
    """Raise ``SchemaError`` if the config is out of range or inconsistent."""
    p = "encoder_config."
    for name in ("hidden_size", "num_filters", "intermediate_size", "codebook_size",
                 "codebook_dim", "head_dim"):  # fmt: skip
        v = getattr(c, name)
        if not 1 <= v <= 1 << 16:
            raise SchemaError(f"{p}{name} = {v} is out of range [1, 65536]")
    for name in ("num_residual_layers", "kernel_size", "last_kernel_size",
                 "residual_kernel_size", "dilation_growth_rate", "compress",
                 "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "downsample_kernel"):  # fmt: skip
        v = getattr(c, name)
        if not 1 <= v <= 256:
            raise SchemaError(f"{p}{name} = {v} is out of range [1, 256]")
    if c.num_attention_heads % c.num_key_value_heads or c.head_dim % 2:
        raise SchemaError(
            f"{p}heads/kv heads/head_dim {c.num_attention_heads}/"
            f"{c.num_key_value_heads}/{c.head_dim} are inconsistent"
        )
    if not 1 <= c.num_semantic_quantizers <= c.num_quantizers <= 64:
        raise SchemaError(
            f"{p}num_semantic_quantizers = {c.num_semantic_quantizers} and "
            f"{c.num_quantizers} kept quantizers are inconsistent"
        )
    if not (c.norm_eps > 0 and c.norm_eps <= 0.1 and 1 <= c.rope_theta <= 1e9):
        raise SchemaError(f"{p}norm_eps / rope_theta out of range")
    if math.prod(c.upsampling_ratios) * 2 != c.frame_samples:
        raise SchemaError(
            f"encode_downsample_rate = {c.frame_samples} is not 2 x the product of "
            f"{p}upsampling_ratios {list(c.upsampling_ratios)}"
        )
    if c.sample_rate != 24000:
        raise SchemaError(f"{p}sampling_rate = {c.sample_rate}: only 24000 is supported")


def codec_encoder_tensor_specs(c: CodecEncoderConfig) -> list[TensorSpec]:
    """The encoder tensors qtts keeps (HF names carry the ``encoder.`` prefix)."""
    t = Table(PART_CODEC_ENCODER, ENCODER_HF_PREFIX)
    F, W = Kind.F32, Kind.EMBED  # EMBED: never quantised (the encoder runs in F32)
    for n, (hf, c_in, c_out, k, _s, _d) in enumerate(c.seanet_convs()):
        t.add(f"cenc.conv.{n}.weight", f"encoder.{hf}.conv.weight", [c_out, c_in, k], W)
        t.add(f"cenc.conv.{n}.bias", f"encoder.{hf}.conv.bias", [c_out], F)
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    for layer in range(c.num_hidden_layers):
        hf, g = f"encoder_transformer.layers.{layer}.", f"cenc.tr.{layer}."
        t.add(g + "attn_norm.weight", hf + "input_layernorm.weight", [h], F)
        t.add(g + "attn_norm.bias", hf + "input_layernorm.bias", [h], F)
        t.add(g + "attn_q.weight", hf + "self_attn.q_proj.weight", [q, h], W)
        t.add(g + "attn_k.weight", hf + "self_attn.k_proj.weight", [kv, h], W)
        t.add(g + "attn_v.weight", hf + "self_attn.v_proj.weight", [kv, h], W)
        t.add(g + "attn_out.weight", hf + "self_attn.o_proj.weight", [h, q], W)
        t.add(g + "attn_scale", hf + "self_attn_layer_scale.scale", [h], F)
        t.add(g + "ffn_norm.weight", hf + "post_attention_layernorm.weight", [h], F)
        t.add(g + "ffn_norm.bias", hf + "post_attention_layernorm.bias", [h], F)
        t.add(g + "ffn_up.weight", hf + "mlp.fc1.weight", [c.intermediate_size, h], W)
        t.add(g + "ffn_down.weight", hf + "mlp.fc2.weight", [h, c.intermediate_size], W)
        t.add(g + "ffn_scale", hf + "mlp_layer_scale.scale", [h], F)
    t.add("cenc.downsample.weight", "downsample.conv.weight", [h, h, c.downsample_kernel], W)
    nsem = c.num_semantic_quantizers
    for which, short in (("semantic", "sem"), ("acoustic", "ac")):
        t.add(f"cenc.vq.{short}_in_proj.weight",
              f"quantizer.{which}_residual_vector_quantizer.input_proj.weight",
              [c.codebook_dim, h], W, hf_shape=[c.codebook_dim, h, 1])  # fmt: skip
    for qi in range(c.num_quantizers):
        if qi < nsem:
            hf = f"quantizer.semantic_residual_vector_quantizer.layers.{qi}.codebook"
        else:
            hf = f"quantizer.acoustic_residual_vector_quantizer.layers.{qi - nsem}.codebook"
        t.add(f"cenc.vq.cb.{qi}.embed_sum", f"{hf}.embed_sum", [c.codebook_size, c.codebook_dim], F)
        t.add(f"cenc.vq.cb.{qi}.usage", f"{hf}.cluster_usage", [c.codebook_size], F)
    return t.rows


def skipped_encoder_tensor(name: str, c: CodecEncoderConfig) -> bool:
    """HF ``encoder.*`` tensors qtts knows and does not keep (codebooks past the kept ones,
    output projections, ``initialized`` flags, the decoder-side halves)."""
    if not name.startswith(ENCODER_HF_PREFIX):
        return False
    rest = name[len(ENCODER_HF_PREFIX) :]
    if rest.endswith((".initialized", "output_proj.weight")):
        return True
    if rest.startswith(("decoder.", "decoder_transformer.", "upsample.")):
        return True
    prefix = "quantizer.acoustic_residual_vector_quantizer.layers."
    if rest.startswith(prefix):
        idx = rest[len(prefix) :].split(".", 1)[0]
        return idx.isdigit() and int(idx) >= c.num_quantizers - c.num_semantic_quantizers
    return False
