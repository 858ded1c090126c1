"""The C matmul over GGUF blocks as the file holds them (Q8_0, Q4_K, Q5_K, Q6_K:
`QuantMatmul.gguf`): against a float64 reference on the weights the `gguf` package's own
dequantization gives (each result the exact sum rounded once to bfloat16, up to float32's error
in the sum), its dequantization equal to gguf's to the bit, the same numbers for a row whatever
the number of rows (batch invariant, with either setting), in every build this host can run
(tests/kernels/variants.py), and as the `GGUFWeight` of a fused projection whose parts are of
different types (a Q4_K_M file's q/k Q4_K and v Q6_K)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from servelm.kernels.build import compiler
from servelm.kernels.quant_matmul import GGUF_KERNEL_TYPES, QuantMatmul
from servelm.model.layers.linear import GGUFWeight
from tests.gguf_kquants import Q, quantize_k, random_blocks
from tests.kernels.variants import flags

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler on this machine")

TYPES = [Q(t) for t in GGUF_KERNEL_TYPES]


@pytest.fixture(scope="module")
def kernel(variant) -> QuantMatmul:
    loaded = QuantMatmul.load(extra_flags=flags(variant))
    assert loaded is not None, f"quant_matmul.c does not build as {variant}"
    return loaded


def weights(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    """The float32 weight [rows, K] gguf's dequantization gives for `raw` [rows, row bytes]."""
    return torch.from_numpy(dequantize(raw, qtype).reshape(raw.shape[0], -1).copy())


