"""The official talker (``qwen-tts`` 0.1.1) as a fixture generator for the talker parity tests.

For parity tests and benchmarks only; ``engine/`` never imports it. What it provides:

* :func:`talker_root_config` -- a tiny CustomVoice ``config.json`` (released codec ids, voices,
  languages; talker width 64 != code-predictor width 32, so ``small_to_mtp_projection`` exists;
  4 query / 2 KV heads, so GQA is exercised; ``tts_model_size = "1b7"``, so instructions count).
* :func:`build_reference_talker` -- ``Qwen3TTSForConditionalGeneration`` with seeded random
  weights (per-tensor generators, scaled so logits have unit spread).
* :func:`make_talker_fixture` -- saves it with ``save_pretrained`` in the released layout
  (``config.json``, ``generation_config.json``, ``model.safetensors``, Qwen2 BPE tokenizer files,
  ``preprocessor_config.json``, ``speech_tokenizer/`` from the tiny decoder fixture), plus an
  "EOS" variant whose ``codec_head`` makes EOS win at a known step, runs every case of
  :data:`CASES` greedily through the official ``generate`` and stores codes, raw talker and
  code-predictor logits, token ids and prefill embeddings in ``cases.npz`` (cached on disk).

The official ``generate`` does not return logits; this module wraps ``talker.generate`` and
``talker.code_predictor.generate`` on the instance to add ``output_logits=True`` and record them.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.talker.prompt import assistant_text, instruct_text
from engine.tools.make_model import build_configs, write_tokenizer_files
from tests.parity import reference as ref

#: Bump whenever the recipe or the cases change (part of the cache key).
TALKER_GENERATOR_VERSION = 1

EOS_STEP_TARGET = 6  # the EOS variant is tuned so that EOS wins near this talker step


@dataclass(frozen=True)
class Case:
    """One greedy generation of the fixture."""

    name: str
    text: str
    voice: str | None
    language: str  # "auto" or a language name
    text_mode: str  # "full" (non_streaming_mode=True) or "stream"
    instruct: str | None = None
    frames: int = 14
    model: str = "base"  # "base" or "eos"


CASES: tuple[Case, ...] = (
    Case("english_full", "Hello, world! The quick brown fox.", "ryan", "english", "full"),
    Case("english_stream", "Hello there, how are you today?", "ryan", "english", "stream",
         frames=20),
    Case("auto_full", "Streaming audio should start quickly.", "vivian", "auto", "full"),
    Case("dialect_chinese", "你好世界。今天天气很好。", "eric", "chinese", "full"),
    Case("dialect_auto_stream", "你好世界。", "dylan", "auto", "stream", frames=12),
    Case("instruct", "It's 12:30 on 2024-05-17.", "serena", "english", "full",
         instruct="Speak softly, slowly and warmly."),
    Case("eos", "Hello, world! The quick brown fox.", "ryan", "english", "full", frames=30,
         model="eos"),
)


def talker_dims() -> dict[str, dict[str, Any]]:
    """Overrides of ``engine.tools.make_model.build_configs("tiny")`` for the parity fixture."""
    return {
        "talker": {
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "text_hidden_size": 64, "text_vocab_size": 512,
            "rope_scaling": {"interleaved": True, "mrope_section": [4, 2, 2],
                             "rope_type": "default"},
        },
        "cp": {
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        },
    }  # fmt: skip


def talker_root_config(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write the tokenizer files into ``folder``; return (root config, generation config)."""
    root, _st_cfg, gen = build_configs("tiny", overrides=talker_dims())
    root = copy.deepcopy(root)
    root.pop("qtts_synthetic", None)
    root["tts_model_size"] = "1b7"
    special = write_tokenizer_files(folder, int(root["talker_config"]["text_vocab_size"]))
    root.update(special)
    gen = {**gen, "max_new_tokens": 8192}
    return root, gen


# --------------------------------------------------------------------------------------------
# weights


def _gen(seed: int, name: str) -> Any:
    torch = ref.import_reference().torch
    return torch.Generator().manual_seed((zlib.crc32(name.encode()) << 20) ^ (seed & 0xFFFFF))


def _value(name: str, shape: tuple[int, ...], g: Any) -> Any:
    torch = ref.import_reference().torch

    def normal(std: float, mean: float = 0.0) -> Any:
        return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

    leaf = name.rsplit(".", 1)[-1]
    if "embedding" in name:
        return normal(1.0)
    if name.endswith("norm.weight"):
        return normal(0.1, 1.0)
    if leaf == "bias":
        return normal(0.05)
    if len(shape) == 2:
        return normal(shape[1] ** -0.5)
    raise AssertionError(f"no recipe for talker tensor {name} {shape}")


