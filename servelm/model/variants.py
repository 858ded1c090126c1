"""Parts the Llama variations share: q/k norms before the rotary embedding, and a helper that
rebuilds the decoder layers of a family.

Each is a subclass of the Llama part it changes (servelm/model/llama.py), so the loader's fused
q/k/v and gate/up parameters, the int4 copies and the packed CPU matmuls apply unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from servelm.model.config import ModelSpec
from servelm.model.layers.norm import RMSNorm
from servelm.model.layers.rotary import apply_rotary
from servelm.model.llama import LlamaAttention


class QKNormAttention(LlamaAttention):
    """Llama attention with an RMSNorm over each head of q and of k before the rotary embedding
    (Qwen3, Gemma 3): one weight of head_dim for all query heads, one for all key heads."""

    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__(spec, layer_idx)
        self.q_norm = self.norm_class(spec.head_dim, spec.rms_norm_eps)
        self.k_norm = self.norm_class(spec.head_dim, spec.rms_norm_eps)

    def forward(self, x, cos_sin, attn, kept_only: bool = False) -> torch.Tensor:
        T, hq, hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(T, hq + 2 * hkv, D)
        # Heads as rows of [T * heads, D], which the norm (and its fused C op) takes.
        q = self.q_norm(qkv[:, :hq].reshape(-1, D))[0].view(T, hq, D)
        k = self.k_norm(qkv[:, hq : hq + hkv].reshape(-1, D))[0].view(T, hkv, D)
        qk = torch.cat((q, k), dim=1)
        if not (self.cpu_ops and self.cpu_ops.rotary_(qk, *cos_sin)):
            qk = apply_rotary(qk, cos_sin)
        out = attn(self.layer_idx, qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :], kept_only)
        return self.o_proj(out.flatten(1))


def rebuild_layers(model: nn.Module, layer_class: type[nn.Module]) -> None:
    """Replace the Llama decoder layers `LlamaForCausalLM.__init__` made with a family's. The
    loader builds models on the meta device, so the replaced layers never held memory."""
    spec = model.spec
    model.layers = nn.ModuleList(layer_class(spec, i) for i in range(spec.num_layers))