def check_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y (bfloat16) is x w^T rounded once to bfloat16, up to float32's error in the sum."""
    ref = x.double() @ w.double().T
    size = x.double().abs() @ w.double().abs().T
    bound = ref.abs() * 2.0**-8 + size * w.shape[1] * 2.0**-24
    error = (y.double() - ref).abs()
    assert (error <= bound).all(), (error - bound).max()
    assert (y.double() - ref).abs().mean() < ref.abs().mean() * 2e-3  # not just within a bound


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_against_float64(kernel, qtype):
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, 48, 512, rng)
    w = weights(raw, qtype)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1)).bfloat16()
    y = kernel.gguf(x, torch.from_numpy(raw), int(qtype), 48)
    assert y.dtype == torch.bfloat16 and y.shape == (5, 48)
    check_close(y, x, w)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_is_ggufs_to_the_bit(kernel, qtype):
    rng = np.random.default_rng(7)
    for raw in (
        random_blocks(qtype, 16, 768, rng),
        quantize_k(rng.standard_normal((16, 768)).astype(np.float32), qtype),
    ):
        got = kernel.gguf_dequantize(torch.from_numpy(raw), int(qtype))
        assert torch.equal(got, weights(raw, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("invariant", [True, False])
def test_rows_alike_whatever_their_number(kernel, qtype, invariant):
    rng = np.random.default_rng(3)
    raw = torch.from_numpy(random_blocks(qtype, 32, 256, rng))
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    kernel.batch_invariant(invariant)
    try:
        alone = torch.cat([kernel.gguf(x[i : i + 1], raw, int(qtype), 32) for i in range(17)])
        for rows in (2, 5, 16, 17):
            assert torch.equal(kernel.gguf(x[:rows], raw, int(qtype), 32), alone[:rows]), rows
    finally:
        kernel.batch_invariant(True)


# Shapes the SIMD paths split unevenly: N not a multiple of the rows a pass takes at once (4 or
# 2 decoding, 8 or 4 in a prompt's tiles), K of one block or an odd number of them (Q8_0: 32),
# and row counts on both sides of the fused (decode) / tiled (prompt) cut (4 with AVX-512 BF16,
# 1 with AVX2).
SHAPES = [(1, 1), (3, 3), (13, 1), (37, 4)]  # (N, blocks along K)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n, blocks", SHAPES, ids=lambda v: str(v))
def test_uneven_shapes_any_rows(kernel, qtype, n, blocks):
    rng = np.random.default_rng(11)
    K = blocks * (32 if qtype == Q.Q8_0 else 256)
    raw = random_blocks(qtype, n, K, rng)
    w = weights(raw, qtype)
    blk = torch.from_numpy(raw)
    x = torch.randn(19, K, generator=torch.Generator().manual_seed(n)).bfloat16()
    alone = torch.cat([kernel.gguf(x[i : i + 1], blk, int(qtype), n) for i in range(19)])
    check_close(alone, x, w)
    logits = torch.cat(
        [kernel.gguf(x[i : i + 1], blk, int(qtype), n, torch.float32) for i in range(19)]
    )
    ref = x.double() @ w.double().T  # float32 out: the float32 sum, not rounded to bfloat16
    size = x.double().abs() @ w.double().abs().T
    assert ((logits.double() - ref).abs() <= size * K * 2.0**-24).all()
    for rows in (2, 3, 4, 5, 9, 19):
        assert torch.equal(kernel.gguf(x[:rows], blk, int(qtype), n), alone[:rows]), rows
        got = kernel.gguf(x[:rows], blk, int(qtype), n, torch.float32)
        assert torch.equal(got, logits[:rows]), rows


def test_shape_mismatch_is_an_error(kernel):
    raw = torch.from_numpy(random_blocks(Q.Q4_K, 16, 512, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="Q4_K"):
        kernel.gguf(torch.zeros(1, 256, dtype=torch.bfloat16), raw, int(Q.Q4_K), 16)
    with pytest.raises(ValueError, match="whole Q6_K blocks"):
        kernel.gguf(torch.zeros(1, 256, dtype=torch.bfloat16), raw, int(Q.Q6_K), 16)


def test_fused_projection_of_mixed_types(kernel):
    """A qkv projection of a Q4_K_M file: q and k Q4_K, v Q6_K (its blocks) and, for the q8
    path, an o-like Q8_0 part in the head kernel's layout."""
    rng = np.random.default_rng(5)
    K = 512
    q_raw = quantize_k(rng.standard_normal((64, K)).astype(np.float32), Q.Q4_K)
    k_raw = quantize_k(rng.standard_normal((32, K)).astype(np.float32), Q.Q4_K)
    v_raw = quantize_k(rng.standard_normal((32, K)).astype(np.float32), Q.Q6_K)
    e_raw = quantize_k(rng.standard_normal((16, K)).astype(np.float32), Q.Q8_0)
    e_w = weights(e_raw, Q.Q8_0)
    packed, error = kernel.quantize_q8(e_w)
    assert error == 0
    parts = [
        (0, 64, "gguf", (int(Q.Q4_K), torch.from_numpy(q_raw))),
        (64, 32, "gguf", (int(Q.Q4_K), torch.from_numpy(k_raw))),
        (96, 32, "gguf", (int(Q.Q6_K), torch.from_numpy(v_raw))),
        (128, 16, "q8", packed),
    ]
    weight = GGUFWeight(parts, kernel)
    assert weight.kinds() == ["Q4_K", "Q4_K", "Q6_K", "Q8_0"]
    assert [kind for _, _, kind, _ in weight.parts] == ["gguf", "gguf", "q8"]  # q, k: one call
    assert weight.nbytes == q_raw.nbytes + k_raw.nbytes + v_raw.nbytes + packed.nbytes
    w = torch.cat([weights(q_raw, Q.Q4_K), weights(k_raw, Q.Q4_K), weights(v_raw, Q.Q6_K), e_w])
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(4)).bfloat16()
    y = weight(x)
    assert y.shape == (3, 144) and y.dtype == torch.bfloat16
    check_close(y[:, :128], x, w[:128])
    # the q8 part: x may be taken as int16 (AVX2 builds), exact but for the smallest x
    ref = x.double() @ w[128:].double().T
    assert ((y[:, 128:].double() - ref).abs() <= ref.abs() * 2.0**-7 + 1e-2).all()
