"""Our talker + code predictor against the official PyTorch reference on the same random weights.

The fixture (tests/parity/reference_talker.py) builds a tiny CustomVoice model with the official
classes, saves it with ``save_pretrained`` and records greedy generations of the official
``generate`` (codes, raw talker and code-predictor logits, prefill embeddings). We convert the
saved folder with ``engine.tools.convert.convert`` and must produce identical codes for every frame,
logits within 1e-3 (F32 weights and KV cache), the same EOS step, and through the pipeline the
same waveform as the reference decoder on the reference codes (to the decoder tolerance 1e-4).
Quantised weights (Q8_0, Q4_0) are measured against the F32 reference logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.backend import BackendSet
from engine.gguf_model import open_model
from engine.pipeline import Pipeline, StreamInfo, SynthesisRequest
from engine.talker import (
    PromptBuilder,
    SamplingParams,
    TalkerModel,
    Trace,
    generate_frames,
    make_rng,
)
from engine.talker.prompt import assistant_text, instruct_text
from engine.talker.sampling import suppress_mask, talker_scores
from engine.tools.convert import convert
from tests.parity.marks import MISSING as _MISSING
from tests.parity.marks import PARITY_MARKS

pytestmark = PARITY_MARKS

if not _MISSING:
    from tests.parity import reference as ref
    from tests.parity import reference_talker as rt

LOGIT_TOL = 1e-3
BASE_CASES = [] if _MISSING else [c for c in rt.CASES if c.model == "base"]


class Fixture:
    """The reference fixture, its converted GGUFs and one TalkerModel per (model, dtype)."""

    def __init__(self, tmp: Path) -> None:
        import torch

        torch.set_num_threads(1)
        self.dir = rt.make_talker_fixture(ref.default_cache_dir(), seed=0)
        self.cases = rt.load_cases(self.dir)
        self.tmp = tmp
        self.backends = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "1"})
        self._models: dict[tuple[str, str], Any] = {}
        self._talkers: dict[tuple[str, str, str], TalkerModel] = {}

    def gguf(self, which: str, dtype: str) -> Any:
        key = (which, dtype)
        if key not in self._models:
            out = self.tmp / f"{which}-{dtype}.gguf"
            convert(self.dir / ("model" if which == "base" else "eos_model"), out, dtype=dtype,
                    progress=False)
            self._models[key] = open_model(out)
        return self._models[key]

    def talker(self, which: str = "base", dtype: str = "f32", kv: str = "f32") -> TalkerModel:
        key = (which, dtype, kv)
        if key not in self._talkers:
            self._talkers[key] = TalkerModel(self.gguf(which, dtype), self.backends, kv)
        return self._talkers[key]


@pytest.fixture(scope="module")
def fx(tmp_path_factory: pytest.TempPathFactory) -> Fixture:
    return Fixture(tmp_path_factory.mktemp("talker_parity"))


def _greedy(fx: Fixture, case: Any, which: str = "base", dtype: str = "f32", kv: str = "f32",
            frames: int | None = None) -> tuple[np.ndarray, Trace, Any]:
    model = fx.gguf(which, dtype)
    pb = PromptBuilder(model)
    prompt = pb.build(case.text, case.voice, case.language, case.instruct, case.text_mode)
    params = SamplingParams.from_defaults(model.generation_defaults).greedy()
    trace = Trace()
    gen = generate_frames(fx.talker(which, dtype, kv), prompt, params,
                          case.frames if frames is None else frames, make_rng(0)[0], trace=trace)
    out = []
    while True:
        try:
            out.append(next(gen).codes)
        except StopIteration as stop:
            result = stop.value
            break
    codes = np.stack(out, axis=1) if out else np.zeros((16, 0), np.int32)
    return codes, trace, result


def test_tokenizer_matches_official(fx: Fixture) -> None:
    pb = PromptBuilder(fx.gguf("base", "f32"))
    for case in rt.CASES:
        r = fx.cases[case.name]
        assert pb.encode(assistant_text(case.text)) == r["input_ids"].tolist(), case.name
        if case.instruct:
            assert pb.encode(instruct_text(case.instruct)) == r["instruct_ids"].tolist()


@pytest.mark.parametrize("case", BASE_CASES, ids=lambda c: c.name)
def test_prefill_embeddings_match(fx: Fixture, case: Any) -> None:
    model = fx.gguf("base", "f32")
    prompt = PromptBuilder(model).build(case.text, case.voice, case.language, case.instruct,
                                        case.text_mode)
    talker = fx.talker()
    talker.reserve(prompt.length + 1)
    pre = talker.prefill(prompt, capture=True)
    r = fx.cases[case.name]
    emb = pre.taps["talk.-1.inp_embd"]
    assert emb.shape == r["prefill"].shape
    assert np.abs(emb - r["prefill"]).max() <= 1e-5
    rows = np.concatenate([pre.trailing, pre.pad[None]])
    n = r["trailing"].shape[0]
    assert np.abs(rows[:n] - r["trailing"]).max() <= 1e-5


@pytest.mark.parametrize("case", BASE_CASES, ids=lambda c: c.name)
def test_greedy_codes_and_logits_match(fx: Fixture, case: Any, record_property: Any) -> None:
    r = fx.cases[case.name]
    codes, trace, result = _greedy(fx, case)
    assert codes.shape == r["codes"].shape == (16, case.frames)
    assert np.array_equal(codes, r["codes"])
    tl = np.stack(trace.talker)
    assert tl.shape == r["talker_logits"].shape  # frames + 1 samplings (the last: no EOS)
    d_talk = float(np.abs(tl - r["talker_logits"]).max())
    d_cp = float(np.abs(np.asarray(trace.code_predictor) - r["cp_logits"]).max())
    record_property("talker_max_abs", d_talk)
    record_property("cp_max_abs", d_cp)
    assert d_talk <= LOGIT_TOL and d_cp <= LOGIT_TOL
    assert float(np.std(r["talker_logits"])) > 0.3  # the fixture's logits are not degenerate
    assert result.outcome == "truncated_no_eos" and result.frames == case.frames


def test_eos_step_matches(fx: Fixture) -> None:
    case = next(c for c in rt.CASES if c.model == "eos")
    r = fx.cases[case.name]
    n_ref = r["codes"].shape[1]
    assert 2 <= n_ref < case.frames, "the EOS fixture must stop on its own"
    codes, trace, result = _greedy(fx, case, which="eos")
    assert result.outcome == "ok" and result.frames == n_ref
    assert np.array_equal(codes, r["codes"])
    assert len(trace.talker) == n_ref + 1  # the last sampling produced EOS
    assert np.abs(np.stack(trace.talker) - r["talker_logits"]).max() <= LOGIT_TOL


def test_min_new_tokens_masks_an_early_eos(fx: Fixture) -> None:
    """With EOS forced to the top from the first step, EOS fires exactly at token 2."""
    model = fx.gguf("base", "f32")
    eos = int(model.talker_config.codec_eos_token_id)
    logits = np.zeros(3072, np.float32)
    logits[eos] = 10.0
    supp = suppress_mask(3072, eos)
    picks = [int(np.argmax(talker_scores(logits, [5] * n, 1.05, 2, eos, supp))) for n in range(3)]
    assert picks[0] != eos and picks[1] != eos and picks[2] == eos


def test_f16_kv_cache_is_close(fx: Fixture, record_property: Any) -> None:
    case = BASE_CASES[0]
    r = fx.cases[case.name]
    codes, trace, _ = _greedy(fx, case, kv="f16")
    d = float(np.abs(np.stack(trace.talker) - r["talker_logits"][: len(trace.talker)]).max())
    record_property("f16_kv_talker_max_abs", d)
    assert d <= 2e-2
    assert np.array_equal(codes[:, :4], r["codes"][:, :4])


def _teacher_forced(fx: Fixture, case: Any, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Logits of a quantised model fed the reference codes (so every step sees the same past)."""
    model = fx.gguf("base", dtype)
    prompt = PromptBuilder(model).build(case.text, case.voice, case.language, case.instruct,
                                        case.text_mode)
    talker = fx.talker("base", dtype, "f32")
    codes = fx.cases[case.name]["codes"]
    talker.reserve(prompt.length + codes.shape[1] + 1)
    pre = talker.prefill(prompt)
    logits, hidden = pre.logits, pre.hidden
    t_out, cp_out = [logits], []
    for k in range(codes.shape[1]):
        row: list[np.ndarray] = []

        def forced(lg: np.ndarray, j: int, k: int = k, row: list[np.ndarray] = row) -> int:
            row.append(lg)
            return int(codes[j + 1, k])

        talker.predict(hidden, int(codes[0, k]), forced)
        cp_out.append(np.stack(row))
        text_add = pre.trailing[k] if k < pre.trailing.shape[0] else pre.pad
        logits, hidden = talker.step(codes[:, k], text_add, prompt.length + k)
        t_out.append(logits)
    return np.stack(t_out), np.stack(cp_out)


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)
    c = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return float(c.min())


