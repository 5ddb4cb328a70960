"""The playground page (GET /playground) in a real browser: Debian's ``chromium`` driven by
Playwright's Python package against a real ``qtts serve`` on loopback, tiny model.

The browser comes from the system (``make test`` installs it: the Makefile's test-sysdeps);
Playwright's own browser download is never used. Screenshots go to
``$QTTS_TEST_ARTIFACTS`` (default ``build/test-artifacts``).
"""

from __future__ import annotations

import base64
import json
import math
import os
import wave
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.service.helpers import ROOT, Server, serving

CHROMIUM = Path(os.environ.get("QTTS_CHROMIUM", "/usr/bin/chromium"))
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(os.environ.get("QTTS_TEST_ARTIFACTS") or ROOT / "build" / "test-artifacts")
KEY = "playground-test-key"
SAMPLE_RATE = 24000

sync_api = pytest.importorskip(
    "playwright.sync_api",
    reason="SKIPPED LOUDLY: the playwright package is missing: pip install -e '.[dev]'",
)
if not CHROMIUM.exists():
    pytest.skip(f"SKIPPED LOUDLY: no browser at {CHROMIUM}: apt-get install chromium "
                "(make test does this through deploy/ci/install-tools.sh) or set QTTS_CHROMIUM",
                allow_module_level=True)

