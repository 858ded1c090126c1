"""Which model class serves which `architectures` entry of a config.json: the one place.

Every family is a variation of the Llama decoder (servelm/model/llama.py); a family's module
subclasses the parts that differ and registers its class here.
"""

from __future__ import annotations

from torch import nn

from servelm.model.config import ModelSpec


def model_class(spec: ModelSpec) -> type[nn.Module]:
    from servelm.model.gemma import GemmaForCausalLM
    from servelm.model.llama import LlamaForCausalLM
    from servelm.model.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
    from servelm.model.phi3 import Phi3ForCausalLM
    from servelm.model.qwen3 import Qwen3ForCausalLM

    classes: dict[str, type[nn.Module]] = {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
        "Gemma2ForCausalLM": GemmaForCausalLM,
        "Gemma3ForCausalLM": GemmaForCausalLM,
        "Phi3ForCausalLM": Phi3ForCausalLM,
        "MixtralForCausalLM": MixtralForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    }
    return classes[spec.architecture]
