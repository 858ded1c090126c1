"""Greedy output does not depend on what else the engine is doing (issue #29).

The default model through `servelm serve` on its default flags and the official openai client:
eight chat prompts of mixed lengths, 64 tokens each at temperature 0, sent alone give the
reference. The same requests must then give identical tokens sent again (a prefix-cache hit:
the prompt's uncached tail goes through the step with other row counts), inside one batch of
16 with eight other requests of mixed lengths, and on a second server whose step budget is 64
tokens (chunked prefill) and whose KV pool is small enough that the batch of 16 preempts
(recomputing a preempted request's tokens as a prompt).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.live_server import LiveServer

MAX_TOKENS = 64
TOPICS = ["a cat", "the sea", "a clock", "bread", "a library", "winter", "a bicycle", "rain"]
# Prompts of about 15 to 200 tokens: several longer than the 64-token step budget below.
PROMPTS = [
    f"Write a short story about {topic}." + " Use plain words and concrete details." * (3 * i)
    for i, topic in enumerate(TOPICS)
]
OTHERS = [
    f"List {n} facts about the number {n * 7}." + " Number each fact." * (5 * n)
    for n in range(1, 9)
]


def complete(client: openai.OpenAI, prompt: str) -> list[str]:
    """The greedy answer's tokens (as the text of each, from the logprobs)."""
    reply = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    tokens = [t.token for t in reply.choices[0].logprobs.content]
    assert len(tokens) == MAX_TOKENS
    return tokens


def alone(client: openai.OpenAI) -> list[list[str]]:
    return [complete(client, p) for p in PROMPTS]


def batched(client: openai.OpenAI) -> list[list[str]]:
    """PROMPTS and OTHERS interleaved, all 16 in flight at once; PROMPTS' answers."""
    mixed = [p for pair in zip(PROMPTS, OTHERS, strict=True) for p in pair]
    with ThreadPoolExecutor(len(mixed)) as pool:
        answers = list(pool.map(lambda p: complete(client, p), mixed))
    return answers[::2]


def first_difference(got: list[list[str]], want: list[list[str]]) -> str:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for j, (a, b) in enumerate(zip(g, w, strict=True)):
            if a != b:
                return f"prompt {i}, token {j}: {a!r} instead of {b!r}"
    return "none"


def serve(model_dir, *flags: str) -> tuple[LiveServer, openai.OpenAI]:
    server = LiveServer(model_dir, "--served-model-name", "default", *flags)
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
    return server, client


@pytest.fixture(scope="module")
def reference(default_model_dir):
    """Each prompt sent alone to a server on the default flags, then the server itself."""
    server, client = serve(default_model_dir)
    try:
        yield alone(client), client
    finally:
        server.stop()


def test_a_repeat_hits_the_prefix_cache_and_gives_the_same_tokens(reference):
    want, client = reference
    got = alone(client)
    assert got == want, first_difference(got, want)


def test_inside_a_batch_of_16_mixed_lengths_the_same_tokens(reference):
    want, client = reference
    got = batched(client)
    assert got == want, first_difference(got, want)


def test_chunked_prefill_and_preemption_give_the_same_tokens(reference, default_model_dir):
    want, _ = reference
    # 40 blocks of 16 tokens (23 KiB a token in bfloat16): any one request fits, 16 do not.
    server, client = serve(
        default_model_dir, "--max-num-batched-tokens", "64", "--kv-cache-memory", "15MiB"
    )
    try:
        chunked = alone(client)
        assert chunked == want, "chunked: " + first_difference(chunked, want)
        preempted = batched(client)
        assert server.metrics().get("servelm:num_preemptions_total", 0) > 0, "nothing was preempted"
        assert preempted == want, "preempted: " + first_difference(preempted, want)
    finally:
        server.stop()
