"""Our ggml decoder against the official PyTorch reference on the same random weights.

The reference builds a random-weight ``speech_tokenizer/`` in the released layout
(tests/parity/reference.py); ``qtts convert`` turns it into a GGUF; both decode the same codes
(which include ids whose cluster_usage is 0 or below the clamp).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.backend import BackendSet
from engine.decoder import DecoderModel, StreamingDecoder, decode, push_together, streaming
from engine.gguf_model import open_model
from engine.tools.convert import convert
from tests.parity import reference as ref
from tests.parity.marks import PARITY_MARKS
from tests.parity.reference import snr_db

pytestmark = PARITY_MARKS

# full: 80 frames so the 72-frame attention window slides (the cache is exercised)
FRAMES = {"tiny": 24, "full": 80}
# reference stage key -> our tapped intermediate
STAGES = ref.DECODER_STAGES


class Case:
    """One fixture size: reference folder, its outputs, and converted GGUFs."""

    def __init__(self, size: str, tmp: Path) -> None:
        import torch

        torch.set_num_threads(2)
        self.size = size
        self.dir = ref.make_reference_tokenizer_dir(ref.default_cache_dir(), size, seed=0)
        self.codes = ref.random_codes(FRAMES[size], seed=1)
        model = ref.load_reference_decoder(self.dir)
        self.stages = ref.reference_stage_outputs(model, self.codes)
        self.wav = self.stages["wav"].reshape(-1)
        self.tmp = tmp
        # QTTS_TEST_BACKEND=cuda runs the same parity on an accelerator (bench/gpu_check.sh)
        self.backends = BackendSet.from_env({
            "QTTS_BACKEND": os.environ.get("QTTS_TEST_BACKEND", "cpu"), "QTTS_THREADS": "2"})
        self._gguf: dict[str, Any] = {}

    def model(self, dtype: str) -> Any:
        if dtype not in self._gguf:
            out = self.tmp / f"{self.size}-{dtype}.gguf"
            convert(self.dir, out, dtype=dtype, decoder_dtype=dtype, progress=False)
            self._gguf[dtype] = open_model(out)
        return self._gguf[dtype]

    def decoder(self, dtype: str, precision: str) -> DecoderModel:
        return DecoderModel.load(self.model(dtype), self.backends, precision)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=["tiny", "full"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[Case]:
    folder = tmp_path_factory.mktemp(request.param)
    yield Case(request.param, folder)
    shutil.rmtree(folder)  # the full case's GGUFs: ~0.7 GB a run otherwise keeps to its end


def test_f32_waveform_and_every_stage_match(case: Case) -> None:
    dec = case.decoder("f32", "exact")
    sd = StreamingDecoder(dec, capture=True)
    wav, timings = sd.push(case.codes)
    assert wav.shape == case.wav.shape == (FRAMES[case.size] * 1920,)
    assert float(np.std(case.wav)) > 0.01  # the fixture is not silence
    assert np.abs(wav - case.wav).max() <= 1e-4
    ours = sd.captured()
    for stage, name in STAGES.items():
        r, o = case.stages[stage], ours[name].T  # ours is time-major
        assert r.shape == o.shape, stage
        scale = max(1.0, float(np.abs(r).max()))
        assert np.abs(r - o).max() <= 1e-4 * scale, stage
    assert set(timings.as_dict()) == {"quant", "preconv", "pretr", "upsample", "bigvgan"}
    assert all(v > 0 for v in timings.as_dict().values())


def test_f16_weights_snr(case: Case, record_property: Any) -> None:
    wav, _ = decode(case.decoder("f16", "exact"), case.codes)
    snr = snr_db(case.wav, wav)
    record_property("snr_f16_db", snr)
    print(f"\n{case.size}: F16 weights SNR {snr:.1f} dB")
    assert snr >= 45.0


def test_fast_mode_snr(case: Case, record_property: Any) -> None:
    wav, _ = decode(case.decoder("f32", "fast"), case.codes)
    snr = snr_db(case.wav, wav)
    record_property("snr_fast_db", snr)
    print(f"\n{case.size}: fast (BF16) SNR {snr:.1f} dB")
    assert snr >= 35.0


@pytest.mark.parametrize("max_rows", ["", "1024"])
def test_stock_ops_match(case: Case, max_rows: str) -> None:
    """The form an accelerator runs: stock ggml ops only (every conv a set of matmuls), also
    with the matmuls split for a row-limited backend (QTTS_MAX_MATMUL_ROWS)."""
    backends = BackendSet.from_env({
        "QTTS_BACKEND": os.environ.get("QTTS_TEST_BACKEND", "cpu"), "QTTS_THREADS": "2",
        "QTTS_CUSTOM_OPS": "0", "QTTS_MAX_MATMUL_ROWS": max_rows})
    dec = DecoderModel.load(case.model("f32"), backends, "exact")
    assert not dec.use_custom_ops
    wav, _ = decode(dec, case.codes)
    assert np.abs(wav - case.wav).max() <= 1e-4


@pytest.mark.consistency
@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("chunking", ["1", "2", "3", "5", "8", "random"])
def test_streaming_equals_offline(case: Case, precision: str, chunking: str) -> None:
    """Any chunking gives the offline decode's audio: the same bits where the decoder is
    chunking-invariant (qtts's CPU kernels, no Winograd conv), else within rounding (fast
    mode's BF16 convs amplify the rounding of other sum orders: there within its precision)."""
    dec = case.decoder("f32", precision)
    offline, _ = decode(dec, case.codes, chunk=10_000)
    rng = np.random.default_rng(7)
    sd = StreamingDecoder(dec)
    t, pieces, start = case.codes.shape[1], [], 0
    while start < t:
        n = int(rng.integers(1, 7)) if chunking == "random" else int(chunking)
        audio, _ = sd.push(case.codes[:, start : start + n])
        assert audio.shape == (min(n, t - start) * 1920,)
        pieces.append(audio)
        start += n
    streamed = np.concatenate(pieces)
    if dec.chunk_invariant:
        np.testing.assert_array_equal(streamed, offline)
    elif precision == "exact":
        assert np.abs(streamed - offline).max() <= 1e-5
    else:
        assert snr_db(offline, streamed) >= 35.0


@pytest.mark.consistency
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_joint_pushes_equal_each_streams_own(case: Case, precision: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Four streams pushed together (``push_together``), joining at different frames, each in
    chunks of its own (1 to 10 frames: some past ``JOIN_MAX_FRAMES``, pushed alone), give each
    stream its offline decode and the carried state of its own pushes: the same bits where the
    decoder is chunking-invariant (then the short chunks of a round run as one graph), else
    within the rounding of other chunkings (then every push runs alone)."""
    dec = case.decoder("f32", precision)
    t = case.codes.shape[1]
    codes = [case.codes] + [ref.random_codes(t, seed=20 + i) for i in range(3)]
    offline = [decode(dec, c, chunk=10_000)[0] for c in codes]
    joins = [0, 0, 1, 1]  # the round at which each stream starts
    rng = np.random.default_rng(11)
    sds = [StreamingDecoder(dec) for _ in codes]
    pieces: list[list[np.ndarray]] = [[] for _ in codes]  # type: ignore[type-arg]
    starts = [0] * len(codes)
    graphs: list[int] = []  # the streams of each push's graphs
    real = streaming._push_group

    def counted(decoders: list[StreamingDecoder], cs: list[np.ndarray]) -> Any:  # type: ignore[type-arg]
        graphs.append(len(decoders))
        return real(decoders, cs)

    monkeypatch.setattr(streaming, "_push_group", counted)
    for rnd in range(10 * t):
        live = [i for i, at in enumerate(joins) if at <= rnd and starts[i] < t]
        if not live and rnd > max(joins):
            break
        # round 1: all four live, with short chunks (one graph for four streams)
        sizes = [min(int(rng.integers(1, 11)) if rnd != 1 else 1 + i, t - starts[i])
                 for i in live]
        outs = push_together([sds[i] for i in live],
                             [codes[i][:, starts[i] : starts[i] + n]
                              for i, n in zip(live, sizes, strict=True)])
        for i, n, (audio, _tm) in zip(live, sizes, outs, strict=True):
            assert audio.shape == (n * 1920,)
            pieces[i].append(audio)
            starts[i] += n
    for i, (sd, want) in enumerate(zip(sds, offline, strict=True)):
        got = np.concatenate(pieces[i])
        own = StreamingDecoder(dec)
        own.push(codes[i])
        assert sd.frames == own.frames == t and sd.state.keys() == own.state.keys()
        if dec.chunk_invariant:
            np.testing.assert_array_equal(got, want, err_msg=f"stream {i}")
            for key, arr in own.state.items():
                np.testing.assert_array_equal(sd.state[key], arr, err_msg=f"{i}: {key}")
        elif precision == "exact":
            assert np.abs(got - want).max() <= 1e-5
        else:
            assert snr_db(want, got) >= 35.0
    assert max(graphs) == (4 if dec.chunk_invariant else 1)
    assert 1 in graphs  # (chunks past JOIN_MAX_FRAMES, or a stream's last few, went alone)


def test_prefix_is_causal(case: Case) -> None:
    dec = case.decoder("f32", "exact")
    k = FRAMES[case.size] // 2
    full, _ = decode(dec, case.codes)
    head, _ = decode(dec, case.codes[:, :k])
    assert np.abs(head - full[: k * 1920]).max() <= 1e-5
    assert np.abs(head - case.wav[: k * 1920]).max() <= 1e-4


@pytest.mark.consistency
def test_reset_starts_a_new_utterance(case: Case) -> None:
    dec = case.decoder("f32", "exact")
    sd = StreamingDecoder(dec)
    first, _ = sd.push(case.codes[:, :4])
    sd.push(case.codes[:, 4:9])
    sd.reset()
    again, _ = sd.push(case.codes[:, :4])
    np.testing.assert_array_equal(first, again)


def _state_gap(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:  # type: ignore[type-arg]
    """The largest difference between two decoder states over their common keys, relative to
    each array's scale."""
    return max(float(np.abs(a[k] - v).max()) / max(float(np.abs(v).max()), 1e-30)
               for k, v in b.items() if k in a)


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_priming_is_a_push_whose_audio_is_dropped(case: Case, precision: str) -> None:
    """``prime`` (an in-context voice's reference frames, for context only) runs the
    upsampler and the wave generator on the last ``history_frames`` frames only, yet leaves the
    state of a full push bit for bit, so the frames after it sound the same to the sample; with
    one frame fewer through those stages the state differs: the bound is tight.

    Where fast mode runs a Winograd conv, its tiles start where the chunk starts, so another
    chunking rounds differently: there the state is that of a push in the chunks priming's
    last stages take (all but the last ``history_frames`` frames, then those) up to rounding
    (with BF16 Winograd the same bits as measured; with F32 Winograd the last bits differ)."""
    from engine.decoder import streaming

    dec = case.decoder("f32", precision)
    keep = streaming.history_frames(dec.cfg)
    n = keep + 6
    pushed, primed = StreamingDecoder(dec), StreamingDecoder(dec)
    pushed.push(case.codes[:, :n])
    primed.prime(case.codes[:, :n])
    assert primed.frames == pushed.frames == n and primed.state.keys() == pushed.state.keys()
    if not dec.weights.winograd:
        for key, arr in pushed.state.items():
            np.testing.assert_array_equal(primed.state[key], arr, err_msg=key)
        short = StreamingDecoder(dec)
        x = streaming._features([short], streaming.StageTimings(),
                                [short._codes(case.codes[:, :n])])
        streaming._wave([short], streaming.StageTimings(), np.ascontiguousarray(x[-(keep - 1):]),
                        [keep - 1])
        assert _state_gap(short.state, pushed.state) > 0
    else:  # (the bound's tightness is the exact case's: here rounding hides the last frame)
        pushed = StreamingDecoder(dec)  # the push to compare with: in those two chunks
        pushed.push(case.codes[:, : n - keep])
        pushed.push(case.codes[:, n - keep : n])
        assert _state_gap(primed.state, pushed.state) <= 1e-4
    after, _ = pushed.push(case.codes[:, n : n + 3])
    then, _ = primed.push(case.codes[:, n : n + 3])
    if not dec.weights.winograd:
        np.testing.assert_array_equal(then, after)
    else:
        assert snr_db(after, then) >= 80.0


# Decoder layouts the released models do not use but a checkpoint may: fewer KV heads than query
# heads (the reference repeats each KV head), and a window of one frame (nothing carried).
# Both once aborted the process at the first decode. And widths the reference rounds down: an
# odd codebook_dim (each codebook vector is half of it) and a decoder_dim that the upsampling
# blocks cannot halve evenly (72 -> 36, 18, 9, 4); our schema once refused both.
ODD_DECODERS = {
    "odd_widths": {"codebook_dim": 33, "decoder_dim": 72},
    "grouped_kv": {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 24,
                   "hidden_size": 72, "intermediate_size": 200, "sliding_window": 5},
    "window_1": {"num_attention_heads": 3, "num_key_value_heads": 1, "sliding_window": 1},
}  # fmt: skip


@pytest.mark.parametrize("layout", sorted(ODD_DECODERS))
def test_odd_decoder_layouts(tmp_path: Path, layout: str) -> None:
    model = ref.build_reference_model("tiny", 4, decoder=ODD_DECODERS[layout])
    ref.save_tokenizer_dir(model, tmp_path / "speech_tokenizer")
    codes = ref.random_codes(24, seed=2)
    want = ref.reference_decode(model, codes)
    convert(tmp_path / "speech_tokenizer", tmp_path / "model.gguf", dtype="f32", progress=False)
    gguf = open_model(tmp_path / "model.gguf")
    for ops in ("1", "0"):  # qtts's window op, then ggml's own nodes
        be = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2",
                                  "QTTS_CUSTOM_OPS": ops})
        dec = DecoderModel.load(gguf, be, "exact")
        got, _ = decode(dec, codes)
        sd = StreamingDecoder(dec)
        streamed = np.concatenate([sd.push(codes[:, i : i + 5])[0] for i in range(0, 24, 5)])
        assert np.abs(got - want).max() <= 1e-4, (ops, np.abs(got - want).max())
        assert np.abs(streamed - got).max() <= 1e-5
        dec.close()
    fast = DecoderModel.load(gguf, BackendSet.from_env({"QTTS_BACKEND": "cpu",
                                                        "QTTS_THREADS": "2"}), "fast")
    got, _ = decode(fast, codes)
    assert snr_db(want, got) >= 35.0
    fast.close()
