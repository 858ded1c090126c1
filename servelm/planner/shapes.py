"""Model shapes: the handful of config.json numbers that decide memory and FLOPs.

A `ModelShape` is a decoder-only transformer of the Llama family (Llama, Mistral,
Qwen2): every layer has q/k/v/o attention projections with grouped-query KV heads,
a gated MLP (gate, up, down) and two RMSNorms. Parameter counts are derived from the
shape, never typed in, so the catalog and a local config.json go through the same math.

A mixture of experts (Mixtral, Qwen3-MoE) replaces the MLP of its sparse layers with
`num_experts` gated MLPs of width `moe_intermediate_size` and a router, of which each
token runs `experts_per_tok`: weight memory counts every expert (`num_params`), per-token
compute only the active ones (`active_params`, `layer_linear_params(active=True)`).

Sizes are per dtype and per tensor-parallel rank:

- Quantised weight dtypes (fp8, int8, int4) apply to the linear layers inside the
  decoder blocks only; embeddings, the LM head and norms stay bf16, which is what
  common fp8 / AWQ / GPTQ checkpoints do.
- Under tensor parallelism (TP) every matrix, the embedding and the LM head are split
  across ranks, norms are replicated, and KV heads are split when there are at least
  as many KV heads as ranks and replicated (one per rank) when there are fewer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from servelm.model.config import projection_biases

# Bytes per stored element. int4 = 4 bits + one fp16 scale and a 4-bit zero point per
# group of 128 weights (the usual AWQ / GPTQ layout): 0.5 + 2/128 + 0.5/128.
WEIGHT_BYTES: dict[str, float] = {
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5 + 2.5 / 128,
}
KV_BYTES: dict[str, float] = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
UNQUANTISED_BYTES = 2.0  # embeddings, LM head and norms stay bf16


class ShapeError(ValueError):
    """A model shape or config.json that cannot be sized (missing key, bad TP degree)."""


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers of a Llama-family model (names follow config.json)."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool
    max_context: int
    qkv_bias: bool = False  # Qwen2: bias on q, k and v
    o_bias: bool = False  # Llama `attention_bias=True` also puts one on o_proj
    mlp_bias: bool = False
    hf_id: str = ""  # where the catalog entry's numbers come from
    # Every layer's sliding window (Mistral's; 0: some layer sees the whole context): the
    # engine gives back KV blocks behind it (planner/plan.py counts it).
    kv_window: int = 0
    qk_norm: bool = False  # per-head RMSNorm weights on q and k (Qwen3, Gemma 3)
    post_norms: bool = False  # Gemma 2/3: norms after attention and MLP too (4 per layer)
    # Mixture of experts (0 experts: dense); `dense_layers` keep the dense MLP (Qwen3-MoE's
    # mlp_only_layers / decoder_sparse_step).
    num_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    dense_layers: int = 0

    # -- parameter counts -------------------------------------------------------------
    def attention_params(self) -> tuple[int, int]:
        """Per-layer (q+o, k+v) parameter counts, biases included."""
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q_o = 2 * self.hidden_size * q_out + (q_out if self.qkv_bias else 0)
        q_o += self.hidden_size if self.o_bias else 0
        k_v = 2 * (self.hidden_size * kv_out + (kv_out if self.qkv_bias else 0))
        return q_o, k_v

    def mlp_params(self) -> int:
        """Per-layer gate + up + down parameter count."""
        bias = 2 * self.intermediate_size + self.hidden_size if self.mlp_bias else 0
        return 3 * self.hidden_size * self.intermediate_size + bias

    def sparse_layers(self) -> int:
        """Layers whose MLP is the mixture of experts."""
        return self.num_layers - self.dense_layers if self.num_experts else 0

    def moe_params(self, active: bool = False) -> int:
        """One sparse layer's router + experts (`active`: the experts one token runs)."""
        expert = 3 * self.hidden_size * self.moe_intermediate_size
        experts = self.experts_per_tok if active else self.num_experts
        return self.num_experts * self.hidden_size + experts * expert

    def all_mlp_params(self, active: bool = False) -> int:
        """The MLPs of every layer, dense and sparse (`active`: what one token runs)."""
        sparse = self.sparse_layers()
        return (self.num_layers - sparse) * self.mlp_params() + sparse * self.moe_params(active)

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def lm_head_params(self) -> int:
        """0 when the LM head reuses the embedding matrix."""
        return 0 if self.tie_embeddings else self.embedding_params()

    def norm_params(self) -> int:
        qk = 2 * self.num_layers * self.head_dim if self.qk_norm else 0
        per_layer = 4 if self.post_norms else 2
        return (per_layer * self.num_layers + 1) * self.hidden_size + qk

    def layer_linear_params(self, active: bool = False) -> int:
        """All matmul weights inside the decoder blocks (what quantisation touches);
        `active`: those one token multiplies by (the chosen experts only)."""
        return self.num_layers * sum(self.attention_params()) + self.all_mlp_params(active)

    def num_params(self) -> int:
        """Total stored parameters (a tied LM head counted once)."""
        return (
            self.layer_linear_params()
            + self.embedding_params()
            + self.lm_head_params()
            + self.norm_params()
        )

    def active_params(self) -> int:
        """Parameters one token is computed with: all but the experts it is not routed to
        (equal to `num_params` for a dense model)."""
        return self.num_params() - self.layer_linear_params() + self.layer_linear_params(True)

    # -- tensor parallelism -------------------------------------------------------------
    def check_tp(self, tp: int) -> None:
        """Raise ShapeError unless `tp` ranks can split this model's heads and MLP."""
        if tp < 1:
            raise ShapeError(f"tensor parallel size must be >= 1, got {tp}")
        parts = [
            (f"{self.num_heads} query heads", self.num_heads),
            (f"intermediate size {self.intermediate_size}", self.intermediate_size),
            (f"expert intermediate size {self.moe_intermediate_size}", self.moe_intermediate_size),
        ]
        bad = [what for what, n in parts if n % tp]
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            bad.append(f"{self.num_kv_heads} KV heads (nor does {tp} split into them)")
        if bad:
            raise ShapeError(f"{self.name}: {', '.join(bad)} do not split across {tp} ranks")

    def collectives_per_step(self, tp: int) -> int:
        """Collectives one forward makes across `tp` ranks (0 at 1): an all-reduce after each
        layer's attention and MLP output projections, one after the vocab-parallel embedding
        lookup, and an all-gather of the logits (what servelm/model/parallel.py does)."""
        return 2 * self.num_layers + 2 if tp > 1 else 0

    def heads_per_gpu(self, tp: int) -> tuple[int, int]:
        """(query heads, KV heads) held by each rank; KV heads replicate when fewer than tp."""
        self.check_tp(tp)
        return self.num_heads // tp, max(1, self.num_kv_heads // tp)

    # -- bytes --------------------------------------------------------------------------
    def weight_bytes(self, dtype: str = "bf16", tp: int = 1) -> float:
        """Weight bytes held by one rank (tp=1: the whole model)."""
        if dtype not in WEIGHT_BYTES:
            raise ShapeError(f"unknown weight dtype {dtype!r}; choose from {sorted(WEIGHT_BYTES)}")
        _, kv_heads = self.heads_per_gpu(tp)
        q_o, k_v = self.attention_params()
        # k/v projections follow the KV heads: split, or one head's worth replicated.
        k_v_per_gpu = k_v * kv_heads // self.num_kv_heads
        # Every expert is held (each rank a 1/tp slice of each), whichever a token runs.
        linear = self.num_layers * (q_o / tp + k_v_per_gpu) + self.all_mlp_params() / tp
        embed = (self.embedding_params() + self.lm_head_params()) / tp
        return linear * WEIGHT_BYTES[dtype] + (embed + self.norm_params()) * UNQUANTISED_BYTES

    def kv_bytes_per_token(self, kv_dtype: str = "bf16", tp: int = 1) -> float:
        """KV-cache bytes one token occupies on one rank (tp=1: the whole model).

        2 (key and value) x layers x KV heads x head_dim x bytes per element.
        """
        if kv_dtype not in KV_BYTES:
            raise ShapeError(f"unknown KV dtype {kv_dtype!r}; choose from {sorted(KV_BYTES)}")
        _, kv_heads = self.heads_per_gpu(tp)
        return 2 * self.num_layers * kv_heads * self.head_dim * KV_BYTES[kv_dtype]


