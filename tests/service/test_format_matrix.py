"""Every response format, streamed and whole, through real decoders: libsndfile (soundfile),
ffmpeg (PyAV) and a browser (headless Chromium's Web Audio ``decodeAudioData``).

Each decoded waveform is aligned with the PCM that went in (codec delay found by
cross-correlation) and compared by correlation and SNR, per codec: lossless formats must give
the PCM back, lossy ones must still be the same sound. Streamed bytes are what the service's
encoders emit over the worker's chunk ramp; whole files what it sends with ``stream: false``
(and, for FLAC, by default: see service/audio.py).
"""

from __future__ import annotations

import base64
import hashlib
import io
import itertools
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import httpx
import numpy as np
import pytest

from service.audio import encode_whole, make_encoder, stream_wanted, to_s16
from tests.service.helpers import Server, codes

SR = 24000
FORMATS = ("pcm", "wav", "flac", "mp3", "opus", "aac")
MODES = ("stream", "whole")
# (min correlation, min SNR dB) against the s16 PCM, after alignment. Lossless: the PCM itself
# (wav/pcm bit exact; FLAC decoders return the same s16). Lossy at the service's bit rates
# (mp3 64k, aac 64k, opus 32k) on this signal keep the waveform (measured 15-30 dB); opus is
# scored after resampling from its 48 kHz decode.
LIMITS = {"pcm": (0.9999, 60.0), "wav": (0.9999, 60.0), "flac": (0.9999, 60.0),
          "mp3": (0.97, 12.0), "aac": (0.97, 12.0), "opus": (0.9, 6.0)}
# Combinations a decoder cannot read by design, each with the reason (and asserted to fail, so
# a decoder that learns them shows up here).
UNREADABLE = {
    ("aac", "stream", "soundfile"): "libsndfile has no AAC decoder in any container",
    ("aac", "whole", "soundfile"): "libsndfile has no AAC decoder in any container",
    ("flac", "stream", "soundfile"): "a streamed FLAC's STREAMINFO says total_samples = 0 "
    "(unknown); libsndfile rejects it, so FLAC is whole unless a stream is asked for",
}


def signal(seconds: float = 2.0) -> np.ndarray[Any, Any]:
    """Speech-like test audio: a gliding harmonic voice with vibrato, syllable envelopes, a
    noise burst and a pause."""
    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * SR)) / SR
    f0 = 140 + 40 * np.sin(2 * np.pi * 0.7 * t) + 4 * np.sin(2 * np.pi * 5.5 * t)
    phase = 2 * np.pi * np.cumsum(f0) / SR
    voice = sum(np.sin(k * phase) / k for k in range(1, 12))
    env = np.clip(np.sin(2 * np.pi * 2.5 * t), 0, None) ** 0.5
    x = 0.35 * voice * env
    burst = (t > 0.8) & (t < 0.95)
    x[burst] += 0.2 * rng.standard_normal(int(burst.sum()))
    x[(t > 1.3) & (t < 1.45)] = 0.0
    return np.clip(x, -0.95, 0.95).astype(np.float32)


def s16(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The PCM the service sends, back as float."""
    q = np.rint(np.clip(x, -1, 1) * 32767.0).astype(np.int16)
    return q.astype(np.float32) / 32768.0


@cache
def encoded(fmt: str, mode: str) -> bytes:
    x = signal()
    if mode == "whole":
        return encode_whole(fmt, x, SR)
    enc = make_encoder(fmt, SR)
    bounds = np.cumsum([0, 1, 2, 4, 8, 16]) * 1920  # the worker's chunk ramp, then the rest
    out = [enc.encode(x[a:b]) for a, b in itertools.pairwise(bounds)]
    out.append(enc.encode(x[bounds[-1] :]))
    return b"".join(out) + enc.finish()


def resample(y: np.ndarray[Any, Any], rate: int) -> np.ndarray[Any, Any]:
    """To 24 kHz by ffmpeg's resampler (only opus decodes at another rate: 48 kHz)."""
    if rate == SR:
        return y
    import av

    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(y, np.float32).reshape(1, -1),
                                       format="flt", layout="mono")
    frame.sample_rate = rate
    rs = av.AudioResampler(format="flt", layout="mono", rate=SR)
    parts = [f.to_ndarray().reshape(-1) for f in (*rs.resample(frame), *rs.resample(None))]
    return np.concatenate(parts).astype(np.float32)


def decode_soundfile(data: bytes, fmt: str) -> np.ndarray[Any, Any]:
    import soundfile as sf

    if fmt == "pcm":
        y, rate = sf.read(io.BytesIO(data), samplerate=SR, channels=1, format="RAW",
                          subtype="PCM_16", dtype="float32")
    else:
        y, rate = sf.read(io.BytesIO(data), dtype="float32")
    return resample(np.asarray(y).reshape(-1), int(rate))


