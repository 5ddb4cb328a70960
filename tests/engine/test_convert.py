"""`qtts convert`: round trips at every dtype, layouts it accepts, and every refusal."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cli.main import main
from engine.errors import ConversionError, ModelFileError
from engine.gguf_model import open_model
from engine.gguf_schema import (
    GGML_F16,
    GGML_F32,
    QUANT_BLOCK,
    Kind,
    decoder_tensor_specs,
    talker_tensor_specs,
)
from engine.tools import convert as convert_mod
from engine.tools.convert import (
    DTYPES,
    SafetensorsFile,
    SafetensorsWriter,
    convert,
    max_abs_error,
)
from engine.tools.make_model import make_checkpoint

QUANT = ("q8_0", "q4_0")


# -- helpers ------------------------------------------------------------------------------------


def copy_ckpt(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint folder without its GGUF."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.gguf", "*.part"))
    return dst


def edit_json(path: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


def rewrite_st(path: Path, fn: Callable[[dict[str, np.ndarray]], object]) -> None:
    """Load every tensor of a safetensors file as f32, let ``fn`` edit the dict, write it back."""
    st = SafetensorsFile(path)
    tensors = {
        n: st.read_f32(n, 0, math.prod(e.shape)).reshape(e.shape) for n, e in st.entries.items()
    }
    fn(tensors)
    w = SafetensorsWriter(path, [(n, "F32", a.shape) for n, a in tensors.items()])
    for a in tensors.values():
        w.write(np.ascontiguousarray(a, dtype=np.float32))
    w.close()


def source_tensor(folder: Path, spec: Any) -> np.ndarray:
    rel = "speech_tokenizer/model.safetensors" if spec.part == "decoder" else "model.safetensors"
    st = SafetensorsFile(folder / rel)
    return st.read_f32(spec.hf_name, 0, math.prod(spec.hf_shape)).reshape(spec.shape)


def shard_st(folder: Path, n_shards: int) -> dict[str, str]:
    """Split ``folder/model.safetensors`` into ``n_shards`` files plus the index
    ``save_pretrained`` writes (tensors in header order, dtypes kept); returns the weight map."""
    path = folder / "model.safetensors"
    st = SafetensorsFile(path)
    names = st.names()
    weight_map: dict[str, str] = {}
    per = math.ceil(len(names) / n_shards)
    for i in range(n_shards):
        shard = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = names[i * per : (i + 1) * per]
        w = SafetensorsWriter(folder / shard,
                              [(n, st.entries[n].dtype, st.entries[n].shape) for n in part])
        for n in part:
            count = math.prod(st.entries[n].shape)
            w.write(st.read_bf16_bits(n, 0, count) if st.entries[n].dtype == "BF16"
                    else st.read_f32(n, 0, count))
            weight_map[n] = shard
        w.close()
    path.unlink()
    total = sum(e.end - e.begin for e in st.entries.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return weight_map


# -- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_round_trip_every_tensor(tiny_model_dir: Path, tmp_path: Path, dtype: str) -> None:
    out = tmp_path / f"model-{dtype}.gguf"
    report = convert(tiny_model_dir, out, dtype=dtype, progress=False, decoder_dtype=dtype)
    want = DTYPES[dtype]
    with open_model(out) as m:
        assert m.decoder_config is not None
        assert m.talker_config is not None and m.code_predictor_config is not None
        specs = decoder_tensor_specs(m.decoder_config) + talker_tensor_specs(
            m.talker_config, m.code_predictor_config
        )
        assert sorted(m.tensor_names()) == sorted(s.name for s in specs)
        for s in specs:
            ref = source_tensor(tiny_model_dir, s)
            gtype = m.tensor_info(s.name).ggml_type
            got = m.tensor_f32(s.name)
            assert got.shape == s.shape
            if s.kind is Kind.F32:
                assert gtype == GGML_F32, s.name
            elif s.kind is Kind.EMBED:
                assert gtype == (GGML_F16 if dtype in QUANT else want), s.name
            elif dtype in QUANT and s.shape[-1] % QUANT_BLOCK:
                assert gtype == GGML_F16, s.name
            else:
                assert gtype == want, s.name
            if gtype == GGML_F32:
                np.testing.assert_array_equal(got, ref, err_msg=s.name)
            else:
                err = np.abs(got.astype(np.float64) - ref)
                assert (err <= max_abs_error(gtype, ref)).all(), s.name
    assert report.n_tensors == len(specs)
    assert report.file_size == out.stat().st_size
    if dtype in QUANT:
        assert report.fallbacks
        assert all(f"stored F16 instead of {dtype.upper()}" in f for f in report.fallbacks)
        assert any("fall" in line or "kept at F16" in line for line in report.summary_lines())
    else:
        assert not report.fallbacks


def test_decoder_weights_stay_f32_unless_asked(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The default keeps decoder weights exact whatever the talker's type; another decoder
    type is allowed but the report says what it costs."""
    out = tmp_path / "default.gguf"
    report = convert(tiny_model_dir, out, dtype="bf16", progress=False)
    with open_model(out) as m:
        assert m.decoder_config is not None and m.talker_config is not None
        for s in decoder_tensor_specs(m.decoder_config):
            assert m.tensor_info(s.name).ggml_type == GGML_F32, s.name
        talk = talker_tensor_specs(m.talker_config, m.code_predictor_config)
        assert any(m.tensor_info(s.name).ggml_type == DTYPES["bf16"] for s in talk)
    assert not any("decoder weights" in line for line in report.summary_lines())
    report = convert(tiny_model_dir, tmp_path / "bf16.gguf", dtype="bf16", progress=False,
                     decoder_dtype="bf16")
    assert any("decoder weights stored BF16: waveform SNR ~30 dB" in line
               for line in report.summary_lines())
    with pytest.raises(ConversionError, match="--decoder-dtype"):
        convert(tiny_model_dir, tmp_path / "x.gguf", decoder_dtype="f8", progress=False)


