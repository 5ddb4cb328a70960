"""``qtts make-model``: a deterministic random-weight checkpoint in the released HF layout.

``make_checkpoint`` writes the folder a released Qwen3-TTS model has: root ``config.json`` /
``generation_config.json`` / ``model.safetensors`` (talker, plus ``speaker_encoder.*`` for Base;
bf16) / Qwen2 BPE tokenizer files, and ``speech_tokenizer/`` with ``config.json`` and
``model.safetensors`` (Mimi ``encoder.*`` and ``decoder.*``, f32). ``make_model`` then converts it
with the same code path as ``qtts convert`` into ``OUT_DIR/model.gguf`` (docs/architecture.md,
The model file) and, unless asked to keep it, removes the checkpoint (serving reads the GGUF
alone).

Variants: ``custom_voice`` (named speakers), ``base`` (voice cloning: speaker encoder, no named
speakers), ``voice_design`` (no speakers; the instruction describes the voice).

Sizes:

* ``0.6b`` (alias ``full``) — released dims of the 0.6B models (talker, decoder, Mimi encoder,
  speaker encoder), the real Qwen2 text vocabulary (``engine/tools/qwen_vocab.py``: fetched
  once through pip by pinned hash, cached) with the Qwen3 added tokens at their released ids:
  151936.
* ``1.7b`` — the 1.7B talker (hidden 2048, intermediate 6144; code predictor 1024 wide, so the
  ``small_to_mtp_projection`` exists) with the same decoder, encoders and vocabulary.
* ``tiny`` — small dims for fast tests; the codec side keeps the released ids (codebooks of
  2048, talker vocabulary 3072, same control/language/speaker ids), the text vocabulary is 512
  with the same 33 added tokens appended after a small learned BPE vocabulary, and the text
  special ids in config.json are remapped to where those tokens land.

Weights are seeded per tensor (``seed`` and the tensor name), scaled so activations stay finite:
linears and embeddings ``N(0, 0.02)``, convolutions ``N(0, 1/fan_in)``, norms 1, biases
``N(0, 0.01)``, layer scales 0.01, ConvNeXt gamma 0.1, snake alpha/beta ~0, codebook usage
positive with a few exact zeros (their sums ~0). The configs carry ``"qtts_synthetic": true`` and
the GGUF ``qtts.synthetic = true``: the audio such a model makes is noise, not speech.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import shutil
import tempfile
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.codec_encoder.schema import codec_encoder_tensor_specs, parse_codec_encoder_config
from engine.dtypes import f32_to_bf16
from engine.errors import ConversionError
from engine.gguf_schema import (
    DECODER_SKIPPED_HF,
    SchemaError,
    decoder_tensor_specs,
    talker_tensor_specs,
)
from engine.speaker.schema import parse_speaker_config, speaker_tensor_specs
from engine.tokenizer_gguf import bytes_to_unicode, qwen2_pre_tokenizer
from engine.tools import qwen_vocab
from engine.tools.convert import (
    SYNTHETIC_MARKER,
    ConversionReport,
    SafetensorsWriter,
    convert,
    parse_decoder_config,
    parse_talker_config,
)

SIZES = ("tiny", "0.6b", "1.7b", "full")  # "full" = "0.6b" (the name older tests use)
VARIANTS = ("custom_voice", "base", "voice_design")
RECIPES = ("default", "stress")  # weight recipes: see generate_tensor / _stress

# The 33 added tokens of the Qwen3 tokenizer, in id order from <|endoftext|> (151643 released).
# (content, special)
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)
_ADDED_INDEX = {c: i for i, (c, _) in enumerate(QWEN3_ADDED_TOKENS)}

# Codec control / language / speaker ids of the released 0.6B CustomVoice config.
CODEC_IDS = {
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
    "codec_eos_token_id": 2150,
    "codec_think_id": 2154,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
}
LANGUAGE_IDS = {
    "chinese": 2055,
    "english": 2050,
    "german": 2053,
    "italian": 2070,
    "portuguese": 2071,
    "spanish": 2054,
    "japanese": 2058,
    "korean": 2064,
    "french": 2061,
    "russian": 2069,
    "beijing_dialect": 2074,
    "sichuan_dialect": 2062,
}
SPEAKER_IDS = {
    "serena": 3066,
    "vivian": 3065,
    "uncle_fu": 3010,
    "ryan": 3061,
    "aiden": 2861,
    "ono_anna": 2873,
    "sohee": 2864,
    "eric": 2875,
    "dylan": 2878,
}
SPEAKER_DIALECTS = {"eric": "sichuan_dialect", "dylan": "beijing_dialect"}

_DIMS: dict[str, dict[str, dict[str, Any]]] = {
    "0.6b": {
        "decoder": {
            "codebook_size": 2048, "codebook_dim": 512, "latent_dim": 1024, "hidden_size": 512,
            "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 16,
            "head_dim": 64, "intermediate_size": 1024, "sliding_window": 72,
            "decoder_dim": 1536, "vector_quantization_hidden_dimension": 512,
        },
        "talker": {
            "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
            "text_hidden_size": 2048, "text_vocab_size": 151936, "mrope_section": [24, 20, 20],
        },
        "cp": {
            "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 5,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        },
        "speaker": {"enc_dim": 1024},
        "mimi": {},
    },
    "tiny": {
        "decoder": {
            "codebook_size": 2048, "codebook_dim": 32, "latent_dim": 32, "hidden_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
            "head_dim": 16, "intermediate_size": 64, "sliding_window": 8, "decoder_dim": 64,
            "vector_quantization_hidden_dimension": 32,
        },
        "talker": {
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "text_hidden_size": 32, "text_vocab_size": 512, "mrope_section": [4, 2, 2],
        },
        "cp": {
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        },
        # the mel front end is fixed (128 bands), the network is small
        "speaker": {
            "enc_dim": 32, "enc_channels": [32, 32, 32, 32, 96],
            "enc_kernel_sizes": [5, 3, 3, 3, 1], "enc_dilations": [1, 2, 3, 4, 1],
            "enc_attention_channels": 16, "enc_res2net_scale": 4, "enc_se_channels": 16,
        },
        "mimi": {
            "hidden_size": 32, "num_filters": 4, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 64, "codebook_dim": 16,
            "vector_quantization_hidden_dimension": 16, "upsample_groups": 32,
        },
    },
}  # fmt: skip
_DIMS["1.7b"] = {
    **_DIMS["0.6b"],
    "talker": {**_DIMS["0.6b"]["talker"], "hidden_size": 2048, "intermediate_size": 6144},
    "speaker": {"enc_dim": 2048},
}
_DIMS["full"] = _DIMS["0.6b"]

# Text the synthetic BPE merges are learned from (any text works; this one is varied).
_CORPUS = """\
The quick brown fox jumps over the lazy dog. Speech synthesis turns written text into sound.
A talker predicts the first codebook, a code predictor fills in the rest, and the decoder turns
sixteen codes per frame into twenty-four thousand samples per second. Hello, world! How are you
today? I'm fine, thanks; we'll see what they've done. It's 12:30 on 2024-05-17, and the price is
$19.99 (about 18 euros). Numbers like 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 100 and 1000 are common.
Streaming audio should start quickly: the first chunk matters most for latency. Voices such as
Vivian, Serena, Ryan and Aiden speak English, Chinese, Japanese, Korean, German, French, Spanish,
Italian, Portuguese and Russian. 你好世界。今天天气很好。こんにちは。안녕하세요. Привет, мир!
Guten Tag, wie geht es Ihnen? Bonjour, comment allez-vous? ¿Dónde está la biblioteca?
The model reads the text, thinks about the language, and then it speaks the words one frame at a
time, eighty milliseconds per frame, until it reaches the end of speech token.
"""
# Chat-template words must be single tokens: the prompt code relies on
# "<|im_start|>assistant\n" being exactly 3 tokens (engine/talker/prompt.py).
_CORPUS += "system\nuser\nassistant\nuser\nassistant\n" * 40


def _learn_merges(n_merges: int) -> list[tuple[str, str]]:
    """Deterministic byte-level BPE merges learned from ``_CORPUS`` (ties broken by pair)."""
    pre = qwen2_pre_tokenizer()
    pieces = [p for p, _ in pre.pre_tokenize_str(_CORPUS)]
    words: Counter[tuple[str, ...]] = Counter(tuple(p) for p in pieces)
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, f in words.items():
            for a, b in itertools.pairwise(w):
                pairs[(a, b)] += f
        if not pairs:
            break
        best, count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if count < 2:
            break
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for w, f in words.items():
            out: list[str] = []
            i = 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += f
        words = merged
    return merges


def _write_synthetic_vocab(folder: Path, base: int) -> None:
    """A small vocabulary of exactly ``base`` entries: 256 byte symbols, merges learned from
    ``_CORPUS``, then filler tokens."""
    vocab: dict[str, int] = {}
    for ch in bytes_to_unicode().values():
        vocab[ch] = len(vocab)
    merges = _learn_merges(min(base - 256, 4000))
    for a, b in merges:
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
    i = 0
    while len(vocab) < base:
        vocab.setdefault(f"qtts_fill_{i}", len(vocab))
        i += 1
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )


def write_tokenizer_files(folder: Path, text_vocab_size: int) -> dict[str, int]:
    """Write vocab.json / merges.txt / tokenizer_config.json; return the text special ids.

    ``full`` (151936): the real Qwen2 vocabulary (engine/tools/qwen_vocab.py), 151643 ranked
    tokens. ``tiny``: a small learned vocabulary of ``text_vocab_size - 33`` entries. Either
    way the 33 added tokens follow it contiguously — which is how ``Qwen2TokenizerFast``
    assigns their ids.
    """
    n_added = len(QWEN3_ADDED_TOKENS)
    base = 151643 if text_vocab_size >= 151643 + n_added else text_vocab_size - n_added
    if base < 256:
        raise ConversionError(str(folder), f"text_vocab_size {text_vocab_size} is too small")
    if base == qwen_vocab.N_RANKS:
        # The released vocabulary itself (fetched once through pip, cached): prompts tokenize
        # exactly as with a real checkpoint, so prompt lengths and timings are the real ones.
        qwen_vocab.write_vocab_files(folder)
    else:
        _write_synthetic_vocab(folder, base)
    added = {
        str(base + k): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for k, (content, special) in enumerate(QWEN3_ADDED_TOKENS)
    }
    cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [
            "<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>",
            "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
        ],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")

    def at(content: str) -> int:
        return base + _ADDED_INDEX[content]

    return {
        "im_start_token_id": at("<|im_start|>"),
        "im_end_token_id": at("<|im_end|>"),
        "tts_pad_token_id": at("<tts_pad>"),
        "tts_bos_token_id": at("<tts_text_bos>"),
        "tts_eos_token_id": at("<tts_text_eod>"),
    }


def build_configs(
    size: str, variant: str = "custom_voice", overrides: dict[str, dict[str, Any]] | None = None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(root config, speech-tokenizer config, generation config)`` for a size.

    ``overrides`` may hold ``"decoder"``, ``"talker"``, ``"cp"``, ``"speaker"``, ``"mimi"`` and
    ``"root"`` dicts merged into the respective config sections (tests use it to build
    unusual layouts). Text special ids are filled in by ``make_checkpoint`` from the tokenizer
    it writes.
    """
    if size not in SIZES:
        raise ConversionError("--size", f"{size!r} is not one of {', '.join(SIZES)}")
    if variant not in VARIANTS:
        raise ConversionError("--variant", f"{variant!r} is not one of {', '.join(VARIANTS)}")
    ov = overrides or {}
    dims = _DIMS[size]
    mimi = {
        "model_type": "mimi", "hidden_size": 512, "num_hidden_layers": 8, "num_quantizers": 32,
        "codebook_size": 2048, "codebook_dim": 256, "frame_rate": 12.5, "sampling_rate": 24000,
        **dims["mimi"], **ov.get("mimi", {}),
    }  # fmt: skip
    dec = {
        **dims["decoder"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "layer_scale_initial_scale": 0.01,
        "max_position_embeddings": 8000,
        "num_quantizers": 16,
        "num_semantic_quantizers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "semantic_codebook_size": 4096,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        **ov.get("decoder", {}),
    }
    st_cfg = {
        "architectures": ["Qwen3TTSTokenizerV2Model"],
        "model_type": "qwen3_tts_tokenizer_12hz",
        "encoder_valid_num_quantizers": 16,
        "input_sample_rate": 24000,
        "output_sample_rate": 24000,
        "decode_upsample_rate": 1920,
        "encode_downsample_rate": 1920,
        "encoder_config": mimi,
        "decoder_config": dec,
        "transformers_version": "4.57.3",
        SYNTHETIC_MARKER: True,
    }  # fmt: skip
    tdims = dict(dims["talker"])
    mrope = tdims.pop("mrope_section")
    cp = {
        **dims["cp"],
        "vocab_size": 2048,
        "hidden_act": "silu",
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "attention_bias": False,
        "use_sliding_window": False,
        "num_code_groups": 16,
        **ov.get("cp", {}),
    }
    talker = {
        **tdims,
        "vocab_size": 3072,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": {"interleaved": True, "mrope_section": mrope, "rope_type": "default"},
        "attention_bias": False,
        "use_sliding_window": False,
        "num_code_groups": 16,
        **CODEC_IDS,
        "codec_language_id": dict(LANGUAGE_IDS),
        "spk_id": {k: [v] for k, v in SPEAKER_IDS.items()} if variant == "custom_voice" else {},
        "spk_is_dialect": (
            {k: SPEAKER_DIALECTS.get(k, False) for k in SPEAKER_IDS}
            if variant == "custom_voice" else {}
        ),
        "code_predictor_config": cp,
        **ov.get("talker", {}),
    }
    root = {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "model_type": "qwen3_tts",
        "tts_model_type": variant,
        "tts_model_size": "1b7" if size == "1.7b" or variant == "voice_design" else "0b6",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "talker_config": talker,
        "speaker_encoder_config": {
            "enc_dim": int(talker["hidden_size"]), "sample_rate": 24000,
            **{k: v for k, v in dims["speaker"].items() if k != "enc_dim"},
            **ov.get("speaker", {}),
        },
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.3",
        SYNTHETIC_MARKER: True,
        **ov.get("root", {}),
    }
    gen = {
        "do_sample": True,
        "repetition_penalty": 1.05,
        "temperature": 0.9,
        "top_p": 1.0,
        "top_k": 50,
        "subtalker_dosample": True,
        "subtalker_temperature": 0.9,
        "subtalker_top_k": 50,
        "subtalker_top_p": 1.0,
        "max_new_tokens": 8192,
    }
    return root, st_cfg, gen


# ---------------------------------------------------------------------------------------------
# Random weights
# ---------------------------------------------------------------------------------------------

_CHUNK = 4 << 20


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _usage(seed: int, name: str, n: int) -> npt.NDArray[np.float32]:
    rng = _rng(seed, name)
    u = rng.uniform(0.5, 2.0, size=n).astype(np.float32)
    u[rng.choice(n, size=min(3, n), replace=False)] = 0.0
    return u


def _fill(name: str, shape: Sequence[int]) -> float | None:
    """Constant init for the tensor, or None for a random one."""
    if name.endswith(("layernorm.weight", "norm.weight", "q_norm.weight", "k_norm.weight")):
        return 1.0
    if name.endswith("layer_scale.scale"):
        return 0.01
    if name.endswith(".gamma"):
        return 0.1
    if name.endswith(".norm.bias"):
        return 0.0
    return None


def _std(name: str, shape: Sequence[int]) -> float:
    if name.endswith((".alpha", ".beta")) or name.endswith(".bias"):
        return 0.01
    if len(shape) == 3:  # conv: [out, in/groups, k]; transposed conv: [in, out, k]
        if ".upsample." in f".{name}" and name.endswith("0.conv.weight"):
            fan_in = shape[0]  # kernel == stride: one tap per output
        elif name.startswith("decoder.") and ".block.1.conv.weight" in name:
            fan_in = shape[0] * 2  # kernel 2r, stride r: two taps per output
        else:
            fan_in = shape[1] * shape[2]
        return 1.0 / math.sqrt(fan_in)
    return 0.02


def _stress(name: str, shape: Sequence[int], rng: np.random.Generator,
            n_upsample: int) -> npt.NDArray[np.float32] | None:
    """The ``stress`` recipe's value of a decoder or talker tensor (None: as ``default``).

    Every stage O(1), as trained weights are (the recipe of the parity fixtures,
    tests/parity/reference.py): decoder layer scales and ConvNeXt gammas U(0.2, 0.6), snake
    log-alpha/beta N(0, 0.3), unit-gain linears and convs (the residual units' second conv 0.3,
    the final conv 0.1, so the waveform is O(0.3) and barely clipped); talker and code predictor
    linears N(0, 1/fan_in) and embeddings N(0, 1), so logits are peaked and every layer moves
    the residual stream; the cloning encoders (Base models: the speech tokenizer's Mimi encoder
    and the ECAPA-TDNN speaker encoder) unit-gain convs and linears, biases N(0, 0.1), norms
    N(1, 0.1) and layer scales U(0.2, 0.6), codebooks as ``default``.
    """
    leaf = name.rsplit(".", 1)[-1]
    shp = tuple(shape)

    def normal(std: float, mean: float = 0.0) -> npt.NDArray[np.float32]:
        return (rng.standard_normal(shp, dtype=np.float32) * np.float32(std)
                + np.float32(mean))

    if name.startswith(("encoder.", "speaker_encoder.")):
        if ".codebook." in name:
            return None
        if leaf == "scale":
            return rng.uniform(0.2, 0.6, shp).astype(np.float32)
        if leaf == "bias":
            return normal(0.1)
        if len(shp) == 1:
            return normal(0.1, 1.0)
        return normal(math.prod(shp[1:]) ** -0.5)

    if name.startswith("decoder."):
        if "cluster_usage" in name or "embedding_sum" in name or name.endswith(".initialized"):
            return None
        if leaf in ("alpha", "beta"):
            return normal(0.3)
        if leaf in ("scale", "gamma"):
            return rng.uniform(0.2, 0.6, shp).astype(np.float32)
        if ".norm." in f".{name}" or "layernorm" in name or leaf == "bias":
            return normal(0.1, 1.0) if leaf == "weight" else normal(0.05)
        if ("upsample." in name and name.endswith(".0.conv.weight")) or (
                name.startswith("decoder.decoder.") and ".block.1.conv.weight" in name):
            c_in, _, k = shp  # transposed conv [in, out, k]
            stride = k if "upsample." in name else k // 2
            return normal((c_in * k / stride) ** -0.5)
        if name.endswith("output_proj.weight") and ".quantizer." in f".{name}":
            return normal((shp[1] * (15 if "rvq_rest" in name else 1)) ** -0.5)
        if len(shp) == 3:
            gain = 1.0
            if name.endswith(".conv2.conv.weight"):
                gain = 0.3
            elif name == f"decoder.decoder.{n_upsample + 2}.conv.weight":
                gain = 0.1
            return normal(gain * (shp[1] * shp[2]) ** -0.5)
        if len(shp) == 2:
            return normal(shp[1] ** -0.5)
        return None
    if name.startswith("talker.") and name.endswith(".weight") and len(shp) == 2:
        if "embedding" in name:
            return normal(1.0)
        return normal(shp[1] ** -0.5)
    return None


def generate_tensor(
    seed: int, name: str, shape: Sequence[int], recipe: str = "default", n_upsample: int = 4
) -> Iterator[npt.NDArray[np.float32]]:
    """Yield float32 chunks (flat, in order) of the deterministic init of tensor ``name``
    (``recipe``: ``default`` or ``stress``, see ``_stress``)."""
    n = math.prod(shape)
    if recipe == "stress":
        value = _stress(name, shape, _rng(seed, name), n_upsample)
        if value is not None:
            yield value.reshape(-1)
            return
    if name.endswith("cluster_usage"):
        yield _usage(seed, name, n)
        return
    if name.endswith(".initialized"):
        yield np.ones(n, dtype=np.float32)
        return
    if name.endswith(("embedding_sum", "embed_sum")):
        stem = name.rsplit(".", 1)[0]
        usage = _usage(seed, stem + ".cluster_usage", shape[0])
        e = _rng(seed, name).standard_normal(tuple(shape), dtype=np.float32)
        e *= np.where(usage > 0, usage, 1e-6).astype(np.float32)[:, None]
        yield e.reshape(-1)
        return
    const = _fill(name, shape)
    if const is not None:
        yield np.full(n, const, dtype=np.float32)
        return
    rng, std = _rng(seed, name), np.float32(_std(name, shape))
    for start in range(0, n, _CHUNK):
        x = rng.standard_normal(min(_CHUNK, n - start), dtype=np.float32)
        x *= std
        yield x


def _write_safetensors(
    path: Path, tensors: Sequence[tuple[str, Sequence[int]]], dtype: str, seed: int, bar: Any,
    recipe: str = "default", n_upsample: int = 4,
) -> None:
    ordered = sorted(tensors)
    # (a failed or interrupted write removes the file: a truncated checkpoint is not kept)
    with SafetensorsWriter(path, [(n, dtype, s) for n, s in ordered]) as w:
        for name, shape in ordered:
            for chunk in generate_tensor(seed, name, shape, recipe, n_upsample):
                data = f32_to_bf16(chunk) if dtype == "BF16" else chunk
                w.write(data)
                bar.update(data.nbytes)


@contextlib.contextmanager
def _writing(out: Path, problem: str = "cannot write") -> Iterator[None]:
    """An ``OSError`` while writing into ``out`` (a full disk, a read-only folder) as the
    one-line ``ConversionError`` that ``qtts`` prints, with the system's reason."""
    try:
        yield
    except OSError as exc:
        raise ConversionError(str(out), f"{problem} ({exc.strerror or exc})") from None


def _mimi_hf_tensors(st_cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every ``encoder.*`` tensor of the released tokenizer file (all 32 codebooks)."""
    total = int(st_cfg["encoder_config"]["num_quantizers"])
    cfg = parse_codec_encoder_config({**st_cfg, "encoder_valid_num_quantizers": total})
    out = [(s.hf_name, s.hf_shape) for s in codec_encoder_tensor_specs(cfg)]
    q = "encoder.quantizer."
    for which, n in (("semantic", cfg.num_semantic_quantizers),
                     ("acoustic", total - cfg.num_semantic_quantizers)):  # fmt: skip
        rvq = f"{q}{which}_residual_vector_quantizer."
        out.append((rvq + "output_proj.weight", (cfg.hidden_size, cfg.codebook_dim, 1)))
        out += [(f"{rvq}layers.{i}.codebook.initialized", (1,)) for i in range(n)]
    return out


def make_checkpoint(
    out_dir: str | os.PathLike[str],
    size: str = "tiny",
    seed: int = 0,
    variant: str = "custom_voice",
    overrides: dict[str, dict[str, Any]] | None = None,
    progress: bool = True,
    recipe: str = "default",
) -> Path:
    """Write a random-weight checkpoint folder in the released HF layout; return its path."""
    from tqdm import tqdm

    if recipe not in RECIPES:
        raise ConversionError("--recipe", f"{recipe!r} is not one of {', '.join(RECIPES)}")

    out = Path(out_dir)
    root, st_cfg, gen = build_configs(size, variant, overrides)
    with _writing(out, "cannot create"):
        (out / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    with _writing(out):
        root.update(write_tokenizer_files(out, int(root["talker_config"]["text_vocab_size"])))
    try:
        dec_cfg = parse_decoder_config(st_cfg)
        talker, cp, _, _ = parse_talker_config(root, has_mtp_tensor=False)
    except SchemaError as exc:
        raise ConversionError(str(out), f"bad synthetic config: {exc}") from None
    dec_tensors = [(s.hf_name, s.hf_shape) for s in decoder_tensor_specs(dec_cfg)]
    cbd = dec_cfg.codebook_vector_dim
    dec_tensors += [(n, (cbd, dec_cfg.codebook_dim, 1)) for n in DECODER_SKIPPED_HF]
    dec_tensors += _mimi_hf_tensors(st_cfg)
    talk_tensors = [(s.hf_name, s.hf_shape) for s in talker_tensor_specs(talker, cp)]
    if variant == "base":
        spk = parse_speaker_config(root["speaker_encoder_config"])
        talk_tensors += [(s.hf_name, s.hf_shape) for s in speaker_tensor_specs(spk)]
    total = 4 * sum(math.prod(s) for _, s in dec_tensors)
    total += 2 * sum(math.prod(s) for _, s in talk_tensors)
    files = {
        "config.json": root,
        "generation_config.json": gen,
        "preprocessor_config.json": {"processor_class": "Qwen3TTSProcessor"},
        "speech_tokenizer/config.json": st_cfg,
        "speech_tokenizer/preprocessor_config.json": {
            "feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1,
            "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True,
            "sampling_rate": 24000,
        },
        "speech_tokenizer/configuration.json": {"framework": "pytorch", "task": "text-to-speech"},
    }  # fmt: skip
    with _writing(out):
        for rel, obj in files.items():
            (out / rel).write_text(json.dumps(obj, indent=2, ensure_ascii=False), encoding="utf-8")
        with tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="make-model",
            disable=None if progress else True, leave=False,  # None: only on a TTY
        ) as bar:  # fmt: skip
            n_up = len(st_cfg["decoder_config"]["upsample_rates"])
            _write_safetensors(
                out / "speech_tokenizer" / "model.safetensors", dec_tensors, "F32", seed, bar,
                recipe, n_up,
            )
            _write_safetensors(out / "model.safetensors", talk_tensors, "BF16", seed, bar,
                               recipe, n_up)
    return out


def make_model(
    out_dir: str | os.PathLike[str],
    size: str = "tiny",
    seed: int = 0,
    variant: str = "custom_voice",
    dtype: str | None = None,
    progress: bool = True,
    overrides: dict[str, dict[str, Any]] | None = None,
    decoder_dtype: str = "f32",
    keep_checkpoint: bool = False,
    recipe: str = "default",
) -> ConversionReport:
    """Convert a synthetic checkpoint to ``OUT_DIR/model.gguf`` (talker f16 at released size,
    f32 tiny; decoder ``decoder_dtype``).

    Serving needs the GGUF alone; the HF-layout checkpoint it is converted from (as large
    again) stays in ``OUT_DIR`` only with ``keep_checkpoint``, else it is written to a
    temporary folder inside ``OUT_DIR`` and removed.
    """
    if dtype is None:
        dtype = "f32" if size == "tiny" else "f16"
    out = Path(out_dir)
    if keep_checkpoint:
        folder = make_checkpoint(out, size, seed, variant, overrides, progress, recipe)
        return convert(folder, folder / "model.gguf", dtype=dtype, progress=progress,
                       decoder_dtype=decoder_dtype)
    with _writing(out, "cannot create"):
        out.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".checkpoint-", dir=out))
    try:
        make_checkpoint(scratch, size, seed, variant, overrides, progress, recipe)
        return convert(scratch, out / "model.gguf", dtype=dtype, progress=progress,
                       decoder_dtype=decoder_dtype)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
