"""Pipeline: text/codes -> streamed chunks, the ramp, timings, outcomes, cancellation, CLI (on the
stress model: tests/conftest.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from cli.main import main
from engine.backend import BackendSet
from engine.decoder import decode
from engine.errors import InputError
from engine.gguf_model import open_model
from engine.pipeline import (
    CodesRequest,
    Pipeline,
    Ramp,
    StreamInfo,
    SynthesisRequest,
    as_request,
    chunk_sizes,
    synthesize,
)
from engine.timings import DECODER_STAGES
from engine.tools.convert import convert
from service.protocol import Job  # the object a worker hands the pipeline

FRAME = 1920
# Streamed vs one-pass decode differ by float rounding only. The tests run the stress model
# (tests/conftest.py): unclipped O(0.3) audio with every decoder stage O(1), so a chunk-boundary
# bug in any stage's carried state (conv history, attention cache, upsampler overlap) moves
# samples far beyond this; the default tiny model clips most samples at +-1 and hid them.
STREAM_TOL = 1e-5


@pytest.fixture(scope="module")
def backends() -> BackendSet:
    return BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "1"})


@pytest.fixture(scope="module")
def pipe(stress_gguf: Path, backends: BackendSet) -> Pipeline:
    return Pipeline(open_model(stress_gguf), backends, precision="exact", kv_type="f32",
                    chunk_max_frames=4)


def collect(pipe: Pipeline, req: Any, cancel: Any = None) -> tuple[list[Any], str, StreamInfo]:
    info = StreamInfo()
    gen = pipe.stream(req, cancel, info)
    chunks = []
    while True:
        try:
            chunks.append(next(gen))
        except StopIteration as stop:
            return chunks, str(stop.value), info


def test_chunk_ramp() -> None:
    g = chunk_sizes(8)
    assert [next(g) for _ in range(7)] == [1, 2, 4, 8, 8, 8, 8]
    g = chunk_sizes(3)
    assert [next(g) for _ in range(4)] == [1, 2, 3, 3]
    g = chunk_sizes(16, "gentle")
    assert [next(g) for _ in range(13)] == [1, 1, 1, 2, 2, 3, 4, 6, 8, 12, 16, 16, 16]
    g = chunk_sizes(10, "gentle")
    assert [next(g) for _ in range(11)] == [1, 1, 1, 2, 2, 3, 4, 6, 8, 10, 10]
    with pytest.raises(ValueError, match="ramp"):
        next(chunk_sizes(8, "steep"))
    # a first chunk of more frames, the ramp going on as after one frame; capped like the rest
    g = chunk_sizes(16, "gentle", 2)
    assert [next(g) for _ in range(8)] == [2, 1, 1, 2, 2, 3, 4, 6]
    g = chunk_sizes(8, "double", 3)
    assert [next(g) for _ in range(5)] == [3, 2, 4, 8, 8]
    assert next(chunk_sizes(2, "gentle", 5)) == 2
    with pytest.raises(ValueError, match="first chunk"):
        next(chunk_sizes(8, "gentle", 0))


def test_auto_ramp_is_gentle_alone_and_doubles_in_a_batch() -> None:
    def walk(ramp: Ramp, shared: list[bool]) -> list[int]:
        sizes = [ramp.target]
        for s in shared:
            ramp.advance(shared=s)
            sizes.append(ramp.target)
        return sizes

    alone = [False] * 12
    assert walk(Ramp(16, "auto"), alone) == [1, 1, 1, 2, 2, 3, 4, 6, 8, 12, 16, 16, 16]
    # in a batch: doubling to 8 frames, what several streams' pushes decode in one graph
    assert walk(Ramp(16, "auto"), [True] * 6) == [1, 2, 4, 8, 8, 8, 8]
    # joined by others after two pushes, alone again at 8: on gently from there
    assert walk(Ramp(16, "auto"), [False, False, True, True, True, False, False]) == [
        1, 1, 1, 2, 4, 8, 12, 16]
    # the fixed ramps ignore the company; a restart (a pause for text) begins again at 1
    assert walk(Ramp(16, "gentle"), [True] * 4) == [1, 1, 1, 2, 2]
    assert walk(Ramp(16, "double"), [False] * 4) == [1, 2, 4, 8, 16]
    r = Ramp(4, "auto")
    assert walk(r, [True] * 3) == [1, 2, 4, 4]
    r.advance(restart=True)
    assert walk(r, [False] * 4) == [1, 1, 1, 2, 2]
    assert walk(Ramp(3, "auto"), [True, False, False]) == [1, 2, 3, 3]
    assert walk(Ramp(16, "auto"), [True, True, True, False, True, False]) == [
        1, 2, 4, 8, 12, 8, 12]
    assert walk(Ramp(16, "auto"), [False] * 10 + [True]) == [
        1, 1, 1, 2, 2, 3, 4, 6, 8, 12, 16, 8]  # joined at 16: down to 8
    with pytest.raises(ValueError, match="ramp"):
        Ramp(8, "steep")
    # a first chunk of two frames: alone, in a batch, and again after a restart
    r = Ramp(16, "auto", first=2)
    assert walk(r, [False] * 4) == [2, 1, 1, 2, 2]
    r.advance(restart=True)
    assert walk(r, [True] * 3) == [2, 4, 8, 8]


@pytest.mark.parametrize(("first", "sizes"), [(1, [1, 1, 1, 2, 2, 3, 2]),
                                              (2, [2, 1, 1, 2, 2, 3, 1])])
def test_gentle_ramp_streams_the_same_audio_in_other_chunks(pipe: Pipeline, first: int,
                                                            sizes: list[int]) -> None:
    """A pipeline with the gentle ramp (opening with ``first_chunk_frames``) streams text and
    codes requests in those chunks: the same codes and audio as the doubling ramp's (fast mode
    on this CPU's kernels: to rounding where a Winograd kernel starts its tiles where a chunk
    starts)."""
    gentle = Pipeline(pipe.model, pipe.backends, pipe.decoder, kv_type="f32", chunk_max_frames=4,
                      chunk_ramp="gentle", first_chunk_frames=first)
    try:
        req = SynthesisRequest("Hello world.", "ryan", "english", seed=5, max_frames=12)
        chunks, _, info = collect(gentle, req)
        assert [c.frames for c in chunks] == sizes
        ref, _, ref_info = collect(pipe, req)
        np.testing.assert_array_equal(np.concatenate(info.codes, 1),
                                      np.concatenate(ref_info.codes, 1))
        a = np.concatenate([c.audio for c in chunks])
        b = np.concatenate([c.audio for c in ref])
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=1e-4)
        codes_chunks, _, _ = collect(gentle, CodesRequest(np.concatenate(info.codes, 1)))
        assert [c.frames for c in codes_chunks] == sizes
    finally:
        gentle.close()
    with pytest.raises(ValueError, match="chunk_ramp"):
        Pipeline(pipe.model, pipe.backends, pipe.decoder, chunk_ramp="steep")
    with pytest.raises(ValueError, match="first_chunk_frames"):
        Pipeline(pipe.model, pipe.backends, pipe.decoder, first_chunk_frames=0)


def test_text_stream_chunks_timings_and_outcome(pipe: Pipeline) -> None:
    req = SynthesisRequest("Hello world.", "ryan", "english", seed=5, max_frames=12)
    chunks, outcome, info = collect(pipe, req)
    assert outcome == "truncated_no_eos" == info.outcome
    assert [c.frames for c in chunks] == [1, 2, 4, 4, 1]
    assert all(c.audio.dtype == np.float32 and c.audio.size == c.frames * FRAME for c in chunks)
    assert info.frames == 12 and info.seed == 5 and info.budget == 12
    first = chunks[0].timings
    assert first.prefill > 0 and first.code_predictor > 0
    assert all(c.timings.prefill == 0 for c in chunks[1:])
    assert all(c.timings.talker_step > 0 and c.timings.code_predictor > 0 for c in chunks[1:])
    for c in chunks:
        assert all(getattr(c.timings, s) > 0 for s in DECODER_STAGES)
    # the streamed audio is the decode of the streamed codes
    codes = np.concatenate(info.codes, axis=1)
    assert codes.shape == (16, 12)
    whole, _ = decode(pipe.decoder, codes, chunk=100)
    assert np.abs(np.concatenate([c.audio for c in chunks]) - whole).max() <= STREAM_TOL


def test_seeded_requests_repeat(pipe: Pipeline) -> None:
    req = SynthesisRequest("Hi there.", "aiden", None, seed=9, max_frames=5, text_mode="stream")
    a, _, ia = collect(pipe, req)
    b, _, ib = collect(pipe, req)
    assert np.array_equal(np.concatenate(ia.codes, 1), np.concatenate(ib.codes, 1))
    audio_a, audio_b = (np.concatenate([c.audio for c in x]) for x in (a, b))
    assert np.array_equal(audio_a, audio_b)


def test_codes_request_same_door(pipe: Pipeline) -> None:
    codes = np.random.default_rng(0).integers(0, 2048, (16, 9))
    chunks, outcome, _ = collect(pipe, CodesRequest(codes))
    assert outcome == "ok" and [c.frames for c in chunks] == [1, 2, 4, 2]
    whole, _ = decode(pipe.decoder, codes, chunk=100)
    assert np.abs(np.concatenate([c.audio for c in chunks]) - whole).max() <= STREAM_TOL
    assert chunks[0].timings.prefill == 0 and chunks[0].timings.bigvgan > 0
    short, _, _ = collect(pipe, CodesRequest(codes, max_frames=3))
    assert sum(c.frames for c in short) == 3
    with pytest.raises(InputError) as err:
        collect(pipe, CodesRequest(codes[:, :0]))
    assert err.value.field == "codes"


def test_cancel_event_stops_within_one_frame(pipe: Pipeline) -> None:
    ev = threading.Event()
    gen = pipe.stream(SynthesisRequest("Hello world.", "ryan", seed=1, max_frames=40), ev)
    first = next(gen)
    assert first.frames == 1
    ev.set()
    with pytest.raises(StopIteration) as stop:
        next(gen)
    assert stop.value.value == "cancelled"
    calls = {"n": 0}

    def after_two() -> bool:
        calls["n"] += 1
        return calls["n"] > 2

    chunks, outcome, _ = collect(pipe, CodesRequest(np.zeros((16, 20), np.int32)), after_two)
    assert outcome == "cancelled" and sum(c.frames for c in chunks) == 3


def test_request_errors(pipe: Pipeline) -> None:
    bad: list[tuple[Any, str]] = [
        (SynthesisRequest("hi", "nobody"), "voice"),
        (SynthesisRequest("hi", "ryan", "elvish"), "language"),
        (SynthesisRequest("", "ryan"), "text"),
        (SynthesisRequest("hi", "ryan", instruct="shout"), "instruct"),
        (SynthesisRequest("hi", "ryan", max_frames=10**6), "max_frames"),
        (SynthesisRequest("hi", "ryan", top_p=2.0), "top_p"),
        (SynthesisRequest("hi", "ryan", chunk_max_frames=-1), "chunk_max_frames"),
    ]
    for req, field_name in bad:
        with pytest.raises(InputError) as err:
            collect(pipe, req)
        assert err.value.field == field_name, req


def test_duck_typed_jobs(pipe: Pipeline) -> None:
    r = as_request(Job(1, "text", text="hi", voice="ryan", sampling={"seed": 3, "top_k": 5},
                       max_frames=4))
    assert isinstance(r, SynthesisRequest) and r.seed == 3 and r.top_k == 5 and r.max_frames == 4
    chunks, outcome, _ = collect(pipe, Job(2, "text", text="hi", voice="ryan",
                                           sampling={"seed": 3}, max_frames=3))
    assert outcome == "truncated_no_eos" and sum(c.frames for c in chunks) == 3
    audio, timings, n = chunks[0]  # unpacks like the (audio, timings, frames) tuple
    assert n == 1 and audio.size == FRAME and timings.prefill > 0
    c = as_request(Job(3, "codes", codes=np.zeros((16, 2), np.int32)))
    assert isinstance(c, CodesRequest)
    with pytest.raises(TypeError):
        as_request(object())


def test_decoder_only_model_refuses_text(stress_model_dir: Path, backends: BackendSet,
                                         tmp_path: Path) -> None:
    out = tmp_path / "decoder-only.gguf"
    convert(stress_model_dir, out, dtype="f32", parts="decoder", progress=False)
    p = Pipeline(open_model(out), backends, precision="exact")
    assert not p.has_talker and p.voices == [] and p.languages == []
    with pytest.raises(InputError) as err:
        collect(p, SynthesisRequest("hello", "ryan"))
    assert err.value.field == "text"
    chunks, outcome, _ = collect(p, CodesRequest(np.ones((16, 2), np.int32)))
    assert outcome == "ok" and sum(c.frames for c in chunks) == 2
    assert main(["synth", "hi", "--model", str(out), "-o", str(tmp_path / "x.wav")]) == 2


def test_synthesize_helper(pipe: Pipeline) -> None:
    audio, info, first = synthesize(pipe, SynthesisRequest("Hi.", "serena", max_frames=2))
    assert audio.size == 2 * FRAME and first > 0 and info.outcome == "truncated_no_eos"


def test_cli_synth_and_voices(stress_gguf: Path, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QTTS_BACKEND", "cpu")
    monkeypatch.setenv("QTTS_THREADS", "1")
    wav, npy = tmp_path / "o.wav", tmp_path / "c.npy"
    rc = main(["synth", "Hello there.", "--model", str(stress_gguf), "--voice", "Ryan",
               "--language", "English", "--seed", "4", "--max-frames", "3", "--save-codes",
               str(npy), "-o", str(wav)])
    assert rc == 0
    data, sr = sf.read(wav, dtype="float32")
    assert sr == 24000 and data.shape == (3 * FRAME,)
    assert np.load(npy).shape == (16, 3)
    err = capsys.readouterr().err
    assert "3 frames" in err and "truncated_no_eos" in err and "warning" in err
    # the stress model is synthetic too: no advice to raise a budget it would fill with noise
    assert "random weights" in err and "raise --max-frames" not in err
    assert main(["synth", "x", "--model", str(stress_gguf), "--voice", "bob", "-o", str(wav)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("qtts: voice: unknown voice 'bob'; choose one of: aiden")
    assert main(["voices", "--model", str(stress_gguf)]) == 0
    out = capsys.readouterr().out
    assert "ryan" in out and "eric  (speaks sichuan_dialect" in out
    assert "languages: auto, chinese" in out and "instructions: not supported" in out


@pytest.fixture(scope="module")
def stress_pipe(stress_gguf_seeded: Path, backends: BackendSet) -> Pipeline:
    """The stress model of each model seed (tests/conftest.py ``STRESS_SEEDS``)."""
    return Pipeline(open_model(stress_gguf_seeded), backends, precision="exact", kv_type="f32",
                    chunk_max_frames=4)


@pytest.mark.parametrize("seed", [3, 4])
def test_stress_model_stream_is_the_whole_decode(stress_pipe: Pipeline, seed: int) -> None:
    """On each stress model the streamed chunks of a text request equal one decode of the same
    codes to float rounding, and the audio is loud and unclipped (so the comparison sees
    every sample)."""
    req = SynthesisRequest("Hello world, how are you?", "ryan", "english", seed=seed,
                           max_frames=20)
    chunks, outcome, info = collect(stress_pipe, req)
    # the stress talker may sample its end of speech before the budget (model seed 1 does at
    # frame 19 with seed 4): the ramp up to whatever it spoke, several chunks in any case
    assert outcome in ("ok", "truncated_no_eos") and 12 <= info.frames <= 20
    full, last = divmod(info.frames - 3, 4)
    assert [c.frames for c in chunks] == [1, 2] + [4] * full + [last] * (last > 0)
    audio = np.concatenate([c.audio for c in chunks])
    assert 0.1 < float(np.std(audio)) < 0.6
    assert float(np.mean(np.abs(audio) >= 0.999)) < 0.01
    whole, _ = decode(stress_pipe.decoder, np.concatenate(info.codes, axis=1), chunk=100)
    assert np.abs(audio - whole).max() <= STREAM_TOL


def test_stress_model_seeds_give_different_speech(stress_pipe: Pipeline) -> None:
    def codes(seed: int) -> np.ndarray[Any, Any]:
        req = SynthesisRequest("Hello world.", "ryan", "english", seed=seed, max_frames=6)
        return np.concatenate(collect(stress_pipe, req)[2].codes, axis=1)

    a, b = codes(1), codes(2)
    assert np.array_equal(a, codes(1))
    assert np.mean(a != b) > 0.5


def test_cli_output_paths_are_checked_before_any_work(stress_gguf: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:  # fmt: skip
    """A file the command could not write is a one-line error naming the option, found before
    the model is even opened (a synthesis used to run whole, then end in libsndfile's
    traceback); a bad codes file or chunk size too (an empty one, or one that starts like a
    zip archive, ended in numpy's traceback)."""
    (tmp_path / "adir").mkdir()
    codes = tmp_path / "c.npy"
    np.save(codes, np.zeros((16, 2), np.int32))
    np.savez(tmp_path / "c.npz", a=np.zeros((16, 2), np.int32))
    (tmp_path / "empty.npy").write_bytes(b"")
    (tmp_path / "pk.npy").write_bytes(b"PK\x03\x04garbage")  # a zip archive's first bytes
    nowhere = str(tmp_path / "no-such.gguf")  # checked after the output: never reached
    synth = ["synth", "Hello.", "--model", nowhere, "--voice", "ryan"]
    decode = ["decode", "--model", nowhere, "--codes", str(codes)]
    for argv, words in (
        ([*synth, "-o", str(tmp_path / "adir")], "--out: "),
        ([*synth, "-o", str(tmp_path / "x.mp3")], "the name must end in .wav"),
        ([*synth, "-o", str(tmp_path / "gone" / "x.wav")], "does not exist"),
        ([*synth, "-o", "/dev/full"], "not a regular file"),
        ([*synth, "-o", ""], "not a file name"),
        ([*synth, "-o", str(tmp_path / "o.wav"), "--save-codes", str(tmp_path / "adir")],
         "--save-codes: "),
        ([*decode, "--out", str(tmp_path / "x.flac")], "the name must end in .wav"),
        ([*decode, "--out", str(tmp_path / "o.wav"), "--stream-chunk", "-3"], "must be >= 1"),
        (["decode", "--model", str(stress_gguf), "--codes", str(tmp_path / "c.npz"), "--out",
          str(tmp_path / "o.wav")], "an .npz archive"),
        *((["decode", "--model", str(stress_gguf), "--codes", str(tmp_path / name), "--out",
            str(tmp_path / "o.wav")], f"{name}: not a readable .npy array")
          for name in ("empty.npy", "pk.npy")),
    ):  # fmt: skip
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "adir.npy").exists()


