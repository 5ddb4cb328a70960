"""The official PyTorch reference (``qwen-tts`` 0.1.1) as a scriptable fixture generator.

This module is for parity tests and benchmarks only; ``engine/`` must never import it. It needs
the ``parity`` extra plus the reference package itself::

    pip install -e '.[parity]'
    pip install --no-deps qwen-tts==0.1.1

What it provides (docs/architecture.md describes the model):

* :func:`import_reference` -- imports the official speech-tokenizer classes (with empty stand-in
  modules for ``torchaudio``, ``sox`` and ``onnxruntime``, which only the unused 25 Hz tokenizer
  touches).
* :func:`decoder_config` / :func:`tokenizer_config` -- the ``tiny`` and ``full`` (released)
  configurations.
* :func:`make_reference_tokenizer_dir` -- builds ``Qwen3TTSTokenizerV2Model`` with seeded,
  scaled random weights and saves it with ``save_pretrained`` in the released
  ``speech_tokenizer/`` layout, cached by (size, seed, generator version).
* :func:`load_reference_decoder`, :func:`reference_decode`, :func:`reference_decode_official`,
  :func:`reference_stage_outputs`, :func:`random_codes`.

Codes are always numpy ``[16, T]`` integer arrays (row q = codebook q), waveforms float32.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import io
import json
import os
import shutil
import sys
import tempfile
import types
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: Bump whenever the weight recipe below changes: it is part of the cache key.
GENERATOR_VERSION = 1

FRAME_SAMPLES = 1920
"""Output samples per codec frame (``decode_upsample_rate``)."""
NUM_QUANTIZERS = 16
CODEBOOK_SIZE = 2048
SAMPLE_RATE = 24000

#: Code ids whose ``cluster_usage`` is exactly 0 in every codebook of a generated fixture
#: (the reference divides by ``max(usage, 1e-5)``).
ZERO_USAGE_IDS: tuple[int, ...] = (0, 3, 1024, 2047)
#: Code ids whose ``cluster_usage`` is positive but below the 1e-5 clamp (2.5e-6).
TINY_USAGE_IDS: tuple[int, ...] = (7, 2046)
TINY_USAGE_VALUE = 2.5e-6
USAGE_EPS = 1e-5

SIZES = ("tiny", "full")

_INSTALL_HINT = (
    "the official Qwen3-TTS reference is not installed; install it with "
    "`pip install -e '.[parity]' && pip install --no-deps qwen-tts==0.1.1` "
    "(make parity-env). torch must be the CPU wheel torch==2.13.0"
)

# Modules imported at load time by qwen_tts' 25 Hz tokenizer only (never by the 12 Hz path).
_STUB_MODULES: tuple[str, ...] = (
    "torchaudio",
    "torchaudio.compliance",
    "torchaudio.compliance.kaldi",
    "sox",
    "onnxruntime",
)


class ReferenceUnavailableError(ImportError):
    """The parity extra (torch, transformers, qwen-tts) is not installed."""


# --------------------------------------------------------------------------------------------
# import


@dataclass(frozen=True)
class ReferenceModules:
    """The reference classes and the torch module, as returned by :func:`import_reference`."""

    torch: Any
    Qwen3TTSTokenizer: Any
    """``qwen_tts.Qwen3TTSTokenizer``: the official loading/decoding wrapper."""
    Qwen3TTSTokenizerV2Model: Any
    Qwen3TTSTokenizerV2Config: Any
    Qwen3TTSTokenizerV2DecoderConfig: Any
    EncodecFeatureExtractor: Any
    no_init_weights: Any


def _install_stub(name: str) -> None:
    """Register an empty module ``name`` unless a module of that name is already imported."""
    if name in sys.modules:
        return
    mod = types.ModuleType(name, "qtts stand-in: only qwen_tts' unused 25 Hz tokenizer uses it")
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    mod.__path__ = []
    mod.__qtts_stub__ = True  # type: ignore[attr-defined]

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise AttributeError(
            f"{name}.{attr}: {name} is a qtts stand-in (the 12 Hz reference path never uses it)"
        )

    mod.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, mod)


def reference_available() -> tuple[bool, str]:
    """Return ``(True, "")`` if :func:`import_reference` works, else ``(False, reason)``."""
    try:
        import_reference()
    except ReferenceUnavailableError as e:
        return False, str(e)
    return True, ""


@functools.cache
def import_reference() -> ReferenceModules:
    """Import the official reference classes.

    Registers empty stand-ins for ``torchaudio`` (no build exists for torch 2.13), ``sox`` and
    ``onnxruntime`` (all three are imported at load time by the 25 Hz tokenizer only; the real
    ``sox`` also shells out to a ``sox`` binary and prints a warning), then imports ``qwen_tts``.
    A stand-in is only registered when the real module is not already imported. The package's
    "flash-attn is not installed" banner (printed on import) is swallowed.

    Raises:
        ReferenceUnavailableError: torch, transformers or qwen-tts is missing.
    """
    try:
        import torch
        import transformers  # noqa: F401  (import before the stubs: its availability probes)
        from transformers import EncodecFeatureExtractor
        from transformers.modeling_utils import no_init_weights
    except ImportError as e:
        raise ReferenceUnavailableError(f"{_INSTALL_HINT} ({e})") from e
    for name in _STUB_MODULES:
        _install_stub(name)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import qwen_tts  # type: ignore[import-untyped]
            from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (  # type: ignore[import-untyped]
                Qwen3TTSTokenizerV2Config,
                Qwen3TTSTokenizerV2DecoderConfig,
            )
            from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (  # type: ignore[import-untyped]
                Qwen3TTSTokenizerV2Model,
            )
    except ImportError as e:
        raise ReferenceUnavailableError(f"{_INSTALL_HINT} ({e})") from e
    return ReferenceModules(
        torch=torch,
        Qwen3TTSTokenizer=qwen_tts.Qwen3TTSTokenizer,
        Qwen3TTSTokenizerV2Model=Qwen3TTSTokenizerV2Model,
        Qwen3TTSTokenizerV2Config=Qwen3TTSTokenizerV2Config,
        Qwen3TTSTokenizerV2DecoderConfig=Qwen3TTSTokenizerV2DecoderConfig,
        EncodecFeatureExtractor=EncodecFeatureExtractor,
        no_init_weights=no_init_weights,
    )


# --------------------------------------------------------------------------------------------
# configurations


def decoder_config(size: str) -> dict[str, Any]:
    """The ``decoder_config`` block of ``speech_tokenizer/config.json`` for ``size``.

    ``"full"`` is the released configuration, field for field; ``"tiny"`` keeps the
    structure (16 codebooks of 2048, upsample rates 8·5·4·3·2·2 = 1920) with small widths.
    """
    full: dict[str, Any] = {
        "codebook_size": 2048,
        "codebook_dim": 512,
        "latent_dim": 1024,
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 64,
        "intermediate_size": 1024,
        "sliding_window": 72,
        "rope_theta": 10000,
        "max_position_embeddings": 8000,
        "rms_norm_eps": 1e-5,
        "layer_scale_initial_scale": 0.01,
        "decoder_dim": 1536,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "num_quantizers": 16,
        "num_semantic_quantizers": 1,
        "semantic_codebook_size": 4096,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
    }
    if size == "full":
        return full
    if size == "tiny":
        return {
            **full,
            "codebook_dim": 32,
            "latent_dim": 64,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 16,
            "intermediate_size": 128,
            "sliding_window": 8,
            "decoder_dim": 96,
        }
    raise ValueError(f"unknown fixture size {size!r}; expected one of {SIZES}")


def encoder_config(size: str) -> dict[str, Any]:
    """The Mimi ``encoder_config`` overrides: transformers defaults for ``full``, small for tiny.

    The encoder is only needed to *encode* reference audio (voice cloning); the decoder
    fixtures never run it, but it is part of the released file.
    """
    if size == "full":
        return {}
    if size == "tiny":
        return {
            "hidden_size": 32,
            "num_filters": 4,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 64,
            "codebook_dim": 16,
            "vector_quantization_hidden_dimension": 16,
            "upsample_groups": 32,
        }
    raise ValueError(f"unknown fixture size {size!r}; expected one of {SIZES}")


def tokenizer_config(size: str, decoder: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for ``Qwen3TTSTokenizerV2Config`` (the top level of config.json);
    ``decoder`` overrides fields of the size's ``decoder_config``."""
    return {
        "encoder_config": encoder_config(size),
        "decoder_config": {**decoder_config(size), **(decoder or {})},
        "encoder_valid_num_quantizers": 16,
        "input_sample_rate": SAMPLE_RATE,
        "output_sample_rate": SAMPLE_RATE,
        "decode_upsample_rate": FRAME_SAMPLES,
        "encode_downsample_rate": FRAME_SAMPLES,
    }


