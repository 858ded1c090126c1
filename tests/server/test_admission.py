"""Admission counts only requests that wait for the batch (issue #32): with
`--max-queued-requests 8` and 64 batch slots, a burst of 80 is refused at most 8 times (once
72 are in: 64 running, 8 waiting), where counting every request without a token yet (those in
prefill too) refused 72."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx

from tests.live_server import LiveServer


def with_long_context(model_dir, tmp_path):
    """A copy of the tiny model with a 32k context, for a stream that surely outlasts a test's
    other requests."""
    folder = tmp_path / "tiny"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32768}))
    return folder


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


def test_no_waiting_queue_and_priorities_only_under_the_priority_policy(tiny_model_dir, tmp_path):
    """`--max-queued-requests 0`: a request is admitted while the batch has room and refused
    when it would wait; `priority` needs `--scheduling-policy priority` (vLLM's 400 too)."""
    long_context = with_long_context(tiny_model_dir, tmp_path)
    fcfs = LiveServer(long_context, "--max-num-seqs", "1", "--max-queued-requests", "0")
    try:
        url = fcfs.base_url + "/completions"
        assert (
            httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 200
        )
        refused = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "priority": 1}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
        long = {"prompt": "hi", "max_tokens": 30000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url, json=long, timeout=120) as running:
            lines = running.iter_lines()
            next(lines)  # in the batch, its one place taken
            full = httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=60)
            assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"
    finally:
        fcfs.stop()
    by_priority = LiveServer(tiny_model_dir, "--scheduling-policy", "priority")
    try:
        body = {"prompt": "hi", "max_tokens": 2, "priority": -3}
        r = httpx.post(by_priority.base_url + "/completions", json=body, timeout=60)
        assert r.status_code == 200
    finally:
        by_priority.stop()


def test_the_queue_counts_each_prompt_and_choice(tiny_model_dir, tmp_path):
    """A request of p prompts x n choices is p*n sequences for the batch and the queue: one
    request of 24 prompts x n=16 had filled a queue of 256 that it was admitted to empty."""
    long_context = with_long_context(tiny_model_dir, tmp_path)
    server = LiveServer(long_context, "--max-num-seqs", "2", "--max-queued-requests", "2")
    try:
        url = server.base_url + "/completions"

        def post(**body):
            return httpx.post(url, json={"prompt": "hi", "max_tokens": 2, **body}, timeout=120)

        never = post(n=5)  # more than the batch and the queue hold: no retry can help
        assert never.status_code == 400 and never.json()["error"]["param"] == "n"
        assert post(prompt=["a", "b", "c"], n=2).status_code == 400
        long = {"prompt": "hi", "max_tokens": 30000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url, json=long, timeout=120) as running:
            lines = running.iter_lines()  # (kept: a dropped iterator closes the stream)
            next(lines)  # 1 of the 2 places taken
            full = post(n=4)  # 1 runs, 3 would wait: more than the queue's 2
            assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"
            assert post(prompt=["a", "b"], n=2).status_code == 503
            assert post(n=3).status_code == 200  # 1 runs, 2 wait
    finally:
        server.stop()
