"""Schema of the speaker-encoder part: config keys, checks and the tensor table.

The reference is ``Qwen3TTSSpeakerEncoder`` (ECAPA-TDNN): an initial TDNN, SE-Res2Net blocks, a
multi-layer feature aggregation conv over the concatenated block outputs, attentive statistics
pooling and a 1x1 projection to ``enc_dim`` (the talker width). Its front end is a fixed log-mel
spectrogram whose constants are code constants of the reference (``MEL_*`` below).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.gguf_schema import (
    PART_SPEAKER,
    SPEAKER_ENCODER_HF_PREFIX,
    Keys,
    KeySpec,
    Kind,
    SchemaError,
    Table,
    TensorSpec,
    VType,
)

# Front end of ``Qwen3TTSForConditionalGeneration.extract_speaker_embedding`` (not in config).
MEL_N_FFT = 1024
MEL_HOP = 256
MEL_WIN = 1024
MEL_FMIN = 0.0
MEL_FMAX = 12000.0
MEL_MAG_EPS = 1e-9
MEL_LOG_CLAMP = 1e-5


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """``speaker_encoder_config`` of the root ``config.json`` (defaults: the reference class)."""

    mel_dim: int
    enc_dim: int
    enc_channels: tuple[int, ...]
    enc_kernel_sizes: tuple[int, ...]
    enc_dilations: tuple[int, ...]
    enc_attention_channels: int
    enc_res2net_scale: int
    enc_se_channels: int
    sample_rate: int

    @property
    def n_blocks(self) -> int:
        """Number of SE-Res2Net blocks (between the first TDNN and the aggregation conv)."""
        return len(self.enc_channels) - 2


SPEAKER_KEYS: tuple[KeySpec, ...] = tuple(
    KeySpec(f, Keys.SPEAKER + k, t)
    for f, k, t in (
        ("mel_dim", "mel_dim", VType.U32),
        ("enc_dim", "enc_dim", VType.U32),
        ("enc_channels", "channels", VType.U32_ARRAY),
        ("enc_kernel_sizes", "kernel_sizes", VType.U32_ARRAY),
        ("enc_dilations", "dilations", VType.U32_ARRAY),
        ("enc_attention_channels", "attention_channels", VType.U32),
        ("enc_res2net_scale", "res2net_scale", VType.U32),
        ("enc_se_channels", "se_channels", VType.U32),
        ("sample_rate", "sample_rate", VType.U32),
    )
)

_DEFAULTS: dict[str, Any] = {
    "mel_dim": 128,
    "enc_dim": 1024,
    "enc_channels": [512, 512, 512, 512, 1536],
    "enc_kernel_sizes": [5, 3, 3, 3, 1],
    "enc_dilations": [1, 2, 3, 4, 1],
    "enc_attention_channels": 128,
    "enc_res2net_scale": 8,
    "enc_se_channels": 128,
    "sample_rate": 24000,
}


def _int(d: dict[str, Any], key: str) -> int:
    v = d.get(key, _DEFAULTS[key])
    if isinstance(v, bool) or not isinstance(v, int):
        raise SchemaError(f"speaker_encoder_config.{key} = {v!r} is not an integer")
    return v


def _ints(d: dict[str, Any], key: str) -> tuple[int, ...]:
    v = d.get(key, _DEFAULTS[key])
    if not isinstance(v, list | tuple) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in v
    ):
        raise SchemaError(f"speaker_encoder_config.{key} = {v!r} is not a list of integers")
    return tuple(v)


def parse_speaker_config(d: dict[str, Any]) -> SpeakerEncoderConfig:
    """Config from the ``speaker_encoder_config`` object (raises ``SchemaError``)."""
    cfg = SpeakerEncoderConfig(
        mel_dim=_int(d, "mel_dim"),
        enc_dim=_int(d, "enc_dim"),
        enc_channels=_ints(d, "enc_channels"),
        enc_kernel_sizes=_ints(d, "enc_kernel_sizes"),
        enc_dilations=_ints(d, "enc_dilations"),
        enc_attention_channels=_int(d, "enc_attention_channels"),
        enc_res2net_scale=_int(d, "enc_res2net_scale"),
        enc_se_channels=_int(d, "enc_se_channels"),
        sample_rate=_int(d, "sample_rate"),
    )
    check_speaker_config(cfg)
    return cfg


def check_speaker_config(c: SpeakerEncoderConfig, talker_hidden: int | None = None) -> None:
    """Raise ``SchemaError`` if the config is out of range or inconsistent."""
    p = "speaker_encoder_config."
    for name in ("mel_dim", "enc_dim", "enc_attention_channels", "enc_se_channels"):
        v = getattr(c, name)
        if not 1 <= v <= 1 << 16:
            raise SchemaError(f"{p}{name} = {v} is out of range [1, 65536]")
    n = len(c.enc_channels)
    if n < 3 or n > 16 or len(c.enc_kernel_sizes) != n or len(c.enc_dilations) != n:
        raise SchemaError(
            f"{p}enc_channels, enc_kernel_sizes and enc_dilations must have the same length "
            f"(3..16), got {n}, {len(c.enc_kernel_sizes)}, {len(c.enc_dilations)}"
        )
    for v in (*c.enc_channels, *c.enc_kernel_sizes, *c.enc_dilations):
        if not 1 <= v <= 1 << 16:
            raise SchemaError(f"{p}channel/kernel/dilation value {v} is out of range")
    if not 2 <= c.enc_res2net_scale <= 64:
        raise SchemaError(f"{p}enc_res2net_scale = {c.enc_res2net_scale} is out of range [2, 64]")
    for i in range(1, n - 1):
        if c.enc_channels[i] % c.enc_res2net_scale or c.enc_channels[i - 1] % c.enc_res2net_scale:
            raise SchemaError(
                f"{p}enc_channels[{i}] = {c.enc_channels[i]} is not divisible by "
                f"enc_res2net_scale = {c.enc_res2net_scale}"
            )
    if sum(c.enc_channels[1:-1]) != c.enc_channels[-1]:
        raise SchemaError(
            f"{p}enc_channels[-1] = {c.enc_channels[-1]} must equal the sum of the block "
            f"channels {sum(c.enc_channels[1:-1])} (the aggregation conv reads their concatenation)"
        )
    if c.sample_rate != 24000:
        raise SchemaError(f"{p}sample_rate = {c.sample_rate}: only 24000 is supported")
    if talker_hidden is not None and c.enc_dim != talker_hidden:
        raise SchemaError(
            f"{p}enc_dim = {c.enc_dim} differs from the talker hidden size {talker_hidden}"
        )


def speaker_tensor_specs(c: SpeakerEncoderConfig) -> list[TensorSpec]:
    """Every speaker-encoder tensor (HF names carry the ``speaker_encoder.`` prefix)."""
    t = Table(PART_SPEAKER, SPEAKER_ENCODER_HF_PREFIX)
    F, W = Kind.F32, Kind.EMBED  # EMBED: never quantised (convs run in F32)
    ch, ks = c.enc_channels, c.enc_kernel_sizes

    def conv(name: str, hf: str, c_out: int, c_in: int, k: int) -> None:
        t.add(f"spk.{name}.weight", f"{hf}.weight", [c_out, c_in, k], W)
        t.add(f"spk.{name}.bias", f"{hf}.bias", [c_out], F)

    conv("tdnn0", "blocks.0.conv", ch[0], c.mel_dim, ks[0])
    s = c.enc_res2net_scale
    for i in range(1, len(ch) - 1):
        hf, g = f"blocks.{i}", f"blk.{i}"
        conv(f"{g}.tdnn1", f"{hf}.tdnn1.conv", ch[i], ch[i - 1], 1)
        for j in range(s - 1):
            conv(f"{g}.res2net.{j}", f"{hf}.res2net_block.blocks.{j}.conv",
                 ch[i] // s, ch[i] // s, ks[i])  # fmt: skip
        conv(f"{g}.tdnn2", f"{hf}.tdnn2.conv", ch[i], ch[i], 1)
        conv(f"{g}.se1", f"{hf}.se_block.conv1", c.enc_se_channels, ch[i], 1)
        conv(f"{g}.se2", f"{hf}.se_block.conv2", ch[i], c.enc_se_channels, 1)
    conv("mfa", "mfa.conv", ch[-1], ch[-1], ks[-1])
    conv("asp.tdnn", "asp.tdnn.conv", c.enc_attention_channels, ch[-1] * 3, 1)
    conv("asp.conv", "asp.conv", ch[-1], c.enc_attention_channels, 1)
    conv("fc", "fc", c.enc_dim, ch[-1] * 2, 1)
    return t.rows
