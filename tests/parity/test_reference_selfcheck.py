"""Self-checks of the official PyTorch reference fixtures (tests/parity/reference.py).

These tests check the *fixture generator and the reference*, not the ggml engine: the saved
layout matches the released decoder tensor table, loading is reproducible, the decode has the
right length and is causal. They need the parity extra (``make parity-env``) and are skipped
loudly without it.
Fixtures are cached under ``$QTTS_FIXTURE_CACHE`` (default ``~/.cache/qtts/fixtures``).
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

try:
    from tests.parity import reference as ref
except ModuleNotFoundError:  # pytest run without the repository root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.parity import reference as ref

from tests.parity.marks import PARITY_MARKS

pytestmark = PARITY_MARKS


# ------------------------------------------------------------------------------------------
# the released decoder tensor table (speech_tokenizer/model.safetensors), written out


def expected_decoder_tensors(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Decoder tensor names/shapes of the released table for config ``c`` (prefix included)."""
    cs, cd = c["codebook_size"], c["codebook_dim"]
    cb = cd // 2
    lat, hid, inter = c["latent_dim"], c["hidden_size"], c["intermediate_size"]
    attn = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    dd = c["decoder_dim"]
    e: dict[str, tuple[int, ...]] = {}

    def cbook(prefix: str) -> None:
        e[f"{prefix}._codebook.embedding_sum"] = (cs, cb)
        e[f"{prefix}._codebook.cluster_usage"] = (cs,)

    cbook("quantizer.rvq_first.vq.layers.0")
    for i in range(c["num_quantizers"] - 1):
        cbook(f"quantizer.rvq_rest.vq.layers.{i}")
    for part in ("rvq_first", "rvq_rest"):
        e[f"quantizer.{part}.output_proj.weight"] = (cd, cb, 1)
        e[f"quantizer.{part}.input_proj.weight"] = (cb, cd, 1)
    e["pre_conv.conv.weight"] = (lat, cd, 3)
    e["pre_conv.conv.bias"] = (lat,)
    p = "pre_transformer"
    e[f"{p}.input_proj.weight"] = (hid, lat)
    e[f"{p}.input_proj.bias"] = (hid,)
    for i in range(c["num_hidden_layers"]):
        lp = f"{p}.layers.{i}"
        e[f"{lp}.input_layernorm.weight"] = (hid,)
        e[f"{lp}.self_attn.q_proj.weight"] = (attn, hid)
        e[f"{lp}.self_attn.k_proj.weight"] = (kv, hid)
        e[f"{lp}.self_attn.v_proj.weight"] = (kv, hid)
        e[f"{lp}.self_attn.o_proj.weight"] = (hid, attn)
        e[f"{lp}.self_attn_layer_scale.scale"] = (hid,)
        e[f"{lp}.post_attention_layernorm.weight"] = (hid,)
        e[f"{lp}.mlp.gate_proj.weight"] = (inter, hid)
        e[f"{lp}.mlp.up_proj.weight"] = (inter, hid)
        e[f"{lp}.mlp.down_proj.weight"] = (hid, inter)
        e[f"{lp}.mlp_layer_scale.scale"] = (hid,)
    e[f"{p}.norm.weight"] = (hid,)
    e[f"{p}.output_proj.weight"] = (lat, hid)
    e[f"{p}.output_proj.bias"] = (lat,)
    for i, r in enumerate(c["upsampling_ratios"]):
        u = f"upsample.{i}"
        e[f"{u}.0.conv.weight"] = (lat, lat, r)
        e[f"{u}.0.conv.bias"] = (lat,)
        e[f"{u}.1.dwconv.conv.weight"] = (lat, 1, 7)
        e[f"{u}.1.dwconv.conv.bias"] = (lat,)
        e[f"{u}.1.norm.weight"] = (lat,)
        e[f"{u}.1.norm.bias"] = (lat,)
        e[f"{u}.1.pwconv1.weight"] = (4 * lat, lat)
        e[f"{u}.1.pwconv1.bias"] = (4 * lat,)
        e[f"{u}.1.pwconv2.weight"] = (lat, 4 * lat)
        e[f"{u}.1.pwconv2.bias"] = (lat,)
        e[f"{u}.1.gamma"] = (lat,)
    e["decoder.0.conv.weight"] = (dd, lat, 7)
    e["decoder.0.conv.bias"] = (dd,)
    rates = c["upsample_rates"]
    for b, r in enumerate(rates, start=1):
        cin, cout = dd // 2 ** (b - 1), dd // 2**b
        bp = f"decoder.{b}.block"
        e[f"{bp}.0.alpha"] = (cin,)
        e[f"{bp}.0.beta"] = (cin,)
        e[f"{bp}.1.conv.weight"] = (cin, cout, 2 * r)
        e[f"{bp}.1.conv.bias"] = (cout,)
        for j in (2, 3, 4):
            for act in ("act1", "act2"):
                e[f"{bp}.{j}.{act}.alpha"] = (cout,)
                e[f"{bp}.{j}.{act}.beta"] = (cout,)
            e[f"{bp}.{j}.conv1.conv.weight"] = (cout, cout, 7)
            e[f"{bp}.{j}.conv1.conv.bias"] = (cout,)
            e[f"{bp}.{j}.conv2.conv.weight"] = (cout, cout, 1)
            e[f"{bp}.{j}.conv2.conv.bias"] = (cout,)
    last = dd // 2 ** len(rates)
    n = len(rates)
    e[f"decoder.{n + 1}.alpha"] = (last,)
    e[f"decoder.{n + 1}.beta"] = (last,)
    e[f"decoder.{n + 2}.conv.weight"] = (1, last, 7)
    e[f"decoder.{n + 2}.conv.bias"] = (1,)
    return {f"decoder.{k}": v for k, v in e.items()}


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file (names -> dtype/shape), without reading data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(n))
    return header