# What the page recorded (window.qttsPlayground) without its audio arrays.
STATE = """() => {
  const s = window.qttsPlayground;
  return {running: s.running !== null, nChunks: s.chunks.length, nSamples: s.nSamples,
          scheduled: s.scheduled, seed: s.seed, t0: s.t0, firstAudioAt: s.firstAudioAt,
          ttfaShownAt: s.ttfaShownAt, responseEndAt: s.responseEndAt, done: s.done,
          meter: s.meter, errors: s.errors};
}"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # Chromium leaves its singleton-socket folder (org.chromium.Chromium.*) in TMPDIR: a
    # folder of this run's, removed with it, instead of /tmp
    env = {**os.environ, "TMPDIR": str(tmp_path_factory.mktemp("chromium-tmp"))}
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS, env=env)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def open_server(service_model: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[Server]:
    yield from serving(service_model, tmp_path_factory.mktemp("playground"), workers=1)


@pytest.fixture(scope="module")
def keyed_server(service_model: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Server]:
    yield from serving(service_model, tmp_path_factory.mktemp("playground-key"), workers=1,
                       api_key=KEY)


def _text_ready(server: Server) -> bool:
    headers = {"Authorization": f"Bearer {KEY}"}
    return bool(httpx.get(server.url + "/v1/models", headers=headers).json()["data"][0]["text"])


def _page(browser: Any, **context: Any) -> Any:
    """A page whose console errors are kept in ``page.qtts_console``. The page's own
    Content-Security-Policy applies to the test too: wait_for_function takes arrow functions
    (a bare expression would be eval'ed, which the policy forbids)."""
    ctx = browser.new_context(accept_downloads=True, **context)
    page = ctx.new_page()
    page.set_default_timeout(60_000)
    page.qtts_console = []
    page.on("console", lambda m: page.qtts_console.append(m.text) if m.type == "error" else None)
    page.qtts_page_errors = []  # uncaught exceptions and rejections of the page's script
    page.on("pageerror", lambda e: page.qtts_page_errors.append(str(e)))
    return page


def _open(page: Any, server: Server) -> None:
    page.goto(server.url + "/playground")
    page.wait_for_function("() => document.getElementById('status').textContent.includes('ready')")


def _synthesize_and_wait(page: Any) -> dict[str, Any]:
    page.wait_for_function("() => { const s = window.qttsPlayground; "
                           "return s.running === null && s.responseEndAt !== null; }")
    return dict(page.evaluate(STATE))


def test_the_page_and_its_files_are_served_from_the_package(open_server: Server) -> None:
    r = httpx.get(open_server.url + "/playground")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert "playground" in httpx.get(open_server.url + "/").text
    for name, ctype in [("playground.js", "text/javascript"), ("playground.css", "text/css"),
                        ("meter.js", "text/javascript")]:
        a = httpx.get(f"{open_server.url}/playground/{name}")
        assert a.status_code == 200 and a.headers["content-type"].startswith(ctype), name
        assert "http://" not in a.text and "https://" not in a.text, f"{name} links elsewhere"
    missing = httpx.get(open_server.url + "/playground/../settings.py")
    assert missing.status_code == 404
    assert httpx.get(open_server.url + "/playground/index.py").status_code == 404


def test_a_synthesis_streams_into_the_audio_graph(browser: Any, open_server: Server) -> None:
    if not _text_ready(open_server):
        pytest.skip("the engine has no text pipeline")
    page = _page(browser)
    requests: list[str] = []
    page.on("request", lambda req: requests.append(req.url))
    _open(page, open_server)
    assert [v for v in page.eval_on_selector_all("#voice option", "os => os.map(o => o.value)")]
    languages = page.eval_on_selector_all("#language option", "os => os.map(o => o.value)")
    assert languages[0] == "auto" and len(languages) == len(set(languages)), languages
    page.fill("#text", "Hello from the playground test.")
    page.fill("#max-seconds", "2")
    page.fill("#seed", "11")
    page.click("#go")
    s = _synthesize_and_wait(page)

    assert s["errors"] == [] and page.is_hidden("#error")
    assert s["done"] is not None, "the stream ended without speech.audio.done"
    q = s["done"]["qtts"]
    # streamed: more than one chunk, all of it scheduled on the audio graph
    assert s["nChunks"] >= 2 and s["nSamples"] > 0 and s["scheduled"] == s["nSamples"]
    assert s["nSamples"] == round(q["audio_seconds"] * SAMPLE_RATE)
    # the first audio was scheduled and its time shown before the response ended
    assert s["t0"] < s["firstAudioAt"] <= s["ttfaShownAt"] < s["responseEndAt"]
    assert page.text_content("#stat-ttfa").strip().endswith(")")  # "N ms (server M ms)"
    # the samples reached the audio graph: the worklet behind the sources heard them
    page.wait_for_function("() => window.qttsPlayground.meter.nonzero > 0")
    meter = page.evaluate("window.qttsPlayground.meter")
    assert meter["peak"] > 0 and meter["frames"] >= meter["nonzero"] > 0
    # the request's own numbers: RTF and per-stage timings from the server
    assert q["rtf"] is not None and q["rtf"] > 0 and q["synth_seconds"] > 0
    assert {"prefill", "talker_step", "code_predictor"} <= set(q["stages"])
    assert page.is_visible("#stages")
    stage_rows = page.eval_on_selector_all("#stages tbody tr td:first-child",
                                           "tds => tds.map(t => t.textContent)")
    assert "talker_step" in stage_rows
    assert "(wall" in page.text_content("#stat-rtf")
    # nothing but this server was asked for anything, and nothing broke the page's policy
    assert all(u.startswith(open_server.url) for u in requests), requests
    assert page.qtts_console == []  # no policy breach, no missing file (a favicon was one)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "playground.png"), full_page=True)

    # download: the WAV is the audio that played
    with page.expect_download() as dl:
        page.click("#download")
    path = Path(dl.value.path())
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (SAMPLE_RATE, 1, 2)
        assert w.getnframes() == s["nSamples"]
    assert dl.value.suggested_filename == "qtts-11.wav"
    page.context.close()


def test_bad_input_shows_the_api_error_in_words(browser: Any, open_server: Server) -> None:
    page = _page(browser)
    _open(page, open_server)
    page.fill("#text", "   ")
    page.click("#go")
    page.wait_for_selector("#error", state="visible")
    text = page.text_content("#error")
    assert "Error 400" in text and "is empty" in text and "(field: input)" in text, text
    page.fill("#text", "hello")
    page.fill("#max-seconds", "100000")
    page.click("#go")
    page.wait_for_function(
        "() => document.getElementById('error').textContent.includes('max_seconds')")
    assert "above the server limit" in page.text_content("#error")
    page.context.close()


def test_the_key_prompt_keeps_the_key_in_the_session(browser: Any, keyed_server: Server
                                                     ) -> None:
    page = _page(browser, viewport={"width": 390, "height": 844})  # a phone
    page.goto(keyed_server.url + "/playground")
    dialog = page.locator("#key-dialog")
    dialog.wait_for(state="visible")
    assert "invalid API key" in page.text_content("#key-why")
    page.fill("#key-input", "wrong")
    page.keyboard.press("Enter")
    page.wait_for_function("() => document.getElementById('key-dialog').open && "
                           "document.getElementById('key-input').value === 'wrong'")
    page.fill("#key-input", KEY)
    page.click("#key-save")
    page.wait_for_function("() => document.getElementById('status').textContent.includes('ready')")
    assert page.evaluate("sessionStorage.getItem('qtts.apiKey')") == KEY
    assert page.evaluate("localStorage.length") == 0
    # readable on a phone: nothing wider than the screen
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    if _text_ready(keyed_server):
        # keyboard only: Ctrl+Enter in the text box synthesizes, with the key
        page.fill("#max-seconds", "1")
        page.focus("#text")
        page.keyboard.press("Control+Enter")
        s = _synthesize_and_wait(page)
        assert s["errors"] == [] and s["done"] is not None and s["nSamples"] > 0
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "playground-phone.png"), full_page=True)
    page.context.close()