def decode_pyav(data: bytes, fmt: str) -> np.ndarray[Any, Any]:
    import av

    opts = {"sample_rate": str(SR), "ch_layout": "mono"} if fmt == "pcm" else {}
    with av.open(io.BytesIO(data), format="s16le" if fmt == "pcm" else None,
                 options=opts) as c:
        frames = list(c.decode(audio=0))
    rate = frames[0].sample_rate
    y = np.concatenate([f.to_ndarray().astype(np.float32).reshape(-1) for f in frames])
    if frames[0].format.name.startswith("s16"):
        y = y / 32768.0
    return resample(y, rate)


def compare(ref: np.ndarray[Any, Any], got: np.ndarray[Any, Any]) -> tuple[float, float, int]:
    """(correlation, SNR dB, lag) of ``got`` against ``ref`` at the best lag (codec delay)."""
    n = len(ref)
    size = 1 << int(np.ceil(np.log2(n + len(got))))
    xc = np.fft.irfft(np.fft.rfft(got, size) * np.conj(np.fft.rfft(ref, size)), size)
    lags = np.r_[0:4000, size - 4000 : size]
    best = lags[int(np.argmax(xc[lags]))]
    lag = int(best if best < size // 2 else best - size)
    a = ref[max(0, -lag) :]
    b = got[max(0, lag) :]
    m = min(len(a), len(b))
    a, b = a[:m].astype(np.float64), b[:m].astype(np.float64)
    corr = float(np.dot(a, b) / np.sqrt(np.dot(a, a) * np.dot(b, b)))
    snr = 10 * float(np.log10(np.dot(a, a) / max(float(np.dot(a - b, a - b)), 1e-20)))
    return corr, snr, lag


def check(fmt: str, got: np.ndarray[Any, Any], exact: bool = True) -> None:
    """``got`` decoded from ``fmt`` is the signal as sent: the very samples for the lossless
    formats (``exact``: a decoder that maps s16 to float by /32768)."""
    ref = s16(signal())
    # whole length back (mp3/aac pad to their frame size; at most ~0.1 s)
    assert len(ref) - 100 <= len(got) <= len(ref) + 3000, (fmt, len(got))
    corr, snr, lag = compare(ref, got)
    min_corr, min_snr = LIMITS[fmt]
    assert corr >= min_corr and snr >= min_snr, (fmt, f"corr {corr:.4f} SNR {snr:.1f} dB "
                                                      f"lag {lag}")
    if fmt in ("pcm", "wav", "flac"):
        assert lag == 0 and len(got) == len(ref)
        # lossless: the very samples (FLAC's were scaled by 32768, not 32767: +-1 in ~20 %)
        assert not exact or np.array_equal(got, ref), (fmt, int(np.sum(got != ref)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("decoder", ["soundfile", "pyav"])
def test_decoders_read_every_format(decoder: str, fmt: str, mode: str) -> None:
    data = encoded(fmt, mode)
    decode = decode_soundfile if decoder == "soundfile" else decode_pyav
    reason = UNREADABLE.get((fmt, mode, decoder))
    if reason is not None:
        with pytest.raises(Exception):  # noqa: B017  (libsndfile's errors vary by case)
            got = decode(data, fmt)
            assert len(got) < len(signal()) / 2  # "read" as garbage counts as a failure too
        return
    check(fmt, decode(data, fmt))


# ---- the browser ------------------------------------------------------------------------

_PAGE = """<!doctype html><meta charset="utf-8"><script>
(async () => {
  const names = %s;
  const out = {};
  for (const name of names) {
    try {
      const buf = await (await fetch('/audio/' + name)).arrayBuffer();
      let samples;
      if (name.startsWith('pcm.')) {  // raw s16le: what a page does with a pcm response
        const i16 = new Int16Array(buf);
        samples = Float32Array.from(i16, (v) => v / 32768);
      } else {  // decodeAudioData resamples to the context's rate: 24 kHz here
        const ctx = new OfflineAudioContext(1, 24000, 24000);
        samples = (await ctx.decodeAudioData(buf)).getChannelData(0);
      }
      const bytes = new Uint8Array(samples.buffer, samples.byteOffset, samples.byteLength);
      let bin = '';
      for (let i = 0; i < bytes.length; i += 0x8000)
        bin += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
      out[name] = {ok: true, data: btoa(bin)};
    } catch (e) {
      out[name] = {ok: false, error: String(e)};
    }
  }
  await fetch('/result', {method: 'POST', body: JSON.stringify(out)});
})();
</script>"""


class _Handler(BaseHTTPRequestHandler):
    files: ClassVar[dict[str, bytes]] = {}
    result: ClassVar[dict[str, Any]] = {}
    done = threading.Event()

    def do_GET(self) -> None:
        if self.path == "/":
            body = (_PAGE % json.dumps(sorted(self.files))).encode()
            ctype = "text/html"
        elif self.path.startswith("/audio/") and self.path[7:] in self.files:
            body, ctype = self.files[self.path[7:]], "application/octet-stream"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        n = int(self.headers["Content-Length"])
        type(self).result.update(json.loads(self.rfile.read(n)))
        self.send_response(204)
        self.end_headers()
        type(self).done.set()

    def log_message(self, *args: Any) -> None:
        pass


def _chromium() -> str | None:
    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser",
                                                       "google-chrome")) if p), None)


