"""The ggml talker and code predictor on the tiny synthetic model: caches, graphs, the loop."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.backend import BackendSet
from engine.errors import InputError
from engine.ggml import Graph
from engine.ggml.graph import name_of
from engine.gguf_model import open_model
from engine.pipeline import Pipeline, SynthesisRequest, synthesize
from engine.talker import (
    PromptBuilder,
    SamplingParams,
    TalkerModel,
    Trace,
    frame_budget,
    generate_frames,
    make_rng,
    qwen3,
)
from engine.talker import model as talker_model
from engine.talker.generate import BUDGET_BASE_FRAMES, BUDGET_FRAMES_PER_TOKEN, Result


@pytest.fixture(scope="module")
def backends() -> BackendSet:
    return BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "1"})


@pytest.fixture(scope="module")
def model(tiny_gguf: Path) -> Any:
    return open_model(tiny_gguf)


@pytest.fixture(scope="module")
def talker(model: Any, backends: BackendSet) -> TalkerModel:
    return TalkerModel(model, backends, kv_type="f32")


def run(talker: TalkerModel, model: Any, text: str, frames: int, seed: int = 0,
        greedy: bool = True, cancel: Any = None, voice: str = "ryan", mode: str = "full"
        ) -> tuple[np.ndarray, Trace, Result]:
    prompt = PromptBuilder(model).build(text, voice, "english", text_mode=mode)
    params = SamplingParams.from_defaults(model.generation_defaults)
    if greedy:
        params = params.greedy()
    trace = Trace()
    gen = generate_frames(talker, prompt, params, frames, make_rng(seed)[0], cancel, trace)
    out = []
    while True:
        try:
            out.append(next(gen).codes)
        except StopIteration as stop:
            res: Result = stop.value
            break
    codes = np.stack(out, 1) if out else np.zeros((16, 0), np.int32)
    return codes, trace, res


def test_codes_are_valid_and_logits_finite(talker: TalkerModel, model: Any) -> None:
    codes, trace, res = run(talker, model, "Hello world.", 6)
    assert codes.shape == (16, 6) and codes.dtype == np.int32
    assert codes.min() >= 0 and codes.max() < 2048
    assert res.outcome == "truncated_no_eos" and res.frames == 6
    assert len(trace.talker) == 7 and len(trace.code_predictor) == 6
    assert all(len(r) == 15 for r in trace.code_predictor)
    assert all(np.isfinite(x).all() for x in trace.talker)


def test_cache_reuse_across_utterances_and_buckets(model: Any, backends: BackendSet,
                                                   talker: TalkerModel,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Stale cache rows from a longer earlier utterance and the bucket size never leak."""
    run(talker, model, "A much longer sentence that fills the cache with other rows.", 20,
        mode="stream")
    a, ta, _ = run(talker, model, "Hello world.", 8)
    fresh = TalkerModel(model, backends, kv_type="f32")
    b, tb, _ = run(fresh, model, "Hello world.", 8)
    assert np.array_equal(a, b)
    assert max(np.abs(x - y).max() for x, y in zip(ta.talker, tb.talker, strict=True)) <= 1e-5
    monkeypatch.setattr(talker_model, "STEP_BUCKET", 4)
    small = TalkerModel(model, backends, kv_type="f32")
    c, tc, _ = run(small, model, "Hello world.", 8)
    assert np.array_equal(a, c)
    assert max(np.abs(x - y).max() for x, y in zip(ta.talker, tc.talker, strict=True)) <= 1e-5
    fresh.close()
    small.close()


def test_seed_makes_sampling_reproducible(talker: TalkerModel, model: Any) -> None:
    a, _, _ = run(talker, model, "Hello world.", 5, seed=42, greedy=False)
    b, _, _ = run(talker, model, "Hello world.", 5, seed=42, greedy=False)
    c, _, _ = run(talker, model, "Hello world.", 5, seed=43, greedy=False)
    g, _, _ = run(talker, model, "Hello world.", 5, greedy=True)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not np.array_equal(a, g)