@pytest.fixture(scope="module")
def base_server(base_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(base_gguf, tmp_path_factory.mktemp("playground-base"), workers=1)


def test_a_base_model_clones_a_voice_and_speaks_it(browser: Any, base_server: Server,
                                                   tmp_path: Path) -> None:
    """A Base model has no built-in voices: the page offers cloning (a real espeak-ng
    reference uploaded through the form), lists the cloned voice and speaks in it. Before
    that, synthesizing says to clone a voice first (it sent voice "default": a 400)."""
    from tests.service.voices_helpers import REF_TEXT, reference

    ref = tmp_path / "me.wav"
    ref.write_bytes(reference(tmp_path))
    page = _page(browser)
    page.goto(base_server.url + "/playground")
    page.wait_for_function(
        "() => document.getElementById('status').textContent.includes('clone a voice')")
    assert page.is_visible("#clone")
    assert page.eval_on_selector_all("#voice option", "os => os.length") == 0
    page.fill("#max-seconds", "1")
    page.click("#go")
    page.wait_for_selector("#error", state="visible")
    assert "clone one first" in page.text_content("#error")

    languages = page.eval_on_selector_all("#language option", "os => os.map(o => o.value)")
    language = languages[-1]  # a language other than auto: cloning keeps it chosen
    page.select_option("#language", language)
    page.set_input_files("#clone-audio", str(ref))
    page.fill("#clone-name", "me")
    page.fill("#clone-transcript", REF_TEXT)
    page.click("#clone-go")
    page.wait_for_function(
        "() => document.getElementById('status').textContent.startsWith('Cloned')")
    assert page.is_hidden("#error")
    assert "(icl," in page.text_content("#status")
    vid = page.eval_on_selector("#voice", "s => s.value")
    assert vid.startswith("voice_")
    assert page.eval_on_selector("#voice", "s => s.selectedOptions[0].textContent") == "me (cloned)"
    assert page.input_value("#language") == language
    stored = httpx.get(base_server.url + "/v1/audio/voices").json()["data"]
    assert [(v["id"], v["name"]) for v in stored] == [(vid, "me")]

    page.fill("#text", "Hello in my own voice.")
    page.click("#go")
    s = _synthesize_and_wait(page)
    assert s["errors"][1:] == [] and s["done"] is not None and s["nSamples"] > 0
    assert page.evaluate("window.qttsPlayground.request.voice") == vid
    # a second clone of the same name: the server's 409 in words, the list unchanged
    page.click("#clone-go")
    page.wait_for_function("() => !document.getElementById('error').hidden")
    assert "Error 409" in page.text_content("#error")
    assert page.eval_on_selector_all("#voice option", "os => os.length") == 1
    assert not [m for m in page.qtts_console if "Content Security Policy" in m], page.qtts_console
    page.context.close()


_FETCH_TTS = """async (url) => {
  try {
    const r = await fetch(url + '/tts', {method: 'POST', headers: {
        'Content-Type': 'application/json', 'X-Request-Id': 'from-page'},
      body: JSON.stringify({codes: Array.from({length: 16}, () => [1, 2]), format: 'pcm'})});
    const n = (await r.arrayBuffer()).byteLength;
    return {status: r.status, bytes: n, rid: r.headers.get('x-request-id'),
            rate: r.headers.get('x-sample-rate')};
  } catch (e) { return {error: String(e)}; }
}"""
_FORM_TTS = """async (url) => {
  const form = new FormData();
  form.append('text', 'Hello.');
  const r = await fetch(url + '/tts', {method: 'POST', body: form, mode: 'no-cors'});
  return r.type;
}"""


def test_pages_of_other_origins_in_a_browser(browser: Any, service_model: Path,
                                             tmp_path: Path) -> None:
    """A web app on another origin: with its origin in QTTS_CORS_ORIGINS its page calls the
    JSON API and reads the answer's headers; unlisted, the browser blocks it, and the form a
    page may post without asking (no-cors) is refused by the server, not run."""
    import subprocess
    import sys

    from tests.service.helpers import free_port

    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("<!doctype html><title>app</title>")
    port = free_port()
    app = f"http://127.0.0.1:{port}"
    static = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                               "127.0.0.1"], cwd=site, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    listed = Server(service_model, tmp_path, workers=1, cors_origins=app)
    unlisted = Server(service_model, tmp_path, workers=1)
    try:
        listed.wait_ready()
        unlisted.wait_ready()
        page = browser.new_page()
        for _ in range(50):  # the static server's first answer
            try:
                page.goto(app + "/index.html")
                break
            except Exception:
                page.wait_for_timeout(100)
        got = page.evaluate(_FETCH_TTS, listed.url)
        assert got == {"status": 200, "bytes": 2 * 1920 * 2, "rid": "from-page",
                       "rate": "24000"}, got
        assert "Failed to fetch" in page.evaluate(_FETCH_TTS, unlisted.url).get("error", "")
        assert page.evaluate(_FORM_TTS, unlisted.url) == "opaque"  # sent; unreadable
        lines = unlisted.wait_request_lines(lambda r: r.get("route") == "/tts")
        assert [r["status"] for r in lines] == [403], lines
        page.close()
    finally:
        listed.stop()
        unlisted.stop()
        static.terminate()
        static.wait(5)