# --------------------------------------------------------------------------------------------
# seeded weights

# Gains of the weight recipe (activation std stays O(1) through the stack; the final conv gain
# puts the waveform std at roughly 0.1-0.3 so a few samples reach the [-1, 1] clamp).
_BIAS_STD = 0.05
_RES_CONV2_GAIN = 0.3
_TCONV_GAIN = 0.7
_OUT_CONV_GAIN = 0.25

#: Weight recipes. ``default``: the gains above (residual branches moderate, snake near identity).
#: ``stress``: every stage O(1), as trained weights are: layer scales U(0.2, 0.6), snake
#: log-alpha/beta ~ N(0, 0.3), conv weights N(0, gain^2 / fan_in) with gain 1 except the residual
#: units' second conv (0.3) and the final conv (0.1), codebooks N(0, 1) with zero-usage ids.
#: Fast-mode precision is measured on it (its rounding errors are amplified, not damped).
RECIPES = ("default", "stress")
_STRESS_SNAKE_STD = 0.3
_STRESS_OUT_CONV_GAIN = 0.1


def _gen(seed: int, name: str) -> Any:
    """A torch generator seeded from (seed, tensor name): order-independent and stable."""
    torch = import_reference().torch
    return torch.Generator().manual_seed((zlib.crc32(name.encode()) << 20) ^ (seed & 0xFFFFF))