# ------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return ref.make_reference_tokenizer_dir(ref.default_cache_dir(), "tiny", 0)


@pytest.fixture(scope="module")
def tiny_model(tiny_dir: Path) -> Any:
    return ref.load_reference_decoder(tiny_dir)


# ------------------------------------------------------------------------------------------
# layout


def test_full_decoder_tensors_match_spec_table() -> None:
    """Config-built (meta device, not run) `full` model: decoder names/shapes = released table."""
    shapes = ref.state_dict_shapes("full")
    dec = {k: v for k, v in shapes.items() if k.startswith("decoder.")}
    assert dec == expected_decoder_tensors(ref.decoder_config("full"))
    # literal rows of the released table, independent of the generator above
    assert dec["decoder.quantizer.rvq_first.vq.layers.0._codebook.embedding_sum"] == (2048, 256)
    assert dec["decoder.quantizer.rvq_rest.output_proj.weight"] == (512, 256, 1)
    assert dec["decoder.pre_conv.conv.weight"] == (1024, 512, 3)
    assert dec["decoder.pre_transformer.input_proj.weight"] == (512, 1024)
    assert dec["decoder.pre_transformer.layers.7.self_attn.q_proj.weight"] == (1024, 512)
    assert dec["decoder.pre_transformer.layers.7.self_attn.o_proj.weight"] == (512, 1024)
    assert dec["decoder.pre_transformer.layers.0.mlp.down_proj.weight"] == (512, 1024)
    assert dec["decoder.upsample.1.0.conv.weight"] == (1024, 1024, 2)
    assert dec["decoder.upsample.0.1.pwconv1.weight"] == (4096, 1024)
    assert dec["decoder.decoder.0.conv.weight"] == (1536, 1024, 7)
    assert dec["decoder.decoder.1.block.1.conv.weight"] == (1536, 768, 16)
    assert dec["decoder.decoder.4.block.1.conv.weight"] == (192, 96, 6)
    assert dec["decoder.decoder.4.block.4.conv1.conv.weight"] == (96, 96, 7)
    assert dec["decoder.decoder.5.alpha"] == (96,)
    assert dec["decoder.decoder.6.conv.weight"] == (1, 96, 7)
    # counts of the released speech_tokenizer/model.safetensors
    assert len(dec) == 271
    assert sum(int(np.prod(s)) for s in dec.values()) == 114_323_137
    assert len(shapes) == 496
    assert 4 * sum(int(np.prod(s)) for s in shapes.values()) == 682_229_764
    assert len(shapes) - len(dec) == 225  # Mimi encoder tensors


