"""Voice cloning end to end against the official ``generate_voice_clone`` (greedy codes).

Both sides load the same ``qtts make-model --variant base --size tiny`` checkpoint: the official
``Qwen3TTSModel.from_pretrained`` reads the HF folder, qtts its converted GGUF (F32, F32 KV
cache). The reference speech is espeak-ng; the prompt is built from it on each side (speaker
encoder, speech-tokenizer encoder, resampling), so every stage of cloning is in the comparison.
Also the VoiceDesign and 1.7B CustomVoice prompts on tiny models with the 1.7B structure (talker
width != code-predictor width).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from engine.backend import BackendSet
from engine.clone.audio import DecodedAudio, decode, resample
from engine.clone.cloner import VoiceCloner
from engine.clone.prompt import VoicePrompt, build_clone_prompt
from engine.gguf_model import open_model
from engine.pipeline import Pipeline, SynthesisRequest, synthesize
from engine.talker import PromptBuilder, SamplingParams, TalkerModel, generate_frames, make_rng
from engine.talker.prompt import Prompt
from engine.tools.make_model import make_model
from tests.parity.marks import MISSING as _MISSING
from tests.parity.marks import PARITY_MARKS
from tests.speech import SENTENCES, espeak_wav

pytestmark = PARITY_MARKS
if not _MISSING:
    from tests.parity import reference_clone as rc

FRAMES = 14
TEXT = "The model reads the text, and then it speaks the words one frame at a time."
TINY_17B = {
    "talker": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16},
    "root": {"tts_model_size": "1b7"},
}  # fmt: skip


@dataclass(frozen=True)
class Case:
    name: str
    x_vector_only: bool
    non_streaming: bool
    audio: str  # "wav22k" (espeak-ng's own rate) or "mp3_16k"
    language: str = "english"


CASES = (
    Case("x_vector_only", True, False, "wav22k"),
    Case("icl_non_streaming", False, True, "wav22k"),
    Case("icl_streaming", False, False, "wav22k", language="auto"),
    Case("icl_mp3_16k", False, False, "mp3_16k"),
)


def _mp3_16k(src: Path, dst: Path) -> Path:
    """Re-encode ``src`` as a 16 kHz mono MP3 with PyAV (libmp3lame)."""
    import av

    audio = decode(src)
    pcm = resample(audio.samples, audio.sample_rate, 16000)
    with av.open(str(dst), mode="w") as out:
        stream = out.add_stream("mp3", rate=16000)
        stream.layout = "mono"  # type: ignore[attr-defined]
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="flt", layout="mono")
        frame.sample_rate = 16000
        for packet in stream.encode(frame):  # type: ignore[attr-defined]
            out.mux(packet)
        for packet in stream.encode(None):  # type: ignore[attr-defined]
            out.mux(packet)
    return dst


class Rig:
    """One converted tiny model, its talker and prompt builder."""

    def __init__(self, folder: Path, backends: BackendSet) -> None:
        self.folder = folder
        self.model = open_model(folder / "model.gguf")
        self.builder = PromptBuilder(self.model)
        self.talker = TalkerModel(self.model, backends, "f32")
        self.backends = backends

    def clone(self, audio: DecodedAudio, ref_text: str, x_vector_only: bool = False
              ) -> VoicePrompt:  # fmt: skip
        """The voice of decoded reference audio (resampled to 24 kHz), made by our cloner."""
        cloner = VoiceCloner(self.model, self.backends, self.builder)
        try:
            return cloner.make(resample(audio.samples, audio.sample_rate), ref_text,
                               x_vector_only)  # fmt: skip
        finally:
            cloner.close()

    def prompt(self, voice: VoicePrompt, text: str = TEXT, language: str = "english",
               mode: str = "stream") -> Prompt:
        """The talker prompt of ``text`` in ``voice``."""
        return build_clone_prompt(self.builder, voice, text, language, mode,
                                  self.talker.frame_embeddings)  # fmt: skip

    def greedy(self, prompt: Prompt, frames: int = FRAMES) -> np.ndarray:
        params = SamplingParams.from_defaults(self.model.generation_defaults).greedy()
        gen = generate_frames(self.talker, prompt, params, frames, make_rng(0)[0])
        return np.stack([f.codes for f in gen], axis=1)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Rig:
    folder = tmp_path_factory.mktemp("clone_base")
    make_model(folder, "tiny", seed=11, variant="base", progress=False, keep_checkpoint=True)
    return Rig(folder, BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2"}))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_generate_voice_clone_greedy(base: Rig, tmp_path: Path, case: Case) -> None:
    src = espeak_wav(tmp_path / "ref.wav", SENTENCES[0])
    if case.audio == "mp3_16k":
        src = _mp3_16k(src, tmp_path / "ref.mp3")
    audio = decode(src)  # both sides get the same decoded samples at the file's own rate
    if case.audio == "mp3_16k":
        assert audio.sample_rate == 16000
    voice = base.clone(audio, SENTENCES[0], case.x_vector_only)
    ours = base.greedy(base.prompt(voice, language=case.language,
                                   mode="full" if case.non_streaming else "stream"))
    want = rc.clone_codes(base.folder, audio.samples, audio.sample_rate, TEXT, case.language,
                          SENTENCES[0], case.x_vector_only, case.non_streaming, FRAMES)
    assert ours.shape == want.shape == (16, FRAMES)
    np.testing.assert_array_equal(ours, want)


def test_cloning_on_stress_weights(tmp_path_factory: pytest.TempPathFactory,
                                   tmp_path: Path) -> None:
    """The ``stress`` recipe, encoders included (every stage O(1), as trained weights are):
    the x-vector within 1e-5, the reference codes identical and the greedy codes of an
    in-context request identical to the reference's."""
    folder = tmp_path_factory.mktemp("clone_stress")
    make_model(folder, "tiny", seed=13, variant="base", progress=False, keep_checkpoint=True,
               recipe="stress")
    rig = Rig(folder, BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2"}))
    audio = decode(espeak_wav(tmp_path / "ref.wav", SENTENCES[1]))
    wav = resample(audio.samples, audio.sample_rate)
    voice = rig.clone(audio, SENTENCES[1])
    want_xv = rc.x_vector(folder, wav)
    np.testing.assert_allclose(voice.x_vector, want_xv, rtol=0,
                               atol=1e-5 * float(np.abs(want_xv).max()))
    np.testing.assert_array_equal(voice.ref_codes, rc.encode(folder, wav))  # type: ignore[arg-type]
    want = rc.clone_codes(folder, audio.samples, audio.sample_rate, TEXT, "english",
                          SENTENCES[1], False, False, FRAMES)
    np.testing.assert_array_equal(rig.greedy(rig.prompt(voice)), want)


def test_cloned_speech_equals_the_references(tmp_path_factory: pytest.TempPathFactory,
                                             tmp_path: Path) -> None:
    """The audio of an in-context request, not only its codes: the reference decodes its
    reference codes and the new ones in one pass and cuts the reference's share; the stream
    (primed with every reference frame) gives the same samples, on a decoder whose attention
    reaches back 4 x 71 frames (stress weights: every stage O(1))."""
    folder = tmp_path_factory.mktemp("clone_speech")
    make_model(folder, "tiny", seed=14, variant="base", progress=False, keep_checkpoint=True,
               recipe="stress",
               overrides={"decoder": {"sliding_window": 72, "num_hidden_layers": 4}})
    audio = decode(espeak_wav(tmp_path / "ref.wav", SENTENCES[2]))
    backends = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2"})
    pipe = Pipeline(open_model(folder / "model.gguf"), backends, precision="exact",
                    kv_type="f32")
    try:
        voice = pipe.clone_voice(resample(audio.samples, audio.sample_rate), SENTENCES[2])
        assert voice.ref_codes is not None and len(voice.ref_codes) > 30
        ours, info, _ = synthesize(pipe, SynthesisRequest(TEXT, voice_prompt=voice,
                                                          language="english", greedy=True,
                                                          max_frames=FRAMES))
    finally:
        pipe.close()
        backends.close()
    codes, want = rc.clone_speech(folder, audio.samples, audio.sample_rate, TEXT, "english",
                                  SENTENCES[2], False, False, FRAMES)
    np.testing.assert_array_equal(np.concatenate(info.codes, axis=1), codes)
    # the reference's cut, int(ref_len / total_len * samples), can fall one sample early
    assert want.size - ours.size in (0, 1)
    want = want[want.size - ours.size :]
    assert float(want.std()) > 0.05
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-4)


