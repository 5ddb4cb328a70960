"""Our talker + code predictor at the released 0.6B size, F32, against the official reference
for a few greedy frames (tests/parity/reference_talker.py ``make_full_talker_fixture``): the
real Qwen2 vocabulary and prompt, 28 talker layers with 16/8 GQA heads of 128, the 5-layer
code predictor. Identical codes and logits within 1e-3, as for the tiny fixture; what the tiny
dims cannot show (head_dim 128, mrope sections 24/20/20, the text projection from 2048, the
released vocabulary's ids) is exercised here.

The converted GGUF is cached beside the fixture (both keyed on the qwen-tts / transformers /
torch versions), so a warm run costs one model load and a few frames.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.backend import BackendSet
from engine.gguf_model import open_model
from engine.talker import (
    PromptBuilder,
    SamplingParams,
    TalkerModel,
    Trace,
    generate_frames,
    make_rng,
)
from engine.talker.prompt import assistant_text
from engine.tools.convert import convert
from tests.parity.marks import PARITY_MARKS

pytestmark = PARITY_MARKS

LOGIT_TOL = 1e-3


def cached_gguf(fixture: Path) -> Path:
    out = fixture / "model-f32.gguf"
    if not out.is_file():
        tmp = fixture / "model-f32.gguf.tmp"
        convert(fixture / "model", tmp, dtype="f32", progress=False)
        tmp.rename(out)
    return out


@pytest.fixture(scope="module")
def full() -> tuple[Any, dict[str, np.ndarray]]:
    from tests.parity import reference as ref
    from tests.parity import reference_talker as rt

    d = rt.make_full_talker_fixture(ref.default_cache_dir(), seed=0)
    return open_model(cached_gguf(d)), rt.load_cases(d)[rt.FULL_CASE.name]


def test_released_size_greedy_frames_match(full: tuple[Any, dict[str, np.ndarray]],
                                           record_property: Any) -> None:
    from tests.parity import reference_talker as rt

    model, r = full
    case = rt.FULL_CASE
    pb = PromptBuilder(model)
    assert pb.encode(assistant_text(case.text)) == r["input_ids"].tolist()
    prompt = pb.build(case.text, case.voice, case.language, case.instruct, case.text_mode)
    params = SamplingParams.from_defaults(model.generation_defaults).greedy()
    backends = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2"})
    talker = TalkerModel(model, backends, "f32")
    trace = Trace()
    gen = generate_frames(talker, prompt, params, case.frames, make_rng(0)[0], trace=trace)
    frames = []
    while True:
        try:
            frames.append(next(gen).codes)
        except StopIteration:
            break
    codes = np.stack(frames, axis=1)
    assert codes.shape == r["codes"].shape == (16, case.frames)
    assert np.array_equal(codes, r["codes"])
    tl = np.stack(trace.talker)
    assert tl.shape == r["talker_logits"].shape
    d_talk = float(np.abs(tl - r["talker_logits"]).max())
    d_cp = float(np.abs(np.asarray(trace.code_predictor) - r["cp_logits"]).max())
    record_property("talker_max_abs", d_talk)
    record_property("cp_max_abs", d_cp)
    assert d_talk <= LOGIT_TOL and d_cp <= LOGIT_TOL
    assert float(np.std(r["talker_logits"])) > 0.3  # the logits are not degenerate