# ---- what the probe of the page found (each test failed on the page before its fix) ------------


def _sse(samples: array[int], event_bytes: int = 4801) -> bytes:
    """``samples`` (s16) as the server streams them (stream_format sse, response_format pcm):
    a speech.audio.delta per ``event_bytes`` of PCM (odd: a sample is split between events),
    then speech.audio.done with its qtts timings. A recorded stream served at once by
    ``page.route``, as a fast server would deliver it."""
    pcm = samples.tobytes()
    events: list[dict[str, Any]] = [
        {"type": "speech.audio.delta", "audio": base64.b64encode(pcm[i:i + event_bytes]).decode()}
        for i in range(0, len(pcm), event_bytes)]
    seconds = len(samples) / SAMPLE_RATE
    events.append({"type": "speech.audio.done", "usage": {"input_tokens": 2},
                   "qtts": {"request_id": "recorded", "audio_seconds": seconds, "ttfa_seconds": 0.1,
                            "queue_seconds": 0.0, "synth_seconds": seconds / 2, "rtf": 0.5,
                            "stages": {"prefill": 0.01, "talker_step": 0.1}}})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def _tone(seconds: float) -> array[int]:
    return array("h", (round(9000 * math.sin(2 * math.pi * 440 * i / SAMPLE_RATE))
                       for i in range(round(seconds * SAMPLE_RATE))))


def _serve_recorded(page: Any, streams: list[bytes]) -> None:
    """POST /v1/audio/speech answers the last of ``streams`` (the test may append more)."""
    page.route("**/v1/audio/speech", lambda route: route.fulfill(
        status=200, body=streams[-1], headers={"Content-Type": "text/event-stream"}))