def _normal(shape: tuple[int, ...], std: float, g: Any, mean: float = 0.0) -> Any:
    torch = import_reference().torch
    return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean


def _decoder_tensor(name: str, shape: tuple[int, ...], cfg: dict[str, Any], g: Any,
                    recipe: str = "default") -> Any:
    """Value of decoder tensor ``name`` (relative to ``decoder.``) under the fixture recipe."""
    torch = import_reference().torch
    stress = recipe == "stress"
    n_rest = cfg["num_quantizers"] - 1
    leaf = name.rsplit(".", 1)[-1]

    if leaf == "cluster_usage":
        usage = torch.rand(shape, generator=g, dtype=torch.float32) * 1.5 + 0.5
        usage[list(ZERO_USAGE_IDS)] = 0.0
        usage[list(TINY_USAGE_IDS)] = TINY_USAGE_VALUE
        return usage
    if leaf == "embedding_sum":
        # Un-normalised sums: the usage-normalised table E = sum / max(usage, 1e-5) is N(0, 1),
        # including the clamped rows (a port that divides by 0 or by the raw usage is off).
        raise AssertionError("embedding_sum is built together with its cluster_usage")
    if leaf in ("alpha", "beta"):  # SnakeBeta log-parameters
        return _normal(shape, _STRESS_SNAKE_STD if stress else 0.1, g)
    if stress and leaf in ("scale", "gamma"):  # LayerScale, ConvNeXt scale
        return torch.rand(shape, generator=g, dtype=torch.float32) * 0.4 + 0.2
    if leaf == "scale":  # LayerScale
        return _normal(shape, 0.1, g, mean=0.5)
    if leaf == "gamma":  # ConvNeXt scale
        return _normal(shape, 0.1, g, mean=0.5)
    if ".norm." in f".{name}" or "layernorm" in name:
        if leaf == "weight":
            return _normal(shape, 0.1, g, mean=1.0)
        return _normal(shape, _BIAS_STD, g)
    if leaf == "bias":
        return _normal(shape, _BIAS_STD, g)
    assert leaf == "weight", name

    transposed = (name.startswith("upsample.") and name.endswith(".0.conv.weight")) or (
        name.startswith("decoder.") and name.endswith(".block.1.conv.weight")
    )
    if transposed:  # ConvTranspose1d [in, out, k]; an output sees in * k/stride taps
        c_in, _, k = shape
        stride = k if name.startswith("upsample.") else k // 2
        gain = _TCONV_GAIN if name.startswith("decoder.") and not stress else 1.0
        return _normal(shape, gain * (c_in * k / stride) ** -0.5, g)
    if name.endswith("output_proj.weight") and name.startswith("quantizer."):
        fan_in = shape[1] * (n_rest if "rvq_rest" in name else 1)
        return _normal(shape, fan_in**-0.5, g)
    if len(shape) == 3:  # Conv1d [out, in/groups, k]
        gain = 1.0
        if name.endswith(".conv2.conv.weight"):
            gain = _RES_CONV2_GAIN
        elif name == f"decoder.{len(cfg['upsample_rates']) + 2}.conv.weight":
            gain = _STRESS_OUT_CONV_GAIN if stress else _OUT_CONV_GAIN
        return _normal(shape, gain * (shape[1] * shape[2]) ** -0.5, g)
    if len(shape) == 2:  # Linear [out, in]
        return _normal(shape, shape[1] ** -0.5, g)
    raise AssertionError(f"no recipe for decoder tensor {name} {shape}")


