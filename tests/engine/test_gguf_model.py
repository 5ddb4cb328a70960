"""The GGUF loader: typed access, every validation failure as one ModelFileError, and a fuzz."""

from __future__ import annotations

import json
import logging
import random
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from engine.errors import ModelFileError
from engine.gguf_model import GgufModel, TensorInfo, open_model
from engine.gguf_schema import ARCH, GGML_F32, Keys

# -- helpers ------------------------------------------------------------------------------------


def rewrite_gguf(
    src: Path,
    dst: Path,
    *,
    arch: str = ARCH,
    drop_keys: tuple[str, ...] = (),
    set_keys: dict[str, tuple[GGUFValueType, Any, GGUFValueType | None]] | None = None,
    drop_tensors: tuple[str, ...] = (),
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]] | None = None,
) -> Path:
    """Re-emit an F32 GGUF with keys/tensors dropped, changed or added."""
    set_keys = set_keys or {}
    tensors = tensors or {}
    with open_model(src) as m:
        kv = dict(m._kv)
        w = GGUFWriter(dst, arch)
        for k, v in kv.items():
            if k == Keys.ARCHITECTURE or k in drop_keys or k in set_keys:
                continue
            if v.vtype == GGUFValueType.ARRAY:
                w.add_key_value(k, v.value, GGUFValueType.ARRAY, GGUFValueType(v.sub))
            else:
                w.add_key_value(k, v.value, GGUFValueType(v.vtype))
        for k, (t, val, sub) in set_keys.items():
            w.add_key_value(k, val, t, sub)
        for name in m.tensor_names():
            if name in drop_tensors or name in tensors:
                continue
            w.add_tensor(name, np.array(m.tensor(name)))
        for name, (arr, raw) in tensors.items():
            w.add_tensor(name, arr, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return dst


# -- the happy path -----------------------------------------------------------------------------


def test_open_tiny_model(
    tiny_gguf: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="qtts.model"):
        m = open_model(tiny_gguf)
    warnings = [r for r in caplog.records if "synthetic" in r.getMessage()]
    assert len(warnings) == 1 and "noise, not speech" in warnings[0].getMessage()
    with m:
        assert isinstance(m, GgufModel)
        assert m.parts == {"decoder", "talker"} and m.synthetic
        root = json.loads((tiny_model_dir / "config.json").read_text())
        dec = json.loads((tiny_model_dir / "speech_tokenizer" / "config.json").read_text())
        d, t, cp = m.decoder_config, m.talker_config, m.code_predictor_config
        assert d is not None and t is not None and cp is not None
        for k in ("codebook_size", "codebook_dim", "latent_dim", "hidden_size", "head_dim",
                  "num_hidden_layers", "sliding_window", "decoder_dim", "num_quantizers",
                  "rms_norm_eps", "rope_theta"):  # fmt: skip
            assert getattr(d, k) == dec["decoder_config"][k], k
        assert d.upsample_rates == (8, 5, 4, 3) and d.upsampling_ratios == (2, 2)
        assert d.upsample_total == 1920 and d.sample_rate == 24000
        assert d.layer_norm_eps == 1e-6 and d.codebook_eps == 1e-5
        tc = root["talker_config"]
        keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads",
                "text_vocab_size", "codec_eos_token_id", "codec_pad_id", "rope_theta")  # fmt: skip
        for k in keys:
            assert getattr(t, k) == tc[k], k
        assert t.mrope_section == tuple(tc["rope_scaling"]["mrope_section"])
        assert cp.num_hidden_layers == tc["code_predictor_config"]["num_hidden_layers"]
        assert not cp.has_mtp_projection
        assert m.special_ids is not None
        assert m.special_ids.tts_pad_token_id == root["tts_pad_token_id"]
        assert m.speakers["vivian"] == 3065 and m.speakers["eric"] == 2875
        assert m.languages["english"] == 2050
        assert m.dialects == {"eric": "sichuan_dialect", "dylan": "beijing_dialect"}
        g = m.generation_defaults
        assert g is not None
        assert (g.temperature, g.top_k, g.repetition_penalty, g.max_new_tokens) == (
            0.9, 50, 1.05, 8192)  # fmt: skip
        assert m.tts_model_type == "custom_voice"
        assert m.metadata[Keys.ARCHITECTURE] == "qwen3-tts"


