"""Convert a GGUF file into a Hugging Face-format model folder.

Output folder (all written into a temp sibling, then renamed into place, so a crash never
leaves a half folder behind):

    config.json              the transformers config of the file's architecture (ARCHITECTURES)
    model.safetensors        float32 weights under HF names (quantized tensors dequantized)
    model.gguf-blocks        the file's own blocks of its quantized projections and logits head
                             whose type servelm's C kernel reads (Q8_0, Q4_K, Q5_K, Q6_K), under
                             the same names (a safetensors file; not named *.safetensors, so
                             the checkpoint loader does not read it as weights); absent if none
    tokenizer.json           rebuilt from tokenizer.ggml.* (see gguf_tokenizer)
    tokenizer_config.json    special tokens, chat template, context length
    generation_config.json   bos/eos ids
    servelm_import.json      manifest: source sha256 + sha256 of each file above (see manifest)

Re-importing the same GGUF into a folder whose manifest already records its sha256 is a no-op.
Every tensor type the `gguf` package dequantizes that a model in the wild uses for these
families is read (TENSOR_TYPES); another type, architecture or tensor is an error naming it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.numpy import save_file

from servelm.store.errors import ModelFileError
from servelm.store.gguf_tokenizer import build_tokenizer, tokenizer_config
from servelm.store.manifest import is_complete, sha256_file, write_manifest
from servelm.store.paths import GGUF_BLOCKS_FILE

Q = GGMLQuantizationType
# The tensor types read: what llama.cpp's F16/BF16/Q8_0/Q4_*/Q5_*/Q*_K_M files are made of.
TENSOR_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)
# The quantized types whose blocks servelm's C kernel multiplies by as they are (the loader
# checks them against the dequantized weights and serves the projections from them).
KEPT_TYPES = frozenset({Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})


@dataclass(frozen=True)
class Architecture:
    """How one GGUF `general.architecture` becomes a transformers config and checkpoint."""

    hf_class: str  # config.json "architectures"
    model_type: str
    # llama.cpp reorders q/k rows for its adjacent-pair rotary (Llama only; the others rotate
    # halves, as HF does)
    permuted_qk: bool = False
    # llama.cpp stores Gemma's RMSNorm weights as 1 + w (its norm multiplies by w); HF keeps w
    norm_plus_one: bool = False
    # the FFN norm: HF's post_attention_layernorm, or Gemma's pre_feedforward_layernorm (whose
    # post_attention_layernorm is the GGUF post_attention_norm after attention)
    sandwich_norms: bool = False


ARCHITECTURES = {
    "llama": Architecture("LlamaForCausalLM", "llama", permuted_qk=True),
    "mistral": Architecture("MistralForCausalLM", "mistral", permuted_qk=True),
    "qwen2": Architecture("Qwen2ForCausalLM", "qwen2"),
    "qwen3": Architecture("Qwen3ForCausalLM", "qwen3"),
    "gemma2": Architecture("Gemma2ForCausalLM", "gemma2", norm_plus_one=True, sandwich_norms=True),
    "gemma3": Architecture(
        "Gemma3ForCausalLM", "gemma3_text", norm_plus_one=True, sandwich_norms=True
    ),
    "phi3": Architecture("Phi3ForCausalLM", "phi3"),
}

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
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3's fused projection, as HF keeps it
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3, Gemma 3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_SANDWICH_NAMES = {  # Gemma 2 and 3
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Tensors that hold configuration, not weights: Phi-3's longrope factors, Llama 3's rope_freqs.
_ROPE_TENSORS = {"rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight"}
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


def architecture(meta: dict[str, Any]) -> Architecture:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} (general.architecture); servelm imports "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[arch]


def build_config(
    meta: dict[str, Any],
    tensor_names: set[str],
    rope_tensors: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """The transformers `config.json` dict of the file's architecture, from GGUF metadata.
    `rope_tensors`: the file's rope factor tensors (Phi-3 longrope, Llama 3 rope_freqs)."""
    arch = architecture(meta)
    arch_name = meta["general.architecture"]
    rope_tensors = rope_tensors or {}

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch_name}.{key}", default)

    def need(key: str) -> Any:
        value = get(key)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch_name}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    context = int(need("context_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    layers = int(need("block_count"))
    bias = "blk.0.attn_q.bias" in tensor_names
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "vocab_size": int(get("vocab_size", len(meta.get("tokenizer.ggml.tokens", [])))),
        "rope_theta": _float32_clean(get("rope.freq_base", 10000.0)),
        "rms_norm_eps": _float32_clean(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": context,
        "hidden_act": "silu",
        # llama.cpp drops output.weight when the model reuses its embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "bfloat16",
    }
    if arch.model_type in ("llama", "mistral", "qwen3"):
        config.update(attention_bias=bias, mlp_bias=False)
    if arch.model_type in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None)
    if arch.model_type == "mistral":
        config["sliding_window"] = get("attention.sliding_window")
    if arch.model_type in ("gemma2", "gemma3_text"):
        window = int(need("attention.sliding_window"))
        # llama.cpp scales queries by 1 / sqrt(hidden / heads) for Gemma 2/3 27B and by
        # 1 / sqrt(head_dim) otherwise (the GGUF has no key for it); HF's query_pre_attn_scalar
        # is the number under that root.
        big = (arch.model_type, layers) in (("gemma2", 46), ("gemma3_text", 62))
        config.update(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=hidden // heads if big else head_dim,
            sliding_window=window,
            attention_bias=False,
        )
        del config["hidden_act"]
    if arch.model_type == "gemma2":
        config.update(
            attn_logit_softcapping=_float32_clean(get("attn_logit_softcapping", 50.0)),
            final_logit_softcapping=_float32_clean(get("final_logit_softcapping", 30.0)),
            # every other layer local, from the first (HF Gemma2Config's own pattern)
            layer_types=[
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
            ],
        )
    if arch.model_type == "gemma3_text":
        # five local layers, then a global one; local layers rotate with a base of 10,000
        # (llama.cpp hard-codes both for Gemma 3, as HF's defaults do)
        pattern = int(get("attention.sliding_window_pattern", 6))
        config.update(
            rope_local_base_freq=10000.0,
            sliding_window_pattern=pattern,
            layer_types=[
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(layers)
            ],
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
        )
    if arch.model_type == "phi3":
        rope_dims = int(get("rope.dimension_count", head_dim))
        config.update(
            partial_rotary_factor=rope_dims / head_dim,
            sliding_window=get("attention.sliding_window"),
            original_max_position_embeddings=int(
                get("rope.scaling.original_context_length", context)
            ),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        )
        if "rope_factors_long.weight" in rope_tensors:
            config["rope_scaling"] = {
                "type": "longrope",
                "long_factor": [float(v) for v in rope_tensors["rope_factors_long.weight"]],
                "short_factor": [float(v) for v in rope_tensors["rope_factors_short.weight"]],
            }
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none" and "rope_scaling" not in config:
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": _float32_clean(get("rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(
                get("rope.scaling.original_context_length", context)
            ),
        }
    if "rope_freqs.weight" in rope_tensors:
        config["rope_scaling"] = _llama3_rope_scaling(rope_tensors["rope_freqs.weight"], config)
    return config


