"""`servelm serve --step-trace`: the real engine writes one line per step, true to what it ran."""

import time

import pytest

from servelm.engine.step_trace import read_step_trace, read_trace_engine
from tests.live_server import LiveServer

PROMPTS = [[5 + i for i in range(n)] for n in (20, 33, 50)]
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def traced(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "steps.jsonl"
    srv = LiveServer(
        tiny_model_dir, "--kv-cache-memory", "4MiB", "--no-prefix-caching",
        "--served-model-name", "tiny", "--step-trace", str(path),
    )  # fmt: skip
    yield srv, path
    srv.stop()


def test_trace_counts_every_token_the_server_computed(traced):
    import openai

    server, path = traced
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    for prompt in PROMPTS:  # one at a time: every step holds one request
        out = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert out.usage.completion_tokens == MAX_TOKENS
    # The engine writes a step's line just after sending its tokens: allow it a moment.
    expected_steps = len(PROMPTS) * MAX_TOKENS
    deadline = time.time() + 10
    while len(steps := read_step_trace(path)) < expected_steps and time.time() < deadline:
        time.sleep(0.05)
    assert len(steps) == expected_steps
    compositions = [step for step, _ in steps]
    assert sum(s.prefill_tokens for s in compositions) == sum(map(len, PROMPTS))
    # each request: one prefill step that samples, then MAX_TOKENS - 1 decode steps
    assert sum(s.decode_tokens for s in compositions) == len(PROMPTS) * (MAX_TOKENS - 1)
    assert sum(s.sampled_tokens for s in compositions) == len(PROMPTS) * MAX_TOKENS
    assert all(s.num_requests == 1 for s in compositions)
    first_decode = compositions[1]
    assert first_decode.context_tokens_read == len(PROMPTS[0])
    assert all(0 < seconds < 10 for _, seconds in steps)
    # the engine line: the tiny model runs in float32, which has no decode stack and no int4
    assert read_trace_engine(path) == {"decode_stack_max_tokens": 0, "wide_step_min_tokens": 0}
