"""GGUF -> HF folder import on a tiny synthetic Llama: config, weights, tokenizer, manifest."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from servelm.store import gguf_import
from servelm.store.gguf_import import import_gguf, unpermute_rotary
from servelm.store.manifest import MANIFEST_NAME, is_complete, sha256_file
from servelm.store.paths import GGUF_BLOCKS_FILE

OUTPUT_FILES = {
    "config.json",
    "model.safetensors",
    GGUF_BLOCKS_FILE,  # the tiny file's down_proj is Q8_0, kept as the file's blocks
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    MANIFEST_NAME,
}


def _read_json(path):
    return json.loads(path.read_text())


def test_config_from_metadata(make_tiny_gguf, tmp_path, tiny):
    src, _ = make_tiny_gguf()
    out = import_gguf(src, tmp_path / "model")
    assert {p.name for p in out.iterdir()} == OUTPUT_FILES
    config = _read_json(out / "config.json")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] == tiny.hidden
    assert config["intermediate_size"] == tiny.ffn
    assert config["num_hidden_layers"] == tiny.layers
    assert config["num_attention_heads"] == tiny.heads
    assert config["num_key_value_heads"] == tiny.kv_heads
    assert config["head_dim"] == tiny.head_dim
    assert config["vocab_size"] == len(tiny.tokens)
    assert config["rope_theta"] == 10000.0
    assert config["rms_norm_eps"] == 1e-5  # exactly: float32 noise rounded away
    assert config["max_position_embeddings"] == tiny.context
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["torch_dtype"] == "bfloat16"
    assert "rope_scaling" not in config
    assert _read_json(out / "generation_config.json") == {"bos_token_id": 1, "eos_token_id": 2}


@pytest.mark.parametrize("tied", [True, False])
def test_weights_round_trip_through_llamacpp_layout(make_tiny_gguf, tmp_path, tied):
    src, expected = make_tiny_gguf(tied=tied)
    out = import_gguf(src, tmp_path / "model")
    weights = load_file(out / "model.safetensors")
    assert set(weights) == set(expected)
    assert ("lm_head.weight" in weights) is (not tied)
    assert _read_json(out / "config.json")["tie_word_embeddings"] is tied
    for name, want in expected.items():
        assert weights[name].dtype == np.float32
        assert weights[name].shape == want.shape, name
        np.testing.assert_array_equal(weights[name], want, err_msg=name)


def test_unpermute_inverts_llamacpp_permute(tiny):
    rng = np.random.default_rng(1)
    for n_head, head_dim, cols in [(9, 64, 5), (3, 64, 7), (1, 8, 3), (4, 16, 1)]:
        w = rng.standard_normal((n_head * head_dim, cols)).astype(np.float32)
        permuted = tiny.permute(w, n_head)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(unpermute_rotary(permuted, n_head), w)


def test_tokenizer_rebuilt(make_tiny_gguf, tmp_path, tiny):
    src, _ = make_tiny_gguf()
    out = import_gguf(src, tmp_path / "model")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = {t: i for i, t in enumerate(tiny.tokens)}
    assert tok.encode("hello world").ids == [ids["hello"], ids["Ġworld"]]
    # Special tokens are matched whole, before BPE; digits are split one by one (smollm).
    assert tok.encode("<|im_start|>hello<|im_end|>").ids == [1, ids["hello"], 2]
    assert tok.encode("12").ids == [ids["1"], ids["2"]]
    assert tok.decode(tok.encode("hello world!").ids) == "hello world!"
    config = _read_json(out / "tokenizer_config.json")
    assert config["bos_token"] == "<|im_start|>"
    assert config["eos_token"] == config["pad_token"] == "<|im_end|>"
    assert config["unk_token"] == "<|endoftext|>"
    assert config["add_bos_token"] is False
    assert config["model_max_length"] == tiny.context
    assert config["chat_template"].startswith("{% for m in messages %}")


def test_gpt2_pre_tokenizer_keeps_digit_merges(make_tiny_gguf, tmp_path, tiny):
    src, _ = make_tiny_gguf(pre="gpt-2")
    out = import_gguf(src, tmp_path / "model")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("12").ids == [tiny.tokens.index("12")]


def test_unknown_pre_tokenizer_is_refused(make_tiny_gguf, tmp_path):
    src, _ = make_tiny_gguf(pre="mystery")
    with pytest.raises(ValueError, match="mystery"):
        import_gguf(src, tmp_path / "model")
    assert list(tmp_path.iterdir()) == [src.parent]  # nothing left behind


def test_manifest_records_every_file(make_tiny_gguf, tmp_path):
    src, _ = make_tiny_gguf()
    out = import_gguf(src, tmp_path / "model")
    manifest = _read_json(out / MANIFEST_NAME)
    assert manifest["source"] == {"file": src.name, "sha256": sha256_file(src)}
    assert set(manifest["files"]) == OUTPUT_FILES - {MANIFEST_NAME}
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == sha256_file(out / name)
        assert entry["size"] == (out / name).stat().st_size
    assert is_complete(out, verify_hashes=True)


def test_second_import_is_a_no_op(make_tiny_gguf, tmp_path, monkeypatch):
    src, _ = make_tiny_gguf()
    out = import_gguf(src, tmp_path / "model")
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}

    def must_not_run(*args, **kwargs):
        raise AssertionError("weights rebuilt on an up-to-date folder")

    monkeypatch.setattr(gguf_import, "build_weights", must_not_run)
    assert import_gguf(src, out) == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_changed_source_replaces_folder(make_tiny_gguf, tmp_path):
    first, _ = make_tiny_gguf("a.gguf", seed=0)
    second, expected = make_tiny_gguf("b.gguf", seed=1)
    out = tmp_path / "model"
    import_gguf(first, out)
    (out / "config.json").unlink()  # an incomplete folder is also re-imported
    import_gguf(second, out)
    assert is_complete(out, sha256_file(second), verify_hashes=True)
    weights = load_file(out / "model.safetensors")
    np.testing.assert_array_equal(weights["model.norm.weight"], expected["model.norm.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "src"]  # no temp/old dirs


def test_crash_leaves_no_half_folder(make_tiny_gguf, tmp_path, monkeypatch):
    src, _ = make_tiny_gguf()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(gguf_import, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        import_gguf(src, tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_unknown_architecture_is_refused(make_tiny_gguf, tmp_path):
    src, _ = make_tiny_gguf(arch="mamba")
    with pytest.raises(ValueError, match="'mamba'"):
        import_gguf(src, tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "model")


def test_transformers_loads_the_folder(make_tiny_gguf, tmp_path, tiny):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    src, expected = make_tiny_gguf()
    out = import_gguf(src, tmp_path / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    state = model.state_dict()
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(state[q], torch.from_numpy(expected[q]))
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])  # tied
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("hello world").input_ids == [
        tiny.tokens.index("hello"),
        tiny.tokens.index("Ġworld"),
    ]
    logits = model(torch.tensor([[1, 5, 6]])).logits
    assert logits.shape == (1, 3, len(tiny.tokens))


def test_another_file_of_the_same_name_goes_beside_a_complete_import(make_tiny_gguf, tmp_path):
    """Two GGUFs both named model.gguf: the second never replaces the first's folder (a server
    may be reading it), and each import is found again where it went."""
    first, first_weights = make_tiny_gguf("a/model.gguf", seed=0)
    second, second_weights = make_tiny_gguf("b/model.gguf", seed=1)
    store = tmp_path / "store"
    a = import_gguf(first, store / "model")
    b = import_gguf(second, store / "model")
    assert a == store / "model" and b == store / f"model-{sha256_file(second)[:12]}"
    for folder, expected in ((a, first_weights), (b, second_weights)):
        weights = load_file(folder / "model.safetensors")
        np.testing.assert_array_equal(weights["model.norm.weight"], expected["model.norm.weight"])
    assert (import_gguf(first, store / "model"), import_gguf(second, store / "model")) == (a, b)
