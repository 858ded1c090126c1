"""Tools and tool turns in the prompt: servelm's Hermes-style text for a template that drops them,
the model's own template (with tools and arguments as objects) for one that reads them."""

from __future__ import annotations

import json

import pytest

from servelm.text.chat_template import (
    ChatTemplateError,
    render_chat_template,
    template_keeps_system,
)
from servelm.text.tool_parsers import parse
from servelm.text.tool_prompt import prepare_messages, template_handles_tools, tools_instruction
from tests.tiny_model import CHATML

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = [
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
]

# A template that reads tools (the shape of Qwen2.5's, much shortened).
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}|{% endfor %}"
)


def test_which_templates_handle_tools():
    assert template_handles_tools(TOOLS_TEMPLATE)
    assert not template_handles_tools(CHATML)
    assert not template_handles_tools(None)


def test_chatml_gets_a_system_block_with_the_tools_and_the_format():
    messages, tools = prepare_messages([{"role": "user", "content": "hi"}], [TOOL], CHATML)
    assert tools is None and [m["role"] for m in messages] == ["system", "user"]
    block = messages[0]["content"]
    assert json.dumps(TOOL) in block.split("<tools>\n")[1].split("\n</tools>")[0]
    assert "<tool_call>" in block and "</tool_call>" in block
    # the format the block shows is the one the hermes parser reads
    example = block.split("<tool_call>\n")[-1].split("\n</tool_call>")[0]
    assert parse("hermes", f"<tool_call>{example}</tool_call>")[1][0].name == "function name"


def test_a_system_message_gets_the_block_appended():
    system = {"role": "system", "content": "Be brief."}
    messages, _ = prepare_messages([system], [TOOL], CHATML, parallel=False)
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert "at most one function" in messages[0]["content"]


def test_history_without_tools_in_the_template():
    messages, _ = prepare_messages(HISTORY, None, CHATML)
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert messages[1]["content"] == f"{call}\n{call}"
    assert messages[2]["content"] == (
        "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
    )
    # what the model wrote parses back into the calls it made
    _, calls = parse("hermes", messages[1]["content"])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ] * 2
    rendered = render_chat_template(CHATML, messages)
    assert "<|im_start|>user\n<tool_response>\nsunny" in rendered
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # untouched


def test_a_template_that_reads_tools_gets_them_and_arguments_as_objects():
    messages, tools = prepare_messages(HISTORY, [TOOL], TOOLS_TEMPLATE)
    assert tools == [TOOL] and [m["role"] for m in messages] == [m["role"] for m in HISTORY]
    rendered = render_chat_template(TOOLS_TEMPLATE, messages, tools=tools)
    assert rendered.startswith("TOOLS:get_weather;|user: ")
    assert 'CALL get_weather {"city": "Paris"}' in rendered  # an object, not a quoted string
    assert "|tool: sunny|tool: rain|" in rendered


# The official templates of two models without a system role, verbatim: Gemma 2's
# (google/gemma-2-2b-it) and Mistral-7B-Instruct-v0.2's.
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}"
    "{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' + "
    "message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{'<start_of_turn>model\\n'}}{% endif %}"
)
MISTRAL_V02 = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
# Phi-3-mini's first template: a system message is dropped without a word.
DROPS_SYSTEM = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.mark.parametrize("template", [GEMMA2, MISTRAL_V02, DROPS_SYSTEM])
def test_without_a_system_role_the_tools_open_the_first_user_turn(template):
    messages, tools = prepare_messages(ASK, [TOOL], template, special_tokens=SPECIAL)
    assert tools is None and [m["role"] for m in messages] == ["user"]
    assert messages[0]["content"] == tools_instruction([TOOL]) + "\n\nWeather in Paris?"
    rendered = render_chat_template(template, messages, True, SPECIAL)  # no longer raises
    assert json.dumps(TOOL) in rendered and rendered.rstrip().endswith(
        ("Weather in Paris? [/INST]", "<start_of_turn>model", "<|assistant|>")
    )


@pytest.mark.parametrize("template", [GEMMA2, MISTRAL_V02])
def test_a_tool_history_renders_where_turns_must_alternate(template):
    messages, _ = prepare_messages(HISTORY, [TOOL], template, special_tokens=SPECIAL)
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[0]["content"].startswith("# Tools")
    assert "<tool_response>\nsunny" in render_chat_template(template, messages, True, SPECIAL)


def test_a_system_message_sent_to_a_template_without_the_role_is_still_refused():
    # as transformers and vLLM refuse it: servelm moves only the text it adds itself
    system = {"role": "system", "content": "Be brief."}
    messages, _ = prepare_messages([system, *ASK], [TOOL], GEMMA2, special_tokens=SPECIAL)
    assert messages[0] == system and messages[1]["content"].startswith("# Tools")
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        render_chat_template(GEMMA2, messages, True, SPECIAL)


def test_which_templates_keep_a_system_message():
    assert template_keeps_system(CHATML, SPECIAL)
    assert not template_keeps_system(GEMMA2, SPECIAL)
    assert not template_keeps_system(MISTRAL_V02, SPECIAL)
    assert not template_keeps_system(DROPS_SYSTEM, SPECIAL)
    # a template adding `bos_token + ...` renders only with the special tokens it is given
    assert template_keeps_system("{{ bos_token + messages[0]['content'] }}", SPECIAL)


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "pythonic"])
@pytest.mark.parametrize("parallel", [True, False])
def test_the_prompt_asks_for_the_format_of_the_parser_in_use(parser, parallel):
    # --tool-call-parser pythonic / llama3_json reads the answer in that format: servelm's text
    # must ask for it (and write earlier calls in it), not for Hermes blocks
    messages, _ = prepare_messages(HISTORY, [TOOL], CHATML, parallel, parser=parser)
    block = messages[0]["content"]
    assert block == tools_instruction([TOOL], parallel, parser)
    example = "\n".join(block.split("</tools>\n\n")[1].split("\n")[1:-1])  # between the words
    _, calls = parse(parser, example)
    assert calls and calls[0].name in ("function name", "function_name")
    assert json.loads(calls[0].arguments) in (
        {"argument name": "value"},
        {"argument_name": "value"},
    )
    assert len(calls) == (2 if parallel and parser == "pythonic" else 1)
    assert ("<tool_call>" in block) == (parser == "hermes")
    # the history's calls, as this parser reads them back
    _, calls = parse(parser, messages[2]["content"], tool_names=["get_weather"])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ] * 2
