"""Which web pages may use the API: a cross-site form (a POST a browser sends from any page
without asking) is refused unless its origin is the server's own or listed in
``QTTS_CORS_ORIGINS``; listed origins get CORS answers. Clients that are not browsers send no
``Origin``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from service.origins import origin_allowed, parse_origins
from service.settings import Settings
from tests.service.helpers import serving
from tests.service.voices_helpers import reference

EVIL = "https://evil.example"
APP = "https://app.example"


@pytest.fixture(scope="module")
def base_server(base_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    yield from serving(base_gguf, tmp_path_factory.mktemp("origins"), cors_origins=APP)


def test_a_cross_site_form_does_nothing(base_server: Any, tmp_path: Path) -> None:
    """A page elsewhere posting forms to a keyless server made voices (and speech) before."""
    ref = reference(tmp_path)
    r = httpx.post(
        base_server.url + "/v1/audio/voices", headers={"Origin": EVIL}, timeout=120,
        data={"name": "planted"}, files={"audio_sample": ("ref.wav", ref, "audio/wav")})
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == "origin_not_allowed" and err["field"] == "origin"
    assert EVIL in err["message"] and "QTTS_CORS_ORIGINS" in err["message"]
    r = httpx.post(base_server.url + "/tts", headers={"Origin": "null"}, timeout=60,
                   data={"text": "Hi.", "max_seconds": "0.5"},
                   files={"ref_audio": ("ref.wav", ref, "audio/wav")})
    assert r.status_code == 403 and r.json()["error"]["field"] == "origin"
    names = [v["name"] for v in httpx.get(base_server.url + "/v1/audio/voices").json()["data"]]
    assert "planted" not in names  # nothing was stored
    # the server's own pages (the playground), a listed origin and clients without an Origin
    own = base_server.url  # http://127.0.0.1:PORT, the Host the request names
    for i, headers in enumerate(({"Origin": own}, {"Origin": APP}, {})):
        r = httpx.post(base_server.url + "/v1/audio/voices", headers=headers, timeout=120,
                       data={"name": f"allowed {i}"},
                       files={"audio_sample": ("ref.wav", ref, "audio/wav")})
        assert r.status_code == 200, (headers, r.text)


def test_listed_origins_get_cors_answers(base_server: Any) -> None:
    pre = httpx.options(base_server.url + "/tts", headers={
        "Origin": APP, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization"})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == APP
    assert "POST" in pre.headers["access-control-allow-methods"]
    r = httpx.post(base_server.url + "/v1/audio/voices/nothing", headers={"Origin": APP})
    assert r.headers["access-control-allow-origin"] == APP  # errors too: the page reads them
    assert "X-Request-Id" in r.headers["access-control-expose-headers"]
    r = httpx.get(base_server.url + "/v1/models", headers={"Origin": EVIL})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    # a listed page on the internet calling a server on localhost or the LAN: Chrome's Private
    # Network Access preflight (it was a 400 that blamed the method)
    pre = httpx.options(base_server.url + "/v1/audio/speech", headers={
        "Origin": APP, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Private-Network": "true"})
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-private-network"] == "true"


def test_the_openai_js_clients_preflight_passes_and_refusals_are_json(base_server: Any
                                                                       ) -> None:  # fmt: skip
    """The official openai JS client (openai-node 6) sends X-Stainless-* headers with every
    request: its preflight was refused ("Disallowed CORS headers", plain text), so a web app
    of a listed origin could not use it. A refused preflight is the API's JSON error now."""
    asked = ("authorization,content-type,x-stainless-os,x-stainless-lang,x-stainless-arch,"
             "x-stainless-retry-count,x-stainless-runtime,x-stainless-runtime-version,"
             "x-stainless-package-version")
    pre = httpx.options(base_server.url + "/v1/audio/speech", headers={
        "Origin": APP, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": asked})
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-headers"] == asked
    for headers, status_field in (
        ({"Origin": EVIL, "Access-Control-Request-Method": "POST"}, "origin"),
        ({"Origin": APP, "Access-Control-Request-Method": "PUT"},
         "access-control-request-method"),
    ):  # fmt: skip
        r = httpx.options(base_server.url + "/tts", headers={**headers, "X-Request-Id": "pf1"})
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
        assert r.json()["error"]["field"] == status_field and r.headers["x-request-id"] == "pf1"


def test_own_origin_behind_a_proxy_and_parsing() -> None:
    h = {"host": "127.0.0.1:8000", "x-forwarded-host": "tts.example.com"}
    assert origin_allowed("https://tts.example.com", h, ())
    assert origin_allowed("http://127.0.0.1:8000", h, ())
    assert origin_allowed("http://tts.example.com", {"host": "tts.example.com:80"}, ())
    assert not origin_allowed("http://127.0.0.1:8001", h, ())
    assert not origin_allowed("null", h, ())
    assert origin_allowed("null", h, ("*",))
    assert parse_origins(" https://A.example/ , http://localhost:3000") == (
        "https://a.example", "http://localhost:3000")
    for bad in ("app.example", "https://app.example/path", "ftp://x"):
        with pytest.raises(ValueError, match="is not an origin"):
            Settings(cors_origins=bad)
