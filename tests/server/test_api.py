"""The OpenAI API end to end with the official client: models, chat, completions, streaming, usage."""

import asyncio
import re

import httpx
import openai
import pytest

from servelm import LLM, SamplingParams
from servelm.text.tokenizer import TextTokenizer

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello world!"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return TextTokenizer(tiny_model_dir)


def test_models_list(client, tiny_model_dir):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    card = models[0].model_dump()
    assert card["root"] == str(tiny_model_dir) and card["owned_by"] == "servelm"
    assert card["max_model_len"] == 512 and card["object"] == "model"


def test_long_prompts_tokenized_off_the_loop_count_the_same(server, client, tokenizer):
    from servelm.server.serving import THREAD_ENCODE_CHARS

    text = "servelm tokenizes long prompts on a worker thread. " * (THREAD_ENCODE_CHARS // 40)
    messages = [{"role": "user", "content": text}]
    ids, chat_ids = tokenizer.encode(text), tokenizer.encode_chat(messages, True)
    assert len(text) >= THREAD_ENCODE_CHARS
    counted = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=30)
    assert counted.json()["count"] == len(ids)
    # longer than this server's 512-token context: the 400 names the count the thread found,
    # or, where the text is too long for any tokenization to fit, a bound below that count
    for call, count in [
        (lambda: client.completions.create(model="tiny", prompt=text, max_tokens=1), len(ids)),
        (
            lambda: client.chat.completions.create(model="tiny", messages=messages, max_tokens=1),
            len(chat_ids),
        ),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        said = re.search(r"has (\d+) input tokens|at least (\d+) tokens", str(refused.value))
        assert said is not None, refused.value
        assert int(said[1]) == count if said[1] else 512 <= int(said[2]) <= count


def test_model_retrieve(client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


def test_logit_bias_moves_greedy_choices(client, tiny_model_dir, tokenizer):
    prompt = [5, 9, 40, 7]

    def greedy(**kw) -> str:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                        extra_body={"ignore_eos": True}, **kw)  # fmt: skip
        return out.choices[0].text

    plain = greedy()
    # +100 on one token outweighs any logit of the model: it is chosen every step
    assert greedy(logit_bias={"77": 100}) == tokenizer.decode([77] * 4)
    # -100 on the first greedy token (its id from the offline engine): the answer changes
    llm = LLM(str(tiny_model_dir), kv_cache_memory="2MiB")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    offline = llm.generate([prompt], params)[0].outputs[0]
    assert offline.text == plain
    first = offline.token_ids[0]
    assert greedy(logit_bias={str(first): -100}) != plain
    assert greedy() == plain  # and a later request without a bias is unaffected


def test_chat_non_streaming_usage_matches_tokenizer(client, tokenizer):
    r = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode_chat(CHAT))
    assert r.usage.completion_tokens == 7 and r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_chat_history_with_a_tool_call_turn(client, tokenizer):
    # An assistant turn that only calls a tool has no content (OpenAI sends null); the tool's
    # answer follows. The tiny ChatML template drops tool calls, so both reach it as servelm's
    # Hermes-style text (text/tool_prompt.py).
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    history = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    r = client.chat.completions.create(model="tiny", messages=history, max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")
    rendered = [
        *CHAT,
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>',
        },
        {"role": "user", "content": "<tool_response>\n42\n</tool_response>"},
    ]
    assert r.usage.prompt_tokens == len(tokenizer.encode_chat(rendered))


def test_chat_stream_chunk_order(client, tokenizer):
    stream = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=9,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks[1:] if c.choices]
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert content[-1].choices[0].finish_reason == "length"
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 9
    assert usage.usage.prompt_tokens == len(tokenizer.encode_chat(CHAT))
    text = "".join(c.choices[0].delta.content or "" for c in content)
    full = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=9, temperature=0, extra_body={"ignore_eos": True}
    )
    assert text == full.choices[0].message.content


