"""Token embedding whose weight always comes from a checkpoint (no random initialisation)."""

from __future__ import annotations

import torch
from torch import nn


class Embedding(nn.Embedding):
    tp = None  # under tensor parallelism: the rank's group (its rows are its share of the vocab)

    def reset_parameters(self) -> None:
        """Nothing to initialise: `load_weights` fills the table."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return super().forward(ids)
        from servelm.model.parallel import vocab_parallel_embedding

        return vocab_parallel_embedding(ids, self.weight, self.tp)