def _llama3_rope_scaling(freqs: np.ndarray, config: dict[str, Any]) -> dict[str, Any]:
    """Llama 3.1+'s rope scaling, which llama.cpp keeps only as per-frequency divisors
    (`rope_freqs`): the published settings (factor 8 or 32, low 1, high 4, from 8,192
    positions) whose divisors these are, or an error naming the tensor."""
    dim = config["head_dim"]
    inv_freq = 1.0 / config["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    for factor in (8.0, 32.0, 16.0, 4.0):
        low, high, old = 1.0, 4.0, 8192
        wavelen = 2 * np.pi / inv_freq
        smooth = (old / wavelen - low) / (high - low)
        divisor = np.where(
            wavelen < old / high,
            1.0,
            np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)),
        )
        if np.allclose(divisor, freqs, rtol=1e-5):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": old,
            }
    raise ValueError("GGUF tensor 'rope_freqs.weight' matches no known Llama 3 rope scaling")


def unpermute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3) ...; HF Llama rotates the two halves of a
    head (x0, x_{d/2}) .... Its converter therefore reorders each head's rows from
    [half A | half B] to interleaved [a0 b0 a1 b1 ...]. Viewing the rows as (head, d/2, 2) and
    swapping the last two axes puts them back as (head, 2, d/2). Whole rows move, so this works
    on a row's quantized blocks as well as on its weights.
    """
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _hf_name(name: str, arch: Architecture) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_RE.fullmatch(name)
    if match:
        suffix = match.group(2)
        table = {**_LAYER_NAMES, **_SANDWICH_NAMES} if arch.sandwich_norms else _LAYER_NAMES
        if arch.model_type == "phi3" and suffix == "ffn_up.weight":
            return f"model.layers.{match.group(1)}.mlp.gate_up_proj.weight"  # gate and up, fused
        if suffix in table:
            return f"model.layers.{match.group(1)}.{table[suffix]}"
    # MoE experts, unknown norms ... would load "fine" and compute garbage if skipped.
    raise ValueError(
        f"GGUF tensor {name!r} has no {arch.hf_class} counterpart; cannot import this model"
    )


def check_types(reader: GGUFReader) -> None:
    """An error naming the first tensor whose type is not one servelm reads."""
    for tensor in reader.tensors:
        if tensor.tensor_type not in TENSOR_TYPES:
            names = ", ".join(sorted(t.name for t in TENSOR_TYPES))
            raise ValueError(
                f"GGUF tensor {tensor.name!r} is {tensor.tensor_type.name}, a type servelm "
                f"does not read (it reads {names})"
            )


def _rope_tensors(reader: GGUFReader) -> dict[str, np.ndarray]:
    return {
        t.name: dequantize(t.data, t.tensor_type).reshape(-1)
        for t in reader.tensors
        if t.name in _ROPE_TENSORS
    }


def build_weights(
    reader: GGUFReader, config: dict[str, Any], meta: dict[str, Any]
) -> tuple[dict[str, np.ndarray], dict[str, tuple[np.ndarray, int]]]:
    """Dequantized float32 tensors under HF names, in torch (row-major, out x in) layout; and
    the projections whose blocks servelm's C kernel reads, as (uint8 [rows, row bytes], type)
    in the same row order."""
    arch = architecture(meta)
    weights: dict[str, np.ndarray] = {}
    blocks: dict[str, tuple[np.ndarray, int]] = {}
    for tensor in reader.tensors:
        if tensor.name in _ROPE_TENSORS:
            continue
        hf_name = _hf_name(tensor.name, arch)
        # tensor.shape is GGUF "ne" order (fastest dimension first): reversed torch order.
        shape = tuple(int(n) for n in reversed(tensor.shape))
        array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        array = np.array(array, dtype=np.float32, order="C")  # own copy, not a view of the mmap
        raw = None
        # the projections', and the logits head's (the embedding's where the head shares it)
        head = "model.embed_tokens.weight" if config["tie_word_embeddings"] else "lm_head.weight"
        if tensor.tensor_type in KEPT_TYPES and (
            hf_name.endswith("proj.weight") or hf_name == head
        ):
            raw = np.array(tensor.data, dtype=np.uint8).reshape(shape[0], -1)
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        part = hf_name.rsplit(".", 2)[-2]
        if arch.permuted_qk and part in heads:
            array = unpermute_rotary(array, heads[part])
            raw = None if raw is None else unpermute_rotary(raw, heads[part])
        if arch.norm_plus_one and hf_name.endswith("norm.weight"):
            array = array - np.float32(1.0)
        weights[hf_name] = np.ascontiguousarray(array)
        if raw is not None:
            blocks[hf_name] = (np.ascontiguousarray(raw), int(tensor.tensor_type))
    if config.get("attention_bias"):
        # HF's attention_bias puts a bias on o_proj too (llama.cpp's is optional): none in the
        # file is a zero one, exactly
        for layer in range(config["num_hidden_layers"]):
            name = f"model.layers.{layer}.self_attn.o_proj.bias"
            weights.setdefault(name, np.zeros(config["hidden_size"], dtype=np.float32))
    return weights, blocks


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def write_blocks(path: Path, blocks: dict[str, tuple[np.ndarray, int]]) -> None:
    """`GGUF_BLOCKS_FILE`: each tensor's raw blocks, its GGUF type by name in the metadata."""
    types = {name: GGMLQuantizationType(qtype).name for name, (_, qtype) in blocks.items()}
    save_file(
        {name: raw for name, (raw, _) in blocks.items()},
        str(path),
        metadata={"format": "gguf-blocks", "types": json.dumps(types)},
    )