def build_reference_talker(root: dict[str, Any], seed: int) -> Any:
    """``Qwen3TTSForConditionalGeneration`` for ``root`` with seeded weights, eval mode, f32."""
    r = ref.import_reference()
    from qwen_tts.core.models.configuration_qwen3_tts import (  # type: ignore[import-untyped]
        Qwen3TTSConfig,
    )
    from qwen_tts.core.models.modeling_qwen3_tts import (  # type: ignore[import-untyped]
        Qwen3TTSForConditionalGeneration,
    )

    config = Qwen3TTSConfig(**copy.deepcopy(root))
    with r.no_init_weights():
        model = Qwen3TTSForConditionalGeneration(config)
    with r.torch.no_grad():
        for name, t in model.state_dict().items():
            if t.is_floating_point():
                t.copy_(_value(name, tuple(t.shape), _gen(seed, name)))
    return model.float().eval()


# --------------------------------------------------------------------------------------------
# running the official generate with logits captured


def hf_tokenizer(folder: Path) -> Any:
    """The official text tokenizer: ``Qwen2TokenizerFast`` from the saved files."""
    from transformers import Qwen2TokenizerFast

    return Qwen2TokenizerFast.from_pretrained(str(folder))


def run_case(model: Any, tok: Any, case: Case, frames: int | None = None,
             greedy: bool = True) -> dict[str, np.ndarray]:
    """Run ``model.generate`` for ``case``; return codes and everything captured (numpy)."""
    torch = ref.import_reference().torch
    n_frames = case.frames if frames is None else frames
    ids = tok(assistant_text(case.text), return_tensors="pt")["input_ids"]
    ins = (tok(instruct_text(case.instruct), return_tensors="pt")["input_ids"]
           if case.instruct else None)
    cap: dict[str, Any] = {"cp_logits": []}
    talker = model.talker
    cp = talker.code_predictor
    talker_generate, cp_generate = talker.generate, cp.generate

    def t_gen(*a: Any, **kw: Any) -> Any:
        kw["output_logits"] = True
        cap["prefill"] = kw["inputs_embeds"][0].clone()
        cap["trailing"] = kw["trailing_text_hidden"][0].clone()
        out = talker_generate(*a, **kw)
        cap["talker_logits"] = torch.cat(list(out.logits), 0)
        return out

    def c_gen(*a: Any, **kw: Any) -> Any:
        kw["output_logits"] = True
        out = cp_generate(*a, **kw)
        cap["cp_logits"].append(torch.cat(list(out.logits), 0))
        return out

    talker.generate, cp.generate = t_gen, c_gen
    try:
        with torch.inference_mode():
            codes_list, _ = model.generate(
                input_ids=[ids], instruct_ids=[ins], languages=[case.language],
                speakers=[case.voice], non_streaming_mode=case.text_mode == "full",
                max_new_tokens=n_frames + 1, do_sample=not greedy,
                subtalker_dosample=not greedy,
            )
    finally:
        del talker.generate, cp.generate  # drop the instance overrides
    codes = codes_list[0].numpy().T.astype(np.int32)  # [16, T]
    cp_logits = (torch.stack(cap["cp_logits"]).numpy() if cap["cp_logits"]
                 else np.zeros((0, 15, 2048), np.float32))
    return {
        "codes": codes,
        "talker_logits": cap["talker_logits"].float().numpy(),
        "cp_logits": cp_logits.astype(np.float32),
        "prefill": cap["prefill"].float().numpy(),
        "trailing": cap["trailing"].float().numpy(),
        "input_ids": ids[0].numpy().astype(np.int32),
        "instruct_ids": (ins[0].numpy().astype(np.int32) if ins is not None
                         else np.zeros(0, np.int32)),
    }


def _bias_eos(model: Any, base: dict[str, np.ndarray], step: int) -> None:
    """Make EOS win at talker step ``step``: its head row becomes 1.05 x the winning code's row.

    At ``step`` the winner's raw logit is the maximum (greedy, and positive in practice), so the
    scaled copy beats it; earlier steps keep their winners unless the copied code was within 5 %
    of their maximum. The fixture records where EOS actually fired.
    """
    torch = ref.import_reference().torch
    winner = int(base["codes"][0, step])
    with torch.no_grad():
        w = model.talker.codec_head.weight
        eos = int(model.config.talker_config.codec_eos_token_id)
        w[eos] = w[winner] * 1.05


# --------------------------------------------------------------------------------------------
# the cached fixture


def fixture_key(seed: int) -> str:
    """Cache key of the talker fixture."""
    from tests.parity.reference import reference_versions

    return f"ref-talker-tiny-seed{seed}-v{TALKER_GENERATOR_VERSION}-{reference_versions()}"


def _save(model: Any, folder: Path, root_files: Path, gen: dict[str, Any], st_dir: Path) -> None:
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        if root_files != folder:
            shutil.copy(root_files / name, folder / name)
    # save_pretrained writes the model's own GenerationConfig; the released file is plain JSON
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))
    (folder / "preprocessor_config.json").write_text(
        json.dumps({"processor_class": "Qwen3TTSProcessor"}))
    shutil.copytree(st_dir, folder / "speech_tokenizer")


