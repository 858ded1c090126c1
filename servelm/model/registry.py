"""Which model class serves which `architectures` entry of a config.json: the one place.

Every family is a variation of the Llama decoder (servelm/model/llama.py); a family's module
subclasses the parts that differ and registers its class here.
"""

from __future__ import annotations

from torch import nn

from servelm.model.config import ModelSpec


def model_class(spec: ModelSpec) -> type[nn.Module]:
    from servelm.model.llama import LlamaForCausalLM
    from servelm.model.moe import MixtralForCausalLM, Qwen3MoeForCausalLM

    classes: dict[str, type[nn.Module]] = {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
        "MixtralForCausalLM": MixtralForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    }
    return classes[spec.architecture]
