"""`servelm plan` end to end through the real CLI parser."""

import json

from servelm.cli import main


def test_json_output_parses(capsys):
    assert main(["plan", "llama-3.1-8b", "--gpu", "h100-80gb", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes_per_token"] == 131_072
    assert out["kv_capacity_blocks"] == 25_720
    assert {c["source"] for c in out["cold_start"]} >= {"local NVMe", "network volume"}


def test_table_output(capsys):
    assert main(["plan", "llama-3.1-70b", "--tp", "4"]) == 0
    out = capsys.readouterr().out
    assert "16 query, 2 KV" in out and "162" in out


def test_a_pool_left_negative_is_shown_as_none_and_the_shortfall(capsys):
    # 811.71 GB of weights + 2 GB allowance on 21.60 GB usable: the pool arithmetic is
    # -792.11 GB, which is not a size
    assert main(["plan", "llama-3.1-405b", "--gpu", "l4"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "KV cache pool │ none: usable memory is 792.11 GB short" in out
    assert "-792" not in out


def test_folder_and_custom_gpu(tmp_path, capsys):
    config = {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["plan", str(tmp_path), "--gpu", "custom", "--gpu-memory-gb", "16", "--json"]
    assert main(argv + ["--max-model-len", "8192"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpu_memory_bytes"] == 16e9
    assert out["num_params"] == 1_235_814_400


def test_does_not_fit_exit_code_and_errors(capsys):
    assert main(["plan", "llama-3.1-70b", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["fits"] is False
    assert main(["plan", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_list(capsys):
    assert main(["plan", "--list"]) == 0
    assert "smollm2-135m" in capsys.readouterr().out