def test_conversion_streams_in_chunks(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tiny chunks (many per tensor) give byte-identical output to the default chunking."""
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    convert(tiny_model_dir, a, dtype="q8_0", progress=False)
    monkeypatch.setattr(convert_mod, "CHUNK_ELEMS", 100)
    convert(tiny_model_dir, b, dtype="q8_0", progress=False)
    assert a.read_bytes() == b.read_bytes()


def test_bf16_source_is_read_exactly(tiny_model_dir: Path) -> None:
    st = SafetensorsFile(tiny_model_dir / "model.safetensors")
    e = st.entries["talker.model.norm.weight"]
    assert e.dtype == "BF16"
    assert np.array_equal(st.read_f32("talker.model.norm.weight", 0, e.shape[0]), np.ones(e.shape))
    raw = np.fromfile(tiny_model_dir / "model.safetensors", dtype="<u2", count=4, offset=e.begin)
    assert raw.tolist() == [0x3F80] * 4  # bf16 1.0


@pytest.mark.parametrize(("dtype", "value", "problem"), [
    ("bf16", 0x7FC0, "contains NaN or Inf values"),  # kept as read: no float pass saw it
    ("f32", 0xFF80, "contains NaN or Inf values"),
    ("f16", 0x4B18, "has values beyond what F16 can hold; use --dtype bf16 or f32"),
    ("q8_0", 0x4B18, "has values beyond what Q8_0 can hold; use --dtype bf16 or f32"),
    ("q4_0", 0x4B18, "has values beyond what Q4_0 can hold; use --dtype bf16 or f32"),
])  # fmt: skip
def test_weights_a_type_cannot_hold_are_refused(tiny_model_dir: Path, tmp_path: Path,
                                                dtype: str, value: int, problem: str) -> None:
    """A BF16 NaN (0x7FC0) or -inf, or a weight of ~1e7 (0x4B18: finite in BF16, past F16 and
    past the F16 scale of a Q8_0 / Q4_0 block): BF16 to BF16 wrote the NaN unchecked, and the
    block types wrote infinite scales, with numpy's overflow warning on stderr."""
    import warnings

    ck = copy_ckpt(tiny_model_dir, tmp_path / "ck")
    name = "talker.model.layers.0.mlp.up_proj.weight"
    e = SafetensorsFile(ck / "model.safetensors").entries[name]
    assert e.dtype == "BF16"
    with (ck / "model.safetensors").open("r+b") as f:
        f.seek(e.begin + 2 * 37)
        f.write(value.to_bytes(2, "little"))
    out = tmp_path / "out.gguf"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (an overflow warning would be raised here)
        with pytest.raises(ConversionError) as info:
            convert(ck, out, dtype=dtype, progress=False)
    assert str(info.value) == f"model.safetensors: tensor {name} {problem}"
    assert not out.exists()


def test_parts_and_decoder_only_folder(tiny_model_dir: Path, tmp_path: Path) -> None:
    dec = tmp_path / "dec.gguf"
    report = convert(tiny_model_dir / "speech_tokenizer", dec, progress=False)
    assert report.parts == ("decoder",)
    assert any("decoder-only" in n for n in report.notes)
    with open_model(dec) as m:
        assert m.parts == {"decoder"}
        assert m.talker_config is None and m.special_ids is None
        assert all(n.startswith("dec.") for n in m.tensor_names())
        with pytest.raises(ModelFileError, match=r"decoder-only model.*cannot synthesise text"):
            m.tokenizer()
    talk = tmp_path / "talk.gguf"
    convert(tiny_model_dir, talk, parts="talker", progress=False)
    with open_model(talk) as m:
        assert m.parts == {"talker"} and m.decoder_config is None
        m.require("talker")
        with pytest.raises(ModelFileError, match=r"has no decoder part \(it holds: talker\)"):
            m.require("decoder")
        assert all(not n.startswith("dec.") for n in m.tensor_names())
    only_dec = tmp_path / "only_dec.gguf"
    convert(tiny_model_dir, only_dec, parts=["decoder"], progress=False)
    with open_model(only_dec) as m:
        assert m.parts == {"decoder"}


def test_encoder_and_speaker_encoder_tensors_are_skipped(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A CustomVoice checkpoint keeps neither cloning part, whatever the files hold."""
    ck = copy_ckpt(tiny_model_dir, tmp_path / "ck")
    n_enc = sum(
        n.startswith("encoder.")
        for n in SafetensorsFile(ck / "speech_tokenizer" / "model.safetensors").names()
    )
    assert n_enc > 0
    rewrite_st(
        ck / "model.safetensors",
        lambda t: t.__setitem__("speaker_encoder.fc.conv.weight", np.ones((8, 8, 1), np.float32)),
    )
    report = convert(ck, ck / "model.gguf", progress=False)
    assert any(f"skipped {n_enc} encoder.* tensors" in n and "voice cloning" in n
               for n in report.notes)  # fmt: skip
    assert any("skipped 1 speaker_encoder.* tensors" in n for n in report.notes)
    with open_model(ck / "model.gguf") as m:
        assert m.parts == {"decoder", "talker"}
        assert not any(n.startswith(("spk.", "cenc.")) for n in m.tensor_names())


def test_base_checkpoint_keeps_the_cloning_parts(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path / "ck", "tiny", variant="base", progress=False)
    convert(ck, ck / "all.gguf", progress=False)
    with open_model(ck / "all.gguf") as m:
        assert m.parts == {"decoder", "talker", "speaker_encoder", "codec_encoder"}
        assert m.speaker_config is not None and m.speaker_config.enc_dim == 32
        assert m.codec_encoder_config is not None and m.codec_encoder_config.num_quantizers == 16
        assert "cenc.vq.cb.15.embed_sum" in m.tensor_names()
        assert "cenc.vq.cb.16.embed_sum" not in m.tensor_names()  # only 16 of 32 kept
    convert(ck, ck / "lean.gguf", parts="decoder,talker", progress=False)
    with open_model(ck / "lean.gguf") as m:
        assert m.parts == {"decoder", "talker"} and m.speaker_config is None


def test_cloning_parts_refused_where_missing(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match="no speaker_encoder"):
        convert(tiny_model_dir, tmp_path / "x.gguf", parts="decoder,talker,speaker_encoder",
                progress=False)  # fmt: skip
    ck = copy_ckpt(tiny_model_dir, tmp_path / "ck")
    rewrite_st(
        ck / "speech_tokenizer" / "model.safetensors",
        lambda t: [t.pop(k) for k in list(t) if k.startswith("encoder.")],
    )
    with pytest.raises(ConversionError, match="no encoder"):
        convert(ck, tmp_path / "y.gguf", parts="decoder,codec_encoder", progress=False)
    # alone it was written, a file no command reads ("a decoder-only model", they said)
    with pytest.raises(ConversionError, match="codec_encoder needs the talker or the decoder"):
        convert(tiny_model_dir, tmp_path / "z.gguf", parts="codec_encoder", progress=False)
    assert not (tmp_path / "z.gguf").exists()


def test_loader_refuses_a_bad_speaker_encoder_tensor(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path / "ck", "tiny", variant="base", progress=False)
    rewrite_st(
        ck / "model.safetensors",
        lambda t: t.__setitem__("speaker_encoder.fc.weight", np.ones((32, 190, 1), np.float32)),
    )
    with pytest.raises(ConversionError, match=r"speaker_encoder\.fc\.weight has shape"):
        convert(ck, tmp_path / "z.gguf", progress=False)


def test_mtp_projection_when_widths_differ(tmp_path: Path) -> None:
    ck = make_checkpoint(
        tmp_path / "ck",
        "tiny",
        overrides={"cp": {"hidden_size": 16, "intermediate_size": 32, "head_dim": 8}},
        progress=False,
    )
    convert(ck, ck / "model.gguf", progress=False)
    with open_model(ck / "model.gguf") as m:
        assert m.code_predictor_config is not None
        assert m.code_predictor_config.has_mtp_projection
        assert m.tensor("cp.mtp_proj.weight").shape == (16, 32)
        assert m.tensor("cp.mtp_proj.bias").shape == (16,)
        assert m.tensor("cp.codec_embd.0.weight").shape == (2048, 32)
        assert m.tensor("cp.head.0.weight").shape == (2048, 16)


def test_cli_convert(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli.gguf"
    code = main(["convert", str(tiny_model_dir), str(out), "--dtype", "q8_0", "--decoder-dtype",
                 "q8_0", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "kept at F16 instead of Q8_0" in err and "wrote" in err and "synthetic" in err
    with open_model(out) as m:
        assert m.synthetic


def test_sharded_checkpoint_converts_as_one_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Shards and ``model.safetensors.index.json`` (the talker's BF16 and the speech
    tokenizer's F32 alike) give the same GGUF, byte for byte, as the single files."""
    ck = copy_ckpt(tiny_model_dir, tmp_path / "ck")
    shard_st(ck, 3)
    shard_st(ck / "speech_tokenizer", 2)
    assert not (ck / "model.safetensors").exists()
    a, b = tmp_path / "one.gguf", tmp_path / "shards.gguf"
    convert(tiny_model_dir, a, dtype="q4_0", progress=False)
    convert(ck, b, dtype="q4_0", progress=False)
    assert a.read_bytes() == b.read_bytes()
    # a single file beside an index wins, as in transformers
    shutil.copy(tiny_model_dir / "model.safetensors", ck / "model.safetensors")
    (ck / "model-00002-of-00003.safetensors").unlink()
    convert(ck, b, dtype="q4_0", progress=False)
    assert a.read_bytes() == b.read_bytes()


def _index_edit(fn: Callable[[dict[str, str]], object]) -> Callable[[Path], None]:
    def edit(ck: Path) -> None:
        shard_st(ck, 2)
        edit_json(ck / "model.safetensors.index.json", lambda obj: fn(obj["weight_map"]))
    return edit


NORM = "talker.model.norm.weight"


def _move_norm(weight_map: dict[str, str]) -> None:
    # the index says the tensor is in the shard that does not hold it
    other = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    weight_map[NORM] = (other - {weight_map[NORM]}).pop()


def _shard_of(ck: Path, name: str) -> Path:
    weight_map = shard_st(ck, 2)
    return ck / weight_map[name]


def _drop_from_shard(ck: Path, name: str) -> None:
    rewrite_st(_shard_of(ck, name), lambda t: t.pop(name))
    edit_json(ck / "model.safetensors.index.json", lambda obj: obj["weight_map"].pop(name))


def _reshape_in_shard(ck: Path, name: str) -> None:
    rewrite_st(_shard_of(ck, name), lambda t: t.__setitem__(name, np.ones(3, np.float32)))


SHARD_REFUSALS: list[tuple[str, Callable[[Path], object], str]] = [
    ("shard missing", lambda ck: (shard_st(ck, 2),
                                  (ck / "model-00002-of-00002.safetensors").unlink()),
     "model-00002-of-00002.safetensors: file is missing"),
    ("index not json", lambda ck: (shard_st(ck, 2),
                                   (ck / "model.safetensors.index.json").write_text("{")),
     "model.safetensors.index.json: is not valid JSON"),
    ("no weight map", lambda ck: (shard_st(ck, 2), edit_json(
        ck / "model.safetensors.index.json", lambda obj: obj.pop("weight_map"))),
     "model.safetensors.index.json: weight_map is missing, empty or not names to file names"),
    ("a path for a shard", _index_edit(lambda wm: wm.__setitem__(
        next(iter(wm)), "../model.safetensors")),
     "model.safetensors.index.json: shard '../model.safetensors' is not a file name"),
    ("tensor elsewhere", _index_edit(_move_norm),
     "model.safetensors.index.json: tensor talker.model.norm.weight is not in model-0000"),
    ("tensor not listed", _index_edit(lambda wm: wm.pop(NORM)),
     ".safetensors: tensor talker.model.norm.weight is not in model.safetensors.index.json"),
    ("tensor listed, in no shard", _index_edit(lambda wm: wm.__setitem__(
        "talker.model.extra.weight", "model-00001-of-00002.safetensors")),
     "model.safetensors.index.json: tensor talker.model.extra.weight is not in "
     "model-00001-of-00002.safetensors"),
    ("tensor in two shards", lambda ck: (shard_st(ck, 2), rewrite_st(
        ck / "model-00002-of-00002.safetensors", lambda t: t.__setitem__(
            "talker.code_predictor.lm_head.0.weight", np.zeros(2, np.float32)))),
     "model.safetensors.index.json: tensor talker.code_predictor.lm_head.0.weight is in both "
     "model-00001-of-00002.safetensors and model-00002-of-00002.safetensors"),
    ("a shard's tensor missing", lambda ck: _drop_from_shard(ck, NORM),
     "model.safetensors.index.json: tensor talker.model.norm.weight is missing"),
    ("a shard's bad shape", lambda ck: _reshape_in_shard(ck, NORM),
     ".safetensors: tensor talker.model.norm.weight has shape [3]"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "mutate", "message"), SHARD_REFUSALS,
                         ids=[r[0] for r in SHARD_REFUSALS])
def test_sharded_checkpoint_refusals(tiny_model_dir: Path, tmp_path: Path, case: str,
                                     mutate: Callable[[Path], object], message: str) -> None:
    ck = copy_ckpt(tiny_model_dir, tmp_path / "ck")
    mutate(ck)
    with pytest.raises(ConversionError) as info:
        convert(ck, tmp_path / "out.gguf", progress=False)
    text = str(info.value)
    assert message in text, text
    assert "\n" not in text


# -- refusals -----------------------------------------------------------------------------------


def _set(path: str, *keys: str, value: Any) -> Callable[[Path], None]:
    def fn(ck: Path) -> None:
        def upd(obj: dict[str, Any]) -> None:
            d = obj
            for k in keys[:-1]:
                d = d[k]
            if value is _DELETE:
                del d[keys[-1]]
            else:
                d[keys[-1]] = value

        edit_json(ck / path, upd)

    return fn


_DELETE = object()
ST = "speech_tokenizer/config.json"
CFG = "config.json"


def _st_edit(rel: str, fn: Callable[[dict[str, np.ndarray]], object]) -> Callable[[Path], None]:
    return lambda ck: rewrite_st(ck / rel, fn)


def _truncate(rel: str) -> Callable[[Path], None]:
    def fn(ck: Path) -> None:
        p = ck / rel
        with p.open("r+b") as f:
            f.truncate(p.stat().st_size - 1000)

    return fn


REFUSALS: list[tuple[str, Callable[[Path], object], str]] = [
    ("unknown model_type", _set(CFG, "model_type", value="llama"),
     "config.json: unknown model_type 'llama' (expected 'qwen3_tts' or "
     "'qwen3_tts_tokenizer_12hz')"),
    ("no model_type", _set(CFG, "model_type", value=_DELETE),
     "config.json: not a Qwen3-TTS model: no model_type"),
    ("bad json", lambda ck: (ck / CFG).write_text("{"), "config.json: is not valid JSON"),
    ("25 Hz tokenizer", _set(CFG, "tokenizer_type", value="qwen3_tts_tokenizer_25hz"),
     "config.json: tokenizer_type 'qwen3_tts_tokenizer_25hz' is not supported"),
    ("unknown speech tokenizer", _set(ST, "model_type", value="mimi"),
     "speech_tokenizer/config.json: unknown speech-tokenizer model_type 'mimi'"),
    ("no speech_tokenizer", lambda ck: shutil.rmtree(ck / "speech_tokenizer"),
     "speech_tokenizer/config.json is missing (use --parts talker"),
    ("missing tensor",
     _st_edit("model.safetensors", lambda t: t.pop("talker.model.norm.weight")),
     "model.safetensors: tensor talker.model.norm.weight is missing"),
    ("mismatched shape",
     _st_edit("speech_tokenizer/model.safetensors", lambda t: t.__setitem__(
         "decoder.decoder.1.block.1.conv.weight", np.zeros((64, 32, 15), np.float32))),
     "speech_tokenizer/model.safetensors: tensor decoder.decoder.1.block.1.conv.weight has shape "
     "[64, 32, 15], expected [64, 32, 16]"),
    ("unexpected tensor",
     _st_edit("model.safetensors", lambda t: t.__setitem__(
         "talker.model.layers.2.input_layernorm.weight", np.ones(32, np.float32))),
     "model.safetensors: unexpected tensor talker.model.layers.2.input_layernorm.weight"),
    ("truncated safetensors", _truncate("model.safetensors"),
     "model.safetensors: tensor "),
    ("window out of range", _set(ST, "decoder_config", "sliding_window", value=0),
     "speech_tokenizer/config.json: decoder_config.sliding_window = 0 is out of range"),
    ("decoder act", _set(ST, "decoder_config", "hidden_act", value="gelu"),
     "decoder_config.hidden_act = 'gelu' is not supported"),
    ("upsample total", _set(ST, "decode_upsample_rate", value=2000),
     "decode_upsample_rate = 2000 does not match the decoder's rates (product of upsample_rates "
     "and upsampling_ratios = 1920)"),
    ("negative eps", _set(CFG, "talker_config", "rms_norm_eps", value=-1.0),
     "config.json: talker_config.rms_norm_eps = -1.0 is out of range (0, 0.1]"),
    ("codec id", _set(CFG, "talker_config", "codec_pad_id", value=5000),
     "config.json: talker_config.codec_pad_id = 5000 is out of range [2048, 3072)"),
    ("mrope", _set(CFG, "talker_config", "rope_scaling", "mrope_section", value=[4, 4, 4]),
     "mrope_section [4, 4, 4] does not sum to head_dim/2 = 8"),
    ("missing text vocab", _set(CFG, "talker_config", "text_vocab_size", value=_DELETE),
     "config.json: talker_config.text_vocab_size is missing"),
    ("heads", _set(CFG, "talker_config", "num_key_value_heads", value=3),
     "talker_config.num_attention_heads = 2 is not a multiple of num_key_value_heads = 3"),
    ("dialect", _set(CFG, "talker_config", "spk_is_dialect", "eric", value="klingon"),
     "talker_config.spk_is_dialect['eric'] = 'klingon' is not a language in codec_language_id"),
    ("speaker id", _set(CFG, "talker_config", "spk_id", "eric", value="x"),
     "talker_config.spk_id['eric'] = 'x' is not an id"),
    ("text special id", _set(CFG, "im_start_token_id", value=600),
     "config.json: im_start_token_id = 600 is out of range [0, 512)"),
    ("code groups", _set(CFG, "talker_config", "code_predictor_config", "num_code_groups",
                         value=8),
     "code_predictor_config.num_code_groups = 8 differs from talker_config.num_code_groups = 16"),
    ("generation", _set("generation_config.json", "temperature", value=0),
     "generation_config.json: generation_config temperature = 0.0 is out of range (0, 100]"),
    ("merges missing", lambda ck: (ck / "merges.txt").unlink(),
     "text tokenizer: merges.txt is missing"),
    ("bad merge", lambda ck: (ck / "merges.txt").write_text("#version: 0.2\nzz qq\n"),
     "text tokenizer: merges.txt merge 'zz qq' uses a token that is not in vocab.json"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "mutate", "message"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals(
    tiny_model_dir: Path,
    tmp_path: Path,
    case: str,
    mutate: Callable[[Path], object],
    message: str,
) -> None:
    ck = copy_ckpt(tiny_model_dir, tmp_path / "ck")
    mutate(ck)
    out = tmp_path / "out.gguf"
    with pytest.raises(ConversionError) as info:
        convert(ck, out, progress=False)
    text = str(info.value)
    assert message in text, text
    assert "\n" not in text
    assert not out.exists() and not (tmp_path / "out.gguf.part").exists()


def test_refusals_without_a_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.gguf"
    with pytest.raises(ConversionError, match=r"nope: is not a folder$"):
        convert(tmp_path / "nope", out, progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match=r"empty: not a Qwen3-TTS model: no config\.json"):
        convert(tmp_path / "empty", out, progress=False)
    with pytest.raises(ConversionError, match=r"--dtype: 'q5' is not one of f32, f16"):
        convert(tiny_model_dir, out, dtype="q5", progress=False)
    with pytest.raises(ConversionError, match=r"--parts: foo is not a part"):
        convert(tiny_model_dir, out, parts="decoder,foo", progress=False)
    with pytest.raises(ConversionError, match="is a speech-tokenizer folder: it has no talker"):
        convert(tiny_model_dir / "speech_tokenizer", out, parts="talker", progress=False)
    with pytest.raises(ConversionError, match="output folder does not exist"):
        convert(tiny_model_dir, tmp_path / "no" / "o.gguf", progress=False)


def test_cli_refusal_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["convert", str(tmp_path / "nope"), str(tmp_path / "o.gguf"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"qtts: {tmp_path / 'nope'}: is not a folder\n"


def test_the_output_is_never_an_input(tiny_model_dir: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The output is a .gguf name and no file of the checkpoint (``qtts convert CK
    CK/model.safetensors``, or CK/config.json, replaced its own input with the GGUF, exit 0,
    and any name was taken). Converting again into the GGUF beside the checkpoint, where
    ``make-model --keep-checkpoint`` writes it, still works."""
    ck = copy_ckpt(tiny_model_dir, tmp_path / "ck")
    before = {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()}
    for out in (ck / "model.safetensors", ck / "config.json", tmp_path / "o.bin"):
        assert main(["convert", str(ck), str(out), "--no-progress"]) == 2
        assert capsys.readouterr().err == f"qtts: out: {out}: the name must end in .gguf\n"
    # a .gguf name that leads to an input: refused by convert() itself
    (tmp_path / "link.gguf").symlink_to(ck / "model.safetensors")
    os.link(ck / "speech_tokenizer" / "model.safetensors", tmp_path / "hard.gguf")
    for name, rel in (("link.gguf", "model.safetensors"),
                      ("hard.gguf", "speech_tokenizer/model.safetensors")):
        with pytest.raises(ConversionError) as info:
            convert(ck, tmp_path / name, progress=False)
        assert str(info.value) == (f"{tmp_path / name}: would replace {rel}, a file of the "
                                   "checkpoint being converted; write the GGUF to another file")
    assert {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()} == before
    for _ in range(2):
        assert main(["convert", str(ck), str(ck / "model.gguf"), "--no-progress"]) == 0
    with open_model(ck / "model.gguf") as m:
        assert m.synthetic


def _official_code() -> Any:
    """``tests.parity.reference`` (the official classes), or a skip where it cannot run."""
    pytest.importorskip("torch")
    from tests.parity import reference as ref

    ok, why = ref.reference_available()
    if not ok:
        pytest.skip(why)
    return ref


def test_converts_a_folder_saved_by_the_official_code(tmp_path: Path) -> None:
    """The reference's own save_pretrained layout (Mimi encoder included) converts exactly."""
    ref = _official_code()
    folder = ref.make_reference_tokenizer_dir(ref.default_cache_dir(), "tiny", 0)
    out = tmp_path / "ref.gguf"
    report = convert(folder, out, dtype="f32", progress=False)
    assert any(n.startswith("skipped") and "encoder.*" in n for n in report.notes)
    st = SafetensorsFile(folder / "model.safetensors")
    with open_model(out) as m:
        assert m.parts == {"decoder"} and m.decoder_config is not None
        for s in decoder_tensor_specs(m.decoder_config):
            ref_arr = st.read_f32(s.hf_name, 0, math.prod(s.hf_shape)).reshape(s.shape)
            np.testing.assert_array_equal(m.tensor(s.name), ref_arr, err_msg=s.name)


def test_converts_shards_saved_by_the_official_code(tmp_path: Path) -> None:
    """``save_pretrained(max_shard_size=...)``'s shards and index convert as the single file."""
    ref = _official_code()
    folder = ref.make_reference_tokenizer_dir(ref.default_cache_dir(), "tiny", 0)
    sharded = tmp_path / "speech_tokenizer"
    ref.build_reference_model("tiny", 0).save_pretrained(
        sharded, safe_serialization=True, max_shard_size="200KB")
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (sharded / "model.safetensors").exists()
    assert (sharded / "model.safetensors.index.json").is_file()
    a, b = tmp_path / "one.gguf", tmp_path / "shards.gguf"
    convert(folder, a, dtype="f32", progress=False)
    convert(sharded, b, dtype="f32", progress=False)
    assert a.read_bytes() == b.read_bytes()