@pytest.mark.parametrize(("argv", "words"), [
    (["make-model", "{tmp}/m", "--size", "tiny", "--seed", "-1"], "--seed: -1 must be >= 0"),
    (["synth", "x", "--model", "m.gguf", "--voice", "ryan", "--max-frames", "0", "-o",
      "{tmp}/o.wav"], "--max-frames: 0 must be >= 1"),
    (["synth", "x", "--model", "m.gguf", "--voice", "ryan", "--seed", "-4", "-o", "{tmp}/o.wav"],
     "--seed: -4 must be >= 0"),
    (["clone-voice", "--model", "m.gguf", "--audio", "a.wav", "--max-seconds", "nan", "-o",
      "{tmp}/v.qvoice"], "--max-seconds: nan must be a number of seconds above 0"),
    (["clone-voice", "--model", "m.gguf", "--audio", "a.wav", "--max-seconds", "0", "-o",
      "{tmp}/v.qvoice"], "--max-seconds: 0 must be a number of seconds above 0"),
    (["doctor", "--model", "m.gguf", "--frames", "-3"], "--frames: -3 must be >= 1"),
    (["doctor", "--model", "m.gguf", "--frames", "0"], "--frames: 0 must be >= 1"),
    (["doctor", "--model", "m.gguf", "--frames", "100000"], "--frames: 100000 must be <= 4096"),
])  # fmt: skip
def test_cli_numbers_out_of_range_are_refused_by_name(argv: list[str], words: str,
                                                      tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:  # fmt: skip
    """A number outside its range is argparse's usage error naming the option: it used to be
    taken (a seed of -1 left a half-written model folder and a traceback; 0 frames meant the
    default; 0 seconds blamed the audio for being over 0 s long; doctor's negative frames
    were a traceback, 0 an empty table, 100000 a run of minutes)."""
    with pytest.raises(SystemExit) as exit_:
        main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {words}" in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []

