"""Voice cloning without the reference: audio intake, bad inputs, .qvoice files, the pipeline
and the CLI on a tiny random Base model (parity lives in tests/parity/test_clone_parity.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cli.main import main
from engine.backend import BackendSet
from engine.clone import voice_file
from engine.clone.audio import decode, load_reference, resample
from engine.clone.prompt import build_clone_prompt, live_start_tokens
from engine.decoder import StreamingDecoder, streaming
from engine.errors import InputError
from engine.gguf_model import open_model
from engine.pipeline import Pipeline, StreamInfo, SynthesisRequest, synthesize
from engine.talker.live import TextUpdate
from engine.tools.make_model import make_model
from tests.engine.live_feed import QueueFeed
from tests.speech import SENTENCES, espeak_wav

REF_TEXT = SENTENCES[0]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("clone_base")
    make_model(folder, "tiny", seed=21, variant="base", progress=False, keep_checkpoint=True)
    return folder


@pytest.fixture(scope="module")
def pipe(base_dir: Path) -> Pipeline:
    backends = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2"})
    return Pipeline(open_model(base_dir / "model.gguf"), backends, precision="exact")


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return espeak_wav(tmp_path_factory.mktemp("speech") / "ref.wav", REF_TEXT)


def _encode(src: Path, dst: Path, codec: str, rate: int, layout: str) -> Path:
    """Re-encode ``src`` with PyAV (container from ``dst``'s suffix)."""
    import av

    a = decode(src)
    pcm = resample(a.samples, a.sample_rate, rate)
    ch = 2 if layout == "stereo" else 1
    data = np.repeat(pcm[None, :], ch, axis=0)
    if ch == 2:
        data[1] *= 0.5  # different channels: the mix must be their mean
    with av.open(str(dst), mode="w") as out:
        stream = out.add_stream(codec, rate=rate)
        stream.layout = layout  # type: ignore[attr-defined]
        fmt = "fltp"
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data), format=fmt, layout=layout)
        frame.sample_rate = rate
        for packet in stream.encode(frame):  # type: ignore[attr-defined]
            out.mux(packet)
        for packet in stream.encode(None):  # type: ignore[attr-defined]
            out.mux(packet)
    return dst


@pytest.mark.parametrize(("suffix", "codec", "rate", "layout"), [
    (".flac", "flac", 48000, "stereo"),
    (".ogg", "libopus", 48000, "stereo"),
    (".m4a", "aac", 16000, "mono"),
    (".mp3", "mp3", 22050, "mono"),
    (".wav", "pcm_s16le", 16000, "stereo"),
])  # fmt: skip
def test_reference_audio_formats(speech: Path, tmp_path: Path, suffix: str, codec: str,
                                 rate: int, layout: str) -> None:  # fmt: skip
    f = _encode(speech, tmp_path / f"ref{suffix}", codec, rate, layout)
    d = decode(f)
    assert d.sample_rate == rate and d.samples.ndim == 1
    wav = load_reference(f)
    assert abs(wav.size / 24000 - d.samples.size / rate) < 1e-3  # 24 kHz, same duration
    ref = load_reference(speech)
    # the same speech survives every container / codec / rate / channel mix
    n = min(ref.size, wav.size) // 2
    corr = np.corrcoef(ref[:n], wav[:n])[0, 1]
    assert corr > 0.5 or suffix in (".ogg", ".m4a", ".mp3")  # lossy codecs shift phase
    assert 0.01 < float(np.abs(wav).max()) <= 1.5
    if suffix != ".m4a":  # (libsndfile does not read AAC: FFmpeg decodes it)
        _decodes_as_the_reference(f, codec)