def test_stream_ends_with_done(server):
    import httpx

    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_completions_prompt_forms(client, tokenizer):
    ids = tokenizer.encode("The quick brown fox")
    by_text = client.completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=5, temperature=0
    )
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids)
    many = client.completions.create(
        model="tiny",
        prompt=["a b", "c d e"],
        max_tokens=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in many.choices] == [0, 1] and many.usage.completion_tokens == 4


def test_n_choices_and_logprobs(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=4,
        n=3,
        seed=7,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        assert len(c.logprobs.content) == 4
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.logprobs.content)
    assert r.usage.completion_tokens == 12
    again = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=4, n=3, seed=7, extra_body={"ignore_eos": True}
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_logprob_bytes_are_each_tokens_own(client):
    # The tiny model, sampling, writes tokens that hold part of a character (their text alone
    # is U+FFFD): their `bytes` are their own, the rest's those of their text.
    r = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=32,
        n=4,
        seed=3,
        temperature=1.0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    entries = [e for c in r.choices for t in c.logprobs.content for e in (t, *t.top_logprobs)]
    split = [e for e in entries if e.token == "\ufffd"]
    assert split and all(e.bytes != list("\ufffd".encode()) for e in split)
    assert all(e.bytes == list(e.token.encode()) for e in entries if e.token != "\ufffd")


def test_developer_messages_are_the_system_prompt(server, client):
    # OpenAI's `developer` role is `system` by another name; this template has never heard of
    # it, so it gets the system turn the model knows.
    def counted(role):
        msgs = [{"role": role, "content": "Answer briefly."}, *CHAT]
        r = httpx.post(server.url + "/tokenize", json={"messages": msgs}, timeout=30)
        return r.json()["tokens"]

    assert counted("developer") == counted("system") != counted("user")
    msgs = [{"role": "developer", "content": "Answer briefly."}, *CHAT]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    assert r.usage.prompt_tokens == len(counted("system"))


def test_tokenize_counts_tools_as_the_chat_does(server, client):
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}

    def counted(**kw):
        body = {"messages": CHAT, **kw}
        return httpx.post(server.url + "/tokenize", json=body, timeout=30).json()["count"]

    for kw in ({}, {"tool_choice": "none"}, {"tool_choice": "required"}):
        r = client.chat.completions.create(
            model="tiny", messages=CHAT, tools=[tool], max_tokens=1, **kw
        )
        assert counted(tools=[tool], **kw) == r.usage.prompt_tokens
    assert counted(tools=[tool]) > counted(tools=[tool], tool_choice="none") == counted()


def test_cached_tokens_on_repeated_long_prompt(client):
    long_prompt = "Paged attention stores keys and values in fixed-size blocks. " * 12
    client.completions.create(model="tiny", prompt=long_prompt, max_tokens=2)
    r = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16
    assert r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens


def test_cache_salt_shares_prefix_blocks_only_within_one_salt(client):
    # vLLM's cache_salt: a tenant's cached prompt must not speed up (so be probed by) another's.
    prompt = "Prefix caching across tenants leaks timing through shared blocks. " * 12

    def cached(**extra):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="tenant-a") == 0  # first time seen, salted
    assert cached() == 0  # unsalted: not tenant a's blocks
    assert cached(cache_salt="tenant-b") == 0
    assert cached(cache_salt="tenant-a") >= 16  # the same salt hits its own
    assert cached(cache_salt="tenant-b") >= 16
    assert cached() >= 16
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        cached(cache_salt="")


