"""Phi-3 (and Phi-3.5 / Phi-4 mini with full rotary): the Llama decoder whose checkpoint already
fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, in the row order servelm fuses
them, so each loads whole into its parameter. LongRoPE (`longrope` / `su`) lives in the rotary
table (servelm/model/layers/rotary.py), and config.py windows every layer when the config has a
`sliding_window`, as transformers does."""

from __future__ import annotations

from servelm.model.llama import LlamaForCausalLM
from servelm.model.loader import PackedShards


class Phi3ForCausalLM(LlamaForCausalLM):
    # checkpoint name fragment -> (our fused parameter fragment, shard): the whole tensor
    packed_modules = {
        "qkv_proj": ("qkv_proj", "all"),
        "gate_up_proj": ("gate_up_proj", "all"),
    }

    def __init__(self, spec, max_positions=None, rope=None) -> None:
        super().__init__(spec, max_positions, rope)
        for layer in self.layers:
            for fused in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
                fused.shards = PackedShards({"all": (0, fused.out_features)})

    def c_layer_loop(self) -> bool:
        """The layer is the plain Llama layer (only the rotary table differs, which the C loop
        reads as it is): windows and activations aside, the C loop runs it."""
        return self.plain_llama_layer()
