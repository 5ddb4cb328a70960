"""``bench/clone.py --http``: voice cloning over HTTP against a real ``qtts serve``.

Starts ``python -m cli serve`` (one worker, ``--threads`` threads, a temporary data directory)
on the deterministic random Base model of ``bench/clone.py`` at ``--dtype``, then per repeat:

1. **create**: ``POST /v1/audio/voices`` with a ~``--seconds`` espeak-ng reference and its
   transcript (in-context cloning), client-side wall time to the answer (target <= 1 s on 2
   cores at 0.6B Q4_0). The server's own split (``qtts_voice_clone_seconds{stage}``: decode,
   encode, prepare, store) is printed from /metrics. Every repeat clones another window of the
   speech (shifted by 0.1 s), so no voice finds the caches an earlier one left.
2. **first audio of its first request**: ``POST /tts`` (streamed pcm) in the new voice, client
   time to the first audio byte (target <= 250 ms); and of a second request in the same voice.

The first repeat after start also loads the encoders in the worker: it is reported apart
(``cold_*``); the others give the medians.

    python bench/clone.py --http [--size 0.6b] [--threads 2] [--dtype q4_0] [--seconds 10]
                                 [--repeats 5]

The machine may be shared: the load average is printed; treat times as upper bounds.
"""

from __future__ import annotations

import io
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import soundfile as sf

from bench.load import start_server, stop_server

TEXT = "Hello, how are you today?"


def _create(client: httpx.Client, url: str, ref: bytes, transcript: str, name: str
            ) -> tuple[str, float]:  # fmt: skip
    t0 = time.perf_counter()
    r = client.post(url + "/v1/audio/voices", data={"name": name, "transcript": transcript},
                    files={"audio_sample": ("ref.wav", ref, "audio/wav")})
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return str(r.json()["id"]), dt


def _first_audio(client: httpx.Client, url: str, voice: str) -> float:
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", url + "/tts", json={
            "text": TEXT, "voice": voice, "format": "pcm", "seed": 1, "max_seconds": 2}) as r:
        r.raise_for_status()
        for piece in r.iter_raw():
            if piece and first is None:
                first = time.perf_counter() - t0
    assert first is not None, "no audio"
    return first


def _stage_means(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for m in re.finditer(r'^qtts_voice_clone_seconds_(sum|count)\{stage="(\w+)"\} (\S+)$', text,
                         re.M):  # fmt: skip
        (sums if m.group(1) == "sum" else counts)[m.group(2)] = float(m.group(3))
    return {k: round(sums[k] / counts[k], 4) for k in sums if counts.get(k)}


def run(size: str, threads: int, dtype: str, seconds: float, repeats: int) -> dict[str, Any]:
    from bench.clone import model_paths, reference_audio

    print(f"load average: {os.getloadavg()}", file=sys.stderr)
    _, _, served = model_paths(size, dtype)
    result: dict[str, Any] = {"mode": "http", "size": size, "threads": threads, "dtype": dtype}
    with tempfile.TemporaryDirectory() as tmp:
        ref_path, transcript = reference_audio(Path(tmp), seconds + 0.1 * (repeats + 1))
        speech, rate = sf.read(ref_path, dtype="float32")

        def window(i: int) -> bytes:
            out = io.BytesIO()
            start = int(0.1 * i * rate)
            sf.write(out, speech[start : start + int(seconds * rate)], rate, format="WAV")
            return out.getvalue()

        settings = {"QTTS_DATA_DIR": str(Path(tmp) / "data"), "QTTS_BACKEND": "cpu"}
        proc, url = start_server(served, 1, threads, settings=settings,
                                 log=Path(tmp) / "serve.log")
        try:
            creates, firsts, seconds_ = [], [], []
            with httpx.Client(timeout=300) as client:
                for i in range(repeats + 1):
                    vid, dt = _create(client, url, window(i), transcript, f"bench-{i}")
                    first = _first_audio(client, url, vid)
                    second = _first_audio(client, url, vid)
                    client.delete(f"{url}/v1/audio/voices/{vid}").raise_for_status()
                    if i == 0:
                        result.update(cold_create_s=round(dt, 4),
                                      cold_first_audio_s=round(first, 4))
                        continue
                    creates.append(dt)
                    firsts.append(first)
                    seconds_.append(second)
            result["reference_seconds"] = seconds
            result["create_s"] = round(statistics.median(creates), 4)
            result["first_audio_first_request_s"] = round(statistics.median(firsts), 4)
            result["first_audio_second_request_s"] = round(statistics.median(seconds_), 4)
            result["server_clone_stage_means_s"] = _stage_means(url)
            result["targets"] = {"create_s": 1.0, "first_audio_first_request_s": 0.25}
        finally:
            stop_server(proc)
    print(json.dumps(result, indent=2))
    return result
