"""Our ggml Mimi encoder against the official ``speech_tokenizer.encode``: identical codes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.backend import BackendSet
from engine.codec_encoder.encoder import CodecEncoder
from engine.codec_encoder.transformer import GEMM_ROWS
from engine.gguf_model import open_model
from engine.tools.make_model import make_model
from tests.parity import reference_clone as rc
from tests.parity.marks import PARITY_MARKS
from tests.speech import SENTENCES, speech_24k

pytestmark = PARITY_MARKS

RELEASED_MIMI = {
    "hidden_size": 512, "num_filters": 64, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2048, "codebook_dim": 256,
    "vector_quantization_hidden_dimension": 256, "upsample_groups": 512,
}  # fmt: skip


@pytest.fixture(scope="module")
def base_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("base_tiny_enc")
    make_model(folder, "tiny", seed=4, variant="base", progress=False, keep_checkpoint=True)
    return folder


def _codes(folder: Path, backends: BackendSet, wav: np.ndarray) -> np.ndarray:
    with open_model(folder / "model.gguf") as m:
        enc = CodecEncoder(m, backends)
        try:
            return enc.encode(wav)
        finally:
            enc.close()


@pytest.mark.parametrize("sentence", range(len(SENTENCES)))
def test_codes_tiny(base_tiny: Path, cpu2: BackendSet, tmp_path: Path, sentence: int) -> None:
    wav = speech_24k(tmp_path, SENTENCES[sentence])
    want = rc.encode(base_tiny, wav)
    got = _codes(base_tiny, cpu2, wav)
    assert got.shape == want.shape == (-(-wav.size // 1920), 16)
    np.testing.assert_array_equal(got, want)


def test_codes_long_clip(base_tiny: Path, cpu2: BackendSet, tmp_path: Path) -> None:
    """14 s: more than the config's 250-frame sliding window at 25 Hz (the reference applies
    no window when it encodes without a cache; neither do we)."""
    wav = np.concatenate([speech_24k(tmp_path, s) for s in SENTENCES * 2])
    assert wav.size / 24000 > 10.5
    np.testing.assert_array_equal(_codes(base_tiny, cpu2, wav), rc.encode(base_tiny, wav))


def test_codes_on_stock_ops(base_tiny: Path, tmp_path: Path) -> None:
    """The form an accelerator runs (stock ggml ops: every conv matmuls, ggml's ELU) gives the
    reference's codes too; the clip's 25 Hz frames are not a multiple of the transformer's
    padding (``padded_length``)."""
    stock = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": "2",
                                 "QTTS_CUSTOM_OPS": "0"})  # fmt: skip
    wav = speech_24k(tmp_path, SENTENCES[1])
    assert (-(-wav.size // 960)) % GEMM_ROWS
    with open_model(base_tiny / "model.gguf") as m:
        enc = CodecEncoder(m, stock)
        assert not enc._form.direct
        got = enc.encode(wav)
        enc.close()
    np.testing.assert_array_equal(got, rc.encode(base_tiny, wav))


def test_codes_released_size(
    cpu2: BackendSet, tmp_path: Path
) -> None:
    """The released Mimi encoder dims (512 hidden, 8 layers, 64 filters, 256-d codebooks)."""
    folder = tmp_path / "model"
    make_model(folder, "tiny", seed=6, variant="base", progress=False, keep_checkpoint=True,
               overrides={"mimi": RELEASED_MIMI})
    wav = speech_24k(tmp_path, SENTENCES[2])
    want = rc.encode(folder, wav)
    got = _codes(folder, cpu2, wav)
    same = float((got == want).mean())
    print(f"released-size encoder: {same:.4f} of codes identical")
    np.testing.assert_array_equal(got, want)
