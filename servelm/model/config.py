"""ModelSpec: the shape of a Llama-family model, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# Llama variations with layers of their own (servelm/model/qwen3.py, gemma.py, phi3.py).
FAMILY_ARCHITECTURES = (
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
)
SUPPORTED_ARCHITECTURES += FAMILY_ARCHITECTURES
# The MLP activations servelm computes (config.json `hidden_act` / `hidden_activation`), by
# transformers' ACT2FN names; servelm/model/llama.py holds their functions.
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu")
ROPE_TYPES = ("llama3", "linear", "default", "longrope", "su")
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
    attention_bias: bool  # q/k/v biases (Qwen2; Llama, Qwen3, Gemma with attention_bias)
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
    o_proj_bias: bool = False  # Llama, Qwen3, Gemma with attention_bias
    mlp_bias: bool = False  # gate/up/down biases (Llama with mlp_bias)
    hidden_act: str = "silu"  # the gated MLP's activation: one of ACTIVATIONS
    local_rope_theta: float | None = None  # rope base of the windowed layers (Gemma 3)
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
    _refuse_quantization(cfg)
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope_scaling = _rope_scaling(cfg)
        spec = ModelSpec(
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
            rope_scaling=rope_scaling,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window") else None,
            layer_windows=_mistral_qwen2_windows(arch, cfg, int(cfg["num_hidden_layers"])),
            hidden_act=_activation(arch, cfg),
            **_biases(arch, cfg),
            **_moe_fields(arch, cfg),
        )
        return replace(spec, **_family_fields(spec, cfg))
    except KeyError as exc:
        raise ModelConfigError(f"config.json lacks the field {exc.args[0]!r}") from None


def _refuse_quantization(cfg: dict[str, Any]) -> None:
    """A quantized checkpoint (`quantization_config`: FP8, GPTQ, AWQ, bitsandbytes...) stores
    its weights in a form servelm does not read (float8 or packed integers, with scales beside
    them): refused by name rather than loaded as if its numbers were the weights."""
    quant = cfg.get("quantization_config")
    if not quant:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    raise ModelConfigError(
        f"quantization_config quant_method {method!r} is not supported: servelm reads "
        "unquantized safetensors and GGUF files"
    )


def _activation(arch: str, cfg: dict[str, Any]) -> str:
    """The gated MLP's activation, as transformers reads it: Gemma's `hidden_activation` (its
    `hidden_act`, where an older config has one, is not read), the others' `hidden_act`."""
    if arch.startswith("Gemma"):
        act = str(cfg.get("hidden_activation") or "gelu_pytorch_tanh")
    else:
        act = str(cfg.get("hidden_act") or "silu")
    if act not in ACTIVATIONS:
        raise ModelConfigError(f"unsupported activation {act!r} (servelm knows {ACTIVATIONS})")
    return act


# A config.json's `model_type` -> its architecture, for configs that name no `architectures`
# (the planner's own shapes)
MODEL_TYPE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def projection_biases(cfg: dict[str, Any]) -> dict[str, bool]:
    """`_biases` of the model a config.json describes, its architecture read from
    `architectures` or, where that names none servelm knows, from `model_type` (for
    `servelm plan`, which sizes what the loader builds)."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    return _biases(arch or MODEL_TYPE_ARCHITECTURES.get(cfg.get("model_type"), ""), cfg)


def _biases(arch: str, cfg: dict[str, Any]) -> dict[str, bool]:
    """Which projections carry a bias, as transformers' modeling file of each family builds
    them: Qwen2's q/k/v always; `attention_bias` puts one on q/k/v and o (Llama, Qwen3,
    Gemma, Qwen3-MoE), `mlp_bias` on gate/up/down (Llama); Mistral, Mixtral and Phi-3 have
    none whatever the config says."""
    if arch == "Qwen2ForCausalLM":
        return dict(attention_bias=True, o_proj_bias=False, mlp_bias=False)
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        return dict(attention_bias=False, o_proj_bias=False, mlp_bias=False)
    attn = bool(cfg.get("attention_bias", False))
    mlp = arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False))
    return dict(attention_bias=attn, o_proj_bias=attn, mlp_bias=mlp)


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


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The rope scaling of the full-attention layers, wherever the config keeps it: `rope_scaling`,
    or transformers 5's `rope_parameters` (per layer type for Gemma 3); None when there is none.
    LongRoPE gets its `original_max_position_embeddings` and `factor` filled in, as
    transformers derives them, so that the rotary table needs nothing else."""
    scaling = cfg.get("rope_scaling")
    if scaling is None:
        params = cfg.get("rope_parameters") or {}
        scaling = params.get("full_attention", params)
    scaling = scaling or {}
    # Phi-4-mini rotates part of each head; servelm's rotary rotates all of it.
    if float(scaling.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1) != 1:
        raise ModelConfigError("partial_rotary_factor other than 1.0 is not supported")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ROPE_TYPES:
        raise ModelConfigError(
            f"unsupported rope_scaling type {kind!r} (servelm knows {', '.join(ROPE_TYPES)})"
        )
    if kind in ("longrope", "su"):
        scaling = dict(scaling)
        original = scaling.get("original_max_position_embeddings")
        original = int(original or cfg["original_max_position_embeddings"])
        scaling["original_max_position_embeddings"] = original
        if scaling.get("factor") is None:
            scaling["factor"] = int(cfg["max_position_embeddings"]) / original
        for key in ("short_factor", "long_factor"):
            if key not in scaling:
                raise ModelConfigError(f"rope_scaling {kind!r} lacks the field {key!r}")
    return scaling


