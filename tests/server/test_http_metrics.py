"""`servelm:http_requests_total` by status code and the per-request TPOT histogram (issue #31:
the dashboard's error-rate and TPOT panels read them)."""

from __future__ import annotations

import httpx
import pytest

from servelm.server.metrics import RequestTimer, ServerMetrics

STATUS = "servelm:http_requests_total{status=%d}"
TPOT = "servelm:request_time_per_output_token_seconds"


def test_requests_counted_by_status_probes_and_scrapes_left_out(server, client):
    before = server.metrics()
    client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    bad = httpx.post(server.base_url + "/completions", json={"model": "tiny", "prompt": 5})
    missing = httpx.post(server.base_url + "/completions", json={"model": "nope", "prompt": "x"})
    assert (bad.status_code, missing.status_code) == (400, 404)
    for path in ("/health", "/ping", "/metrics"):
        assert httpx.get(server.url + path).status_code == 200
    after = server.metrics()
    for code in (200, 400, 404):
        assert after[STATUS % code] - before.get(STATUS % code, 0) == 1, code
    # only the three requests above: the probes and the scrapes are not in the total
    assert after["servelm:http_requests_total"] - before.get("servelm:http_requests_total", 0) == 3


def test_tpot_per_request_leaves_out_one_token_answers(server, client):
    before = server.metrics()
    client.completions.create(
        model="tiny", prompt="a b c", max_tokens=6, extra_body={"ignore_eos": True}
    )
    client.completions.create(
        model="tiny", prompt="a b c", max_tokens=1, extra_body={"ignore_eos": True}
    )
    after = server.metrics()
    assert after[TPOT + "_count"] - before[TPOT + "_count"] == 1
    e2e = after["servelm:e2e_request_latency_seconds_sum"]
    assert 0 < after[TPOT + "_sum"] - before[TPOT + "_sum"] < e2e


def test_tpot_is_first_to_last_token_over_the_tokens_after_the_first():
    metrics = ServerMetrics("m", 16, 8)
    timer = RequestTimer(metrics, arrival=0.5, num_prompt_tokens=4)
    timer.on_tokens(1.0, 1)  # the first token: TTFT 0.5 s
    timer.on_tokens(1.5, 2)  # two tokens in one step
    timer.on_tokens(2.0, 1)
    timer.on_finish(2.0, "length", 3)
    assert metrics.tpot.labels("m")._sum.get() == pytest.approx((2.0 - 1.0) / 3)
    assert metrics.ttft.labels("m")._sum.get() == pytest.approx(0.5)


def bucket_counts(metrics: ServerMetrics, name: str) -> dict[float, float]:
    """{upper bound: cumulative count} of histogram `name`, as Prometheus scrapes it."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        float(sample.labels["le"]): sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
        if sample.name == name + "_bucket"
    }


def test_prompt_tokens_count_once_its_prompt_has_run_and_long_stalls_keep_their_size():
    metrics = ServerMetrics("m", 16, 8)
    prompt = metrics.prompt_tokens.labels("m")
    timer = RequestTimer(metrics, arrival=0.0, num_prompt_tokens=161)
    timer.on_tokens(1.0, 1)
    assert prompt._value.get() == 161  # with the first token, not when the answer ends
    timer.on_tokens(20.6, 1)  # a 19.6 s stall between two tokens
    timer.on_finish(20.6, "length", 161)
    assert prompt._value.get() == 161
    itl = bucket_counts(metrics, "servelm:inter_token_latency_seconds")
    assert (itl[10.0], itl[20.0]) == (0, 1)  # (not read as the largest bucket below it)
    assert bucket_counts(metrics, TPOT)[20.0] == 1
    # an answer of the prompt alone (max_tokens 0 with echo) counts it when it ends
    RequestTimer(metrics, arrival=0.0, num_prompt_tokens=7).on_finish(1.0, "length", 7)
    assert prompt._value.get() == 168
