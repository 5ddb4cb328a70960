"""A schemathesis run over the server's own OpenAPI document: generated requests (voices and
languages from the model's enums, so many reach a worker) must get documented statuses with
documented bodies, and never a server error. Bounded: a fixed number of examples per
operation, short texts and audio."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.service.helpers import Server, metric, serving

EXAMPLES = 40  # per operation and mode


@pytest.fixture(scope="module")
def fuzz_server(service_model: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[Server]:
    yield from serving(service_model, tmp_path_factory.mktemp("fuzz"), workers=1, queue_size=16,
                       max_text_chars=120, max_audio_seconds=1, request_timeout=60)


def test_api_against_its_openapi_document(fuzz_server: Server) -> None:
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /tts", "POST /v1/audio/speech", "GET /v1/models", "GET /readyz"}
    statuses: dict[str, set[int]] = {}
    voice = httpx.get(fuzz_server.url + "/v1/audio/voices", timeout=10).json()["voices"][0]
    for op in operations:
        seen = statuses.setdefault(f"{op.method.upper()} {op.path}", set())
        # valid requests, then (where there is a body to break) invalid ones: must be 4xx
        modes = list(GenerationMode) if op.method.lower() == "post" else [GenerationMode.POSITIVE]
        for mode in modes:
            _fuzz(op, mode, seen, voice)
    # no server error anywhere, and the generated requests did reach the workers
    try:
        errors = metric(fuzz_server.metrics(), "qtts_internal_errors_total", route="/tts")
    except KeyError:
        errors = 0
    assert errors == 0
    assert "Traceback" not in fuzz_server.log()
    assert 200 in statuses["POST /tts"] and 200 in statuses["POST /v1/audio/speech"], statuses


def _with_a_voice(case: Any, voice: str) -> Any:
    # The schema cannot say that a text needs a voice on this CustomVoice model (a codes
    # request needs none): without one, most valid requests would stop at that 400 and few
    # would reach a worker.
    body = case.body
    if isinstance(body, dict) and body.get("voice") is None and body.get("codes") is None:
        body["voice"] = voice
    return case


def _fuzz(op: Any, mode: GenerationMode, statuses: set[int], voice: str) -> None:
    strategy = op.as_strategy(generation_mode=mode)
    if mode is GenerationMode.POSITIVE:
        strategy = strategy.map(lambda case: _with_a_voice(case, voice))

    @given(case=strategy)
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        response = case.call(timeout=60)
        statuses.add(response.status_code)
        # (a request the schema allows may still be refused: text or codes, a voice for a
        # CustomVoice model ... are rules of the model, not of the JSON schema)
        case.validate_response(response, excluded_checks=[positive_data_acceptance])
        assert response.status_code < 500, (op.path, response.status_code, response.text)

    run()


def test_openapi_documents_every_status_with_the_error_schema(fuzz_server: Server) -> None:
    doc = httpx.get(fuzz_server.url + "/openapi.json", timeout=10).json()
    err = {"$ref": "#/components/schemas/ErrorResponse"}
    for route in ("/tts", "/v1/audio/speech"):
        responses = doc["paths"][route]["post"]["responses"]
        for status in ("400", "401", "403", "408", "413", "415", "422", "500", "503", "504"):
            assert responses[status]["content"]["application/json"]["schema"] == err, status
    voices_path = doc["paths"]["/v1/audio/voices"]
    assert {"401", "403", "408", "413", "415", "500", "503"} <= set(
        voices_path["post"]["responses"])
    assert "403" in doc["paths"]["/v1/audio/voices/{voice_id}"]["delete"]["responses"]
    assert "401" in doc["paths"]["/v1/models"]["get"]["responses"]
    # the multipart form of /tts: its fields as text, the reference a file, no codes
    form = doc["paths"]["/tts"]["post"]["requestBody"]["content"]["multipart/form-data"]
    fields = doc["components"]["schemas"][form["schema"]["$ref"].rsplit("/", 1)[1]]["properties"]
    assert fields["ref_audio"]["format"] == "binary" and "codes" not in fields
    assert fields["voice"]["enum"] == httpx.get(fuzz_server.url + "/v1/audio/voices",
                                                timeout=10).json()["voices"]
    assert "HTTPValidationError" not in doc["components"]["schemas"]  # (validation errors are 400s)
    voices = httpx.get(fuzz_server.url + "/v1/audio/voices", timeout=10).json()["voices"]
    voice = doc["components"]["schemas"]["TTSRequest"]["properties"]["voice"]["anyOf"][0]
    assert voice["enum"] == voices
    text = doc["components"]["schemas"]["TTSRequest"]["properties"]["text"]["anyOf"][0]
    assert text["maxLength"] == 120  # the server's QTTS_MAX_TEXT_CHARS
