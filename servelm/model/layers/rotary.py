"""Rotary position embedding (the half-split layout of HF Llama) with llama3 / linear / LongRoPE
scaling.

cos/sin are computed in float32 for every position up to the context length at start-up and
stored in the model's dtype (as the reference implementation casts them), so a step only
indexes the table with its token positions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are stretched by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    return inv_freq


def longrope_freqs(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3's `longrope`, formerly `su`): each frequency divided by its own factor,
    the short ones below `original_max_position_embeddings` and the long ones from there on, and
    cos/sin scaled by the attention factor. Returns position x frequency angles and that factor.

    transformers picks one set for a whole forward by its longest position (so a sequence that
    grows past the original length re-rotates nothing it cached, but its new tokens turn long);
    here each position has its own, which is the same for every sequence within the original
    length and for every token past it, and keeps a step's result independent of its batch."""
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling["factor"])
    attention = scaling.get("attention_factor")
    if attention is None:  # the paper's choice, as transformers makes it
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim

    def inv_freq(ext: list[float]) -> torch.Tensor:
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta**shape)

    pos = torch.arange(max_positions, dtype=torch.float32)
    short = torch.outer(pos, inv_freq(scaling["short_factor"]))
    long = torch.outer(pos, inv_freq(scaling["long_factor"]))
    return torch.where((pos < original)[:, None], short, long), float(attention)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        kind = scaling and scaling.get("rope_type", scaling.get("type"))
        if kind in ("longrope", "su"):
            freqs, attention = longrope_freqs(head_dim, max_positions, theta, scaling)
        else:
            inv_freq = rope_inv_freq(head_dim, theta, scaling)
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
            attention = 1.0
        emb = torch.cat((freqs, freqs), dim=-1)
        half = head_dim // 2
        sin = emb.sin() * attention
        # rotate_half(x) * sin == roll(x, half) * [-sin | sin]: the sign lives in the table.
        sin[:, :half] = -sin[:, :half]
        self.register_buffer("cos", (emb.cos() * attention).to(dtype), persistent=False)
        self.register_buffer("signed_sin", sin.to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of each token's position, [T, 1, D]: once per step, every layer."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x: [T, H, D] (queries and keys side by side), cos_sin from `RotaryEmbedding.lookup`;
    rotates each token by its position.

    Same operations and roundings as the reference's `x * cos + rotate_half(x) * sin`.
    """
    cos, signed_sin = cos_sin
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin
