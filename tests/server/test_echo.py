"""echo, prompt logprobs and max_tokens 0 on a live `servelm serve` of the tiny model, through
the openai client (issue #37). Values against transformers: tests/server/test_prompt_logprobs_default.py."""

from __future__ import annotations

import httpx
import pytest

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from servelm.text.tokenizer import TextTokenizer

    return TextTokenizer(tiny_model_dir)


def check_prompt_part(lp, ids: list[int], tokenizer, k: int) -> None:
    """The echoed prompt's part of a completions `logprobs` object."""
    n = len(ids)
    assert lp.tokens[:n] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:n])
    for pos in range(1, n):
        top = lp.top_logprobs[pos]
        # the k most likely and the prompt's own token (which may be one of them)
        assert lp.tokens[pos] in top and top[lp.tokens[pos]] == lp.token_logprobs[pos]
        assert k <= len(top) <= k + 1
    assert lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_without_logprobs(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, echo=True)
    choice = r.choices[0]
    assert choice.text.startswith(PROMPT) and choice.logprobs is None
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    echoed = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def test_echo_with_logprobs_covers_prompt_then_answer(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw, echo=True, extra_body={"ignore_eos": True})
    lp, gen = r.choices[0].logprobs, plain.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 3
    check_prompt_part(lp, ids, tokenizer, 2)
    # the generated part is what it is without echo, its offsets counted after the prompt
    # (float32 matmuls over the scored chunk's rows may round the sampled row's last bits
    # otherwise than over it alone; bfloat16 ones do not)
    assert lp.tokens[len(ids) :] == gen.tokens
    assert lp.token_logprobs[len(ids) :] == pytest.approx(gen.token_logprobs, abs=1e-5)
    for ours, theirs in zip(lp.top_logprobs[len(ids) :], gen.top_logprobs, strict=True):
        assert list(ours) == list(theirs)
        assert list(ours.values()) == pytest.approx(list(theirs.values()), abs=1e-5)
    assert lp.text_offset[len(ids) :] == [len(PROMPT) + o for o in gen.text_offset]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 3


def test_max_tokens_zero_scores_the_prompt_only(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids)
    check_prompt_part(choice.logprobs, ids, tokenizer, 1)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    # same values as when an answer follows
    longer = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2, echo=True, logprobs=1
    )
    assert longer.choices[0].logprobs.token_logprobs[: len(ids)] == choice.logprobs.token_logprobs
    # without logprobs: the prompt back, nothing generated
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True)
    assert r.choices[0].text == PROMPT and r.choices[0].logprobs is None


def test_max_tokens_zero_without_echo_is_400(server):
    for path, body in (
        ("/completions", {"prompt": PROMPT, "max_tokens": 0}),
        ("/completions", {"prompt": PROMPT, "max_tokens": 0, "logprobs": 1}),
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}),
    ):
        r = httpx.post(server.base_url + path, json=body, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "max_tokens" and "0 only with echo" in err["message"]
    r = httpx.post(
        server.base_url + "/completions",
        json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 21},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_batched_prompts_echo_each(client, tokenizer):
    texts = ["Hello there", "One two three four five six", "x"]
    id_lists = [tokenizer.encode(t) for t in texts]
    for prompt in (texts, id_lists):
        r = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0, n=2
        )
        assert len(r.choices) == 6
        for choice in r.choices:
            ids = id_lists[choice.index // 2]
            assert len(choice.logprobs.tokens) == len(ids)
            check_prompt_part(choice.logprobs, ids, tokenizer, 0)
            if prompt is texts:
                assert choice.text == texts[choice.index // 2]
        assert r.usage.prompt_tokens == sum(map(len, id_lists))
        for i in range(3):  # both choices of a prompt score it alike (to float32 rounding)
            first, second = (r.choices[2 * i + j].logprobs.token_logprobs for j in (0, 1))
            assert first[0] is None and second[0] is None
            assert first[1:] == pytest.approx(second[1:], abs=1e-5)


def test_prompt_logprobs_on_both_endpoints(client, tokenizer, server):
    ids = tokenizer.encode(PROMPT)
    r = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    plps = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plps) == len(ids) and plps[0] is None
    echo = (
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
        .choices[0]
        .logprobs
    )
    for pos in range(1, len(ids)):
        entry = plps[pos]
        assert 2 <= len(entry) <= 3
        own = entry[str(ids[pos])]
        assert own["logprob"] == echo.token_logprobs[pos]
        assert own["decoded_token"] == echo.tokens[pos]
        ranked = sorted((e["rank"], e["logprob"]) for t, e in entry.items() if t != str(ids[pos]))
        assert [rank for rank, _ in ranked][:2] == [1, 2] or own["rank"] <= 2
        assert own["rank"] >= 1
    messages = [{"role": "user", "content": "What is two plus two?"}]
    chat_ids = tokenizer.encode_chat(messages, True)
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    plps = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plps) == len(chat_ids) and plps[0] is None
    assert all(list(e) == [str(t)] for e, t in zip(plps[1:], chat_ids[1:], strict=True))
    # streamed: the choice's first chunk carries them
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=2,
            stream=True,
            extra_body={"prompt_logprobs": 0},
        )
    )
    streamed = [c.choices[0].model_extra.get("prompt_logprobs") for c in chunks if c.choices]
    streamed = [p for p in streamed if p is not None]
    assert streamed == [plps]
    # without asking, no such field
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1)
    assert "prompt_logprobs" not in (r.choices[0].model_extra or {})