def _write_folder(reader: GGUFReader, meta: dict[str, Any], folder: Path) -> None:
    config = build_config(meta, {t.name for t in reader.tensors}, _rope_tensors(reader))
    tokenizer = build_tokenizer(meta)  # fail on an unsupported tokenizer before the slow part
    weights, blocks = build_weights(reader, config, meta)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if blocks:
        write_blocks(folder / GGUF_BLOCKS_FILE, blocks)
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


def open_gguf(path: Path) -> GGUFReader:
    """A reader of the GGUF file `path`, or ModelFileError naming it. gguf's reader parses the
    whole header and tensor index up front, and on a file cut short or not a GGUF at all fails
    with whatever numpy says first ("not enough values to unpack", "index 0 is out of bounds"):
    that stays in the chained exception, the message says what is wrong."""
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError) as exc:
        with path.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelFileError(
                f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)"
            ) from exc
        raise ModelFileError(
            f"{path} is not a valid, complete GGUF file: it is cut short or corrupt"
        ) from exc


def import_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert `gguf_path` into an HF-format folder at `out_dir` and return that folder.

    Skips the work when `out_dir` already holds a complete import of the same file (by sha256);
    where it holds a complete import of another file, the folder is `<out_dir>-<sha256[:12]>`.
    Raises ModelFileError (a ValueError) naming the file and what it cannot import: not a GGUF,
    cut short, an architecture, a tensor type, a tensor, a tokenizer.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    source_sha256 = sha256_file(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _store_locked(out_dir.parent):
        if is_complete(out_dir) and not is_complete(out_dir, source_sha256):
            # another file of the same name (llama.cpp's ggml-model-f16.gguf ...) is imported
            # there, and a server may be reading it: this one goes beside it, never over it
            out_dir = out_dir.with_name(f"{out_dir.name}-{source_sha256[:12]}")
        if not is_complete(out_dir, source_sha256):
            _import(gguf_path, out_dir, source_sha256)
    return out_dir


@contextlib.contextmanager
def _store_locked(store: Path) -> Iterator[None]:
    """One import at a time in a store, across processes (two servers started together on two
    files of the same name each chose a folder the other was about to fill)."""
    fd = os.open(store, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _import(gguf_path: Path, out_dir: Path, source_sha256: str) -> None:
    reader = open_gguf(gguf_path)
    try:
        meta = read_metadata(reader)
        # reject a file it cannot import before creating anything on disk
        build_config(meta, {t.name for t in reader.tensors})
        check_types(reader)
    except ValueError as exc:  # what it cannot import: say in which file
        raise ModelFileError(f"{gguf_path}: {exc}") from exc

    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it owner-only; the final folder should read like any other
    try:
        _write_folder(reader, meta, tmp)
        for path in tmp.iterdir():
            path.chmod(0o644)  # safetensors creates its file owner-only
        write_manifest(tmp, gguf_path.name, source_sha256)
        _move_into_place(tmp, out_dir, source_sha256)
    except ValueError as exc:  # a tokenizer or tensor it cannot convert
        raise ModelFileError(f"{gguf_path}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