def test_tensor_views_are_zero_copy_and_read_only(tiny_gguf: Path) -> None:
    with open_model(tiny_gguf) as m:
        info = m.tensor_info("dec.blk.1.tconv.weight")
        assert isinstance(info, TensorInfo)
        gtype, ne, offset, nbytes = info
        assert gtype == GGML_F32 and ne == (16, 32, 64) and nbytes == 16 * 32 * 64 * 4
        assert offset >= m.data_offset and offset % 32 == 0
        arr = m.tensor("dec.blk.1.tconv.weight")
        assert arr.shape == (64, 32, 16) and arr.dtype == np.float32
        assert not arr.flags.writeable
        assert np.shares_memory(arr, m.mmap)
        raw = np.asarray(m.mmap[offset : offset + nbytes]).view(np.float32).reshape(64, 32, 16)
        assert np.array_equal(arr, raw)
        assert m.tensor("dec.rvq.cb.0.embed_sum").shape == (2048, 16)
        assert m.tensor("dec.rvq.first_proj.weight").shape == (32, 16)
        usage = m.tensor("dec.rvq.cb.3.usage")
        assert (usage == 0).sum() >= 1 and (usage >= 0).all()
        with pytest.raises(ModelFileError, match="no tensor named nope"):
            m.tensor("nope")


def test_quantised_tensor_views(tiny_model_dir: Path, tmp_path: Path) -> None:
    from engine.tools.convert import convert

    out = tmp_path / "q.gguf"
    convert(tiny_model_dir, out, dtype="q8_0", progress=False)
    with open_model(out) as m:
        info = m.tensor_info("talk.blk.0.attn_q.weight")
        assert info.ggml_type == GGMLQuantizationType.Q8_0
        raw = m.tensor("talk.blk.0.attn_q.weight")
        assert raw.dtype == np.uint8 and raw.shape == (32, 34)
        assert m.tensor_f32("talk.blk.0.attn_q.weight").shape == (32, 32)
        assert m.tensor("talk.codec_embd.weight").dtype == np.float16


# -- refusals -----------------------------------------------------------------------------------


