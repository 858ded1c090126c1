"""Our chat template rendering equals transformers' `apply_chat_template`, string and token ids."""

from __future__ import annotations

import json
import shutil

import pytest

from servelm.text.chat_template import ChatTemplateError
from servelm.text.tokenizer import TextTokenizer

CONVERSATIONS = {
    "system": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is paged attention?"},
    ],
    "no-system": [{"role": "user", "content": "Hello world! How are you today?"}],
    "multi-turn": [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "def add(a, b):\n    return a + b\n\nWhat does this do?"},
        {"role": "assistant", "content": "It adds two numbers."},
        {"role": "user", "content": "And with strings?"},
    ],
    "multi-turn-no-system": [
        {"role": "user", "content": "Pick a number: 0 1 2 3"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "Why?"},
    ],
    "non-ascii": [{"role": "user", "content": "Café, 你好, and a fox 🦊  with  spaces "}],
}


def _hf_ids(hf_tok, messages, add_generation_prompt: bool, **kwargs) -> list[int]:
    out = hf_tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _check_same_as_transformers(model_dir, hf_tok, name: str, add_generation_prompt: bool) -> None:
    ours = TextTokenizer(model_dir)
    messages = CONVERSATIONS[name]
    want = hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.apply_chat_template(messages, add_generation_prompt) == want
    assert ours.encode_chat(messages, add_generation_prompt) == _hf_ids(
        hf_tok, messages, add_generation_prompt
    )


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_default(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_tiny_template_matches_transformers(tiny_model_dir, hf_tiny, name, add_generation_prompt):
    _check_same_as_transformers(tiny_model_dir, hf_tiny, name, add_generation_prompt)


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_default_template_matches_transformers(
    default_model_dir, hf_default, name, add_generation_prompt
):
    _check_same_as_transformers(default_model_dir, hf_default, name, add_generation_prompt)


def _folder_with_template(src, dst, template: str | None):
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    if template is not None:
        cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def test_raise_exception_becomes_chat_template_error(tiny_model_dir, tmp_path):
    template = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversations must start with a user message') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    tok = TextTokenizer(_folder_with_template(tiny_model_dir, tmp_path, template))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    with pytest.raises(ChatTemplateError, match="must start with a user message"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_missing_template_is_chat_template_error(tiny_model_dir, tmp_path):
    tok = TextTokenizer(_folder_with_template(tiny_model_dir, tmp_path, None))
    with pytest.raises(ChatTemplateError):
        tok.encode_chat([{"role": "user", "content": "hi"}])


def test_developer_is_system_unless_the_template_knows_it():
    from servelm.text.chat_template import with_template_roles

    msgs = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    plain = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    assert [m["role"] for m in with_template_roles(msgs, plain)] == ["system", "user"]
    knows = "{% for m in messages %}{% if m['role'] == 'developer' %}D{% endif %}{% endfor %}"
    assert with_template_roles(msgs, knows) == msgs


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
OLD = "OLD{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
NEW = "NEW{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
TOOL_USE = "TOOL_USE{% for t in tools %}<{{ t.function.name }}>{% endfor %}" + OLD
NAMED = [{"name": "default", "template": OLD}, {"name": "tool_use", "template": TOOL_USE}]
# (config's chat_template, {file: text}) of the folder layouts models ship
LAYOUTS = {
    "named": (NAMED, {}),
    "jinja-file-over-config": (OLD, {"chat_template.jinja": NEW}),
    "jinja-file-over-named": (NAMED, {"chat_template.jinja": NEW}),
    "additional-files": (
        OLD,
        {"chat_template.jinja": NEW, "additional_chat_templates/tool_use.jinja": TOOL_USE},
    ),
    "processor-json-only": (None, {"chat_template.json": json.dumps({"chat_template": NEW})}),
    "named-without-default": ([{"name": "tool_use", "template": TOOL_USE}], {}),
}


@pytest.mark.parametrize("tools", [None, [TOOL]], ids=["no-tools", "tools"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_template_is_chosen_as_transformers_chooses_it(tiny_model_dir, tmp_path, layout, tools):
    from transformers import AutoTokenizer

    config_template, files = LAYOUTS[layout]
    folder = _folder_with_template(tiny_model_dir, tmp_path, config_template)
    for name, text in files.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(text)
    hf = AutoTokenizer.from_pretrained(folder)
    ours = TextTokenizer(folder)
    messages = [{"role": "user", "content": "hi"}]
    try:
        want = hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
    except ValueError:  # no template for this conversation
        with pytest.raises(ChatTemplateError):
            ours.apply_chat_template(messages, True, tools=tools)
        assert ours.chat_template_for(tools is not None) is None
        return
    assert ours.apply_chat_template(messages, True, tools=tools) == want
    assert ours.chat_template_for(tools is not None) == hf.get_chat_template(tools=tools)


def test_a_malformed_list_of_templates_names_the_file(tiny_model_dir, tmp_path):
    from servelm.store.errors import ModelFileError

    folder = _folder_with_template(tiny_model_dir, tmp_path, [{"template": OLD}])
    with pytest.raises(ModelFileError, match=r"tokenizer_config\.json: chat_template must be"):
        TextTokenizer(folder)


# Qwen3's switch (shortened), and variables other templates read from apply_chat_template's kwargs
KWARGS_TEMPLATE = (
    "{{ bos_token }}{% for d in documents or [] %}<doc>{{ d.text }}</doc>{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}{{ date_string | default('') }}"
)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"enable_thinking": False},
        {"enable_thinking": True, "date_string": "26 Jul 2024"},
        {"documents": [{"title": "a", "text": "The fox."}]},
        {"bos_token": "<|endoftext|>"},  # over the special token, as transformers has it
    ],
)
def test_template_kwargs_render_as_transformers_kwargs(tiny_model_dir, tmp_path, kwargs):
    from transformers import AutoTokenizer

    folder = _folder_with_template(tiny_model_dir, tmp_path, KWARGS_TEMPLATE)
    hf = AutoTokenizer.from_pretrained(folder)
    ours = TextTokenizer(folder)
    messages = CONVERSATIONS["system"]
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ours.apply_chat_template(messages, True, template_kwargs=kwargs) == want
    ids = _hf_ids(hf, messages, True, **kwargs)
    assert ours.encode_chat(messages, True, template_kwargs=kwargs) == ids


@pytest.mark.parametrize(
    "key", ["messages", "tools", "add_generation_prompt", "chat_template", "tokenize"]
)
def test_template_kwargs_may_not_set_what_the_renderer_sets(tiny_model_dir, key):
    from servelm.text.chat_template import TemplateKwargsError

    ours = TextTokenizer(tiny_model_dir)
    with pytest.raises(TemplateKwargsError, match=rf"^chat_template_kwargs\.{key} "):
        ours.apply_chat_template(CONVERSATIONS["system"], True, template_kwargs={key: None})


def test_a_template_failing_on_a_kwarg_is_a_chat_template_error(tiny_model_dir, tmp_path):
    folder = _folder_with_template(tiny_model_dir, tmp_path, "{{ limit + 1 }}")
    with pytest.raises(ChatTemplateError, match="TypeError"):
        TextTokenizer(folder).apply_chat_template([], template_kwargs={"limit": "ten"})
