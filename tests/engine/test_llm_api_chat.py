"""`LLM.chat` builds the prompt the server builds for the same OpenAI-format messages (one
preparation, `servelm/text/chat_messages.py`): compared with the ids a live server's /tokenize
answers, and the same refusal for a message neither can carry."""

from __future__ import annotations

import httpx
import pytest

from servelm import LLM, SamplingParams
from tests.live_server import LiveServer

WEATHER_CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
CONVERSATIONS = {
    "plain": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "developer role": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ],
    "content as text parts": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "you"}],
        }
    ],
    "assistant tool calls, null content, tool result": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "20C"},
    ],
}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = LiveServer(tiny_model_dir, "--kv-cache-memory", "8MiB", "--max-model-len", "512")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), kv_cache_memory="16MiB", max_model_len=512, num_threads=1)


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_chat_prompt_ids_are_the_servers(server, llm, name):
    messages = CONVERSATIONS[name]
    r = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    (out,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=1))
    assert out.prompt_token_ids == r.json()["tokens"]


def test_a_message_neither_carries_is_refused_alike(server, llm):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    r = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=60)
    assert r.status_code == 400
    says = "messages.0.content: only text parts are supported, got 'image_url'."
    assert r.json()["error"]["message"] == says
    with pytest.raises(ValueError, match=says):
        llm.chat(messages)
