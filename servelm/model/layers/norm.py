"""RMSNorm, computed in float32 like the reference implementation, returned in the input dtype.

It also adds the previous sublayer's output to the residual stream first (`delta`), so that on
the CPU both run as one fused C op (`servelm.kernels.cpu_ops`) with the same roundings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from servelm.kernels.cpu_ops import CpuOps


class RMSNorm(nn.Module):
    cpu_ops: CpuOps | None = None  # set by LlamaForCausalLM.use_cpu_ops

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.shape = (hidden_size,)

    def forward(
        self, x: torch.Tensor, delta: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + delta), x + delta); the fused op updates x in place."""
        fused = self.cpu_ops and self.cpu_ops.add_rms_norm(x, delta, self.weight, self.eps)
        if fused:
            return fused
        if delta is not None:
            x = x + delta
        return self.weight * F.rms_norm(x.float(), self.shape, eps=self.eps).to(x.dtype), x


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores w and the norm scales by (1 + w), in float32
    before the one rounding to the input dtype (transformers' Gemma2/3RMSNorm); torch ops only,
    as the fused C op rounds the Llama way."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(
        self, x: torch.Tensor, delta: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is not None:
            x = x + delta
        normed = F.rms_norm(x.float(), self.shape, eps=self.eps) * (1.0 + self.weight.float())
        return normed.to(x.dtype), x