def _meter_still(page: Any) -> bool:
    """Whether no more audio reaches the speakers (the meter counts non-silent frames)."""
    page.wait_for_timeout(250)  # the worklet's last reports
    before = page.evaluate("() => window.qttsPlayground.meter.nonzero")
    page.wait_for_timeout(600)
    return bool(page.evaluate("() => window.qttsPlayground.meter.nonzero") == before)


def test_stop_and_esc_silence_audio_that_outlives_its_response(browser: Any,
                                                               open_server: Server) -> None:
    """The response ends long before its audio does (a server faster than real time): Stop
    and Esc still stop the audio, and Stop is disabled when the last scheduled audio ends."""
    page = _page(browser)
    streams = [_sse(_tone(4.0))]
    _serve_recorded(page, streams)
    _open(page, open_server)
    for how in ["button", "Escape"]:
        page.click("#go")
        s = _synthesize_and_wait(page)
        assert s["nSamples"] == 4 * SAMPLE_RATE and s["done"] is not None
        page.wait_for_function("() => window.qttsPlayground.meter.nonzero > 0")
        assert page.is_enabled("#stop"), f"{how}: Stop is disabled while the audio plays"
        if how == "button":
            page.click("#stop")
        else:
            page.focus("#text")
            page.keyboard.press("Escape")
        assert _meter_still(page), f"{how}: the audio plays on after Stop"
        assert page.is_disabled("#stop") and page.is_enabled("#go")
        assert page.evaluate("() => window.qttsPlayground.playing") == 0
        assert "Stopped" in page.text_content("#status")
        assert page.is_enabled("#download")  # what arrived is kept
    # left to play to its end, the audio disables Stop by itself
    streams.append(_sse(_tone(0.5)))
    page.click("#go")
    _synthesize_and_wait(page)
    page.wait_for_function("() => document.getElementById('stop').disabled", timeout=10_000)
    assert page.evaluate("() => window.qttsPlayground.playing") == 0
    assert page.qtts_page_errors == []
    page.context.close()


def test_a_double_click_starts_one_synthesis(browser: Any, open_server: Server) -> None:
    """The first Synthesize of a page load waits for the audio worklet to load: a double
    click (or Ctrl+Enter twice) meanwhile starts one request, not two into one result."""
    if not _text_ready(open_server):
        pytest.skip("the engine has no text pipeline")
    for how in ["dblclick", "Control+Enter"]:
        page = _page(browser)
        posts: list[str] = []
        page.on("request", lambda r, posts=posts: posts.append(r.url)
                if r.method == "POST" and r.url.endswith("/v1/audio/speech") else None)
        _open(page, open_server)
        page.fill("#text", "Hi.")
        page.fill("#max-seconds", "0.5")
        page.fill("#seed", "3")
        if how == "dblclick":
            page.dblclick("#go")
        else:
            page.focus("#text")
            page.keyboard.press(how)
            page.keyboard.press(how)
        s = _synthesize_and_wait(page)
        page.wait_for_timeout(300)  # a second request would have been sent by now
        assert len(posts) == 1, f"{how}: {len(posts)} requests"
        assert s["errors"] == [] and s["done"] is not None
        assert s["nSamples"] == round(s["done"]["qtts"]["audio_seconds"] * SAMPLE_RATE)
        assert page.is_enabled("#go") and page.qtts_page_errors == []
        page.context.close()


def test_a_download_that_fails_says_so_and_one_runs_at_a_time(browser: Any,
                                                              open_server: Server) -> None:
    """A compressed download is a second request: the network failing on it is an error in
    words (not an uncaught rejection, the status left at "Encoding…"), and a double click on
    Download sends one request (each is a whole synthesis on the server)."""
    if not _text_ready(open_server):
        pytest.skip("the engine has no text pipeline")
    page = _page(browser)
    _open(page, open_server)
    page.fill("#text", "Hi.")
    page.fill("#max-seconds", "0.5")
    page.fill("#seed", "5")
    page.click("#go")
    assert _synthesize_and_wait(page)["errors"] == []
    page.route("**/v1/audio/speech", lambda route: route.abort("connectionrefused"))
    page.select_option("#format", "mp3")
    page.click("#download")
    page.wait_for_selector("#error", state="visible", timeout=10_000)
    assert "download failed" in page.text_content("#error")
    assert page.text_content("#status") == "Download failed."
    assert page.is_enabled("#download") and page.qtts_page_errors == []
    page.unroute("**/v1/audio/speech")

    posts: list[str] = []
    page.on("request", lambda r: posts.append(r.url) if r.method == "POST" else None)
    page.select_option("#format", "flac")
    with page.expect_download() as dl:
        page.dblclick("#download")
    page.wait_for_function(
        "() => document.getElementById('status').textContent.startsWith('Saved')")
    page.wait_for_timeout(300)
    assert len(posts) == 1, posts
    assert dl.value.suggested_filename == "qtts-5.flac"
    assert Path(dl.value.path()).read_bytes()[:4] == b"fLaC"
    assert page.is_hidden("#error") and page.is_enabled("#download")
    page.context.close()