def test_tiny_saved_layout(tiny_dir: Path) -> None:
    """The saved tiny folder: released file set, f32 safetensors with the released names/shapes."""
    assert tiny_dir.name == "speech_tokenizer"
    assert {"config.json", "model.safetensors", "preprocessor_config.json"} <= {
        p.name for p in tiny_dir.iterdir()
    }
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_tts_tokenizer_12hz"
    assert cfg["architectures"] == ["Qwen3TTSTokenizerV2Model"]
    assert cfg["decode_upsample_rate"] == 1920
    for k, v in ref.decoder_config("tiny").items():
        assert cfg["decoder_config"][k] == v, k
    pre = json.loads((tiny_dir / "preprocessor_config.json").read_text())
    assert pre["feature_extractor_type"] == "EncodecFeatureExtractor"
    assert pre["sampling_rate"] == 24000

    header = read_safetensors_header(tiny_dir / "model.safetensors")
    header.pop("__metadata__", None)
    assert {v["dtype"] for v in header.values()} == {"F32"}
    saved = {k: tuple(v["shape"]) for k, v in header.items()}
    assert saved == ref.state_dict_shapes("tiny")
    dec = {k: v for k, v in saved.items() if k.startswith("decoder.")}
    assert dec == expected_decoder_tensors(ref.decoder_config("tiny"))


@pytest.mark.slow
def test_full_saved_layout() -> None:
    """Builds (or reuses) the 682 MB `full` random fixture and checks its header."""
    d = ref.make_reference_tokenizer_dir(ref.default_cache_dir(), "full", 0)
    header = read_safetensors_header(d / "model.safetensors")
    header.pop("__metadata__", None)
    assert {v["dtype"] for v in header.values()} == {"F32"}
    saved = {k: tuple(v["shape"]) for k, v in header.items()}
    assert saved == ref.state_dict_shapes("full")
    cfg = json.loads((d / "config.json").read_text())
    for k, v in ref.decoder_config("full").items():
        assert cfg["decoder_config"][k] == v, k


# ------------------------------------------------------------------------------------------
# determinism


def test_tiny_load_twice_identical(tiny_dir: Path, tiny_model: Any) -> None:
    other = ref.load_reference_decoder(tiny_dir)
    a, b = tiny_model.state_dict(), other.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert bool((a[k] == b[k]).all()), k
    codes = ref.random_codes(12, seed=7)
    np.testing.assert_array_equal(
        ref.reference_decode(tiny_model, codes), ref.reference_decode(other, codes)
    )


def test_tiny_build_is_deterministic(tiny_dir: Path, tmp_path: Path) -> None:
    again = ref.make_reference_tokenizer_dir(tmp_path, "tiny", 0)
    assert (again / "model.safetensors").read_bytes() == (
        tiny_dir / "model.safetensors"
    ).read_bytes()
    other_seed = ref.make_reference_tokenizer_dir(tmp_path, "tiny", 1)
    assert (other_seed / "model.safetensors").read_bytes() != (
        tiny_dir / "model.safetensors"
    ).read_bytes()


def test_random_codes() -> None:
    codes = ref.random_codes(40, seed=3)
    assert codes.shape == (16, 40) and codes.dtype == np.int64
    assert codes.min() >= 0 and codes.max() < 2048
    np.testing.assert_array_equal(codes, ref.random_codes(40, seed=3))
    assert not np.array_equal(codes, ref.random_codes(40, seed=4))
    for q in range(16):
        assert set(ref.ZERO_USAGE_IDS + ref.TINY_USAGE_IDS) <= set(codes[q].tolist())


# ------------------------------------------------------------------------------------------
# decoding


def test_tiny_usage_clamp_rows(tiny_model: Any) -> None:
    """Fixture property: some usages are exactly 0 / below 1e-5; the normalised rows are O(1)."""
    sd = tiny_model.state_dict()
    for q in range(15):
        pre = f"decoder.quantizer.rvq_rest.vq.layers.{q}._codebook"
        usage = sd[f"{pre}.cluster_usage"].numpy()
        assert (usage[list(ref.ZERO_USAGE_IDS)] == 0).all()
        assert (usage[list(ref.TINY_USAGE_IDS)] < ref.USAGE_EPS).all()
        table = sd[f"{pre}.embedding_sum"].numpy() / np.maximum(usage, ref.USAGE_EPS)[:, None]
        assert np.isfinite(table).all() and 0.5 < float(table.std()) < 2.0