def test_prompt_logprobs_with_logprobs_without_echo(client, tokenizer):
    """The prompt's scores go to prompt_logprobs alone: logprobs cover the answer only."""
    ids = tokenizer.encode(PROMPT)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1)
    kw |= dict(extra_body={"ignore_eos": True, "prompt_logprobs": 1})
    r = client.completions.create(**kw)
    choice = r.choices[0]
    assert len(choice.logprobs.tokens) == 3 and choice.logprobs.text_offset[0] == 0
    assert len(choice.model_extra["prompt_logprobs"]) == len(ids)
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
    assert sum(len(c.logprobs.tokens) for c in chunks if c.logprobs) == 3
    assert [c.model_extra.get("prompt_logprobs") is not None for c in chunks].count(True) == 1


def test_streamed_echo_equals_whole(client, tokenizer):
    kw = dict(model="tiny", prompt=[PROMPT, "Another prompt"], max_tokens=4, temperature=0)
    kw |= dict(echo=True, logprobs=1, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    texts, lps = ["", ""], [None, None]
    for c in client.completions.create(**kw, stream=True):
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.logprobs is not None:
                lp = ch.logprobs
                if lps[ch.index] is None:
                    lps[ch.index] = {k: list(getattr(lp, k)) for k in ("tokens", "token_logprobs")}
                    lps[ch.index]["text_offset"] = list(lp.text_offset)
                else:
                    for k in ("tokens", "token_logprobs", "text_offset"):
                        lps[ch.index][k] += getattr(lp, k)
    for i, choice in enumerate(whole.choices):
        assert texts[i] == choice.text
        assert lps[i]["tokens"] == choice.logprobs.tokens
        # the same numbers, up to float32 rounding: the two runs' steps batch the prompts
        # differently, and the tiny model's float32 torch matmuls round by batch shape
        assert lps[i]["token_logprobs"] == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)
        # (the prompt's offsets; a generated token's streamed offset counts the text sent
        # before its chunk, the whole answer's the decoded tokens before it: these may differ)
        n = len(tokenizer.encode(kw["prompt"][i]))
        assert lps[i]["text_offset"][:n] == choice.logprobs.text_offset[:n]
        assert lps[i]["text_offset"][n] == choice.logprobs.text_offset[n] == len(kw["prompt"][i])


# -- a parameter servelm cannot honour is never ignored ---------------------------------------
# Refused with a 400 naming the parameter: a body that asks for it.
REFUSED = {
    "suffix": ("/completions", {"prompt": "hi", "suffix": "!"}, "suffix"),
    "best_of": ("/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    "stream_options.continuous_usage_stats": (
        "/completions",
        {"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}},
        "stream_options",
    ),
}
# Accepted with nothing to do, by what the field is: OpenAI's `user` names the caller's end
# user for the provider's abuse monitoring; the answer does not depend on it (as in vLLM).
NOTHING_TO_DO = {"user"}


def test_every_request_field_is_read_or_refused(server):
    """Every field of the request models is read by the server's code, or refused by name
    when a request sets it (REFUSED, checked live), or is metadata with nothing to honour."""
    import re
    from pathlib import Path

    from servelm.server import protocol

    code = "".join(
        p.read_text()
        for p in Path(protocol.__file__).parent.glob("*.py")
        if p.name != "protocol.py"
    )
    fields = set()
    for model in (protocol.CompletionRequest, protocol.ChatCompletionRequest):
        fields |= set(model.model_fields)
    fields |= {f"stream_options.{f}" for f in protocol.StreamOptions.model_fields}
    for name in sorted(fields - NOTHING_TO_DO):
        if name in REFUSED:
            path, body, param = REFUSED[name]
            r = httpx.post(server.base_url + path, json={**body, "max_tokens": 1}, timeout=30)
            assert r.status_code == 400, (name, r.text)
            assert r.json()["error"]["param"] == param, (name, r.text)
            continue
        leaf = name.rsplit(".", 1)[-1]
        assert re.search(rf"\.{leaf}\b|[\"']{leaf}[\"']", code), (
            f"request field {name!r} is accepted but nothing in servelm/server reads it: "
            "implement it or refuse it by name (REFUSED)"
        )


def test_a_prompt_only_answer_has_its_queue_time_counted(server, client):
    # max_tokens 0 finishes with no token: its time in the queue is still a sample
    name = "servelm:request_queue_time_seconds_count"
    before = server.metrics()[name]
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True)
    assert server.metrics()[name] == before + 1
