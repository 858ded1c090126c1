"""Admission counts only requests that wait for the batch (issue #32): with
`--max-queued-requests 8` and 64 batch slots, a burst of 80 is refused at most 8 times (once
72 are in: 64 running, 8 waiting), where counting every request without a token yet (those in
prefill too) refused 72."""

from __future__ import annotations

import asyncio

import httpx

from tests.live_server import LiveServer


def test_a_burst_is_admitted_up_to_the_batch_and_the_queue(tiny_model_dir):
    server = LiveServer(
        tiny_model_dir,
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "64",
        "--max-queued-requests",
        "8",
    )

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"prompt": [5] * 32, "max_tokens": 32, "ignore_eos": True}
            url = server.base_url + "/completions"
            return await asyncio.gather(*(client.post(url, json=body) for _ in range(80)))

    try:
        for _ in range(2):  # the second burst: nothing of the first is still counted
            codes = [r.status_code for r in asyncio.run(burst())]
            assert set(codes) <= {200, 503}, codes
            assert codes.count(503) <= 8, codes
        assert server.metrics().get("servelm:num_requests_running", 0) == 0
    finally:
        server.stop()
