"""Chat templates through `servelm serve` and the official openai client, the prompt each request
gets equal to the one transformers' `apply_chat_template` renders: a request's
`chat_template_kwargs`, a model's named `tool_use` template, text parts, and tools on a template
that has no system role (Gemma 2's)."""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest

from tests.live_server import LiveServer
from tests.text.test_tool_prompt import GEMMA2

# Qwen3's thinking switch (shortened) as the default template, and a `tool_use` one beside it
THINK = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
TOOL_USE = "{% for t in tools %}<tool>{{ t.function.name }}</tool>\n{% endfor %}" + THINK
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _model_with_template(src, dst, template):
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def _serve(folder):
    return LiveServer(folder, "--kv-cache-memory", "8MiB", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def named(tiny_model_dir, tmp_path_factory):
    templates = [{"name": "default", "template": THINK}, {"name": "tool_use", "template": TOOL_USE}]
    folder = _model_with_template(tiny_model_dir, tmp_path_factory.mktemp("m") / "n", templates)
    srv = _serve(folder)
    yield folder, srv
    srv.stop()


@pytest.fixture(scope="module")
def gemma2(tiny_model_dir, tmp_path_factory):
    folder = _model_with_template(tiny_model_dir, tmp_path_factory.mktemp("m") / "g", GEMMA2)
    srv = _serve(folder)
    yield folder, srv
    srv.stop()


def _client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60)


def _hf_ids(folder, messages, **kwargs) -> list[int]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _tokenize(srv, **body) -> list[int]:
    r = httpx.post(srv.url + "/tokenize", json={"messages": ASK, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_chat_template_kwargs_reach_the_template(named):
    folder, srv = named
    off = {"enable_thinking": False}
    want = _hf_ids(folder, ASK, **off)
    assert len(want) > len(_hf_ids(folder, ASK))  # the switch changes the prompt
    reply = _client(srv).chat.completions.create(
        model="tiny", messages=ASK, max_tokens=1, extra_body={"chat_template_kwargs": off}
    )
    assert reply.usage.prompt_tokens == len(want)


def test_tokenize_takes_chat_template_kwargs(named):
    folder, srv = named
    off = {"enable_thinking": False}
    assert _tokenize(srv, chat_template_kwargs=off) == _hf_ids(folder, ASK, **off)


@pytest.mark.parametrize("key", ["add_generation_prompt", "tools", "tokenize"])
def test_chat_template_kwargs_may_not_set_what_servelm_sets(named, key):
    with pytest.raises(openai.BadRequestError) as e:
        _client(named[1]).chat.completions.create(
            model="tiny", messages=ASK, max_tokens=1, extra_body={"chat_template_kwargs": {key: 1}}
        )
    assert e.value.body["param"] == "chat_template_kwargs"
    assert e.value.body["message"].startswith(f"chat_template_kwargs.{key} ")


def test_a_request_with_tools_gets_the_tool_use_template(named):
    folder, srv = named
    with_tools = _hf_ids(folder, ASK, tools=TOOLS)
    assert _tokenize(srv, tools=TOOLS) == with_tools
    assert _tokenize(srv) == _hf_ids(folder, ASK)
    reply = _client(srv).chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, max_tokens=1
    )
    assert reply.usage.prompt_tokens == len(with_tools)


def test_text_parts_are_joined_a_line_apart(named):
    # as vLLM passes them to a template that reads text content
    folder, srv = named
    parts = [{"type": "text", "text": "Summarize this:"}, {"type": "text", "text": "The cat sat."}]
    r = httpx.post(
        srv.url + "/tokenize", json={"messages": [{"role": "user", "content": parts}]}, timeout=60
    )
    joined = [{"role": "user", "content": "Summarize this:\nThe cat sat."}]
    assert r.json()["tokens"] == _hf_ids(folder, joined)


def test_tools_reach_a_template_without_a_system_role(gemma2):
    folder, srv = gemma2
    reply = _client(srv).chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, max_tokens=1
    )
    ids = _tokenize(srv, tools=TOOLS)
    assert reply.usage.prompt_tokens == len(ids)
    r = httpx.post(srv.url + "/detokenize", json={"tokens": ids}, timeout=60)
    prompt = r.json()["prompt"]
    assert prompt.startswith("<|im_start|><start_of_turn>user\n# Tools\n")  # (its bos_token)
    assert json.dumps(TOOLS[0]) in prompt and "<tool_call>" in prompt
    assert prompt.endswith("What is the weather in Paris?<end_of_turn>\n<start_of_turn>model\n")
