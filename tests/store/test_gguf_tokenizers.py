"""Tokenizers of the families' GGUF files: SentencePiece vocabularies (Gemma, Phi-3, Mistral:
`tokenizer.ggml.model == "llama"`) and byte-level ones split by Llama 3's or Qwen 2's regex,
built through transformers' GGUF converter; the chat template comes with them."""

from __future__ import annotations

import json

import gguf
import pytest
from tokenizers import Tokenizer

from servelm.store.gguf_import import import_gguf
from tests.store.gguf_models import (
    MERGES,
    SPECIALS,
    TEMPLATE,
    TOKENS,
    tiny_hf_model,
    write_family_gguf,
)

SPM_TOKENS = ["<unk>", "<s>", "</s>", "▁", "h", "e", "l", "o", "w", "r", "d"]
SPM_TOKENS += ["he", "ll", "hell", "hello", "▁hello", "▁w", "or", "▁wor", "▁worl", "▁world"]
SPM_TOKENS += ["<start_of_turn>", "<end_of_turn>"]


@pytest.fixture(scope="module")
def model():
    return tiny_hf_model("llama", vocab_size=len(SPM_TOKENS))


def write_spm_gguf(path, model, arch="llama"):
    """The tiny model with a SentencePiece vocabulary (scores rank the merges)."""
    write_family_gguf(path, model, arch)
    reader = gguf.GGUFReader(path)
    out = path.with_name("spm-" + path.name)
    writer = gguf.GGUFWriter(str(out), arch)
    from servelm.store.gguf_import import _field_value

    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture", "tokenizer.")):
            continue
        writer.add_key_value(field.name, _field_value(field), field.types[0])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(SPM_TOKENS)
    writer.add_token_scores([0.0] * 3 + [-float(i) for i in range(len(SPM_TOKENS) - 3)])
    types = [2, 3, 3] + [1] * (len(SPM_TOKENS) - 5) + [3, 3]
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(
        "{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>{% endfor %}"
    )
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_sentencepiece_vocabulary(model, tmp_path):
    src = write_spm_gguf(tmp_path / "m.gguf", model)
    folder = import_gguf(src, tmp_path / "model")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = {t: i for i, t in enumerate(SPM_TOKENS)}
    encoded = tok.encode("hello world", add_special_tokens=False).ids
    assert encoded == [ids["▁hello"], ids["▁world"]]
    assert tok.decode(encoded) == "hello world"
    # control tokens stay whole
    assert (
        tok.encode("<start_of_turn>hello", add_special_tokens=False).ids[0]
        == ids["<start_of_turn>"]
    )
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True  # llama.cpp's default for SentencePiece
    assert config["bos_token"] == "<s>" and config["eos_token"] == "</s>"
    assert config["chat_template"].startswith("{% for m in messages %}<start_of_turn>")


@pytest.mark.parametrize(("pre", "twelve"), [("llama-bpe", ["12"]), ("qwen2", ["1", "2"])])
def test_byte_level_split_by_the_models_regex(pre, twelve, tmp_path):
    """Llama 3 keeps up to 3 digits together (so the "1 2" merge fires), Qwen 2 splits each."""
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in dict(
        block_count=1, context_length=64, embedding_length=256, feed_forward_length=256
    ).items():
        getattr(writer, f"add_{key}")(value)
    writer.add_head_count(4)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_chat_template(TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from servelm.store.gguf_import import GGUFReader, read_metadata
    from servelm.store.gguf_tokenizer import build_tokenizer

    tok = build_tokenizer(read_metadata(GGUFReader(path)))
    assert [TOKENS[i] for i in tok.encode("12").ids] == twelve
    assert [TOKENS[i] for i in tok.encode("hello world").ids] == ["hello", "Ġworld"]
    assert tok.encode("<|im_start|>hello").ids[0] == TOKENS.index("<|im_start|>")


def test_unknown_tokenizer_model_is_named(tmp_path):
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("rwkv")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from servelm.store.gguf_import import GGUFReader, read_metadata
    from servelm.store.gguf_tokenizer import build_tokenizer

    with pytest.raises(ValueError, match="'rwkv'"):
        build_tokenizer(read_metadata(GGUFReader(path)))
