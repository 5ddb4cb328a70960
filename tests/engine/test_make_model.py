"""`qtts make-model`: released HF layout, determinism, dims, and the synthetic marker."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cli.main import main
from engine.codec_encoder.schema import (
    codec_encoder_tensor_specs,
    parse_codec_encoder_config,
    skipped_encoder_tensor,
)
from engine.gguf_model import open_model
from engine.gguf_schema import DECODER_SKIPPED_HF, decoder_tensor_specs, talker_tensor_specs
from engine.speaker.schema import parse_speaker_config, speaker_tensor_specs
from engine.tools.convert import SafetensorsFile, parse_decoder_config, parse_talker_config
from engine.tools.make_model import (
    build_configs,
    generate_tensor,
    make_model,
    write_tokenizer_files,
)

LAYOUT = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "speech_tokenizer/config.json",
    "speech_tokenizer/model.safetensors",
    "speech_tokenizer/preprocessor_config.json",
    "speech_tokenizer/configuration.json",
    "model.gguf",
]


def _full_configs(
    size: str = "full", variant: str = "custom_voice"
) -> tuple[dict[str, Any], dict[str, Any]]:
    root, st_cfg, _ = build_configs(size, variant)
    root.update(
        im_start_token_id=151644, im_end_token_id=151645, tts_pad_token_id=151671,
        tts_bos_token_id=151672, tts_eos_token_id=151673,
    )  # fmt: skip
    return root, st_cfg


def test_tiny_layout_and_weights(tiny_model_dir: Path) -> None:
    for rel in LAYOUT:
        assert (tiny_model_dir / rel).is_file(), rel
    root = json.loads((tiny_model_dir / "config.json").read_text())
    assert root["model_type"] == "qwen3_tts" and root["tts_model_type"] == "custom_voice"
    assert root["qtts_synthetic"] is True
    st_cfg = json.loads((tiny_model_dir / "speech_tokenizer" / "config.json").read_text())
    assert st_cfg["model_type"] == "qwen3_tts_tokenizer_12hz" and st_cfg["qtts_synthetic"]
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert gen["temperature"] == 0.9 and gen["top_k"] == 50 and gen["max_new_tokens"] == 8192

    talk = SafetensorsFile(tiny_model_dir / "model.safetensors")
    dec = SafetensorsFile(tiny_model_dir / "speech_tokenizer" / "model.safetensors")
    assert {e.dtype for e in talk.entries.values()} == {"BF16"}
    assert {e.dtype for e in dec.entries.values()} == {"F32"}
    assert any(n.startswith("encoder.") for n in dec.names())  # released layout: Mimi encoder too
    assert not any(n.startswith("speaker_encoder.") for n in talk.names())  # Base only
    for n in DECODER_SKIPPED_HF:
        assert n in dec
    for st in (talk, dec):
        for name, e in st.entries.items():
            x = st.read_f32(name, 0, math.prod(e.shape))
            assert np.isfinite(x).all(), name
            if name.endswith("cluster_usage"):
                assert (x >= 0).all() and 1 <= (x == 0).sum() <= 3, name
            elif name.endswith(("norm.weight", "layernorm.weight")):
                assert (x == 1).all(), name
            elif name.endswith((".alpha", ".beta")):
                assert np.abs(x).max() < 0.1, name
            elif e.shape and len(e.shape) >= 2 and x.size > 100:
                assert 0 < float(x.std()) < 1.5, name
    usage = dec.read_f32("decoder.quantizer.rvq_first.vq.layers.0._codebook.cluster_usage", 0, 2048)
    emb = dec.read_f32(
        "decoder.quantizer.rvq_first.vq.layers.0._codebook.embedding_sum", 0, 2048 * 16
    ).reshape(2048, 16)
    table = emb / np.maximum(usage, 1e-5)[:, None]  # the decoder's E_q stays moderate
    assert np.abs(table).max() < 10


def test_deterministic_and_seeded(tmp_path: Path) -> None:
    a = make_model(tmp_path / "a", "tiny", seed=7, progress=False, keep_checkpoint=True)
    b = make_model(tmp_path / "b", "tiny", seed=7, progress=False, keep_checkpoint=True)
    c = make_model(tmp_path / "c", "tiny", seed=8, progress=False)
    d = make_model(tmp_path / "d", "tiny", seed=7, progress=False)  # checkpoint not kept
    assert a.out_path.read_bytes() == b.out_path.read_bytes() == d.out_path.read_bytes()
    assert a.out_path.read_bytes() != c.out_path.read_bytes()
    # by default the folder keeps only what serving reads
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["model.gguf"]
    assert (tmp_path / "a" / "model.safetensors").is_file()
    for rel in ("model.safetensors", "speech_tokenizer/model.safetensors", "vocab.json"):
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()


def test_dtype_option_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["make-model", str(tmp_path / "m"), "--size", "tiny", "--seed", "3",
                 "--dtype", "q4_0", "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0, err
    assert "synthetic" in err
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["model.gguf"]
    with open_model(tmp_path / "m" / "model.gguf") as m:
        assert m.synthetic
        assert m.tensor_info("talk.blk.0.ffn_up.weight").ggml_type == 2  # Q4_0
        assert m.tensor_info("talk.text_embd.weight").ggml_type == 1  # F16, never quantised
    with pytest.raises(SystemExit) as info:  # argparse refuses an unknown size
        main(["make-model", str(tmp_path / "x"), "--size", "huge"])
    assert info.value.code == 2


def test_full_dims_match_the_released_model() -> None:
    """Released 0.6B CustomVoice + tokenizer dims (docs/architecture.md), without writing."""
    root, st_cfg = _full_configs()
    dec = parse_decoder_config(st_cfg)
    talker, cp, special, voices = parse_talker_config(root, has_mtp_tensor=False)
    dspecs = decoder_tensor_specs(dec)
    assert len(dspecs) + len(DECODER_SKIPPED_HF) == 271
    n_dec = sum(math.prod(s.hf_shape) for s in dspecs) + 2 * 256 * 512
    assert n_dec == 114_323_137
    tspecs = talker_tensor_specs(talker, cp)
    assert sum(math.prod(s.hf_shape) for s in tspecs) == 905_788_672  # 914.6 M - speaker enc.
    assert talker.text_vocab_size == 151936 and talker.vocab_size == 3072
    assert (talker.hidden_size, talker.num_hidden_layers, talker.head_dim) == (1024, 28, 128)
    assert (cp.num_hidden_layers, cp.vocab_size, cp.num_code_groups) == (5, 2048, 16)
    assert not cp.has_mtp_projection
    assert talker.mrope_section == (24, 20, 20) and talker.rope_theta == 1e6
    assert (talker.codec_pad_id, talker.codec_bos_id, talker.codec_eos_token_id) == (
        2148,
        2149,
        2150,
    )
    assert voices.speakers["dylan"] == 2878 and voices.dialects["dylan"] == "beijing_dialect"
    assert voices.languages["sichuan_dialect"] == 2062
    assert special.tts_pad_token_id == 151671
    assert dec.block_channels() == [(1536, 768, 8), (768, 384, 5), (384, 192, 4), (192, 96, 3)]


def test_full_tokenizer_reaches_the_specials(tmp_path: Path) -> None:
    ids = write_tokenizer_files(tmp_path, 151936)
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    assert len(vocab) == 151643 and max(vocab.values()) == 151642
    added = json.loads((tmp_path / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert added[str(ids["im_start_token_id"])]["content"] == "<|im_start|>"
    assert (
        added["151671"]["content"] == "<tts_pad>" and added["151675"]["content"] == "<|audio_pad|>"
    )


def _reference() -> Any:
    pytest.importorskip("torch")
    from tests.parity import reference as ref

    ok, why = ref.reference_available()
    if not ok:
        pytest.skip(why)
    ref.import_reference()
    return ref


@pytest.mark.parametrize(
    ("size", "variant"),
    [("tiny", "custom_voice"), ("full", "custom_voice"), ("tiny", "base"), ("1.7b", "base")],
)
def test_layout_equals_the_official_classes(size: str, variant: str) -> None:
    """Our name/shape table equals the state dicts of the official qwen-tts classes."""
    ref = _reference()
    import torch
    from qwen_tts.core.models.configuration_qwen3_tts import (  # type: ignore[import-untyped,unused-ignore]
        Qwen3TTSConfig,
    )
    from qwen_tts.core.models.modeling_qwen3_tts import (  # type: ignore[import-untyped,unused-ignore]
        Qwen3TTSForConditionalGeneration,
    )

    mods = ref.import_reference()
    if size != "tiny":
        root, st_cfg = _full_configs(size, variant)
    else:
        root, st_cfg, _ = build_configs("tiny", variant)
        root.update(im_start_token_id=480, im_end_token_id=481, tts_pad_token_id=507,
                    tts_bos_token_id=508, tts_eos_token_id=509)  # fmt: skip
    dec = parse_decoder_config(st_cfg)
    talker, cp, _, _ = parse_talker_config(root, has_mtp_tensor=False)
    with torch.device("meta"):
        tok_model = mods.Qwen3TTSTokenizerV2Model(mods.Qwen3TTSTokenizerV2Config(**st_cfg))
        tts = Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**root))
    ref_dec = {
        k: tuple(v.shape) for k, v in tok_model.state_dict().items() if k.startswith("decoder.")
    }
    ours = {s.hf_name: s.hf_shape for s in decoder_tensor_specs(dec)}
    ours.update({n: (dec.codebook_vector_dim, dec.codebook_dim, 1) for n in DECODER_SKIPPED_HF})
    assert ours == ref_dec
    ref_talk = {k: tuple(v.shape) for k, v in tts.state_dict().items()}
    ours_talk = {s.hf_name: s.hf_shape for s in talker_tensor_specs(talker, cp)}
    if variant == "base":
        spk = parse_speaker_config(root["speaker_encoder_config"])
        ours_talk.update({s.hf_name: s.hf_shape for s in speaker_tensor_specs(spk)})
    assert ours_talk == ref_talk
    # the Mimi encoder: what qtts keeps, plus what it knowingly skips, is the official state dict
    enc = parse_codec_encoder_config(st_cfg)
    ref_enc = {k: tuple(v.shape) for k, v in tok_model.state_dict().items()
               if k.startswith("encoder.")}  # fmt: skip
    kept = {s.hf_name: s.hf_shape for s in codec_encoder_tensor_specs(enc)}
    assert set(kept) <= set(ref_enc) and all(ref_enc[k] == v for k, v in kept.items())
    assert all(skipped_encoder_tensor(k, enc) for k in set(ref_enc) - set(kept))


@pytest.mark.slow
def test_full_model(qtts_cache_dir: Path) -> None:
    """Makes (once, cached) the released-size synthetic model at f16 and validates it."""
    if not os.environ.get("QTTS_RUN_SLOW"):
        pytest.skip("set QTTS_RUN_SLOW=1 to build the 2.5 GB full-size synthetic model")
    folder = qtts_cache_dir / "models" / "synthetic-full-f16-seed0-v2"
    if not (folder / "model.gguf").is_file():
        make_model(folder, "full", seed=0, dtype="f16", progress=False)
    with open_model(folder / "model.gguf") as m:
        assert m.synthetic and m.parts == {"decoder", "talker"}
        assert m.tensor("talk.text_embd.weight").shape == (151936, 2048)
        assert m.tensor("dec.blk.1.tconv.weight").shape == (1536, 768, 16)
        tok = m.tokenizer()
        assert tok.encode("<|im_start|>assistant\n").ids[0] == 151644


def test_stress_recipe_is_loud_and_unclipped(stress_gguf: Path, tiny_gguf: Path,
                                                     tmp_path: Path, cpu1: Any) -> None:
    """The stress recipe's decoder output is O(0.3) and unclipped (the default recipe's
    clips), and an unknown recipe is refused naming the option."""
    from engine.decoder import DecoderModel, decode
    from engine.errors import ConversionError

    codes = np.random.default_rng(3).integers(0, 2048, (16, 24)).astype(np.int32)

    def wav(path: Path) -> np.ndarray[Any, Any]:
        dec = DecoderModel.load(open_model(path), cpu1, "exact")
        y, _ = decode(dec, codes)
        dec.close()
        return y

    stress, default = wav(stress_gguf), wav(tiny_gguf)
    assert 0.1 < float(np.std(stress)) < 0.6
    assert float(np.mean(np.abs(stress) >= 0.999)) < 0.01
    assert float(np.mean(np.abs(default) >= 0.999)) > 0.5
    with pytest.raises(ConversionError) as err:
        make_model(tmp_path, size="tiny", recipe="loud", progress=False)
    assert "--recipe" in str(err.value)


def test_stress_recipe_covers_the_cloning_encoders() -> None:
    """Under ``stress`` the encoders' convs and linears are unit-gain (std 1/sqrt(fan_in)),
    biases N(0, 0.1), norms N(1, 0.1), layer scales U(0.2, 0.6) (the default's Mimi transformer
    is near the identity: linears 0.02, layer scales 0.01); codebooks are the default's."""

    def tensor(name: str, shape: tuple[int, ...], recipe: str = "stress") -> np.ndarray[Any, Any]:
        return np.concatenate(list(generate_tensor(5, name, shape, recipe)))

    for name, shape in (("speaker_encoder.blocks.1.tdnn1.conv.weight", (48, 32, 3)),
                        ("encoder.encoder.layers.3.conv.weight", (48, 32, 3)),
                        ("encoder.encoder_transformer.layers.0.mlp.fc1.weight", (48, 32))):
        w = tensor(name, shape)
        assert abs(float(w.std()) * math.sqrt(math.prod(shape[1:])) - 1.0) < 0.05, name
    fc1 = "encoder.encoder_transformer.layers.0.mlp.fc1.weight"
    assert float(tensor(fc1, (48, 32), "default").std()) < 0.03
    for bias in ("speaker_encoder.blocks.1.tdnn1.conv.bias", "encoder.encoder.layers.3.conv.bias"):
        assert 0.08 < float(tensor(bias, (512,)).std()) < 0.12, bias
    norm = tensor("encoder.encoder_transformer.layers.0.input_layernorm.weight", (512,))
    assert abs(float(norm.mean()) - 1.0) < 0.03 and 0.08 < float(norm.std()) < 0.12
    scale = tensor("encoder.encoder_transformer.layers.0.mlp_layer_scale.scale", (512,))
    assert 0.2 <= float(scale.min()) and float(scale.max()) <= 0.6
    cb = "encoder.quantizer.semantic_residual_vector_quantizer.layers.0.codebook.embed_sum"
    np.testing.assert_array_equal(tensor(cb, (64, 8)), tensor(cb, (64, 8), "default"))