def _cases(tiny: Path, tmp: Path) -> Iterator[tuple[str, Path, str]]:
    """(case, file, exact problem text or prefix ending in '...')."""
    S, U32, ARR = GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.ARRAY
    yield "missing", tmp / "none.gguf", "file not found"
    (tmp / "dir.gguf").mkdir()
    yield "directory", tmp / "dir.gguf", "is not a regular file"
    (tmp / "empty.gguf").write_bytes(b"")
    yield "empty", tmp / "empty.gguf", "file is too short to be a GGUF (0 bytes)"
    data = tiny.read_bytes()
    (tmp / "magic.gguf").write_bytes(b"GGML" + data[4:])
    yield "magic", tmp / "magic.gguf", "not a GGUF file (magic b'GGML', expected b'GGUF')"
    (tmp / "ver.gguf").write_bytes(data[:4] + (2).to_bytes(4, "little") + data[8:])
    yield "version", tmp / "ver.gguf", "unsupported GGUF version 2 (expected 3)"
    (tmp / "cut.gguf").write_bytes(data[: len(data) // 2])
    yield "truncated", tmp / "cut.gguf", "tensor ...runs past the end of the file"
    yield (
        "arch",
        rewrite_gguf(tiny, tmp / "arch.gguf", arch="llama"),
        ("architecture is 'llama', expected 'qwen3-tts'"),
    )
    yield (
        "format",
        rewrite_gguf(tiny, tmp / "fmt.gguf", set_keys={Keys.FORMAT_VERSION: (U32, 2, None)}),
        "qtts format version 2 is not supported (expected 1)",
    )
    yield (
        "parts",
        rewrite_gguf(
            tiny, tmp / "parts.gguf", set_keys={Keys.PARTS: (ARR, ["decoder", "vocoder"], S)}
        ),
        "qwen3-tts.parts = ['decoder', 'vocoder'] is not a subset of "
        "['decoder', 'talker', 'speaker_encoder', 'codec_encoder']",
    )
    yield (
        "missing key",
        rewrite_gguf(tiny, tmp / "key.gguf", drop_keys=("qwen3-tts.decoder.num_layers",)),
        "required key qwen3-tts.decoder.num_layers is missing",
    )
    yield (
        "key type",
        rewrite_gguf(
            tiny, tmp / "ktype.gguf", set_keys={"qwen3-tts.decoder.num_layers": (S, "two", None)}
        ),
        "key qwen3-tts.decoder.num_layers has type STRING, expected an integer",
    )
    yield (
        "range",
        rewrite_gguf(
            tiny, tmp / "range.gguf", set_keys={"qwen3-tts.decoder.sliding_window": (U32, 0, None)}
        ),
        "decoder_config.sliding_window = 0 is out of range [1, 1048576]",
    )
    yield (
        "codec id",
        rewrite_gguf(
            tiny, tmp / "codec.gguf", set_keys={"qwen3-tts.talker.codec_bos_id": (U32, 9999, None)}
        ),
        "talker_config.codec_bos_id = 9999 is out of range [2048, 3072)",
    )
    yield (
        "shape",
        rewrite_gguf(
            tiny,
            tmp / "shape.gguf",
            tensors={"dec.blk.1.tconv.weight": (np.zeros((64, 32, 15), np.float32), None)},
        ),
        "tensor dec.blk.1.tconv.weight has shape [64, 32, 15], expected [64, 32, 16]",
    )
    yield (
        "type",
        rewrite_gguf(
            tiny,
            tmp / "type.gguf",
            tensors={"dec.pretr.norm.weight": (np.ones(32, np.float16), None)},
        ),
        "tensor dec.pretr.norm.weight has type F16, expected one of F32",
    )
    yield (
        "quant type",
        rewrite_gguf(
            tiny,
            tmp / "qtype.gguf",
            tensors={"dec.pretr.norm.weight": (np.zeros(34, np.uint8), GGMLQuantizationType.Q8_0)},
        ),
        "tensor dec.pretr.norm.weight has type Q8_0, expected one of F32",
    )
    yield (
        "embed type",
        rewrite_gguf(
            tiny,
            tmp / "etype.gguf",
            tensors={
                "talk.text_embd.weight": (np.zeros((512, 34), np.uint8), GGMLQuantizationType.Q8_0)
            },
        ),
        "tensor talk.text_embd.weight has type Q8_0, expected one of BF16, F16, F32",
    )
    yield (
        "missing tensor",
        rewrite_gguf(tiny, tmp / "mt.gguf", drop_tensors=("cp.head.3.weight",)),
        "tensor cp.head.3.weight is missing",
    )
    yield (
        "extra tensor",
        rewrite_gguf(tiny, tmp / "xt.gguf", tensors={"dec.extra": (np.ones(4, np.float32), None)}),
        "unexpected tensor dec.extra (not part of this model's layout)",
    )
    with open_model(tiny) as m:
        tokens = list(m.metadata[Keys.TOKENIZER_TOKENS])
        ids = list(m.metadata[Keys.SPEAKER_IDS])
    yield (
        "tokenizer",
        rewrite_gguf(
            tiny, tmp / "tok.gguf", set_keys={Keys.TOKENIZER_TOKENS: (ARR, tokens[:-1], S)}
        ),
        "tokenizer has 511 tokens, expected text_vocab_size = 512",
    )
    yield (
        "speakers",
        rewrite_gguf(
            tiny,
            tmp / "spk.gguf",
            set_keys={Keys.SPEAKER_IDS: (ARR, ids[:-1], GGUFValueType.INT32)},
        ),
        "9 speaker names but 8 speaker ids",
    )


def test_every_refusal_is_one_model_file_error(tiny_gguf: Path, tmp_path: Path) -> None:
    for case, path, problem in _cases(tiny_gguf, tmp_path):
        with pytest.raises(ModelFileError) as info:
            open_model(path)
        exc = info.value
        assert exc.path == str(path), case
        assert "\n" not in str(exc), case
        if problem.endswith("...runs past the end of the file"):
            assert exc.problem.startswith("tensor ") and "runs past the end" in exc.problem, case
        else:
            assert exc.problem == problem, (case, exc.problem)
        assert str(exc) == f"{path}: {exc.problem}"


# -- fuzz ---------------------------------------------------------------------------------------


class _Hang(Exception):
    pass


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise _Hang


def _try_open(path: Path) -> str:
    """'ok' or 'error'; anything else than ModelFileError propagates to the test."""
    try:
        m = open_model(path)
    except ModelFileError as exc:
        assert "\n" not in str(exc)
        return "error"
    try:
        for name in m.tensor_names()[:3]:
            m.tensor(name)
        if "talker" in m.parts:
            m.tokenizer().encode("<|im_start|>assistant\nhello<|im_end|>")
    except ModelFileError:
        return "error"
    finally:
        m.close()
    return "ok"


def test_fuzz_truncations_and_byte_flips(tiny_gguf: Path, tmp_path: Path) -> None:
    """>= 500 damaged copies: each loads and validates or fails with ModelFileError, fast."""
    rng = random.Random(1234)
    logging.getLogger("qtts.model").setLevel(logging.ERROR)  # no synthetic warning spam
    data = tiny_gguf.read_bytes()
    with open_model(tiny_gguf) as m:
        header_end = m.data_offset
    work = tmp_path / "fuzz.gguf"
    shutil.copyfile(tiny_gguf, work)
    old = signal.signal(signal.SIGALRM, _alarm)
    outcomes: dict[str, int] = {"ok": 0, "error": 0}
    try:
        # byte flips (in place, undone after each case): mostly in the header
        with work.open("r+b") as f:
            for i in range(320):
                pos = rng.randrange(header_end) if rng.random() < 0.85 else rng.randrange(len(data))
                flip = bytes([data[pos] ^ (1 << rng.randrange(8))])
                f.seek(pos)
                f.write(flip)
                f.flush()
                signal.alarm(5)
                try:
                    outcomes[_try_open(work)] += 1
                except _Hang:
                    pytest.fail(f"flip #{i} at byte {pos} hung")
                except Exception as exc:
                    pytest.fail(f"flip #{i} at byte {pos}: {type(exc).__name__}: {exc}")
                finally:
                    signal.alarm(0)
                f.seek(pos)
                f.write(data[pos : pos + 1])
                f.flush()
        # truncations (shrinking one copy step by step)
        sizes = sorted(
            {rng.randrange(header_end + 64) for _ in range(150)}
            | {rng.randrange(len(data)) for _ in range(100)},
            reverse=True,
        )
        for size in sizes:
            with work.open("r+b") as f:
                f.truncate(size)
            signal.alarm(5)
            try:
                outcomes[_try_open(work)] += 1
            except _Hang:
                pytest.fail(f"truncation to {size} bytes hung")
            except Exception as exc:
                pytest.fail(f"truncation to {size} bytes: {type(exc).__name__}: {exc}")
            finally:
                signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, old)
        logging.getLogger("qtts.model").setLevel(logging.NOTSET)
    total = outcomes["ok"] + outcomes["error"]
    assert total >= 500
    assert outcomes["error"] >= 250  # truncations always fail; most header flips too
    # (no total-time bound: each open has its own 5 s hang alarm; speed is not checked here)


def _damage(src: Path, dst: Path, name: str, at: int, value: bytes) -> Path:
    with open_model(src) as m:
        info = m.tensor_info(name)
    data = bytearray(src.read_bytes())
    data[info.offset + at : info.offset + at + len(value)] = value
    dst.write_bytes(bytes(data))
    return dst


def test_a_weight_that_is_not_finite_is_refused_when_the_file_opens(
        tiny_gguf: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Tensor data has no checksum: one NaN or infinity (bit rot, a bad copy, a bad export)
    passed every check; in a norm it turned the decoder's audio into full-scale DC (its clamp
    maps NaN to +1) and the talker's logits into NaN (greedy codes all 0, sampling a numpy
    traceback), with exit status 0. Every type is looked at: F32, F16 and a Q4_0 block's
    scale."""
    from engine.tools.convert import convert

    f16 = tmp_path / "f16.gguf"
    convert(tiny_model_dir, f16, dtype="f16", progress=False)
    q4 = tmp_path / "q4.gguf"
    convert(tiny_model_dir, q4, dtype="q4_0", progress=False)
    nan32, inf32 = np.float32(np.nan).tobytes(), np.float32(-np.inf).tobytes()
    inf16, nan16 = np.float16(np.inf).tobytes(), np.float16(np.nan).tobytes()
    for src, name, at, value in (
        (tiny_gguf, "dec.rvq.cb.3.usage", 8, nan32),
        (tiny_gguf, "talk.blk.0.attn_norm.weight", 4, inf32),
        (tiny_gguf, "dec.pretr.blk.0.attn_norm.weight", 0, nan32),
        (f16, "talk.blk.1.ffn_up.weight", 6, inf16),
        (q4, "talk.blk.0.attn_q.weight", 18, nan16),  # the second block's F16 scale
    ):  # fmt: skip
        bad = _damage(src, tmp_path / "bad.gguf", name, at, value)
        with pytest.raises(ModelFileError) as exc:
            open_model(bad)
        assert str(exc.value) == (f"{bad}: tensor {name} holds NaN or infinite values (a "
                                  "damaged file)")
    for good in (tiny_gguf, f16, q4):
        open_model(good).close()
