"""Shared by the voice tests: real reference speech (espeak-ng), servers on the tiny Base model,
the create call, and the audit lines of a server's JSON log."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import soundfile as sf

from tests.service.helpers import Server, decoded_seconds
from tests.speech import SENTENCES, espeak_wav

REF_TEXT = SENTENCES[0]


def reference(folder: Path, text: str = REF_TEXT) -> bytes:
    """``text`` spoken by espeak-ng, as WAV bytes."""
    return espeak_wav(folder / "ref.wav", text).read_bytes()


def wav_bytes(samples: np.ndarray[Any, Any], rate: int = 24000) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def create(server: Server, audio: bytes, name: str, transcript: str | None = REF_TEXT,
           key: str | None = None, **extra: str) -> httpx.Response:
    data = {"name": name, **extra}
    if transcript is not None:
        data["transcript"] = transcript
    return httpx.post(server.url + "/v1/audio/voices", data=data, headers=auth(key),
                      files={"audio_sample": ("ref.wav", audio, "audio/wav")}, timeout=120)


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def speak(server: Server, voice: Any, key: str | None = None, **body: Any) -> httpx.Response:
    """A short /tts request in ``voice`` (a whole WAV file)."""
    return httpx.post(server.url + "/tts", headers=auth(key), timeout=120, json={
        "text": "Hello there.", "voice": voice, "max_seconds": 0.5, "stream": False,
        "seed": 1, **body})


def assert_speech(r: httpx.Response) -> None:
    assert r.status_code == 200, r.text
    assert decoded_seconds(r.content, "wav") > 0


def audit_lines(server: Server) -> list[dict[str, Any]]:
    out = []
    for line in server.log().splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("logger") == "qtts.audit":
                out.append(rec)
    return out
