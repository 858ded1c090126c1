"""A SentencePiece tokenizer (Llama 2, Mistral: "▁" for spaces, a decoder that drops a text's
first space) through the real server: an answer's first word keeps its space after the prompt,
as decoding the prompt and the answer together gives it (the `tokenizers` library's own
decode is the reference), streamed or not, echoed or not, in completions and chat."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.live_server import LiveServer

PROMPT = "The capital of France"


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    from tests.text.sentencepiece_model import build_model

    return build_model(tmp_path_factory.mktemp("sp-llama"))


@pytest.fixture(scope="module")
def sp_server(sp_dir):
    srv = LiveServer(sp_dir, "--kv-cache-memory", "8MiB", "--served-model-name", "sp")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def sp_tok(sp_dir):
    from servelm.text.tokenizer import TextTokenizer

    return TextTokenizer(sp_dir)


def after(tok, prompt: list[int], answer: list[int]) -> str:
    """What decoding the prompt and the answer together adds to the prompt's own text."""
    whole, before = tok.decode(prompt + answer), tok.decode(prompt)
    assert whole.startswith(before)
    return whole[len(before) :]


def forced(tok, piece: str) -> dict:
    """A body that makes the answer one given token (its logit raised far above the rest)."""
    return {
        "max_tokens": 1,
        "temperature": 0,
        "logit_bias": {tok.tokenizer.token_to_id(piece): 100},
    }


def streamed(server, path: str, body: dict) -> str:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    parts = [
        c.get("text") or c.get("delta", {}).get("content") or ""
        for e in events
        for c in e["choices"]
    ]
    return "".join(parts)


def test_completion_keeps_the_first_space(sp_server, sp_tok):
    body = {"prompt": PROMPT, **forced(sp_tok, "\u2581is")}
    want = after(sp_tok, sp_tok.encode(PROMPT), [sp_tok.tokenizer.token_to_id("\u2581is")])
    assert want == " is"
    url = sp_server.url + "/v1/completions"
    assert httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"] == want
    assert streamed(sp_server, "/v1/completions", body) == want
    echoed = httpx.post(url, json={**body, "echo": True}, timeout=60).json()["choices"][0]["text"]
    assert echoed == PROMPT + " is"
    # token ids as the prompt: the same
    ids = sp_tok.encode(PROMPT)
    assert (
        httpx.post(url, json={**body, "prompt": ids}, timeout=60).json()["choices"][0]["text"]
        == want
    )


def test_chat_answer_is_what_decoding_adds(sp_server, sp_tok):
    # the template ends the prompt with the special token [/INST]
    messages = [{"role": "user", "content": "Hello world"}]
    prompt = httpx.post(sp_server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert prompt[-1] == sp_tok.tokenizer.token_to_id("[/INST]")
    body = {"messages": messages, **forced(sp_tok, "\u2581capital")}
    want = after(sp_tok, prompt, [sp_tok.tokenizer.token_to_id("\u2581capital")])
    assert want.endswith(" capital")
    r = httpx.post(sp_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert r["choices"][0]["message"]["content"] == want
    assert streamed(sp_server, "/v1/chat/completions", body) == want