def make_talker_fixture(out_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Build (or reuse) the fixture folder; return it.

    Layout: ``<key>/model/`` and ``<key>/eos_model/`` (HF checkpoint folders in the released
    layout), ``<key>/cases.npz`` (per case: ``<name>.codes`` [16, T] and the captured arrays),
    ``<key>/fixture.json``. Built in a temporary sibling and renamed into place.
    """
    root_dir = Path(out_dir) / fixture_key(seed)
    if (root_dir / "cases.npz").is_file():
        return root_dir
    r = ref.import_reference()
    r.torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    st_dir = ref.make_reference_tokenizer_dir(out_dir, "tiny", seed)
    with ref.fixture_folder(out_dir, fixture_key(seed),
                            lambda done: (done / "cases.npz").is_file()) as tmp:
        base_dir = tmp / "model"
        base_dir.mkdir()
        root, gen = talker_root_config(base_dir)
        model = build_reference_talker(root, seed)
        _save(model, base_dir, base_dir, gen, st_dir)
        tok = hf_tokenizer(base_dir)
        arrays: dict[str, np.ndarray] = {}
        meta: dict[str, Any] = {"seed": seed, "version": TALKER_GENERATOR_VERSION, "cases": {}}
        results: dict[str, dict[str, np.ndarray]] = {}
        for case in CASES:
            if case.model != "base":
                continue
            results[case.name] = run_case(model, tok, case)
        _bias_eos(model, results["english_full"], EOS_STEP_TARGET)
        eos_dir = tmp / "eos_model"
        eos_dir.mkdir()
        _save(model, eos_dir, base_dir, gen, st_dir)
        for case in CASES:
            if case.model == "eos":
                results[case.name] = run_case(model, tok, case)
        for name, res in results.items():
            for k, v in res.items():
                arrays[f"{name}.{k}"] = v
            meta["cases"][name] = {"frames": int(res["codes"].shape[1])}
        np.savez(tmp / "cases.npz", **arrays)
        (tmp / "fixture.json").write_text(json.dumps(meta, indent=2) + "\n")
    return root_dir


def load_cases(fixture_dir: Path) -> dict[str, dict[str, np.ndarray]]:
    """``cases.npz`` as ``{case name: {array name: array}}``."""
    with np.load(fixture_dir / "cases.npz") as z:
        out: dict[str, dict[str, np.ndarray]] = {}
        for key in z.files:
            name, _, item = key.partition(".")
            out.setdefault(name, {})[item] = z[key]
    return out


# --------------------------------------------------------------------------------------------
# the released-size fixture: a few greedy frames of the 0.6B talker, F32

#: The case the released-size fixture runs (few frames: at 0.9 B parameters, F32, each costs).
FULL_CASE = Case("full_size", "Hello there, how are you today?", "ryan", "english", "stream",
                 frames=3)


def full_fixture_key(seed: int) -> str:
    """Cache key of the released-size talker fixture."""
    from tests.parity.reference import reference_versions

    return f"ref-talker-0.6b-seed{seed}-v{TALKER_GENERATOR_VERSION}-{reference_versions()}"


def make_full_talker_fixture(out_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Build (or reuse) the released-size fixture: ``<key>/model/`` (the 0.6B CustomVoice
    talker and code predictor at their released dims, the real Qwen2 vocabulary, F32, seeded
    like the tiny fixture; the tiny decoder as ``speech_tokenizer/``) and ``<key>/cases.npz``
    with :data:`FULL_CASE` run greedily through the official ``generate``."""
    root_dir = Path(out_dir) / full_fixture_key(seed)
    if (root_dir / "cases.npz").is_file():
        return root_dir
    r = ref.import_reference()
    r.torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    st_dir = ref.make_reference_tokenizer_dir(out_dir, "tiny", seed)
    with ref.fixture_folder(out_dir, full_fixture_key(seed),
                            lambda done: (done / "cases.npz").is_file()) as tmp:
        base_dir = tmp / "model"
        base_dir.mkdir()
        root, _st_cfg, gen = build_configs("0.6b")
        root = copy.deepcopy(root)
        root.pop("qtts_synthetic", None)
        root.update(write_tokenizer_files(base_dir, int(root["talker_config"]["text_vocab_size"])))
        gen = {**gen, "max_new_tokens": 8192}
        model = build_reference_talker(root, seed)
        _save(model, base_dir, base_dir, gen, st_dir)
        res = run_case(model, hf_tokenizer(base_dir), FULL_CASE)
        del model
        np.savez(tmp / "cases.npz", **{f"{FULL_CASE.name}.{k}": v for k, v in res.items()})
        (tmp / "fixture.json").write_text(json.dumps(
            {"seed": seed, "version": TALKER_GENERATOR_VERSION, "size": "0.6b",
             "frames": int(res["codes"].shape[1])}, indent=2) + "\n")
    return root_dir
