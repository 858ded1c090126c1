"""The Llama family (Llama 2/3/3.1, SmolLM, Mistral, Qwen2) as one decoder-only model.

Projections are fused at load time: q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so
a layer runs two matmuls where the checkpoint has five. Each norm first adds the previous
sublayer's output to the residual stream; with `use_cpu_ops` the norms, the rotary embedding
and SiLU-and-multiply run as fused C ops on CPU tensors (same roundings as the torch ops).
Biases (q/k/v, o, the MLP's) and the MLP's activation are as the spec reads them from
config.json, family by family (model/config.py).
Attention over the paged KV cache is delegated to the `attn` object passed to `forward` (the
worker's attention backend); the model knows nothing about blocks, batches or devices.

Tokens of every request in a step are flattened into one [T] sequence (no padding):

    input_ids  [T]         positions [T]          hidden [T, hidden_size]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from servelm.kernels.cpu_ops import CpuOps
from servelm.model.config import ACTIVATIONS, ModelSpec
from servelm.model.layers.embedding import Embedding
from servelm.model.layers.linear import Linear, LogitsHead, Q8Weight, pack_linears_for_cpu
from servelm.model.layers.norm import RMSNorm
from servelm.model.layers.rotary import RotaryEmbedding, apply_rotary
from servelm.model.loader import PackedShards


class PagedAttention(Protocol):
    kept_rows: torch.Tensor | None  # the rows the last layer computes (None: all)

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kept_only=False
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of this step's tokens -> attention output [T, Hq, D]
        (with `kept_only`: [len(kept_rows), Hq, D], for those rows)."""
        ...


class LlamaAttention(nn.Module):
    cpu_ops: CpuOps | None = None

    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
        )
        q, kv = spec.q_size, spec.kv_size
        self.qkv_proj = Linear(spec.hidden_size, q + 2 * kv, bias=spec.attention_bias)
        shards = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        self.qkv_proj.shards = PackedShards(shards)
        self.o_proj = Linear(q, spec.hidden_size, bias=spec.o_proj_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn: PagedAttention,
        kept_only: bool = False,
    ) -> torch.Tensor:
        T = x.shape[0]
        hq, hkv = self.num_heads, self.num_kv_heads
        # q, k and v heads are contiguous in the fused output: rotate q and k in one pass.
        qkv = self.qkv_proj(x).view(T, hq + 2 * hkv, self.head_dim)
        qk = qkv[:, : hq + hkv]
        if not (self.cpu_ops and self.cpu_ops.rotary_(qk, *cos_sin)):
            qk = apply_rotary(qk, cos_sin)
        out = attn(self.layer_idx, qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :], kept_only)
        return self.o_proj(out.flatten(1))


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' `gelu_new` (NewGELUActivation), written out as it computes it: the tanh
    approximation, rounded otherwise than torch's `gelu(approximate="tanh")`."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


# config.json's activation names (transformers' ACT2FN) -> the function on the gate.
ACTIVATION_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_new": _gelu_new,
    "relu": F.relu,
}
assert set(ACTIVATION_FNS) == set(ACTIVATIONS)


class LlamaMLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)), with `spec.hidden_act` for act (SiLU as a
    fused C op where `cpu_ops` has it) and biases where `spec.mlp_bias` says."""

    cpu_ops: CpuOps | None = None

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        inter = spec.intermediate_size
        self.gate_up_proj = Linear(spec.hidden_size, 2 * inter, bias=spec.mlp_bias)
        self.gate_up_proj.shards = PackedShards({"gate": (0, inter), "up": (inter, inter)})
        self.down_proj = Linear(inter, spec.hidden_size, bias=spec.mlp_bias)
        self.inter = inter
        self.silu = spec.hidden_act == "silu"
        self.act = ACTIVATION_FNS[spec.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        h = self.cpu_ops.silu_and_mul(gate_up) if self.silu and self.cpu_ops else None
        if h is None:
            gate, up = gate_up.split(self.inter, dim=-1)
            h = self.act(gate) * up
        return self.down_proj(h)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = LlamaAttention(spec, layer_idx)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = LlamaMLP(spec)

    def forward(self, x, delta, cos_sin, attn, kept_only=False):
        """x: the residual stream; delta: what the previous layer adds to it (None before the
        first layer). Returns the stream and this layer's own addition, for the next norm;
        with `kept_only` (the last layer) for `attn.kept_rows` alone."""
        h, x = self.input_layernorm(x, delta)
        out = self.self_attn(h, cos_sin, attn, kept_only)
        if kept_only and attn.kept_rows is not None:
            x = x[attn.kept_rows]
        h, x = self.post_attention_layernorm(x, out)
        return x, self.mlp(h)


class LlamaForCausalLM(nn.Module):
    cpu_ops: CpuOps | None = None
    head_q8: Q8Weight | None = None  # an exact Q8_0 copy of the head, set by the loader
    batch_invariant: bool = False  # the head's rows computed alike whatever their number
    # checkpoint name fragment -> (our fused parameter fragment, shard)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(
        self, spec: ModelSpec, max_positions: int | None = None, rope: RotaryEmbedding | None = None
    ) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rope = rope or RotaryEmbedding(
            spec.head_dim,
            max_positions or spec.max_position_embeddings,
            spec.rope_theta,
            spec.rope_scaling,
        )
        if spec.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def checkpoint_name(self, param_name: str) -> str:
        """Our parameter name as the HF checkpoint spells it (without the fused shard)."""
        if param_name.startswith("lm_head."):
            return param_name
        return "model." + param_name

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: PagedAttention
    ) -> torch.Tensor:
        """The final hidden states of the rows the step samples from, `attn.kept_rows` (all rows
        where that is None): the last layer computes no others."""
        x, delta = self.embed_tokens(input_ids), None
        cos_sin = self.rope.lookup(positions)
        for i, layer in enumerate(self.layers):
            x, delta = layer(x, delta, cos_sin, attn, kept_only=i == len(self.layers) - 1)
        return self.norm(x, delta)[0]

    def c_layer_loop(self) -> bool:
        """Whether servelm/kernels/decode_stack.c, which runs the plain Llama layer (full
        attention at the default scale, SiLU), can run this model's layers. A family that
        changes the layer in any way (norms, activation, MoE, windows, soft-capping) answers
        False. (Biases the C loop refuses itself: worker/decode_stack.py takes no `Linear` with
        one.)"""
        return self.plain_llama_layer() and type(self) is LlamaForCausalLM

    def plain_llama_layer(self) -> bool:
        """Whether the spec leaves the Llama layer's attention and activation as the C loop
        computes them."""
        spec = self.spec
        plain = not any(spec.layer_windows) and spec.attn_scale is None
        return plain and spec.attn_logit_softcap is None and spec.hidden_act == "silu"

    def use_cpu_ops(self, ops: CpuOps | None) -> None:
        """Run the norms, rotary and SiLU-and-multiply as fused C ops (None: torch ops)."""
        self.cpu_ops = ops
        for module in self.modules():
            if isinstance(module, (RMSNorm, LlamaAttention, LlamaMLP)):
                module.cpu_ops = ops

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def prepare_for_inference(self) -> None:
        """Once the weights are loaded: repack matmul weights where the device gains from it."""
        self.logits_head = LogitsHead(self.head_weight, self.head_q8, self.batch_invariant)
        if self.lm_head is not None:
            self.lm_head = None  # the head above holds the weight (packed or not)
        pack_linears_for_cpu(self)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_head(hidden)  # float32
