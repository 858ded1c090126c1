"""Qwen3: the Llama decoder with an RMSNorm on each head of q and k before the rotary embedding,
no q/k/v biases and head_dim from the config (often not hidden_size / heads)."""

from __future__ import annotations

from servelm.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from servelm.model.variants import QKNormAttention, rebuild_layers


class Qwen3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, spec, layer_idx: int) -> None:
        super().__init__(spec, layer_idx)
        self.self_attn = QKNormAttention(spec, layer_idx)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, spec, max_positions=None, rope=None) -> None:
        super().__init__(spec, max_positions, rope)
        rebuild_layers(self, Qwen3DecoderLayer)
