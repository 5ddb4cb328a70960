"""The stress test model (``make_model(recipe="stress")``, the session's ``stress_gguf``)
end to end against the official reference: text -> our talker -> codes -> our streamed
decoder, and the official decoder on those codes, stage by stage.

On this model every stage moves its input by O(1) (asserted), and the waveform is O(0.3) and
unclipped, so a broken stage (RVQ dequant, pre-conv, pre-transformer attention, upsampler,
BigVGAN blocks and snake) shows in its own tap and in the audio; with the default recipe the
pre-transformer is about the identity and the output clips, which hides most of them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.backend import BackendSet
from engine.decoder import StreamingDecoder
from engine.gguf_model import open_model
from engine.pipeline import Pipeline, StreamInfo, SynthesisRequest
from tests.parity import reference as ref
from tests.parity.marks import PARITY_MARKS

pytestmark = PARITY_MARKS

FRAMES = 24  # the tiny decoder's 8-frame attention window slides
STAGES = ref.DECODER_STAGES


class Run:
    def __init__(self, stress_model_dir: Path, seed: int) -> None:
        import torch

        torch.set_num_threads(2)
        backends = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2"})
        model = open_model(stress_model_dir / "model.gguf")
        pipe = Pipeline(model, backends, precision="exact", kv_type="f32", chunk_max_frames=4)
        info = StreamInfo()
        req = SynthesisRequest("Hello there, how are you today?", "ryan", "english", seed=seed,
                               max_frames=FRAMES)
        self.audio = np.concatenate([c.audio for c in pipe.stream(req, None, info)])
        self.codes = np.concatenate(info.codes, axis=1).astype(np.int64)
        sd = StreamingDecoder(pipe.decoder, capture=True)
        sd.push(self.codes.astype(np.int32))
        self.ours = sd.captured()
        dec = ref.load_reference_decoder(stress_model_dir / "speech_tokenizer")
        self.ref = ref.reference_stage_outputs(dec, self.codes)


@pytest.fixture(scope="module", params=[1, 2], ids=["seed1", "seed2"])
def run(request: pytest.FixtureRequest, stress_model_dir: Path) -> Run:
    return Run(stress_model_dir, request.param)



def test_the_audio_is_loud_and_unclipped(run: Run) -> None:
    assert run.codes.shape == (16, FRAMES)
    assert 0.1 < float(np.std(run.audio)) < 0.6
    assert float(np.mean(np.abs(run.audio) >= 0.999)) < 0.01


@pytest.mark.parametrize("stage", list(STAGES))
def test_every_stage_matches_the_reference(run: Run, stage: str) -> None:
    r, o = run.ref[stage], run.ours[STAGES[stage]].T  # ours is time-major
    assert r.shape == o.shape
    scale = max(1.0, float(np.abs(r).max()))
    assert np.abs(r - o).max() <= 1e-4 * scale


def test_the_streamed_audio_is_the_reference_waveform(run: Run) -> None:
    assert run.audio.shape == run.ref["wav"].shape
    assert np.abs(run.audio - run.ref["wav"]).max() <= 1e-4


def test_every_stage_does_work(run: Run) -> None:
    """Each stage changes its input by O(1) relative to its size: a stage that passed its
    input through (or an attention that averaged everything) would not be caught otherwise."""
    r = run.ref
    # the pre-transformer: each layer moves the residual stream
    for i in range(2):
        before = r["pretr_in"] if i == 0 else r[f"pretr_layer{i - 1}"]
        after = r[f"pretr_layer{i}"]
        assert np.linalg.norm(after - before) > 0.2 * np.linalg.norm(before), i
    # the upsampler's ConvNeXt and the BigVGAN blocks: not near-linear pass-throughs
    for blk in ("blk1", "blk2", "blk3", "blk4"):
        assert float(np.std(r[blk])) > 0.05, blk
    assert float(np.std(r["snake_out"])) > 0.1