def _encoder_tensor(name: str, shape: tuple[int, ...], g: Any) -> Any:
    """Generic, deterministic values for the (unused by decoding) Mimi encoder tensors."""
    torch = import_reference().torch
    if len(shape) >= 2:
        fan_in = int(np.prod(shape[1:]))
        return _normal(shape, fan_in**-0.5, g)
    if name.endswith("cluster_usage"):
        return torch.ones(shape)
    if name.endswith("scale"):
        return torch.full(shape, 0.01)
    if name.endswith("weight"):
        return torch.ones(shape)
    return torch.zeros(shape)


def _fill_weights(model: Any, cfg: dict[str, Any], seed: int, recipe: str = "default") -> None:
    """Overwrite every float tensor of the state dict with the seeded recipe."""
    torch = import_reference().torch
    state = model.state_dict()
    with torch.no_grad():
        for name, t in state.items():
            if not t.is_floating_point():
                continue
            shape = tuple(t.shape)
            g = _gen(seed, name)
            if name.startswith("decoder."):
                rel = name[len("decoder.") :]
                if rel.endswith("embedding_sum"):
                    continue
                value = _decoder_tensor(rel, shape, cfg, g, recipe)
            else:
                value = _encoder_tensor(name, shape, g)
            t.copy_(value)
        for name, t in state.items():
            if name.startswith("decoder.") and name.endswith("embedding_sum"):
                usage = state[name.replace("embedding_sum", "cluster_usage")]
                e = _normal(tuple(t.shape), 1.0, _gen(seed, name))
                t.copy_(e * usage.clamp(min=USAGE_EPS)[:, None])


# --------------------------------------------------------------------------------------------
# build / cache / load


def default_cache_dir() -> Path:
    """Where fixtures are cached: ``$QTTS_FIXTURE_CACHE``, else ``<qtts cache>/fixtures``.

    The qtts cache is ``$QTTS_CACHE_DIR`` or ``~/.cache/qtts`` (as in tests/conftest.py).
    """
    env = os.environ.get("QTTS_FIXTURE_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("QTTS_CACHE_DIR") or "~/.cache/qtts"
    return Path(base).expanduser() / "fixtures"


def reference_versions() -> str:
    """The versions that make the reference's outputs: part of every cache key, so upgrading
    qwen-tts, transformers or torch rebuilds the cached fixtures and their outputs."""
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for dist, tag in (("qwen-tts", "qt"), ("transformers", "tf"), ("torch", "pt")):
        try:
            parts.append(f"{tag}{version(dist)}")
        except PackageNotFoundError:
            parts.append(f"{tag}none")
    return "-".join(parts).replace("+", "_")


def fixture_key(size: str, seed: int, recipe: str = "default") -> str:
    """Cache key of a reference tokenizer fixture."""
    tag = "" if recipe == "default" else f"-{recipe}"
    return f"ref-tokenizer-{size}{tag}-seed{seed}-v{GENERATOR_VERSION}-{reference_versions()}"


def _check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"unknown weight recipe {recipe!r}; expected one of {RECIPES}")


def build_reference_model(size: str, seed: int, recipe: str = "default",
                          decoder: dict[str, Any] | None = None) -> Any:
    """Instantiate ``Qwen3TTSTokenizerV2Model`` for ``size`` with the seeded fixture weights
    (``decoder``: overrides of the decoder's config, for layouts of other checkpoints).

    Deterministic for a given (size, seed): every tensor is drawn from a generator seeded by
    (seed, tensor name), nothing depends on the global RNG or on construction order.
    """
    ref = import_reference()
    config = ref.Qwen3TTSTokenizerV2Config(**tokenizer_config(size, decoder))
    with ref.no_init_weights():
        model = ref.Qwen3TTSTokenizerV2Model(config)
    _check_recipe(recipe)
    _fill_weights(model, {**decoder_config(size), **(decoder or {})}, seed, recipe)
    return model.eval()