def _layer_types_windows(cfg: dict[str, Any], sliding: list[bool]) -> tuple[int | None, ...]:
    """Per-layer windows: transformers 5's `layer_types` where the config has them, else
    `sliding` (the family's older rule); () when no layer has a window."""
    types = cfg.get("layer_types")
    if types:
        sliding = [t == "sliding_attention" for t in types]
    window = cfg.get("sliding_window")
    if not window or not any(sliding):
        return ()
    return tuple(int(window) if s else None for s in sliding)


def _family_fields(spec: ModelSpec, cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields Qwen3, Gemma 2/3 and Phi-3 set beyond the Llama ones (none for the others)."""
    arch, n = spec.architecture, spec.num_layers
    if arch not in FAMILY_ARCHITECTURES:
        return {}
    fields: dict[str, Any] = {}
    if arch == "Qwen3ForCausalLM":
        # Older configs: layers from max_window_layers on are windowed with use_sliding_window.
        first = int(cfg.get("max_window_layers") or 0)
        windowed = bool(cfg.get("use_sliding_window"))
        fields["layer_windows"] = (
            _layer_types_windows(cfg, [windowed and i >= first for i in range(n)])
            if windowed
            else ()
        )
    elif arch == "Phi3ForCausalLM":  # transformers windows every layer when the config has one
        fields["layer_windows"] = _layer_types_windows(cfg, [True] * n)
    else:  # Gemma 2 and 3
        if arch == "Gemma2ForCausalLM":  # older configs: even layers local, odd ones global
            sliding = [i % 2 == 0 for i in range(n)]
        else:  # Gemma 3: every `sliding_window_pattern`-th layer global, the others local
            pattern = int(
                cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
            )
            sliding = [(i + 1) % pattern != 0 for i in range(n)]
        fields["layer_windows"] = _layer_types_windows(cfg, sliding)
        fields["attn_scale"] = float(cfg.get("query_pre_attn_scalar") or spec.head_dim) ** -0.5
        fields["attn_logit_softcap"] = cfg.get("attn_logit_softcapping")
        fields["final_logit_softcap"] = cfg.get("final_logit_softcapping")
        fields["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", True))
        if arch == "Gemma3ForCausalLM":
            local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
            theta = local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0
            fields["local_rope_theta"] = float(theta)
            full = (cfg.get("rope_parameters") or {}).get("full_attention") or {}
            if full.get("rope_theta"):
                fields["rope_theta"] = float(full["rope_theta"])
    return fields


def _mistral_qwen2_windows(arch: str, cfg: dict[str, Any], n: int) -> tuple[int | None, ...]:
    """Per-layer windows as transformers applies them: Mistral's `sliding_window` on every
    layer (null: none); Qwen2's only with `use_sliding_window`, on the layers its `layer_types`
    name (transformers 5) or else from `max_window_layers` on. () for no window."""
    window = cfg.get("sliding_window")
    if not window:
        return ()
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):  # Mixtral's attention is Mistral's
        return (int(window),) * n
    if arch != "Qwen2ForCausalLM" or not cfg.get("use_sliding_window"):
        return ()
    types = cfg.get("layer_types")
    first = int(cfg.get("max_window_layers") or 0)
    sliding = [t == "sliding_attention" for t in types] if types else [i >= first for i in range(n)]
    return tuple(int(window) if s else None for s in sliding) if any(sliding) else ()


def load_spec(model_dir: str | Path) -> ModelSpec:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{path} not found: a model folder needs a config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path} is not valid JSON: {exc}") from None
    return spec_from_dict(cfg)
