"""Mixture-of-experts models (Mixtral, Qwen3-MoE): the Llama decoder with a routed MLP.

A router (one [experts, hidden] matrix) scores every token; softmax in float32, the top-k
experts are kept, and their weights renormalised to sum to 1 where the family does (Mixtral
always, Qwen3-MoE when `norm_topk_prob`). Each expert is a `LlamaMLP` of the expert width and
runs on the rows routed to it alone: the step's (token, expert) pairs are grouped by expert,
each expert's rows gathered with `index_select`, and its weighted output added back with
`index_add_`, so a step costs top-k expert MLPs per token, not all of them. Experts are plain
`Linear`s, so the int4 copies and packed CPU matmuls apply to them as to any projection; the
router and the grouping run in torch. The C decode_stack does not run these layers
(`c_layer_loop` is False for every subclass of the Llama model).

    x [T, hidden] -> logits [T, E] -> top-k (weights [T, k], experts [T, k]) -> out [T, hidden]
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from servelm.model.config import ModelSpec
from servelm.model.layers.rotary import RotaryEmbedding
from servelm.model.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from servelm.model.variants import QKNormAttention


class Router(nn.Module):
    """The gate: one logit per expert and token (kept out of `Linear` so that int4 rounding
    never moves a token to another expert)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MoeMLP(nn.Module):
    # Mixtral multiplies each expert's output by its float32 weight and rounds the product;
    # Qwen3-MoE rounds the weight to the model dtype first (transformers' order, both).
    float32_weights = True

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.top_k = spec.experts_per_tok
        self.renormalize = spec.norm_topk_prob
        self.gate = Router(spec.hidden_size, spec.num_experts)
        expert = replace(spec, intermediate_size=spec.moe_intermediate_size)
        self.experts = nn.ModuleList(LlamaMLP(expert) for _ in range(spec.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's chosen experts [T, k] and their weights [T, k] (float32 or x's dtype)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights if self.float32_weights else weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen, weights = self.route(x)
        # (token, slot) pairs in expert order: pair p is token p // k's slot p % k.
        pairs = chosen.flatten()
        order = pairs.argsort(stable=True)
        counts = torch.bincount(pairs, minlength=len(self.experts)).tolist()
        weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        # Experts in index order, as transformers adds them, so float sums round alike.
        for expert, n in zip(self.experts, counts, strict=True):
            if n == 0:
                continue
            picked = order[start : start + n]
            start += n
            rows = picked // self.top_k
            y = expert(x.index_select(0, rows)) * weights.index_select(0, picked)[:, None]
            out.index_add_(0, rows, y.to(x.dtype))
        return out


class Qwen3MoeMLP(MoeMLP):
    float32_weights = False


class MoeDecoderLayer(LlamaDecoderLayer):
    """The Llama layer with the mixture in place of the dense MLP where the spec says so."""

    moe_class: type[MoeMLP] = MoeMLP

    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__(spec, layer_idx)
        if layer_idx in spec.moe_layers:
            self.mlp = self.moe_class(spec)


class MoeForCausalLM(LlamaForCausalLM):
    layer_class: type[LlamaDecoderLayer] = MoeDecoderLayer

    def __init__(
        self, spec: ModelSpec, max_positions: int | None = None, rope: RotaryEmbedding | None = None
    ) -> None:
        super().__init__(spec, max_positions, rope)
        # Built on the meta device (servelm/model/loader.py), so the dense layers replaced
        # here never held memory.
        self.layers = nn.ModuleList(self.layer_class(spec, i) for i in range(spec.num_layers))


class MixtralForCausalLM(MoeForCausalLM):
    # Mixtral's checkpoint names: block_sparse_moe.gate, block_sparse_moe.experts.N.w1 (gate),
    # w3 (up) and w2 (down), as save_pretrained writes them (one tensor per expert).
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "w1": ("gate_up_proj", "gate"),
        "w3": ("gate_up_proj", "up"),
    }

    def checkpoint_name(self, param_name: str) -> str:
        name = super().checkpoint_name(param_name)
        return name.replace(".mlp.", ".block_sparse_moe.").replace(".down_proj.", ".w2.")


class Qwen3MoeDecoderLayer(MoeDecoderLayer):
    """Qwen3's attention (q/k norms per head) with the mixture, or the dense MLP on the layers
    `mlp_only_layers` / `decoder_sparse_step` leave dense."""

    moe_class = Qwen3MoeMLP

    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__(spec, layer_idx)
        self.self_attn = QKNormAttention(spec, layer_idx)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    # Checkpoint names are Llama's: mlp.gate, mlp.experts.N.gate_proj / up_proj / down_proj.
    layer_class = Qwen3MoeDecoderLayer