@pytest.mark.parametrize("dtype", ["f16", "bf16", "q8_0", "q4_0"])
def test_quantised_weights_effect(fx: Fixture, dtype: str, record_property: Any) -> None:
    """Measured (teacher-forced) logit error of quantised talker/code-predictor weights."""
    case = BASE_CASES[0]
    r = fx.cases[case.name]
    tl, cl = _teacher_forced(fx, case, dtype)
    rt_l, rc_l = r["talker_logits"], r["cp_logits"]
    eos = 2150
    supp = suppress_mask(3072, eos)
    ref_pick = [int(np.argmax(talker_scores(x, [], 1.0, 0, eos, supp))) for x in rt_l]
    our_pick = [int(np.argmax(talker_scores(x, [], 1.0, 0, eos, supp))) for x in tl]
    agree_talk = float(np.mean(np.equal(ref_pick, our_pick)))
    agree_cp = float(np.mean(np.argmax(cl, -1) == np.argmax(rc_l, -1)))
    free, _, _ = _greedy(fx, case, dtype=dtype)
    same = np.all(free == r["codes"], axis=0)
    first_diff = int(np.argmin(same)) if not same.all() else free.shape[1]
    stats = {
        "talker_cos_min": _cos(tl, rt_l), "talker_max_abs": float(np.abs(tl - rt_l).max()),
        "cp_cos_min": _cos(cl, rc_l), "cp_max_abs": float(np.abs(cl - rc_l).max()),
        "argmax_agree_talker": agree_talk, "argmax_agree_cp": agree_cp,
        "free_running_identical_frames": first_diff,
    }
    for k, v in stats.items():
        record_property(f"{dtype}_{k}", v)
    print(f"\n{dtype}: " + ", ".join(f"{k}={v:.4g}" for k, v in stats.items()))
    # Regression bounds around the measured values (docs/talker.md). Random weights give flat
    # logits (unit spread over 2048-3072 ids), so near-ties are common and argmax agreement is
    # a pessimistic proxy for a trained model's.
    floor = {"f16": 0.99999, "bf16": 0.9999, "q8_0": 0.999, "q4_0": 0.95}[dtype]
    assert stats["talker_cos_min"] >= floor and stats["cp_cos_min"] >= floor
    assert agree_cp >= {"f16": 0.98, "bf16": 0.95, "q8_0": 0.9, "q4_0": 0.5}[dtype]