def save_tokenizer_dir(model: Any, folder: Path) -> None:
    """``model`` as a ``speech_tokenizer/`` folder in the released layout (``save_pretrained``
    f32, and the Encodec feature extractor's config)."""
    ref = import_reference()
    model.save_pretrained(folder, safe_serialization=True)
    fe = ref.EncodecFeatureExtractor(
        feature_size=1, sampling_rate=SAMPLE_RATE, padding_value=0.0, return_attention_mask=True
    )
    fe.save_pretrained(folder)


def make_reference_tokenizer_dir(out_dir: str | os.PathLike[str], size: str, seed: int,
                                 recipe: str = "default") -> Path:
    """Build (or reuse) a random-weight ``speech_tokenizer/`` folder and return its path.

    Layout: ``out_dir/<fixture_key>/speech_tokenizer/{config.json, model.safetensors,
    preprocessor_config.json}`` -- the released layout, written by ``save_pretrained`` (f32) and
    the Encodec feature extractor's ``save_pretrained``; ``out_dir/<fixture_key>/fixture.json``
    records how it was made. The folder is built in a temporary sibling and renamed into place,
    so a present folder is always complete (concurrent builders are safe: the loser discards).
    """
    if size not in SIZES:
        raise ValueError(f"unknown fixture size {size!r}; expected one of {SIZES}")
    _check_recipe(recipe)
    key = fixture_key(size, seed, recipe)
    root = Path(out_dir) / key
    target = root / "speech_tokenizer"
    if (target / "model.safetensors").is_file():
        return target
    ref = import_reference()
    with fixture_folder(out_dir, key,
                        lambda done: (done / "speech_tokenizer" / "model.safetensors").is_file()
                        ) as tmp:
        save_tokenizer_dir(build_reference_model(size, seed, recipe), tmp / "speech_tokenizer")
        meta = {
            "size": size,
            "seed": seed,
            "recipe": recipe,
            "generator_version": GENERATOR_VERSION,
            "zero_usage_ids": list(ZERO_USAGE_IDS),
            "tiny_usage_ids": list(TINY_USAGE_IDS),
            "tiny_usage_value": TINY_USAGE_VALUE,
            "torch": ref.torch.__version__,
        }
        (tmp / "fixture.json").write_text(json.dumps(meta, indent=2) + "\n")
    return target