def test_icl_prompt_prefix_is_reused(base: Rig, tmp_path: Path) -> None:
    """A second request with the same stored voice prefills only what follows its prefix."""
    audio = decode(espeak_wav(tmp_path / "ref.wav", SENTENCES[2]))
    voice = base.clone(audio, SENTENCES[2])
    p1 = base.prompt(voice, mode="full")
    p2 = base.prompt(voice, "Another sentence entirely.", mode="full")
    first = base.greedy(p1, 3)
    base.talker.prefill(p2)
    assert base.talker.last_prefill_positions == p2.length - p2.n_prefix
    np.testing.assert_array_equal(base.greedy(p1, 3), first)  # reuse changes nothing


def _tiny_17b(tmp_path_factory: pytest.TempPathFactory, variant: str) -> Rig:
    folder = tmp_path_factory.mktemp(f"tiny17b_{variant}")
    make_model(folder, "tiny", seed=12, variant=variant, progress=False, keep_checkpoint=True,
               overrides=TINY_17B)
    return Rig(folder, BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2"}))


@pytest.mark.parametrize("x_vector_only", [True, False], ids=["x_vector", "icl"])
def test_voice_clone_17b_structure_greedy(tmp_path_factory: pytest.TempPathFactory,
                                          tmp_path: Path, x_vector_only: bool) -> None:
    """A Base model with the 1.7B structure (talker width != code-predictor width: the
    projection between them, and an x-vector at the talker's width)."""
    rig = _tiny_17b(tmp_path_factory, "base")
    assert rig.talker.weights.cp_mtp_w is not None
    audio = decode(espeak_wav(tmp_path / "ref.wav", SENTENCES[0]))
    voice = rig.clone(audio, SENTENCES[0], x_vector_only)
    assert voice.x_vector.shape == (TINY_17B["talker"]["hidden_size"],)
    want = rc.clone_codes(rig.folder, audio.samples, audio.sample_rate, TEXT, "english",
                          SENTENCES[0], x_vector_only, False, FRAMES)
    np.testing.assert_array_equal(rig.greedy(rig.prompt(voice)), want)


@pytest.mark.parametrize("non_streaming", [True, False], ids=["full", "stream"])
def test_voice_design_greedy(tmp_path_factory: pytest.TempPathFactory,
                             non_streaming: bool) -> None:  # fmt: skip
    rig = _tiny_17b(tmp_path_factory, "voice_design")
    assert rig.talker.weights.cp_mtp_w is not None  # the 1.7B projection is exercised
    instruct = "A warm, low female voice, speaking slowly."
    prompt = rig.builder.build(TEXT, None, "english", instruct,
                               "full" if non_streaming else "stream")  # fmt: skip
    want = rc.design_codes(rig.folder, TEXT, instruct, "english", non_streaming, FRAMES)
    np.testing.assert_array_equal(rig.greedy(prompt), want)


# query heads per KV head that do not divide 16 (the fused prefill attention's lanes) and widths
# that are not a multiple of the quantisation block: the talker 6 heads over 2, the code
# predictor 5 over 1
ODD_HEADS = {
    "talker": {"hidden_size": 80, "intermediate_size": 136, "num_attention_heads": 6,
               "num_key_value_heads": 2, "head_dim": 16},
    "cp": {"hidden_size": 48, "intermediate_size": 72, "num_attention_heads": 5,
           "num_key_value_heads": 1, "head_dim": 16},
}  # fmt: skip


@pytest.mark.parametrize("non_streaming", [True, False], ids=["full", "stream"])
def test_custom_voice_greedy_with_odd_head_groups(tmp_path_factory: pytest.TempPathFactory,
                                                  non_streaming: bool) -> None:
    folder = tmp_path_factory.mktemp("tiny_odd_heads")
    make_model(folder, "tiny", seed=5, variant="custom_voice", progress=False,
               keep_checkpoint=True, overrides=ODD_HEADS)
    rig = Rig(folder, BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2"}))
    prompt = rig.builder.build(TEXT, "ryan", "english", None,
                               "full" if non_streaming else "stream")  # fmt: skip
    want = rc.custom_codes(rig.folder, TEXT, "ryan", "english", None, non_streaming, FRAMES)
    np.testing.assert_array_equal(rig.greedy(prompt), want)


def test_custom_voice_17b_instruct_greedy(tmp_path_factory: pytest.TempPathFactory) -> None:
    rig = _tiny_17b(tmp_path_factory, "custom_voice")
    assert rig.builder.honours_instruct
    instruct = "Speak softly and cheerfully."
    prompt = rig.builder.build(TEXT, "ryan", "english", instruct, "full")
    want = rc.custom_codes(rig.folder, TEXT, "ryan", "english", instruct, True, FRAMES)
    np.testing.assert_array_equal(rig.greedy(prompt), want)