def test_stop_strings_and_max_tokens_past_the_context(client, tokenizer):
    base = (
        client.completions.create(
            model="tiny",
            prompt="Hello world",
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = base[3:6]
    r = client.completions.create(
        model="tiny",
        prompt="Hello world",
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == base[: base.index(stop)]
    # prompt + an asked max_tokens beyond the context (512): refused, as OpenAI and vLLM do;
    # the default max_tokens (16) is cut to the room left and ends with "length"
    prompt = [3 + i % 300 for i in range(500)]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=13)
    assert refused.value.body["param"] == "max_tokens"
    assert refused.value.body["code"] == "context_length_exceeded"
    assert "(13 > 512 - 500)" in refused.value.body["message"]
    r = client.completions.create(model="tiny", prompt=prompt, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12


def test_streamed_greedy_equals_offline(client, tiny_model_dir):
    prompt = "A serving engine batches requests"
    stream = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=20,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = "".join(c.choices[0].text for c in stream if c.choices)
    llm = LLM(str(tiny_model_dir), kv_cache_memory="2MiB")
    offline = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[
        0
    ].text
    assert streamed == offline


def test_concurrent_streams_exact_lengths_and_metrics_agree(server):
    before = server.metrics()
    aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)

    async def one(i: int) -> tuple[int, int, int]:
        stream = await aclient.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"request number {i}"}],
            max_tokens=4 + i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return i, usage.completion_tokens, usage.prompt_tokens

    async def main():
        return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(main())
    assert all(done == 4 + i for i, done, _ in results)
    after = server.metrics()
    gen = after["servelm:generation_tokens_total"] - before["servelm:generation_tokens_total"]
    prompt = after["servelm:prompt_tokens_total"] - before["servelm:prompt_tokens_total"]
    ok = after["servelm:request_success_total{finished_reason=length}"] - before.get(
        "servelm:request_success_total{finished_reason=length}", 0
    )
    assert gen == sum(d for _, d, _ in results)
    assert prompt == sum(p for _, _, p in results)
    assert ok == 32
    # the API process's own CPU time (what `servelm simulate --calibrate-bench` prices per token)
    assert after["process_cpu_seconds_total"] > before["process_cpu_seconds_total"]
    assert (
        after["servelm:time_to_first_token_seconds_count"]
        - before["servelm:time_to_first_token_seconds_count"]
        == 32
    )
    # vLLM's per-request histograms: one sample each, the tokens summing to the counters
    grew = {k: after[k] - before[k] for k in after if k.startswith("servelm:request_")}
    assert grew["servelm:request_prompt_tokens_sum"] == prompt
    assert grew["servelm:request_generation_tokens_sum"] == gen
    for name in (
        "prompt_tokens",
        "generation_tokens",
        "prefill_time_seconds",
        "decode_time_seconds",
    ):
        assert grew[f"servelm:request_{name}_count"] == 32, name


def test_tokenize_detokenize_version(server, tokenizer):
    import httpx

    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
    d = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert d["prompt"] == "Hello world"
    assert httpx.get(server.url + "/version").json()["version"]


def test_tokenize_counts_messages_as_chat_completions_do(server, client):
    import httpx

    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                          {"type": "text", "text": "world"}]}]  # fmt: skip
    r = client.chat.completions.create(model="tiny", messages=parts, max_tokens=1)
    counted = httpx.post(server.url + "/tokenize", json={"messages": parts}).json()
    assert counted["count"] == r.usage.prompt_tokens
    missing = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user"}]})
    assert missing.status_code == 400 and "content is required" in missing.text


def test_streamed_logprobs_cover_every_token(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=16,
        stream=True,
        logprobs=True,
        top_logprobs=1,
        extra_body={"ignore_eos": True},
    )
    entries = [
        t
        for c in stream
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert len(entries) == 16


def test_n_choices_of_the_largest_seed_wrap_around_as_the_python_api_does(client):
    top, bottom = 2**63 - 1, -(2**63)

    def texts(seed, n):
        r = client.completions.create(
            model="tiny", prompt="Once", max_tokens=6, temperature=1.0, seed=seed, n=n
        )
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    assert texts(top, 2) == texts(top, 1) + texts(bottom, 1)


def test_a_chat_answer_without_max_tokens_runs_to_the_end_of_the_context(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me a long story."}],
        extra_body={"ignore_eos": True, "min_tokens": 20},
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 512  # the server's context
