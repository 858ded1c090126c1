"""Token embedding whose weight always comes from a checkpoint (no random initialisation)."""

from __future__ import annotations

from torch import nn


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        """Nothing to initialise: `load_weights` fills the table."""