@pytest.fixture(scope="module")
def browser_decoded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every (format, mode) file decoded by headless Chromium, served over loopback HTTP."""
    exe = _chromium()
    if exe is None:
        pytest.skip("NO CHROMIUM: install the chromium package for the browser decode test")
    handler = type("H", (_Handler,), {"files": {f"{f}.{m}": encoded(f, m) for f in FORMATS
                                                for m in MODES},
                                      "result": {}, "done": threading.Event()})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    profile = tmp_path_factory.mktemp("chromium")
    # its singleton-socket folder (org.chromium.Chromium.*) goes to TMPDIR: this run's folder
    env = {**os.environ, "TMPDIR": str(tmp_path_factory.mktemp("chromium-tmp"))}
    proc = subprocess.Popen(
        [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--autoplay-policy=no-user-gesture-required", f"--user-data-dir={profile}",
         f"http://127.0.0.1:{httpd.server_address[1]}/"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        assert handler.done.wait(120), "the browser page never reported"
        yield handler.result
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        httpd.shutdown()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_browser_reads_every_format(browser_decoded: dict[str, Any], fmt: str,
                                    mode: str) -> None:
    r = browser_decoded[f"{fmt}.{mode}"]
    assert r["ok"], r.get("error")
    # (Chromium maps s16 to float by its own rule, not /32768: the samples are compared by
    # the Python decoders above)
    check(fmt, np.frombuffer(base64.b64decode(r["data"]), dtype=np.float32), exact=False)


# ---- the service's choice ---------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 1920, 2304, 5000])
@pytest.mark.parametrize("mode", MODES)
def test_a_flac_declares_its_md5_right_or_not_at_all(n: int, mode: str) -> None:
    """STREAMINFO's MD5 is the samples' or all zeros (unknown). A streamed FLAC shorter than
    one block (2304 samples: one frame of audio is 1920) had a wrong one, which `flac -t`
    calls a corrupt file."""
    x = signal()[:n]
    if mode == "whole":
        data = encode_whole("flac", x, SR)
    else:
        enc = make_encoder("flac", SR)
        data = enc.encode(x) + enc.finish()
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # STREAMINFO first
    info = data[8:42]
    total = int.from_bytes(info[10:18], "big") & ((1 << 36) - 1)
    md5 = info[18:34]
    assert md5 in (bytes(16), hashlib.md5(to_s16(x)).digest()), (mode, n, md5.hex())
    assert total in (0, n)
    if mode == "whole":
        assert total == n and md5 != bytes(16)
    assert np.array_equal(decode_pyav(data, "flac"), s16(x))


def test_flac_is_whole_unless_a_stream_is_asked_for() -> None:
    assert not stream_wanted("flac", True, stream_given=False)
    assert stream_wanted("flac", True, stream_given=True)
    assert stream_wanted("mp3", True, stream_given=False)
    assert not stream_wanted("mp3", False, stream_given=True)


def test_default_flac_response_opens_with_soundfile(server: Server) -> None:
    """The issue's case: the official client's default (streamed) request for FLAC."""
    import soundfile as sf

    n = 25
    body = {"model": "qtts", "input": "", "voice": "vivian", "response_format": "flac",
            "codes": codes(n, seed=4)}
    r = httpx.post(server.url + "/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert int(r.headers["content-length"]) == len(r.content)
    y, rate = sf.read(io.BytesIO(r.content), dtype="float32")
    assert rate == SR and len(y) == n * 1920
    asked = httpx.post(server.url + "/v1/audio/speech", json={**body, "stream": True},
                       timeout=60)
    assert asked.status_code == 200 and "content-length" not in asked.headers
    assert np.array_equal(decode_pyav(asked.content, "flac"), y)