def test_tiny_decode_finite_length_level(tiny_model: Any) -> None:
    T = 20
    wav = ref.reference_decode(tiny_model, ref.random_codes(T, seed=1))
    assert wav.dtype == np.float32 and wav.shape == (T * 1920,)
    assert np.isfinite(wav).all()
    assert np.abs(wav).max() <= 1.0
    assert 0.05 < float(wav.std()) < 0.5
    assert float(np.mean(np.abs(wav) >= 1.0)) < 0.01  # not clipped everywhere


def test_tiny_official_decode_equals_one_pass(tiny_model: Any) -> None:
    """For T <= 300 the official chunked `decode` is the single forward pass."""
    codes = ref.random_codes(40, seed=2)
    np.testing.assert_array_equal(
        ref.reference_decode_official(tiny_model, codes), ref.reference_decode(tiny_model, codes)
    )


@pytest.mark.parametrize("K", [1, 9, 17])
def test_tiny_decode_is_causal(tiny_model: Any, K: int) -> None:
    """Decoding the first K frames gives the first K*1920 samples of the full decode."""
    codes = ref.random_codes(24, seed=5)
    full = ref.reference_decode(tiny_model, codes)
    prefix = ref.reference_decode(tiny_model, codes[:, :K])
    assert prefix.shape == (K * 1920,)
    np.testing.assert_allclose(prefix, full[: K * 1920], rtol=0, atol=1e-4)


def test_tiny_stage_outputs(tiny_model: Any) -> None:
    T = 10
    codes = ref.random_codes(T, seed=4)
    c = ref.decoder_config("tiny")
    st = ref.reference_stage_outputs(tiny_model, codes)
    lat, dd = c["latent_dim"], c["decoder_dim"]
    want = {
        "quant": (c["codebook_dim"], T),
        "preconv": (lat, T),
        "pretr": (lat, T),
        "upsample": (lat, 4 * T),
        "conv_in": (dd, 4 * T),
        "blk1": (dd // 2, 32 * T),
        "blk2": (dd // 4, 160 * T),
        "blk3": (dd // 8, 640 * T),
        "blk4": (dd // 16, 1920 * T),
        "wav": (1920 * T,),
    }
    for k, shape in want.items():
        assert st[k].shape == shape, k
        assert st[k].dtype == np.float32 and np.isfinite(st[k]).all(), k
    np.testing.assert_array_equal(st["wav"], ref.reference_decode(tiny_model, codes))
    np.testing.assert_array_equal(st["wav"], np.clip(st["conv_out"], -1, 1))

    # `quant` = the RVQ stage (docs/architecture.md), recomputed in numpy from the state dict
    sd = {k: v.numpy().astype(np.float64) for k, v in tiny_model.state_dict().items()}
    q = "decoder.quantizer"

    def table(prefix: str) -> np.ndarray:
        usage = np.maximum(sd[f"{prefix}._codebook.cluster_usage"], 1e-5)
        out: np.ndarray = sd[f"{prefix}._codebook.embedding_sum"] / usage[:, None]
        return out

    e0 = table(f"{q}.rvq_first.vq.layers.0")[codes[0]].T
    rest = sum(table(f"{q}.rvq_rest.vq.layers.{i}")[codes[i + 1]].T for i in range(15))
    quant = (
        sd[f"{q}.rvq_first.output_proj.weight"][:, :, 0] @ e0
        + sd[f"{q}.rvq_rest.output_proj.weight"][:, :, 0] @ rest
    )
    np.testing.assert_allclose(st["quant"], quant, rtol=0, atol=1e-4)


def test_tiny_sdpa_equals_eager_attention(tiny_dir: Path, tiny_model: Any) -> None:
    """The default (sdpa) sliding-window path agrees with eager attention (T=30 > window 8)."""
    eager = ref.load_reference_decoder(tiny_dir, attn_implementation="eager")
    assert eager.decoder.config._attn_implementation == "eager"
    assert tiny_model.decoder.config._attn_implementation == "sdpa"
    codes = ref.random_codes(30, seed=6)
    a = ref.reference_stage_outputs(tiny_model, codes)
    b = ref.reference_stage_outputs(eager, codes)
    np.testing.assert_allclose(a["pretr"], b["pretr"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(a["wav"], b["wav"], rtol=0, atol=1e-5)
