"""Convert a Llama-architecture GGUF file into a Hugging Face-format model folder.

Output folder (all written into a temp sibling, then renamed into place, so a crash never
leaves a half folder behind):

    config.json              LlamaForCausalLM config from the `llama.*` metadata
    model.safetensors        float32 weights under HF names (quantized tensors dequantized)
    tokenizer.json           byte-level BPE rebuilt from tokenizer.ggml.* (see gguf_tokenizer)
    tokenizer_config.json    special tokens, chat template, context length
    generation_config.json   bos/eos ids
    servelm_import.json      manifest: source sha256 + sha256 of each file above (see manifest)

Re-importing the same GGUF into a folder whose manifest already records its sha256 is a no-op.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.numpy import save_file

from servelm.store.gguf_tokenizer import build_tokenizer, tokenizer_config
from servelm.store.manifest import is_complete, sha256_file, write_manifest

# GGUF tensor name -> HF name. Per-layer names are "blk.N.<suffix>".
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def _field_value(field: Any) -> Any:
    """Decode one GGUF key/value field into plain Python (str, int, float, bool, or list)."""
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        parts = [field.parts[i] for i in field.data]
        if field.types[1] == GGUFValueType.STRING:
            return [p.tobytes().decode("utf-8") for p in parts]
        return np.concatenate(parts).tolist() if parts else []
    part = field.parts[field.data[0]]
    if kind == GGUFValueType.STRING:
        return part.tobytes().decode("utf-8")
    return part[0].item()


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata of a GGUF file, decoded."""
    return {key: _field_value(field) for key, field in reader.fields.items()}


def _float32_clean(value: float) -> float:
    # GGUF stores floats as float32: 1e-5 comes back as 9.9999997e-06. Seven significant digits
    # are all float32 holds, so rounding to them recovers the number the model was trained with.
    return float(f"{value:.7g}")


def build_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """A transformers LlamaForCausalLM `config.json` dict from GGUF metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}: only 'llama' models can be imported"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"llama.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    context = int(get("context_length"))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "vocab_size": int(get("vocab_size", len(meta.get("tokenizer.ggml.tokens", [])))),
        "rope_theta": _float32_clean(get("rope.freq_base", 10000.0)),
        "rms_norm_eps": _float32_clean(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": context,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        # llama.cpp drops output.weight when the model reuses its embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "bfloat16",
    }
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": _float32_clean(get("rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(
                get("rope.scaling.original_context_length", context)
            ),
        }
    return config


def unpermute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3) ...; HF Llama rotates the two halves of a
    head (x0, x_{d/2}) .... Its converter therefore reorders each head's rows from
    [half A | half B] to interleaved [a0 b0 a1 b1 ...]. Viewing the rows as (head, d/2, 2) and
    swapping the last two axes puts them back as (head, 2, d/2).
    """
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_RE.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    # Biases, llama3 rope_freqs, MoE experts ... would load "fine" and compute garbage if skipped.
    raise ValueError(f"GGUF tensor {name!r} has no Llama counterpart; cannot import this model")


def build_weights(reader: GGUFReader, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Dequantized float32 tensors under HF names, in torch (row-major, out x in) layout."""
    weights: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        hf_name = _hf_name(tensor.name)
        # tensor.shape is GGUF "ne" order (fastest dimension first): reversed torch order.
        shape = tuple(int(n) for n in reversed(tensor.shape))
        array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        array = np.array(array, dtype=np.float32, order="C")  # own copy, not a view of the mmap
        if hf_name.endswith("q_proj.weight"):
            array = unpermute_rotary(array, config["num_attention_heads"])
        elif hf_name.endswith("k_proj.weight"):
            array = unpermute_rotary(array, config["num_key_value_heads"])
        weights[hf_name] = np.ascontiguousarray(array)
    return weights


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _write_folder(reader: GGUFReader, meta: dict[str, Any], folder: Path) -> None:
    config = build_config(meta, {t.name for t in reader.tensors})
    tokenizer = build_tokenizer(meta)  # fail on an unsupported tokenizer before the slow part
    weights = build_weights(reader, config)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _write_json(folder / "config.json", config)
    tokenizer.save(str(folder / "tokenizer.json"))
    _write_json(
        folder / "tokenizer_config.json",
        tokenizer_config(meta, config["max_position_embeddings"]),
    )
    _write_json(
        folder / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]},
    )


def _move_into_place(tmp: Path, out_dir: Path, source_sha256: str) -> None:
    """Rename the finished temp folder to `out_dir`, replacing a stale one if present."""
    old: Path | None = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        # Another process finished the same import between our rename and this one.
        if not is_complete(out_dir, source_sha256):
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def import_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert `gguf_path` into an HF-format folder at `out_dir` and return `out_dir`.

    Skips the work when `out_dir` already holds a complete import of the same file (by sha256).
    Raises ValueError for a non-Llama architecture or an unsupported tokenizer.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    source_sha256 = sha256_file(gguf_path)
    if is_complete(out_dir, source_sha256):
        return out_dir

    reader = GGUFReader(gguf_path)
    meta = read_metadata(reader)
    build_config(meta, set())  # reject a non-llama file before creating anything on disk

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it owner-only; the final folder should read like any other
    try:
        _write_folder(reader, meta, tmp)
        for path in tmp.iterdir():
            path.chmod(0o644)  # safetensors creates its file owner-only
        write_manifest(tmp, gguf_path.name, source_sha256)
        _move_into_place(tmp, out_dir, source_sha256)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
