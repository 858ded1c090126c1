"""ModelSpec: the shape of a Llama-family model, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# Mixtures of experts (servelm/model/moe.py).
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ARCHITECTURES += MOE_ARCHITECTURES


class ModelConfigError(ValueError):
    """The model folder cannot be served: missing file, unsupported architecture, bad field."""


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2)
    rope_scaling: dict[str, Any] | None = None
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    sliding_window: int | None = None
    # Per-layer attention window in tokens (None: the layer attends to the whole context); empty
    # when no layer has one. The attention backends and the KV cache read it through `window`.
    layer_windows: tuple[int | None, ...] = ()
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # tanh soft-capping of attention scores (Gemma 2)
    final_logit_softcap: float | None = None  # tanh soft-capping of the logits (Gemma 2)
    # Mixture of experts (servelm/model/moe.py): the layers in `moe_layers` route each token
    # to `experts_per_tok` of `num_experts` MLPs of width `moe_intermediate_size` (the others
    # keep the dense MLP of `intermediate_size`); `norm_topk_prob`: the chosen experts'
    # weights are renormalised to sum to 1.
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()

    def window(self, layer_idx: int) -> int | None:
        return self.layer_windows[layer_idx] if self.layer_windows else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Keys and values of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def spec_from_dict(cfg: dict[str, Any]) -> ModelSpec:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelConfigError(
            f"unsupported architecture {archs or '(none given)'}; servelm supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind not in ("llama3", "linear", "default"):
                raise ModelConfigError(f"unsupported rope_scaling type {kind!r}")
        return ModelSpec(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            # transformers 5 writes rope_theta inside rope_parameters only
            rope_theta=float(
                cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 1e4
            ),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            rope_scaling=rope_scaling,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window") else None,
            **_moe_fields(arch, cfg),
        )
    except KeyError as exc:
        raise ModelConfigError(f"config.json lacks the field {exc.args[0]!r}") from None


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral or Qwen3-MoE config (none for the others)."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    # transformers 5 writes num_local_experts for both (num_experts is its alias).
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    layers = int(cfg["num_hidden_layers"])
    if experts < 1:
        raise ModelConfigError(f"{arch}: config.json lacks num_local_experts / num_experts")
    if not 0 < int(cfg.get("num_experts_per_tok") or 0) <= experts:
        raise ModelConfigError(
            f"{arch}: num_experts_per_tok {cfg.get('num_experts_per_tok')!r} must be 1..{experts}"
        )
    if arch == "MixtralForCausalLM":  # every layer; experts as wide as intermediate_size
        return dict(
            num_experts=experts,
            experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=True,
            moe_layers=tuple(range(layers)),
        )
    # Qwen3-MoE: layer i is sparse unless listed in mlp_only_layers, every decoder_sparse_step.
    dense = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)
    return dict(
        num_experts=experts,
        experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_layers=tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
    )


def load_spec(model_dir: str | Path) -> ModelSpec:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{path} not found: a model folder needs a config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path} is not valid JSON: {exc}") from None
    return spec_from_dict(cfg)
