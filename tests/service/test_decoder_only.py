"""A decoder-only GGUF: codes work (also through the OpenAI route), text is a clear 422."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.service.helpers import FRAME_SAMPLES, Server, codes


@pytest.fixture(scope="module")
def decoder_only(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.tools.convert import convert

    out = tmp_path_factory.mktemp("decoder-only") / "model.gguf"
    convert(tiny_model_dir, out, dtype="f32", parts="decoder", progress=False)
    return out


def test_decoder_only_model(decoder_only: Path, tmp_path: Any) -> None:
    server = Server(decoder_only, tmp_path)
    try:
        server.wait_ready()
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["parts"] == ["decoder"]
        v = httpx.get(server.url + "/v1/audio/voices").json()
        assert v["voices"] == [] and v["languages"] == []
        r = httpx.post(server.url + "/tts", json={"text": "hello"})
        assert r.status_code == 422
        err = r.json()["error"]
        assert err["field"] == "text" and "no talker" in err["message"]
        assert "send codes" in err["message"]
        r = httpx.post(server.url + "/v1/audio/speech",
                       json={"model": "tts-1", "voice": "alloy", "input": "hello"})
        assert r.status_code == 422 and r.json()["error"]["param"] == "input"
        # codes need no voice list: the OpenAI client's required voice is accepted as is
        r = httpx.post(server.url + "/v1/audio/speech", timeout=60, json={
            "model": "tts-1", "voice": "alloy", "input": "", "response_format": "pcm",
            "codes": codes(5)})
        assert r.status_code == 200 and len(r.content) == 5 * FRAME_SAMPLES * 2
    finally:
        server.stop()