def test_end_to_end_wav_equals_reference_decode(fx: Fixture) -> None:
    """text -> wav through the pipeline == reference codes decoded by the reference decoder."""
    import torch

    case = BASE_CASES[0]
    r = fx.cases[case.name]
    model = fx.gguf("base", "f32")
    pipe = Pipeline(model, fx.backends, precision="exact", kv_type="f32", chunk_max_frames=4)
    info = StreamInfo()
    req = SynthesisRequest(case.text, case.voice, case.language, case.instruct, case.text_mode,
                           greedy=True, max_frames=case.frames)
    chunks = list(pipe.stream(req, info=info))
    assert [c.frames for c in chunks] == [1, 2, 4, 4, 3]
    audio = np.concatenate([c.audio for c in chunks])
    assert info.outcome == "truncated_no_eos"
    assert np.array_equal(np.concatenate(info.codes, axis=1), r["codes"])
    torch.set_num_threads(1)
    dec = ref.load_reference_decoder(fx.dir / "model" / "speech_tokenizer")
    wav = ref.reference_decode(dec, r["codes"])
    assert audio.shape == wav.shape
    assert float(np.std(wav)) > 0.01
    assert np.abs(audio - wav).max() <= 1e-4
    pipe.close()


def test_pipeline_reports_eos(fx: Fixture) -> None:
    """Through the pipeline the EOS model ends with outcome "ok" at the reference's frame."""
    case = next(c for c in rt.CASES if c.model == "eos")
    r = fx.cases[case.name]
    pipe = Pipeline(fx.gguf("eos", "f32"), fx.backends, precision="exact", kv_type="f32")
    info = StreamInfo()
    req = SynthesisRequest(case.text, case.voice, case.language, text_mode=case.text_mode,
                           greedy=True, max_frames=case.frames)
    chunks = list(pipe.stream(req, info=info))
    assert info.outcome == "ok"
    assert sum(c.frames for c in chunks) == r["codes"].shape[1]
    assert np.array_equal(np.concatenate(info.codes, axis=1), r["codes"])
    pipe.close()