def test_cancellation_stops_within_one_frame(talker: TalkerModel, model: Any) -> None:
    ev = threading.Event()
    prompt = PromptBuilder(model).build("Hello world.", "ryan", "english")
    params = SamplingParams.from_defaults(model.generation_defaults).greedy()
    gen = generate_frames(talker, prompt, params, 50, make_rng(0)[0], ev.is_set)
    frames = [next(gen), next(gen)]
    ev.set()
    with pytest.raises(StopIteration) as stop:
        next(gen)
    assert stop.value.value.outcome == "cancelled" and stop.value.value.frames == len(frames)
    pre = threading.Event()
    pre.set()
    codes, _, res = run(talker, model, "Hello world.", 5, cancel=pre.is_set)
    assert codes.shape[1] == 0 and res.outcome == "cancelled"


def test_frame_budget_formula_and_caps() -> None:
    assert frame_budget(10, None, 4096, 8192) == BUDGET_BASE_FRAMES + 10 * BUDGET_FRAMES_PER_TOKEN
    assert frame_budget(10, 0, 4096, 8192) == frame_budget(10, None, 4096, 8192)
    assert frame_budget(10, 7, 4096, 8192) == 7
    assert frame_budget(1000, None, 300, 8192) == 300  # server cap
    assert frame_budget(1000, None, 4096, 201) == 200  # generation_config max_new_tokens - 1
    # a limit (a client's max_seconds) lowers the formula's budget and never raises it
    assert frame_budget(10, None, 4096, 8192, limit=25) == 25
    assert frame_budget(10, None, 4096, 8192, limit=1000) == frame_budget(10, None, 4096, 8192)
    assert frame_budget(10, 300, 4096, 8192, limit=25) == 25
    # the cap itself is allowed, one frame over it is refused (an off-by-one here refused
    # requests for exactly the server's longest audio)
    assert frame_budget(10, 4096, 4096, 8192) == 4096
    with pytest.raises(InputError) as err:
        frame_budget(10, 4097, 4096, 8192)
    assert err.value.field == "max_frames" and "4097" in str(err.value)
    with pytest.raises(InputError) as err:
        frame_budget(10, 5000, 4096, 8192)
    assert err.value.field == "max_frames"
    with pytest.raises(InputError):
        frame_budget(10, -3, 4096, 8192)


def test_every_intermediate_is_named(talker: TalkerModel, model: Any) -> None:
    """Graphs read like the math: talk.blk0.attn_out, cp.blk1.ffn_out, ..."""
    run(talker, model, "Hi.", 2)
    assert talker._step is not None
    step_names = {name_of(n) for n in talker._step[1].graph.nodes()}
    cp_names = {name_of(n) for n in talker._cp_graphs[3].graph.nodes()}
    for il in range(len(talker.weights.layers)):
        for part in ("attn_norm", "q_norm", "k_rope", "kqv_merged", "attn_out", "attn_res",
                     "ffn_out", "l_out"):
            assert f"talk.blk{il}.{part}" in step_names
    assert {"hidden", "logits", "talk.inp_embd"} <= step_names and "cp.blk1.ffn_out" in cp_names
    assert isinstance(talker._step[1].graph, Graph)


def test_graphs_are_cached_not_rebuilt(talker: TalkerModel, model: Any) -> None:
    run(talker, model, "Hi.", 3)
    builds = talker.stats.builds
    run(talker, model, "Hi.", 3)
    # per utterance only the prefill graph is built: the step graph of the same cache bucket
    # and the 15 code-predictor graphs are reused
    assert talker.stats.builds - builds == 1
    assert len(talker._cp_graphs) == 15
    assert talker.stats.runs > talker.stats.builds
    assert 0.0 <= talker.stats.share() < 1.0


def test_max_positions_are_enforced(talker: TalkerModel) -> None:
    with pytest.raises(InputError):
        talker.reserve(int(talker.cfg.max_position_embeddings) + 1)
    with pytest.raises(ValueError):
        TalkerModel.__new__(TalkerModel).__init__(None, None, kv_type="q8")  # type: ignore[misc]