def _kv_window(config: dict) -> int:
    """The window of every layer as the engine reads the config (0: none, or a layer without
    one, such as Gemma's global layers, or a config servelm cannot read)."""
    from servelm.engine.kv_cache.manager import kv_window
    from servelm.model.config import ModelConfigError, spec_from_dict

    try:
        return kv_window(spec_from_dict(config).layer_windows) or 0
    except (ModelConfigError, KeyError, TypeError, ValueError):
        return 0


def shape_from_config(config: dict, name: str = "model") -> ModelShape:
    """Build a ModelShape from a parsed Llama / Mistral / Qwen2 config.json."""
    config = config.get("text_config", config)  # multimodal wrappers nest the LM config
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        biases = projection_biases(config)  # as the loader builds them (model/config.py)
        shape = ModelShape(
            name=name,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_context=int(config.get("max_position_embeddings", 4096)),
            qkv_bias=biases["attention_bias"],
            o_bias=biases["o_proj_bias"],
            mlp_bias=biases["mlp_bias"],
            kv_window=_kv_window(config),
            qk_norm=config.get("model_type") in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"),
            post_norms=config.get("model_type") in ("gemma2", "gemma3", "gemma3_text"),
            **_moe_shape(config),
        )
    except KeyError as exc:
        raise ShapeError(f"config.json for {name} lacks {exc.args[0]!r}") from exc
    return shape


def _moe_shape(config: dict) -> dict:
    """The mixture-of-experts numbers of a Mixtral / Qwen3-MoE config.json (none if dense)."""
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    if not experts:
        return {}
    layers = int(config["num_hidden_layers"])
    # Qwen3-MoE: layer i is sparse every decoder_sparse_step unless in mlp_only_layers.
    dense = set(config.get("mlp_only_layers") or ())
    step = int(config.get("decoder_sparse_step") or 1)
    sparse = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return dict(
        num_experts=experts,
        experts_per_tok=int(config["num_experts_per_tok"]),
        # Mixtral's experts are intermediate_size wide; Qwen3-MoE names their width apart.
        moe_intermediate_size=int(
            config.get("moe_intermediate_size") or config["intermediate_size"]
        ),
        dense_layers=layers - sparse,
    )


def shape_from_folder(path: str | Path) -> ModelShape:
    """Read `config.json` from a model folder (or the file itself) into a ModelShape."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise ShapeError(f"no config.json at {config_path}")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ShapeError(f"{config_path} is not valid JSON: {exc}") from exc
    name = (config_path.parent if config_path.name == "config.json" else config_path).name
    return shape_from_config(config, name=name)
