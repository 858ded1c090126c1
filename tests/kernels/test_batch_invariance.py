"""Batch invariance in every kernel build: a row's result does not depend on the rows around it.

The int4 and Q8_0 matmuls: each row of x multiplied alone equals, bit for bit, the same row
among 1 to 40 others (one pass, several passes, a tile's rest), with every activation width.
Prefill attention: a query attended alone, as a decode token is (n = 1, its context up to it),
equals the same query inside any prompt chunk that holds it, bit for bit. By row count
(`--no-batch-invariant`) the matmuls are not invariant on the builds that switch paths, which
shows the check can fail.
"""

from __future__ import annotations

import pytest
import torch

from servelm.kernels.build import compiler
from servelm.kernels.paged_prefill import PagedPrefillKernel
from servelm.kernels.quant_matmul import QuantMatmul
from tests.kernels.test_paged_decode import scattered_tables
from tests.kernels.test_quant_matmul import q4_weight, q8_weight
from tests.kernels.variants import INTEGERS, PREFILL, TILES, flags, params

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler on this machine")

BATCHES = [2, 3, 5, 6, 9, 16, 17, 40, 300]  # 300: more than one sweep of x (quant_matmul.c)


@pytest.fixture(scope="module")
def kernel(variant) -> QuantMatmul:
    loaded = QuantMatmul.load(extra_flags=flags(variant))
    assert loaded is not None and loaded.invariant  # the default
    return loaded


def rows_alone_differ(matmul, x: torch.Tensor) -> list[int]:
    """The rows of x whose product alone is not bit for bit their product among all of x."""
    together = matmul(x)
    return [i for i in range(x.shape[0]) if not torch.equal(matmul(x[i : i + 1])[0], together[i])]


def some_x(batch: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # magnitudes spread over 2^-10 .. 2^4: integer x rounds the small ones, row by row
    return (
        torch.randn(batch, cols, generator=g)
        * 2.0 ** torch.randint(-10, 5, (batch, 1), generator=g)
    ).bfloat16()


@pytest.mark.parametrize("activations", ["int16", "int8", "float32"])
def test_q4_rows_alone_equal_rows_among_others(kernel, activations):
    q, scale, low, _ = q4_weight(96, 576, seed=3)
    packed = QuantMatmul.pack_q4(q, scale, low)
    kernel.use_activations(activations)
    try:
        for batch in BATCHES:
            x = some_x(batch, 576, batch)
            assert rows_alone_differ(lambda x: kernel.q4(x, packed, 96), x) == [], batch
    finally:
        kernel.use_activations("auto")


def test_q8_rows_alone_equal_rows_among_others(kernel):
    q, scale, _ = q8_weight(160, 576, seed=4)
    packed = QuantMatmul.pack_q8(q, scale)
    for batch in BATCHES:
        x = some_x(batch, 576, batch)
        got = kernel.q8(x, packed, 160)
        assert got.dtype == torch.float32
        assert rows_alone_differ(lambda x: kernel.q8(x, packed, 160), x) == [], batch


@pytest.mark.parametrize("variant", params(TILES | INTEGERS), indirect=True)
def test_by_row_count_the_paths_switch_and_rows_differ(kernel):
    """The builds that switch paths by row count (tiles from 6 rows, integer x from 2): the
    check above fails without batch invariance."""
    q, scale, low, _ = q4_weight(96, 576, seed=3)
    packed = QuantMatmul.pack_q4(q, scale, low)
    x = some_x(16, 576, 7)
    kernel.batch_invariant(False)
    try:
        assert rows_alone_differ(lambda x: kernel.q4(x, packed, 96), x) != []
    finally:
        kernel.batch_invariant(True)


@pytest.mark.parametrize("variant", params(PREFILL), indirect=True)
@pytest.mark.parametrize("d,hq,hkv", [(64, 9, 3), (128, 8, 2), (64, 4, 4), (32, 32, 1)])
def test_prefill_attention_of_a_query_is_that_of_a_decode(variant, d, hq, hkv):
    kernel = PagedPrefillKernel.load(torch.bfloat16, d, 16, flags(variant))
    g = torch.Generator().manual_seed(d + hq)
    block, num_blocks = 16, 96
    caches = [torch.randn(num_blocks * block, hkv, d, generator=g).bfloat16() for _ in range(2)]
    ctx = 300
    table = torch.tensor(scattered_tables([ctx], num_blocks, seed=hq)[0])
    q_all = torch.randn(ctx, hq, d, generator=g).bfloat16()

    def attend(first: int, n: int) -> torch.Tensor:
        """Queries first .. first + n - 1 as one chunk (their context: up to the last)."""
        out = torch.empty(n, hq, d, dtype=torch.bfloat16)
        return kernel(q_all[first : first + n], *caches, table, block, first + n, 0.125, out)

    # chunks of every shape: a whole prompt, after cached tokens, tiles' and chunks' rests
    for first, n in [(0, ctx), (0, 37), (5, 60), (37, 16), (100, 200), (255, 45), (299, 1)]:
        chunk = attend(first, n)
        for i in sorted({0, 1, n // 2, n - 2, n - 1} & set(range(n))):
            alone = attend(first + i, 1)[0]  # as a decode token at that position
            assert torch.equal(alone, chunk[i]), (first, n, i)