def test_q4_0_repack_matches_plain_layout(tiny_model_dir: Path, backends: BackendSet,
                                          tmp_path: Path) -> None:
    """The re-laid-out copy of Q4_0 matrices (gemv_q4's layout with VNNI, else ggml's
    CPU_REPACK) computes what the zero-copy layout computes."""
    from engine.tools.convert import convert

    out = tmp_path / "q4.gguf"
    convert(tiny_model_dir, out, dtype="q4_0", progress=False)
    m = open_model(out)
    plain = TalkerModel(m, backends, kv_type="f32", repack=False)
    packed = TalkerModel(m, backends, kv_type="f32", repack=True)
    assert plain.weights.repacked is None and plain.weights.q4_matrices == 0
    assert (packed.weights.q4_matrices > 0
            or (packed.weights.repacked is not None and packed.weights.repacked.nbytes > 0))
    a, ta, _ = run(plain, m, "Hello world.", 4)
    b, tb, _ = run(packed, m, "Hello world.", 4)
    assert np.array_equal(a, b)
    d = max(np.abs(x - y).max() for x, y in zip(ta.talker, tb.talker, strict=True))
    assert d <= 1e-4 * max(1.0, float(np.abs(ta.talker[0]).max()))
    plain.close()
    packed.close()


def test_talker_cache_grows_and_shrinks(model: Any, backends: BackendSet,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    t = TalkerModel(model, backends, kv_type="f16")
    t.reserve(100)
    assert t.cache is not None and t.cache.n_ctx == 128
    t.reserve(1000)
    assert t.cache.n_ctx == 1024
    t.reserve(300)  # small caches are kept for the next long request
    assert t.cache.n_ctx == 1024
    monkeypatch.setattr(talker_model, "SHRINK_BYTES", 0)
    t.reserve(300)
    assert t.cache.n_ctx == 1024  # not 4x oversized
    t.reserve(100)
    assert t.cache.n_ctx == 128
    t.close()


def test_warm_up_reserves_a_cache_that_is_kept(model: Any, backends: BackendSet,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The first request does not allocate the talker cache, and it never shrinks below the
    warm-up reservation (but does grow past it)."""
    t = TalkerModel(model, backends, kv_type="f16")
    t.warm_up(reserve_positions=200)
    assert t.cache is not None and t.cache.n_ctx == 256
    monkeypatch.setattr(talker_model, "SHRINK_BYTES", 0)
    cache = t.cache
    t.reserve(10)
    assert t.cache is cache  # 25x oversized, but the reservation
    t.reserve(1000)
    assert t.cache.n_ctx == 1024
    t.reserve(10)
    assert t.cache.n_ctx == 256  # back to the reservation, not to 64
    t.close()


def test_pinned_prefixes_serve_every_voice_and_language(model: Any, backends: BackendSet
                                                        ) -> None:
    """Pipeline warm-up pins the prefix of every voice x language: a first request of any of
    them prefills only its text, with the results of a full prefill."""
    pipe = Pipeline(model, backends, precision="exact", kv_type="f32")
    pipe.warm_up()
    talker = pipe.talker
    assert talker is not None and pipe.prompts is not None
    prefixes = set()
    for voice in pipe.voices:
        for language in pipe.languages:
            p = pipe.prompts.build(".", voice, language)
            prefixes.add((p.text_ids[:p.n_prefix].tobytes(), p.codec_ids[:p.n_prefix].tobytes()))
    # dialect voices map "auto" and "chinese" to their dialect: one prefix for both
    assert talker.pinned_prefixes == len(prefixes) == len(pipe.voices) * len(pipe.languages) - 2
    for voice, language in (("ryan", "english"), ("eric", "auto"), ("vivian", "korean")):
        p = pipe.prompts.build("Hello world, once more.", voice, language)
        pinned = talker.prefill(p)
        assert talker.last_prefill_positions == p.length - p.n_prefix
        cold = talker.prefill(p, reuse_prefix=False)
        assert np.abs(pinned.logits - cold.logits).max() <= 1e-5
    req = SynthesisRequest("Hello world, once more.", "ryan", "english", greedy=True,
                           max_frames=4)
    plain = Pipeline(model, backends, precision="exact", kv_type="f32")
    (wav_a, info_a, _), (wav_b, info_b, _) = synthesize(pipe, req), synthesize(plain, req)
    assert np.array_equal(np.concatenate(info_a.codes, axis=1),
                          np.concatenate(info_b.codes, axis=1))
    assert np.array_equal(wav_a, wav_b)
    pipe.close()
    plain.close()


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_a_pinned_prefix_holds_the_rows_a_request_keeps(model: Any, backends: BackendSet,
                                                         kv_type: str) -> None:
    """A prefix pinned at warm-up has the bits of the one a request computes and keeps (its
    first graph): with QTTS_PIN_PREFIXES on or off a voice sounds the same for a seed."""
    pb = PromptBuilder(model)
    prompts = [pb.build(".", v, lang) for v in ("ryan", "eric", "vivian")
               for lang in ("auto", "english", "chinese")]
    pinned, kept = (TalkerModel(model, backends, kv_type=kv_type) for _ in range(2))
    assert pinned.pin_prefixes(prompts) == 8  # eric: "auto" and "chinese" are one prefix
    assert pinned.pin_prefixes(prompts) == 8  # (each once)
    for p in prompts:
        kept.prefill(pb.build("Some text to speak.", p.voice, p.language))
    assert len(kept._prefix) == 8
    for key, (k, v) in pinned._pinned.items():
        k1, v1 = kept._prefix[key]
        assert k.shape == k1.shape and k.shape[1] in (8, 9)  # "auto" has no language id
        assert k.dtype == k1.dtype and np.array_equal(k, k1) and np.array_equal(v, v1)
    pinned.close()
    kept.close()


def test_prompt_prefix_reuse(model: Any, backends: BackendSet) -> None:
    """A repeat voice/language prefills only the text; results equal a full prefill."""
    t = TalkerModel(model, backends, kv_type="f32")
    pb = PromptBuilder(model)
    first = pb.build("Something else entirely.", "ryan", "english")
    p = pb.build("Hello world.", "ryan", "english")
    assert first.n_prefix == p.n_prefix == 9
    t.prefill(first)
    assert t.last_prefill_positions == first.length
    reused = t.prefill(p)
    assert t.last_prefill_positions == p.length - p.n_prefix
    full = t.prefill(p, reuse_prefix=False)
    assert t.last_prefill_positions == p.length
    assert np.abs(reused.logits - full.logits).max() <= 1e-5
    assert np.abs(reused.hidden - full.hidden).max() <= 1e-5
    other = pb.build("Hello world.", "vivian", "english")  # another speaker: another prefix
    t.prefill(other)
    assert t.last_prefill_positions == other.length
    a, _, _ = run(t, model, "Hello world.", 6)
    b, _, _ = run(TalkerModel(model, backends, kv_type="f32"), model, "Hello world.", 6)
    assert np.array_equal(a, b)
    t.close()


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_prefill_shortcuts_match_the_full_prefill(model: Any, backends: BackendSet,
                                                  kv_type: str) -> None:
    """The prefill's shortcuts change nothing: a reused prefix (written with the new rows as one
    block) and the last layer at the last position only. ``capture`` takes neither: it runs
    every position of the prompt through every layer (its taps need them)."""
    t = TalkerModel(model, backends, kv_type=kv_type)
    pb = PromptBuilder(model)
    t.prefill(pb.build("Something else entirely.", "ryan", "english"))
    p = pb.build("Hello world, once more.", "ryan", "english")
    assert qwen3.prefill_n_kv(p.length, 1 << 20) > p.length  # the read is padded past it
    reused = t.prefill(p)
    assert t.last_prefill_positions == p.length - p.n_prefix
    cold = t.prefill(p, reuse_prefix=False)
    full = t.prefill(p, capture=True)
    for out in (reused, cold):
        assert np.abs(out.logits - full.logits).max() <= 1e-5
        assert np.abs(out.hidden - full.hidden).max() <= 1e-5
    # the steps read what the prefill wrote: same frames after either prefill
    a, _, _ = run(t, model, "Hello world, once more.", 4)
    b, _, _ = run(TalkerModel(model, backends, kv_type=kv_type), model,
                  "Hello world, once more.", 4)
    assert np.array_equal(a, b)
    t.close()
