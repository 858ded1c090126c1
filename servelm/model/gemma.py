"""Gemma 2 and Gemma 3 (text): the Llama decoder with

- RMSNorms that scale by (1 + w) (the checkpoint stores w), four per layer: before and after
  attention, before and after the MLP (the post-norms normalise the sublayer's output before it
  joins the residual stream);
- a GELU-tanh gated MLP (`hidden_activation`, which LlamaMLP reads), embeddings scaled by sqrt(hidden_size) rounded to the model dtype, and
  tied embeddings;
- attention scaled by query_pre_attn_scalar ** -0.5, soft-capped logits (Gemma 2: attention
  scores, in the attention backend, and the final logits, in `compute_logits`), and local
  sliding-window layers alternating with global ones (`spec.layer_windows`, honoured by the
  attention backend);
- Gemma 3: q/k norms (of the (1 + w) kind) and a second rotary table, of base
  `local_rope_theta`, for the windowed layers.
"""

from __future__ import annotations

import torch

from servelm.model.layers.norm import GemmaRMSNorm
from servelm.model.layers.rotary import RotaryEmbedding
from servelm.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from servelm.model.variants import QKNormAttention, rebuild_layers


class GemmaQKNormAttention(QKNormAttention):
    norm_class = GemmaRMSNorm


class GemmaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, spec, layer_idx: int) -> None:
        super().__init__(spec, layer_idx)
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        if spec.architecture == "Gemma3ForCausalLM":
            self.self_attn = GemmaQKNormAttention(spec, layer_idx)

    def forward(self, x, delta, cos_sin, attn, kept_only=False):
        """As the Llama layer's; what this layer adds to the stream is the post-normed MLP
        output (the post-normed attention output is added here)."""
        h, x = self.input_layernorm(x, delta)
        out = self.post_attention_layernorm(self.self_attn(h, cos_sin, attn, kept_only))[0]
        if kept_only and attn.kept_rows is not None:
            x = x[attn.kept_rows]
        h, x = self.pre_feedforward_layernorm(x, out)
        return x, self.post_feedforward_layernorm(self.mlp(h))[0]


class GemmaForCausalLM(LlamaForCausalLM):
    def __init__(self, spec, max_positions=None, rope=None) -> None:
        super().__init__(spec, max_positions, rope)
        rebuild_layers(self, GemmaDecoderLayer)
        self.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rope_local: RotaryEmbedding | None = None

    def local_rope(self) -> RotaryEmbedding:
        """The windowed layers' table (Gemma 3): made on first use like `self.rope`, whose rows,
        dtype and device it takes (the loader builds the model on the meta device and gives it
        its rope afterwards)."""
        if self.spec.local_rope_theta is None:
            return self.rope
        cos = self.rope.cos
        if self.rope_local is None or self.rope_local.cos.device != cos.device:
            table = RotaryEmbedding(
                self.spec.head_dim, cos.shape[0], self.spec.local_rope_theta, None, cos.dtype
            )
            self.rope_local = table.to(cos.device)
        return self.rope_local

    def forward(self, input_ids, positions, attn) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the model dtype first, as transformers multiplies
        x = x * x.new_tensor(self.spec.hidden_size**0.5)
        cos_sin = self.rope.lookup(positions)
        local = self.local_rope().lookup(positions) if self.spec.local_rope_theta else cos_sin
        delta, last = None, len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            rope = local if self.spec.window(i) is not None else cos_sin
            x, delta = layer(x, delta, rope, attn, kept_only=i == last)
        return self.norm(x, delta)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)  # float32
        cap = self.spec.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