@contextlib.contextmanager
def fixture_folder(out_dir: str | os.PathLike[str], key: str,
                   done: Callable[[Path], bool]) -> Iterator[Path]:
    """Build the cached fixture folder ``out_dir/key`` atomically: the block fills the yielded
    temporary sibling, which is then renamed into place (when another process finished the
    same fixture first, ``done(out_dir/key)`` holds and theirs is kept); whatever is left of
    the temporary folder is removed, also on error."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    root = Path(out_dir) / key
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=out_dir))
    tmp.chmod(0o755)
    try:
        yield tmp
        try:
            tmp.rename(root)
        except OSError:
            if not done(root):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_reference_decoder(
    tokenizer_dir: str | os.PathLike[str], attn_implementation: str | None = None
) -> Any:
    """Load a ``speech_tokenizer/`` folder through the official path, float32, eval mode.

    Uses ``qwen_tts.Qwen3TTSTokenizer.from_pretrained`` (AutoFeatureExtractor + AutoModel after
    the package's own Auto* registration) and returns its ``Qwen3TTSTokenizerV2Model``
    (``.decoder`` is the ``Qwen3TTSTokenizerV2Decoder``). ``attn_implementation=None`` keeps the
    transformers default (``sdpa``, as the official package gets); ``"eager"`` switches the
    decoder to the plain matmul/softmax path (useful to cross-check the sliding-window mask).
    Thread count is left to the caller.
    """
    ref = import_reference()
    wrapper = ref.Qwen3TTSTokenizer.from_pretrained(str(tokenizer_dir), dtype=ref.torch.float32)
    model = wrapper.model.eval()
    if model.get_model_type() != "qwen3_tts_tokenizer_12hz":
        raise ValueError(f"{tokenizer_dir}: not a 12 Hz tokenizer ({model.get_model_type()})")
    if attn_implementation is not None:
        # Passing attn_implementation to from_pretrained only reaches the top-level config; the
        # decoder's attention layers and mask builder read the decoder module's own config.
        model.config._attn_implementation = attn_implementation
        model.decoder.config._attn_implementation = attn_implementation
    return model


# --------------------------------------------------------------------------------------------
# decoding


def random_codes(
    T: int,
    seed: int,
    zero_usage_ids: tuple[int, ...] = ZERO_USAGE_IDS + TINY_USAGE_IDS,
    num_quantizers: int = NUM_QUANTIZERS,
    codebook_size: int = CODEBOOK_SIZE,
) -> np.ndarray:
    """Seeded uniform codes ``[num_quantizers, T]`` (int64) that contain clamped-usage ids.

    Every id in ``zero_usage_ids`` appears in every codebook (at seeded positions) as long as
    ``T >= len(zero_usage_ids)``; for smaller T as many as fit. The defaults are the fixture's
    exact-zero and below-epsilon ``cluster_usage`` ids.
    """
    if T < 1:
        raise ValueError("T must be >= 1")
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, codebook_size, size=(num_quantizers, T), dtype=np.int64)
    ids = np.asarray(zero_usage_ids, dtype=np.int64)
    n = min(len(ids), T)
    for q in range(num_quantizers):
        pos = rng.permutation(T)[:n]
        codes[q, pos] = np.roll(ids, q)[:n]
    return codes


def _check_codes(model: Any, codes: np.ndarray) -> Any:
    torch = import_reference().torch
    dcfg = model.config.decoder_config
    codes = np.asarray(codes)
    if codes.ndim != 2 or codes.shape[0] != dcfg.num_quantizers or codes.shape[1] < 1:
        raise ValueError(f"codes must be [{dcfg.num_quantizers}, T>=1], got {codes.shape}")
    if not np.issubdtype(codes.dtype, np.integer):
        raise ValueError(f"codes must be integers, got {codes.dtype}")
    if codes.min() < 0 or codes.max() >= dcfg.codebook_size:
        raise ValueError(f"code ids must be in [0, {dcfg.codebook_size})")
    return torch.from_numpy(codes.astype(np.int64))[None]  # [1, 16, T]


def _unwrap(model: Any) -> Any:
    """Accept the ``Qwen3TTSTokenizer`` wrapper as well as the model itself."""
    return model.model if hasattr(model, "feature_extractor") else model


def reference_decode(model: Any, codes: np.ndarray) -> np.ndarray:
    """One forward pass of the reference decoder over all T frames -> float32 ``[T*1920]``.

    Equals the official ``decode`` for T <= 300 (which chunks at 300 frames with 25 frames of
    left context); clamped to [-1, 1] by the reference itself.
    """
    torch = import_reference().torch
    model = _unwrap(model)
    x = _check_codes(model, codes)
    with torch.inference_mode():
        wav = model.decoder(x)  # [1, 1, T*1920], clamped
    return np.array(wav[0, 0].to(torch.float32).numpy(), dtype=np.float32)


def reference_decode_official(model: Any, codes: np.ndarray) -> np.ndarray:
    """The official ``Qwen3TTSTokenizerV2Model.decode`` path (300/25 chunking) -> ``[T*1920]``."""
    torch = import_reference().torch
    model = _unwrap(model)
    x = _check_codes(model, codes).transpose(1, 2)  # [1, T, 16]
    with torch.inference_mode():
        out = model.decode(x, return_dict=True)
    return np.array(out.audio_values[0].to(torch.float32).numpy(), dtype=np.float32)


# The reference's stage taps (``reference_stage_outputs``) and our decoder's named intermediates
# that hold the same values (ours time-major).
DECODER_STAGES = {
    "quant": "dec.rvq.out",
    "preconv": "dec.pre_conv.out",
    "pretr": "dec.pretr.out",
    "upsample": "dec.up1.out",
    "conv_in": "dec.conv_in.out",
    "blk1": "dec.blk1.out",
    "blk2": "dec.blk2.out",
    "blk3": "dec.blk3.out",
    "blk4": "dec.blk4.out",
}


def _stage_taps(dec: Any) -> list[tuple[str, Any, bool]]:
    """(key, module, time_major) for every hooked stage of a ``Qwen3TTSTokenizerV2Decoder``.

    ``quant`` is taken as the *input* of ``pre_conv`` (the RVQ has no module forward of its own:
    the decoder calls ``quantizer.decode``); ``upsample.{0,1}`` are ModuleLists, so their
    ConvNeXt block (``upsample.i.1``) is hooked; the pre-transformer works time-major.
    """
    n_blocks = len(dec.config.upsample_rates)
    pt = dec.pre_transformer
    taps: list[tuple[str, Any, bool]] = [
        ("preconv", dec.pre_conv, False),
        ("pretr_in", pt.input_proj, True),
        *((f"pretr_layer{i}", layer, True) for i, layer in enumerate(pt.layers)),
        ("pretr_norm", pt.norm, True),
        ("pretr", pt, True),
        ("upsample0", dec.upsample[0][-1], False),
        ("upsample", dec.upsample[-1][-1], False),
        ("conv_in", dec.decoder[0], False),
        *((f"blk{i + 1}", dec.decoder[i + 1], False) for i in range(n_blocks)),
        ("snake_out", dec.decoder[n_blocks + 1], False),
        ("conv_out", dec.decoder[n_blocks + 2], False),
    ]
    return taps


def reference_stage_outputs(model: Any, codes: np.ndarray) -> dict[str, np.ndarray]:
    """Activations of every decoder stage (forward hooks on the official modules).

    Channel-first float32 numpy arrays, batch dimension removed (C = channels, T = frames):

    ``quant`` [codebook_dim, T] RVQ output (input of ``pre_conv``); ``preconv`` [latent, T];
    ``pretr`` [latent, T] pre-transformer output; ``upsample`` [latent, 4T] (after
    ``upsample.1``); ``conv_in`` [decoder_dim, 4T] (``decoder.0``); ``blk1``..``blk4`` (after
    ``decoder.1``..``decoder.4``); ``wav`` [T*1920] final clamped waveform.

    Extra keys for finer debugging: ``pretr_in`` [hidden, T] (``input_proj`` output),
    ``pretr_layer{i}`` [hidden, T] (after transformer layer i), ``pretr_norm`` [hidden, T]
    (final RMSNorm), ``upsample0`` [latent, 2T], ``snake_out`` [C_last, 1920T]
    (``decoder.5``), ``conv_out`` [1920T] (``decoder.6``, before the clamp).
    """
    torch = import_reference().torch
    model = _unwrap(model)
    dec = model.decoder
    x = _check_codes(model, codes)
    out: dict[str, Any] = {}

    def grab(key: str, time_major: bool) -> Callable[[Any, Any, Any], None]:
        def hook(_m: Any, _inp: Any, output: Any) -> None:
            t = getattr(output, "last_hidden_state", output)
            if isinstance(t, tuple):
                t = t[0]
            out[key] = t[0].transpose(0, 1) if time_major else t[0]

        return hook

    def grab_quant(_m: Any, inp: Any) -> None:
        out["quant"] = inp[0][0]

    handles = [dec.pre_conv.register_forward_pre_hook(grab_quant)]
    try:
        for key, module, time_major in _stage_taps(dec):
            handles.append(module.register_forward_hook(grab(key, time_major)))
        with torch.inference_mode():
            wav = dec(x)
    finally:
        for h in handles:
            h.remove()
    out["wav"] = wav[0, 0]
    out["conv_out"] = out["conv_out"][0]
    return {k: v.to(torch.float32).contiguous().numpy().copy() for k, v in out.items()}


def state_dict_shapes(size: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors ``save_pretrained`` writes for ``size``, without weights.

    Builds the model on torch's ``meta`` device (no memory, no compute).
    """
    ref = import_reference()
    config = ref.Qwen3TTSTokenizerV2Config(**tokenizer_config(size))
    with ref.torch.device("meta"), ref.no_init_weights():
        model = ref.Qwen3TTSTokenizerV2Model(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """Signal-to-noise ratio of ``test`` against ``reference`` in dB (waveform comparisons)."""
    noise = float(np.sum((reference.astype(np.float64) - test) ** 2))
    return 10 * float(np.log10(float(np.sum(reference.astype(np.float64) ** 2))
                               / max(noise, 1e-30)))