def test_the_language_stays_chosen_when_the_voices_reload(browser: Any,
                                                          open_server: Server) -> None:
    """Entering an API key reloads the voice list: the chosen voice and language stay."""
    page = _page(browser)
    _open(page, open_server)
    languages = page.eval_on_selector_all("#language option", "os => os.map(o => o.value)")
    assert len(languages) > 1, languages
    page.select_option("#language", languages[-1])
    voice = page.input_value("#voice")
    page.evaluate("() => { document.getElementById('status').textContent = 'reloading'; }")
    page.click("#key-button")
    page.fill("#key-input", "any-key")
    page.keyboard.press("Enter")
    page.wait_for_function("() => document.getElementById('status').textContent.includes('ready')")
    assert page.input_value("#language") == languages[-1]
    assert page.input_value("#voice") == voice
    page.context.close()


def test_wav_and_pcm_downloads_are_the_samples_the_server_sent(browser: Any,
                                                               open_server: Server) -> None:
    """The page decodes s16 by /32768; its wav and pcm files are the server's samples again,
    bit for bit, full scale included (the loud half lost a step when encoded by *32767)."""
    page = _page(browser)
    samples = array("h", [-32768, 32767, 0, 1, -1, 16384, -16385, 32766, -32767])
    samples.extend(range(-32768, 32768, 7))
    _serve_recorded(page, [_sse(samples)])
    _open(page, open_server)
    page.fill("#seed", "9")
    page.click("#go")
    s = _synthesize_and_wait(page)
    assert s["nSamples"] == len(samples)
    page.keyboard.press("Escape")  # full-scale noise: no need to hear it
    for fmt in ["wav", "pcm"]:
        page.select_option("#format", fmt)
        with page.expect_download() as dl:
            page.click("#download")
        assert dl.value.suggested_filename == f"qtts-9.{fmt}"
        path = Path(dl.value.path())
        if fmt == "wav":
            with wave.open(str(path)) as w:
                got = w.readframes(w.getnframes())
        else:
            got = path.read_bytes()
        assert got == samples.tobytes(), fmt
    page.context.close()


def test_the_key_dialog_refuses_a_key_no_header_can_carry(browser: Any,
                                                         keyed_server: Server) -> None:
    """A header carries ISO-8859-1 only: a key with other characters is refused by the
    dialog, in words, instead of every request failing with the browser's opaque error."""
    page = _page(browser)
    page.goto(keyed_server.url + "/playground")
    page.locator("#key-dialog").wait_for(state="visible")
    page.fill("#key-input", "clé-ключ")
    page.keyboard.press("Enter")
    page.wait_for_selector("#key-error", state="visible", timeout=5_000)
    text = page.text_content("#key-error")
    assert "API key" in text and '"к"' in text and "ISO-8859-1" in text, text
    assert page.evaluate("() => document.getElementById('key-dialog').open")
    assert page.get_attribute("#key-input", "aria-invalid") == "true"
    assert page.evaluate("sessionStorage.getItem('qtts.apiKey')") is None
    page.fill("#key-input", KEY)
    page.keyboard.press("Enter")
    page.wait_for_function("() => document.getElementById('status').textContent.includes('ready')")
    assert page.is_hidden("#key-error") and page.is_hidden("#error")
    assert page.evaluate("sessionStorage.getItem('qtts.apiKey')") == KEY
    assert page.qtts_page_errors == []
    page.context.close()
