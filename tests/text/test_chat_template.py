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


def _hf_ids(hf_tok, messages, add_generation_prompt: bool) -> list[int]:
    out = hf_tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
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
