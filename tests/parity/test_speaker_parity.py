"""Our ggml speaker encoder (log-mel front end + ECAPA-TDNN) against the official reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.backend import BackendSet
from engine.gguf_model import open_model
from engine.speaker.encoder import SpeakerEncoder
from engine.speaker.mel import mel_filterbank
from engine.tools.make_model import make_model
from tests.parity import reference_clone as rc
from tests.parity.marks import PARITY_MARKS
from tests.speech import SENTENCES, speech_24k

pytestmark = PARITY_MARKS


@pytest.fixture(scope="module")
def base_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("base_tiny")
    make_model(folder, "tiny", seed=3, variant="base", progress=False, keep_checkpoint=True)
    return folder


def test_mel_filterbank_equals_librosa() -> None:
    import librosa

    ours = mel_filterbank(24000, 1024, 128, 0.0, 12000.0)
    theirs = librosa.filters.mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("sentence", range(len(SENTENCES)))
def test_x_vector_tiny(base_tiny: Path, cpu2: BackendSet, tmp_path: Path, sentence: int) -> None:
    wav = speech_24k(tmp_path, SENTENCES[sentence])
    want = rc.x_vector(base_tiny, wav)
    with open_model(base_tiny / "model.gguf") as m:
        enc = SpeakerEncoder(m, cpu2)
        got = enc.embed(wav)
        enc.close()
    assert got.shape == want.shape
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"x-vector max relative error {rel:.2e}")
    assert rel < 1e-4, rel


def test_x_vector_on_stock_ops(base_tiny: Path, tmp_path: Path) -> None:
    """The form an accelerator runs (stock ggml ops: every conv matmuls, the pooling statistics
    as ggml nodes) gives the reference's x-vector too."""
    stock = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2",
                                 "QTTS_CUSTOM_OPS": "0"})  # fmt: skip
    wav = speech_24k(tmp_path, SENTENCES[0])
    want = rc.x_vector(base_tiny, wav)
    with open_model(base_tiny / "model.gguf") as m:
        enc = SpeakerEncoder(m, stock)
        assert not enc._form.direct
        got = enc.embed(wav)
        enc.close()
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    assert rel < 1e-4, rel


RELEASED_SPEAKER = {
    "enc_channels": [512, 512, 512, 512, 1536], "enc_kernel_sizes": [5, 3, 3, 3, 1],
    "enc_dilations": [1, 2, 3, 4, 1], "enc_attention_channels": 128, "enc_res2net_scale": 8,
    "enc_se_channels": 128,
}  # fmt: skip


def test_x_vector_released_size(
    cpu2: BackendSet, tmp_path: Path
) -> None:
    """The released ECAPA-TDNN (512 channels, scale 8, enc_dim 1024) on a small talker."""
    folder = tmp_path / "model"
    make_model(folder, "tiny", seed=5, variant="base", progress=False, keep_checkpoint=True,
               overrides={"talker": {"hidden_size": 1024}, "speaker": RELEASED_SPEAKER})
    wav = speech_24k(tmp_path, SENTENCES[1])
    want = rc.x_vector(folder, wav)
    with open_model(folder / "model.gguf") as m:
        assert m.speaker_config is not None and m.speaker_config.enc_dim == 1024
        enc = SpeakerEncoder(m, cpu2)
        got = enc.embed(wav)
        enc.close()
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"x-vector max relative error {rel:.2e}")
    assert rel < 1e-4, rel
