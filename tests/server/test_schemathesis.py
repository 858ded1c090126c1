"""A bounded schemathesis run (issue #32) against a live `servelm serve`: requests generated from
/openapi.json, valid and invalid, and every answer checked against the same document. Fails on
any 5xx, any request that hangs (--request-timeout), any status, content type, header or body
the document does not describe, and any invalid request the server accepts."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.live_server import LiveServer

CHECKS = ",".join(
    (
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_headers_conformance",
        "response_schema_conformance",
        "negative_data_rejection",
    )
)


@pytest.fixture(scope="module")
def small_context_server(tiny_model_dir):
    # A 128-token context bounds every generation, whatever max_tokens the fuzzer draws.
    srv = LiveServer(
        tiny_model_dir, "--kv-cache-memory", "4MiB", "--served-model-name", "tiny",
        "--max-model-len", "128", "--max-num-seqs", "16",
    )  # fmt: skip
    yield srv
    srv.stop()


def test_schemathesis_finds_nothing(small_context_server, tmp_path):
    har = tmp_path / "run.har"
    cmd = [
        str(Path(sys.executable).with_name("schemathesis")), "run",
        small_context_server.url + "/openapi.json",
        "--checks", CHECKS,
        "--phases", "examples,coverage,fuzzing",
        "--max-examples", "10",
        "--seed", "20",  # the same requests each run: a failure reproduces
        "--workers", "1",
        "--request-timeout", "20",
        "--report", "har", "--report-har-path", str(har),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]

    # The run reached what it is meant to check: whole answers and streams of both endpoints.
    seen = Counter()
    for entry in json.loads(har.read_text())["log"]["entries"]:
        response, url = entry["response"], entry["request"]["url"]
        kind = next(
            (h["value"].split(";")[0] for h in response["headers"]
             if h["name"].lower() == "content-type"), None,
        )  # fmt: skip
        path = url.split("/v1")[-1].split("?")[0]
        seen[(path, response["status"], kind)] += 1
    for path in ("/chat/completions", "/completions"):
        assert seen[(path, 200, "application/json")] >= 1, seen
        assert seen[(path, 200, "text/event-stream")] >= 1, seen
        assert seen[(path, 400, "application/json")] >= 10, seen


def test_document_says_400_with_the_error_object_and_sse(small_context_server):
    import httpx

    doc = httpx.get(small_context_server.url + "/openapi.json").json()
    assert "422" not in json.dumps(doc["paths"]) and "HTTPValidationError" not in json.dumps(doc)
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        responses = doc["paths"][path]["post"]["responses"]
        for status in ("400", "404", "413"):
            assert responses[status]["content"]["application/json"]["schema"] == error, path
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"application/json", "text/event-stream"} <= set(responses["200"]["content"])
        assert "503" in responses and "500" in responses
    detail = doc["components"]["schemas"]["ErrorDetail"]["properties"]["code"]
    assert {"type": "integer"} not in detail["anyOf"]  # a string or null, never a status
    # token ids are bounded by the vocabulary the server loaded (the tiny model's 384)
    tokens = doc["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]
    assert tokens["items"] == {"type": "integer", "minimum": 0, "maximum": 383}
