"""The logits head returns float32, and batch invariant computes each row alike whatever the
number of rows: a row's logits alone equal its logits among others, bit for bit."""

from __future__ import annotations

import pytest
import torch

from servelm.model.layers.linear import HEAD_CHUNK_ROWS, LogitsHead


@pytest.mark.parametrize("rows", [1, 5, HEAD_CHUNK_ROWS, HEAD_CHUNK_ROWS + 3, 40])
def test_a_batch_invariant_head_gives_each_row_its_own_logits(rows):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(1000, 96, generator=g).bfloat16()
    x = torch.randn(rows, 96, generator=g).bfloat16()
    head = LogitsHead(weight, invariant=True)
    together = head(x)
    assert together.dtype == torch.float32 and together.shape == (rows, 1000)
    for i in range(rows):
        assert torch.equal(head(x[i : i + 1])[0], together[i]), i
    torch.testing.assert_close(
        together, x.double() @ weight.double().T, rtol=1e-5, atol=1e-4, check_dtype=False
    )