def test_a_damaged_mp3s_decoder_notes_go_to_the_log(speech: Path, tmp_path: Path,
                                                    capfd: pytest.CaptureFixture[str],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """libmpg123 prints notes on a damaged MP3 to the process's stderr (one of them without a
    newline), which broke a server's JSON log lines: they are one log warning now, and the
    audio that is there is decoded."""
    whole = _encode(speech, tmp_path / "ref.mp3", "mp3", 22050, "mono").read_bytes()
    damaged = whole[: len(whole) // 2] + b"garbage" * 100
    capfd.readouterr()
    with caplog.at_level(logging.WARNING, logger="qtts.clone"):
        d = decode(damaged)
    assert capfd.readouterr().err == ""
    said = [r.getMessage() for r in caplog.records if r.name == "qtts.clone"]
    assert len(said) == 1 and said[0].startswith("the audio: its decoder said: "), said
    assert "Illegal Audio-MPEG-Header" in said[0]
    assert 0.5 < d.samples.size / d.sample_rate < decode(whole).samples.size / d.sample_rate
    caplog.clear()
    # one the decoder gives up on: its notes say why, beside the one-line refusal
    with caplog.at_level(logging.WARNING, logger="qtts.clone"), \
            pytest.raises(InputError, match="cannot be decoded"):
        decode(whole[: len(whole) * 3 // 4] + b"garbage" * 200)
    assert any("Giving up resync" in r.getMessage() for r in caplog.records), caplog.records
    capfd.readouterr()
    caplog.clear()
    decode(whole)  # a sound file: nothing said
    assert capfd.readouterr().err == "" and not caplog.records
    # threads decoding at once each get their notes logged, and fd 2 is stderr again after
    before = os.fstat(2)
    with caplog.at_level(logging.WARNING, logger="qtts.clone"):
        workers = [threading.Thread(target=lambda: [decode(damaged) for _ in range(5)])
                   for _ in range(4)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
    assert len([r for r in caplog.records if "Illegal Audio-MPEG-Header" in r.getMessage()]) == 20
    assert capfd.readouterr().err == ""


def test_an_aac_encoders_padding_is_not_audio(tmp_path: Path) -> None:
    """An M4A says how long its stream is; the AAC frames decoded past it are the encoder's
    padding. A 30.0 s file was refused as over the 30 s cap (30.04 s decoded)."""
    import av

    for seconds in (1.0, 30.0):
        n = round(seconds * 24000)
        x = (0.3 * np.sin(2 * np.pi * 220 * np.arange(n) / 24000)).astype(np.float32)[None]
        f = tmp_path / f"tone{seconds:g}.m4a"
        with av.open(str(f), mode="w") as out:  # as ffmpeg writes it: frames with their times
            stream = out.add_stream("aac", rate=24000)
            stream.layout = "mono"  # type: ignore[attr-defined]
            for i in range(0, n, 1024):
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(x[:, i:i + 1024]),
                                                   format="fltp", layout="mono")
                frame.sample_rate, frame.pts = 24000, i
                for packet in stream.encode(frame):  # type: ignore[attr-defined]
                    out.mux(packet)
            for packet in stream.encode(None):  # type: ignore[attr-defined]
                out.mux(packet)
        assert decode(f, 30.0).samples.size == n
        assert load_reference(f).size == n


def _decodes_as_the_reference(f: Path, codec: str) -> None:
    """The reference reads a voice's audio with libsndfile: ``soundfile.read`` for bytes (what
    an upload is), ``librosa.load(path, sr=None, mono=True)`` for a path. A lossy file decodes
    to those samples, not to another decoder's: ``soundfile.read``'s bit for bit; librosa's
    within a float32 step (mpg123 rounds a little differently unseeked; for Opus, libsndfile's
    one large first read unseeked, librosa's way, starts ~250 samples late)."""
    import librosa

    want = sf.read(f, dtype="float32", always_2d=True)[0].mean(axis=1, dtype=np.float32)
    if codec != "libopus":
        np.testing.assert_allclose(librosa.load(f, sr=None, mono=True)[0], want, rtol=0,
                                   atol=2.0**-23)
    for src in (f, f.read_bytes()):
        np.testing.assert_array_equal(decode(src).samples, want)


def test_stereo_is_the_channel_mean(tmp_path: Path) -> None:
    t = np.arange(48000) / 48000
    left, right = np.sin(2 * np.pi * 220 * t), 0.2 * np.sin(2 * np.pi * 330 * t)
    sf.write(tmp_path / "st.wav", np.stack([left, right], axis=1).astype(np.float32), 48000,
             subtype="FLOAT")  # fmt: skip
    d = decode(tmp_path / "st.wav")
    np.testing.assert_allclose(d.samples, ((left + right) / 2).astype(np.float32), atol=1e-6)


@pytest.mark.parametrize(("make", "problem"), [
    (lambda p: sf.write(p, np.full(12000, 0.3, np.float32), 24000), "at least 1 s"),
    (lambda p: sf.write(p, np.full(23990, 0.3, np.float32), 24000),
     "is 0.999 s long; a voice needs at least 1 s"),  # (not "1.00 s long")
    (lambda p: sf.write(p, np.random.default_rng(0).uniform(-.5, .5, 24000 * 31)
                        .astype(np.float32), 24000), "the limit is 30 s"),
    (lambda p: sf.write(p, np.zeros(48000, np.float32), 24000), "is silent"),
    (lambda p: p.write_bytes(np.random.default_rng(1).bytes(5000)), "cannot be decoded"),
    (lambda p: p.write_bytes(b""), "cannot be decoded"),
])  # fmt: skip
def test_bad_reference_audio(tmp_path: Path, make: object, problem: str) -> None:
    p = tmp_path / "bad.wav"
    make(p)  # type: ignore[operator]
    with pytest.raises(InputError, match=problem) as info:
        load_reference(p)
    assert info.value.field == "ref_audio" and "\n" not in str(info.value)


def _antiphase_alac(path: Path, tone: np.ndarray) -> None:
    """An M4A of lossless ALAC whose right channel is the left inverted: PyAV decodes it to
    planar samples (libsndfile does not read MP4)."""
    import av

    pcm = (np.stack([tone, -tone]) * 32767).astype(np.int16)
    with av.open(str(path), mode="w", format="ipod") as out:
        st = out.add_stream("alac", rate=24000, layout="stereo")
        frame = av.AudioFrame.from_ndarray(pcm, format="s16p", layout="stereo")
        frame.sample_rate = 24000
        for packet in (*st.encode(frame), *st.encode(None)):
            out.mux(packet)


def test_channels_that_cancel_are_named(tmp_path: Path) -> None:
    # a stereo clip whose channels cancel when mixed to mono (the reference mixes them) is
    # silent to cloning; the message says why, where "is silent" alone read as a wrong file
    tone = (0.3 * np.sin(np.arange(48000) * 2 * np.pi * 220 / 24000)).astype(np.float32)
    wav = tmp_path / "antiphase.wav"
    sf.write(wav, np.stack([tone, -tone], axis=1), 24000)
    m4a = tmp_path / "antiphase.m4a"
    _antiphase_alac(m4a, tone)
    for path in (wav, m4a):
        with pytest.raises(InputError, match="silent once its channels are mixed to mono") as e:
            load_reference(path)
        assert e.value.field == "ref_audio" and "\n" not in str(e.value)
    # channels that are silent themselves (a constant offset in each) are plain silence
    dc = tmp_path / "dc.wav"
    sf.write(dc, np.full((48000, 2), [0.3, -0.2], np.float32), 24000)
    with pytest.raises(InputError, match=r"is silent \(no sample above -60 dBFS\)"):
        load_reference(dc)
    # one silent channel beside a loud one mixes to half the loud one: not refused
    sf.write(tmp_path / "half.wav", np.stack([tone, np.zeros_like(tone)], axis=1), 24000)
    assert load_reference(tmp_path / "half.wav").shape == (48000,)


def _silent_flac(path: Path, seconds: int, rate: int = 8000, layout: str = "mono") -> Path:
    """A FLAC of digital silence: a few bytes per block, so hours fit in a small upload."""
    import av

    with av.open(str(path), mode="w") as out:
        stream = out.add_stream("flac", rate=rate)
        stream.layout = layout  # type: ignore[attr-defined]
        block = np.zeros((1, rate * len(av.AudioLayout(layout).channels)), np.int16)
        for i in range(seconds):
            frame = av.AudioFrame.from_ndarray(block, format="s16", layout=layout)
            frame.sample_rate, frame.pts = rate, i * rate
            for packet in stream.encode(frame):  # type: ignore[attr-defined]
                out.mux(packet)
        for packet in stream.encode(None):  # type: ignore[attr-defined]
            out.mux(packet)
    return path


def test_a_decompression_bomb_is_refused_while_decoding(tmp_path: Path) -> None:
    """An hour of FLAC silence is under 1 MB but 28.8 M samples (115 MB as float32; a 10 MB
    upload holds days of it): decoding stops once the cap is passed, so what it holds is
    bounded by the cap, not by the file."""
    import tracemalloc

    bomb = _silent_flac(tmp_path / "bomb.flac", 3600)
    assert bomb.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match=r"is over 30 s long; the limit is 30 s") as info:
            load_reference(bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.field == "ref_audio"
    assert peak < 8 << 20, f"decoding held {peak >> 20} MB"  # 30 s at 8 kHz: ~1 MB
    with pytest.raises(InputError, match="is over 5 s long"):
        decode(bomb, max_seconds=5)
    assert decode(_silent_flac(tmp_path / "short.flac", 2)).samples.size == 16000


def test_what_one_read_holds_does_not_grow_with_the_channels(tmp_path: Path) -> None:
    """Eight channels of silence: each read holds a bounded number of samples, not of frames
    (a frame is eight samples here), so decoding to the cap holds ~the mono samples kept."""
    import tracemalloc

    bomb = _silent_flac(tmp_path / "bomb8.flac", 600, layout="7.1")
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match=r"is over 30 s long"):
            load_reference(bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # 30 s of mono at 8 kHz is ~1 MB; reads of 65536 frames of 8 channels held 4.8 MB
    assert peak < 2 << 20, f"decoding held {peak / 2**20:.1f} MB"


@pytest.mark.parametrize(("subtype", "fmt"), [("PCM_U8", "WAV"), ("PCM_S8", "AIFF"),
                                              ("PCM_24", "WAV"), ("ULAW", "WAV")])
def test_integer_pcm_reads_as_libsndfile_reads_it(tmp_path: Path, subtype: str,
                                                  fmt: str) -> None:
    """8-bit WAV is unsigned (silence is 128): it must come out centred on 0, as libsndfile
    (the reference's reader) gives it, not with half of full scale added."""
    t = np.arange(24000) / 24000
    x = (0.5 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    path = tmp_path / f"ref.{fmt.lower()}"
    sf.write(path, x, 24000, subtype=subtype, format=fmt)
    want, _ = sf.read(path, dtype="float32")
    got = decode(path).samples
    assert abs(float(got.mean())) < 0.01  # (the 8-bit writer truncates: -0.5 / 128)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_missing_reference_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="file not found"):
        load_reference(tmp_path / "nope.wav")


def test_empty_transcript_refused_in_icl_mode(pipe: Pipeline, speech: Path) -> None:
    for text in (None, "", "   "):
        with pytest.raises(InputError, match="ref_text: is empty"):
            pipe.clone_voice(str(speech), text)
    with pytest.raises(InputError, match="ref_text: has nothing to speak"):
        pipe.clone_voice(str(speech), "\u200b\ufeff")
    voice = pipe.clone_voice(str(speech), None, x_vector_only=True)
    assert not voice.icl and voice.x_vector.shape == (32,)



def test_lone_surrogates_refused_in_clone_texts(pipe: Pipeline, speech: Path) -> None:
    with pytest.raises(InputError, match="ref_text: has a lone surrogate"):
        pipe.clone_voice(str(speech), "a\ud800b")
    voice = pipe.clone_voice(str(speech), None, x_vector_only=True)
    req = SynthesisRequest("a\udfffb", voice_prompt=voice, greedy=True, max_frames=2)
    with pytest.raises(InputError, match="text: has a lone surrogate"):
        list(pipe.stream(req))

def test_cloned_stream_starts_with_new_speech(pipe: Pipeline, speech: Path) -> None:
    voice = pipe.clone_voice(str(speech), REF_TEXT)
    assert voice.icl and voice.ref_codes is not None and voice.ref_codes.shape[1] == 16
    info = StreamInfo()
    req = SynthesisRequest("Good morning.", voice_prompt=voice, greedy=True, max_frames=6,
                           text_mode="stream")  # fmt: skip
    chunks = list(pipe.stream(req, info=info))
    # the reference frames are decoded for context only: every sample sent is a new frame's
    assert chunks[0].frames == 1 and chunks[0].audio.size == 1920
    assert sum(c.audio.size for c in chunks) == 1920 * info.frames == 1920 * 6
    codes = np.concatenate(info.codes, axis=1)
    assert not np.array_equal(codes[:, :1], voice.ref_codes[:1].T)



def test_a_cloned_stream_has_the_whole_reference_as_context(
        tmp_path_factory: pytest.TempPathFactory, speech: Path) -> None:
    """The reference decodes reference + new codes in one pass and cuts the reference's share,
    so the new audio has every reference frame as context. On a decoder whose attention
    reaches back 4 x 71 frames (the released one: 8 x 71) the stream equals that one pass;
    priming with the last 25 reference frames, as before, did not."""
    folder = tmp_path_factory.mktemp("clone_long_context")
    make_model(folder, "tiny", seed=23, variant="base", progress=False, recipe="stress",
               overrides={"decoder": {"sliding_window": 72, "num_hidden_layers": 4}})
    backends = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2"})
    p = Pipeline(open_model(folder / "model.gguf"), backends, precision="exact")
    try:
        voice = p.clone_voice(str(speech), REF_TEXT)
        assert voice.ref_codes is not None and len(voice.ref_codes) > 30
        audio, info, _ = synthesize(p, SynthesisRequest("Hello there.", voice_prompt=voice,
                                                        greedy=True, max_frames=6))
        new = np.concatenate(info.codes, axis=1)
        one_pass, _ = StreamingDecoder(p.decoder).push(
            np.concatenate([voice.ref_codes.T, new], axis=1))
        want = one_pass[len(voice.ref_codes) * 1920 :]
        assert audio.shape == want.shape and float(np.abs(want).std()) > 0.05
        np.testing.assert_allclose(audio, want, rtol=0, atol=1e-4)
        short = StreamingDecoder(p.decoder)
        short.prime(voice.ref_codes[-25:].T)
        assert float(np.abs(short.push(new)[0] - want).max()) > 1e-2
    finally:
        p.close()
        backends.close()


@pytest.mark.parametrize("x_only", [True, False], ids=["x_vector", "icl"])
def test_a_cloned_voice_defaults_to_streaming_text(pipe: Pipeline, speech: Path,
                                                   x_only: bool) -> None:
    """As the reference's ``generate_voice_clone`` (``non_streaming_mode=False``): a request in
    a cloned voice that names no text mode is laid out streaming, and a pinned voice's prefix
    runs through its transcript (an in-context request prefills less than its ``full`` twin)."""
    voice = pipe.clone_voice(str(speech), REF_TEXT, x_vector_only=x_only)
    pipe.pin_voice(voice)

    def run(mode: str | None) -> tuple[np.ndarray, int]:
        info = StreamInfo()
        req = SynthesisRequest("Good morning, how are you?", voice_prompt=voice, greedy=True,
                               max_frames=5, text_mode=mode)  # fmt: skip
        list(pipe.stream(req, info=info))
        assert pipe.talker is not None
        return np.concatenate(info.codes, axis=1), pipe.talker.last_prefill_positions

    default, n_default = run(None)
    stream, n_stream = run("stream")
    full, n_full = run("full")
    np.testing.assert_array_equal(default, stream)
    assert not np.array_equal(default, full)
    assert n_default == n_stream
    if not x_only:
        assert n_stream < n_full


@contextlib.contextmanager
def decoded_frames() -> Iterator[list[int]]:
    """The frames every decoder push or priming takes while the block runs (both go through
    ``streaming._features``), one entry a stream and call."""
    frames: list[int] = []
    real = streaming._features

    def counting(decoders: list[StreamingDecoder], tm: object, codes: list[np.ndarray]
                 ) -> np.ndarray:
        frames.extend(c.shape[1] for c in codes)
        return real(decoders, tm, codes)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(streaming, "_features", counting)
        yield frames


def test_a_prepared_voice_speaks_its_first_request_from_its_caches(pipe: Pipeline,
                                                                   speech: Path) -> None:
    """``prepare_voice`` (what a worker does when it makes a voice) leaves the voice's prefix
    among the recent ones (the rows a prefill would have kept, bit for bit) and its decoder
    primed: the first request prefills only its own positions and decodes only its own frames,
    and sounds as an unprepared first request."""
    voice = pipe.clone_voice(str(speech), REF_TEXT)
    req = SynthesisRequest("Good morning.", voice_prompt=voice, greedy=True, max_frames=4)
    assert pipe.talker is not None
    pipe._primed.clear()
    pipe.talker.forget_prefixes()
    cold = np.concatenate([c.audio for c in pipe.stream(req)])
    n_all = pipe.talker.last_prefill_positions
    snapshot = dict(pipe.talker._prefix)  # what the prefill kept of its prefix
    pipe._primed.clear()
    pipe.talker.forget_prefixes()
    pipe.prepare_voice(voice)
    assert pipe.talker.pinned_prefixes == 0  # kept among the recent ones, not pinned
    assert pipe.talker._prefix.keys() == snapshot.keys()
    for key, (k, v) in pipe.talker._prefix.items():  # the same rows, bit for bit
        np.testing.assert_array_equal(k, snapshot[key][0])
        np.testing.assert_array_equal(v, snapshot[key][1])
    with decoded_frames() as frames:
        warm = np.concatenate([c.audio for c in pipe.stream(req)])
    prompt = pipe._clone_prompt(req)
    assert pipe.talker.last_prefill_positions == n_all - prompt.n_prefix
    assert sum(frames) == 4  # its own frames only: no priming
    np.testing.assert_array_equal(warm, cold)


def test_a_voice_primes_the_decoder_once(pipe: Pipeline, speech: Path) -> None:
    """The primed decoder state of an in-context voice is kept: a second request does not
    decode the reference frames again, and its audio is the first one's to the sample (the
    first request did not write into the kept state)."""
    voice = pipe.clone_voice(str(speech), REF_TEXT)
    req = SynthesisRequest("Good morning.", voice_prompt=voice, greedy=True, max_frames=6)
    pipe._primed.clear()
    with decoded_frames() as frames:
        first = np.concatenate([c.audio for c in pipe.stream(req)])
    assert voice.ref_codes is not None
    assert sum(frames) == len(voice.ref_codes) + 6  # the reference's frames, then its own
    assert len(pipe._primed) == 1
    with decoded_frames() as frames:
        second = np.concatenate([c.audio for c in pipe.stream(req)])
    assert sum(frames) == 6  # the new frames only: no priming again
    np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("x_only", [True, False], ids=["x_vector", "icl"])
def test_live_text_in_a_cloned_voice_equals_streaming_text(pipe: Pipeline, speech: Path,
                                                           x_only: bool) -> None:
    """Text written word by word, in a cloned voice: the codes of the whole text as a
    streaming-text request. An in-context voice waits for the text to cover its reference
    frames (EOS or PAD there would end the text), then runs live like any voice."""
    voice = pipe.clone_voice(str(speech), None if x_only else REF_TEXT, x_vector_only=x_only)
    need = live_start_tokens(voice)
    assert (need == 1) == x_only and need < 200
    assert pipe.prompts is not None
    text = SENTENCES[1]
    while len(pipe.prompts.target_words(text, "stream")) < need + 8:
        text += " " + SENTENCES[1]
    words = text.split(" ")
    feed = QueueFeed()

    def writer() -> None:
        for i, w in enumerate(words):
            time.sleep(0.005)
            feed.q.put(TextUpdate(w if i == 0 else " " + w))
        feed.q.put(TextUpdate("", end=True))

    t = threading.Thread(target=writer)
    t.start()
    info = StreamInfo()
    live = SynthesisRequest(text="", voice_prompt=voice, seed=3, max_frames=need + 40)
    audio = [c.audio for c in pipe.stream_live(live, feed, None, info)]
    t.join()
    ref = StreamInfo()
    whole = SynthesisRequest(text=text, voice_prompt=voice, seed=3, max_frames=need + 40,
                             text_mode="stream")
    ref_audio = [c.audio for c in pipe.stream(whole, None, ref)]
    np.testing.assert_array_equal(np.concatenate(info.codes, axis=1),
                                  np.concatenate(ref.codes, axis=1))
    assert info.outcome == ref.outcome
    # the same frames decode to the same audio up to rounding: a pause for text restarts the
    # chunk ramp, and other chunk sizes round differently (the decoder's streaming tests bound it)
    assert sum(a.size for a in audio) == sum(a.size for a in ref_audio) == 1920 * info.frames


def test_live_text_opening_of_an_icl_voice_needs_its_tokens(pipe: Pipeline,
                                                            speech: Path) -> None:
    voice = pipe.clone_voice(str(speech), REF_TEXT)
    assert pipe.prompts is not None and pipe.talker is not None
    need = live_start_tokens(voice)
    ids = pipe.prompts.target_words(" ".join([SENTENCES[1]] * 20), "stream")
    with pytest.raises(InputError, match="starts from"):
        build_clone_prompt(pipe.prompts, voice, ".", None, "stream",
                           pipe.talker.frame_embeddings, ids[: need - 1])
    p = build_clone_prompt(pipe.prompts, voice, ".", None, "stream",
                           pipe.talker.frame_embeddings, ids[: need + 2])
    # the text continues: the ids it did not place trail, and no EOS among them
    assert list(p.trailing_ids) == ids[need : need + 2]

def test_voice_file_round_trip_and_fingerprint(pipe: Pipeline, speech: Path, tmp_path: Path,
                                               base_dir: Path) -> None:  # fmt: skip
    voice = pipe.clone_voice(str(speech), REF_TEXT)
    path = tmp_path / "v.qvoice"
    path.write_bytes(voice_file.dumps(voice))
    back = voice_file.load(path, pipe.voice_fingerprint)
    assert back.ref_text == REF_TEXT and back.fingerprint == voice.fingerprint
    np.testing.assert_array_equal(back.x_vector, voice.x_vector)
    np.testing.assert_array_equal(back.ref_codes, voice.ref_codes)  # type: ignore[arg-type]
    np.testing.assert_array_equal(back.ref_ids, voice.ref_ids)  # type: ignore[arg-type]
    a, _, _ = synthesize(pipe, SynthesisRequest("Hello.", voice_prompt=voice, greedy=True,
                                                max_frames=4))  # fmt: skip
    b, _, _ = synthesize(pipe, SynthesisRequest("Hello.", voice_prompt=back, greedy=True,
                                                max_frames=4))  # fmt: skip
    np.testing.assert_array_equal(a, b)
    with pytest.raises(InputError, match="made for another model"):
        voice_file.load(path, "0" * 64)
    for junk in (b"", b"PK\x03\x04nonsense", np.random.default_rng(2).bytes(300)):
        with pytest.raises(InputError, match="not a qtts voice file"):
            voice_file.load(junk)


def _crafted_voice_files(pipe: Pipeline, speech: Path, folder: Path) -> dict[str, Path]:
    """Voice files with this model's fingerprint whose insides are wrong: what a damaged or
    hostile file holds."""
    good = pipe.clone_voice(str(speech), REF_TEXT)
    codes, ids = good.ref_codes, good.ref_ids
    assert codes is not None and ids is not None
    vocab = int(pipe.model.talker_config.text_vocab_size)
    out = {}
    for name, voice in (
        ("x_vector", dataclasses.replace(good, x_vector=good.x_vector[:7])),
        ("ids", dataclasses.replace(good, ref_ids=np.append(ids, vocab).astype(np.int32))),
        ("negative_ids", dataclasses.replace(good, ref_ids=np.append(ids, -1).astype(np.int32))),
        ("long", dataclasses.replace(good, ref_codes=np.tile(codes, (40_000 // len(codes), 1)))),
    ):  # fmt: skip
        out[name] = folder / f"{name}.qvoice"
        out[name].write_bytes(voice_file.dumps(voice))
    # a zip bomb: 800 MB of zero codes deflate to under 1 MB
    meta = {"format": voice_file.FORMAT, "version": voice_file.VERSION, "mode": "icl",
            "fingerprint": pipe.voice_fingerprint, "ref_text": REF_TEXT}
    buf = io.BytesIO()
    np.savez_compressed(buf, meta=np.array(json.dumps(meta)), x_vector=good.x_vector,
                        ref_codes=np.zeros((12_500_000, 16), np.int32), ref_ids=ids)
    out["bomb"] = folder / "bomb.qvoice"
    out["bomb"].write_bytes(buf.getvalue())
    assert out["bomb"].stat().st_size < voice_file.MAX_BYTES
    # fractional codes (were cut to integers), a mode and a fingerprint that are not there
    for name, changes, arrays in (
            ("float_codes", {}, {"ref_codes": codes.astype(np.float32) + 0.5}),
            # int64 ids past int32: a cast wrapped 2**32 + 5 to 5, an id in range
            ("wide_ids", {}, {"ref_ids": np.append(ids, 2**32 + 5).astype(np.int64)}),
            ("bogus_mode", {"mode": "bogus"}, {}),
            ("no_fingerprint", {"fingerprint": None}, {})):
        buf = io.BytesIO()
        np.savez(buf, meta=np.array(json.dumps({**meta, **changes})), x_vector=good.x_vector,
                 **{"ref_ids": ids, "ref_codes": codes, **arrays})
        out[name] = folder / f"{name}.qvoice"
        out[name].write_bytes(buf.getvalue())
    return out


RUN_CLI = "import sys; from cli.main import main; sys.exit(main(sys.argv[1:]))"


@pytest.mark.parametrize(("case", "problem"), [
    ("x_vector", "x-vector has 7 values"),
    ("ids", "transcript ids fall outside"),
    ("negative_ids", "transcript ids fall outside"),
    ("long", "the talker holds"),
    ("bomb", "not a qtts voice file"),
    ("float_codes", "not a qtts voice file"),
    ("wide_ids", "not a qtts voice file"),
    ("bogus_mode", "is damaged (no mode or model fingerprint)"),
    ("no_fingerprint", "is damaged (no mode or model fingerprint)"),
])  # fmt: skip
def test_damaged_voice_files_are_one_line_errors(pipe: Pipeline, speech: Path, base_dir: Path,
                                                 tmp_path: Path, case: str,
                                                 problem: str) -> None:  # fmt: skip
    """Out-of-range transcript ids used to abort the process in ggml's get_rows, and the bomb
    unpacked its 800 MB: each is now refused before any work, naming the file. (A subprocess:
    an abort would take the test run with it.)"""
    path = _crafted_voice_files(pipe, speech, tmp_path)[case]
    run = subprocess.run(
        [sys.executable, "-c", RUN_CLI, "synth", "Hi.", "--model", str(base_dir / "model.gguf"),
         "--voice-file", str(path), "-o", str(tmp_path / "o.wav"), "--max-frames", "2"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "QTTS_THREADS": "2"})
    lines = [ln for ln in run.stderr.splitlines() if "synthetic random-weight" not in ln]
    assert run.returncode == 2, run.stderr
    assert len(lines) == 1 and problem in lines[0] and str(path) in lines[0], run.stderr


def test_voice_fingerprint_ignores_dtype_and_parts(base_dir: Path, tmp_path: Path,
                                                  pipe: Pipeline) -> None:  # fmt: skip
    from engine.clone.voice_file import model_fingerprint
    from engine.tools.convert import convert

    convert(base_dir, tmp_path / "lean.gguf", dtype="f16", parts="decoder,talker",
            progress=False)  # fmt: skip
    with open_model(tmp_path / "lean.gguf") as lean:
        assert model_fingerprint(lean) == pipe.voice_fingerprint
    other = tmp_path / "other"
    make_model(other, "tiny", seed=22, variant="base", progress=False, keep_checkpoint=True)
    with open_model(other / "model.gguf") as m:
        assert model_fingerprint(m) != pipe.voice_fingerprint


def test_non_base_models_refuse_cloning(tiny_gguf: Path, speech: Path) -> None:
    backends = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "1"})
    p = Pipeline(open_model(tiny_gguf), backends)
    try:
        with pytest.raises(InputError, match="only Base models"):
            p.clone_voice(str(speech), REF_TEXT)
    finally:
        p.close()


def test_the_cloner_loads_ahead_only_where_the_model_clones(base_dir: Path, tiny_gguf: Path,
                                                            speech: Path) -> None:
    """A server's warm-up loads a Base model's encoders (``load_cloner``), and the first voice
    uses those, not a second copy; a model that cannot clone loads nothing and says so."""
    backends = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "1"})
    other = Pipeline(open_model(tiny_gguf), backends)
    base = Pipeline(open_model(base_dir / "model.gguf"), backends, precision="exact")
    try:
        assert other.load_cloner() is False
        assert other._cloner is None
        assert base.load_cloner() is True
        encoders = (base._cloner._speaker, base._cloner._codec)
        assert None not in encoders
        voice = base.clone_voice(str(speech), REF_TEXT)
        assert voice.ref_codes is not None and voice.x_vector.size
        assert (base._cloner._speaker, base._cloner._codec) == encoders
    finally:
        base.close()
        other.close()


def test_base_model_without_voice_says_how_to_clone(pipe: Pipeline) -> None:
    with pytest.raises(InputError, match="give reference audio"):
        synthesize(pipe, SynthesisRequest("Hello.", voice="ryan"))


def test_cli_clone_voice_then_synth(base_dir: Path, speech: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    model = str(base_dir / "model.gguf")
    qv = tmp_path / "me.qvoice"
    assert main(["clone-voice", "--model", model, "--audio", str(speech), "--text", REF_TEXT,
                 "-o", str(qv)]) == 0  # fmt: skip
    assert "in-context voice" in capsys.readouterr().err
    out = tmp_path / "o.wav"
    assert main(["synth", "Good morning.", "--model", model, "--voice-file", str(qv), "-o",
                 str(out), "--greedy", "--max-frames", "3"]) == 0  # fmt: skip
    audio, sr = sf.read(out)
    assert sr == 24000 and audio.size == 3 * 1920
    capsys.readouterr()
    # every bad input is one line naming the problem, exit status 2
    bad = tmp_path / "bad.mp3"
    bad.write_bytes(b"\x00" * 100)
    short, offset = tmp_path / "short.wav", tmp_path / "offset.wav"
    sf.write(short, sf.read(speech, dtype="float32")[0][:12000], 24000)
    sf.write(offset, np.full(72000, 0.5, np.float32), 24000)
    for argv, problem in (
        (["clone-voice", "--model", model, "--audio", str(bad), "--text", "x", "-o",
          str(tmp_path / "b.qvoice")], "cannot be decoded"),
        (["clone-voice", "--model", model, "--audio", str(speech), "-o",
          str(tmp_path / "b.qvoice")], "qtts: text: is empty"),
        (["clone-voice", "--model", model, "--audio", str(speech), "--text", "a\udc80", "-o",
          str(tmp_path / "b.qvoice")], "qtts: text: "),
        (["synth", "Hi.", "--model", model, "--voice-file", str(bad), "-o", str(out)],
         "not a qtts voice file"),
        (["synth", "Hi.", "--model", model, "--voice-file", "/dev/zero", "-o", str(out)],
         "not a regular file"),  # (once read until memory ran out)
        (["synth", "Hi.", "--model", model, "--ref-text", "x", "-o", str(out)],
         "--ref-text needs --ref-audio"),
        # flags that would change nothing are refused (they were dropped without a word)
        (["synth", "Hi.", "--model", model, "--voice-file", str(bad), "--x-vector-only", "-o",
          str(out)], "--x-vector-only needs --ref-audio"),
        (["synth", "Hi.", "--model", model, "--ref-audio", str(speech), "--x-vector-only",
          "--ref-text", "x", "-o", str(out)], "--x-vector-only uses no transcript"),
        # audio that decodes but cannot clone: the option and the file are named (it was
        # "ref_audio: is 0.5 s long", a field the command line does not have)
        (["clone-voice", "--model", model, "--audio", str(short), "--x-vector-only", "-o",
          str(tmp_path / "b.qvoice")], f"qtts: --audio: {short}: is 0.5 s long"),
        (["synth", "Hi.", "--model", model, "--ref-audio", str(short), "--x-vector-only", "-o",
          str(out)],
         f"qtts: --ref-audio: {short}: is 0.5 s long"),
        (["clone-voice", "--model", model, "--audio", str(offset), "--x-vector-only", "-o",
          str(tmp_path / "b.qvoice")], "is silent"),  # a constant offset is no sound
    ):  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert problem in err and "Traceback" not in err and err.count("\n") == 1, err
