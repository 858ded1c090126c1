"""The fused C layers give what the torch ops they replace give.

bfloat16, the dtype they serve in: bit for bit, but for a float32 sum (norm) or e^x (SiLU)
computed in another order, which now and then rounds a result the other way. float32: to a few
ulps, since the compiler may fuse a multiply and an add that torch rounds separately. Each test
runs on every build this host can run (AVX-512 BF16, AVX2, plain C: tests/kernels/variants.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelm.kernels.build import compiler
from servelm.kernels.cpu_ops import CpuOps
from servelm.model.layers.norm import RMSNorm
from servelm.model.layers.rotary import RotaryEmbedding, apply_rotary
from tests.kernels.variants import flags

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler on this machine")
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def ops(variant) -> CpuOps:
    loaded = CpuOps.load(flags(variant))
    assert loaded is not None, f"cpu_ops.c does not build as {variant}"
    return loaded


def randn(*shape, dtype, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def assert_matches(got, want, rare_flips: bool = False):
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want)
    elif rare_flips:
        assert (got != want).float().mean().item() < 1e-3
        torch.testing.assert_close(got, want)  # and a flip is one rounding step
    else:
        assert torch.equal(got, want)


def reference_norm(norm: RMSNorm, x, delta):
    norm.cpu_ops = None
    return norm(x.clone(), delta)


# Widths: the default model's, one that is not a whole number of 16-lane vectors (AVX-512) and
# one that is not of 8-lane vectors either (AVX2): the bf16 ops' vector code takes whole
# vectors, their scalar loops the rest.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 16, 300])  # 300 x 576 takes the threaded path
@pytest.mark.parametrize("width", [576, 40, 36])
def test_add_rms_norm_matches_torch(ops, dtype, rows, width):
    norm = RMSNorm(width, 1e-5).to(dtype)
    norm.weight.data = randn(width, dtype=dtype, seed=1)
    x, delta = randn(rows, width, dtype=dtype, seed=2), randn(rows, width, dtype=dtype, seed=3)
    for d in (None, delta):
        want_out, want_x = reference_norm(norm, x, d)
        got_x = x.clone()
        got_out, returned_x = ops.add_rms_norm(got_x, d, norm.weight, norm.eps)
        assert returned_x is got_x  # the residual stream is updated in place
        assert_matches(got_x, want_x)
        assert_matches(got_out, want_out, rare_flips=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 16, 12])
def test_rotary_in_place_matches_torch(ops, dtype, D):
    T, hq, hkv = 37, 9, 3
    rope = RotaryEmbedding(D, 4096, 10000.0, None, dtype=dtype)
    cos_sin = rope.lookup(torch.randint(0, 4096, (T,), generator=torch.Generator().manual_seed(4)))
    qkv = randn(T, hq + 2 * hkv, D, dtype=dtype, seed=5)
    want = apply_rotary(qkv[:, : hq + hkv], cos_sin)
    v_before = qkv[:, hq + hkv :].clone()
    assert ops.rotary_(qkv[:, : hq + hkv], *cos_sin)  # a strided view into the fused output
    assert_matches(qkv[:, : hq + hkv], want)
    assert torch.equal(qkv[:, hq + hkv :], v_before)  # values are left alone


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 40, 36])
def test_silu_and_mul_matches_torch(ops, dtype, width):
    gate_up = randn(50, 2 * width, dtype=dtype, seed=6, scale=4.0)
    gate, up = gate_up.split(width, dim=-1)
    want = F.silu(gate) * up
    assert_matches(ops.silu_and_mul(gate_up), want, rare_flips=True)


def test_other_dtypes_and_layouts_are_declined(ops):
    half = torch.zeros(4, 64, dtype=torch.float16)
    assert ops.add_rms_norm(half, None, torch.ones(64, dtype=torch.float16), 1e-5) is None
    assert ops.silu_and_mul(torch.zeros(4, 64).t()) is None  # not contiguous
    cos = torch.zeros(4, 1, 64)
    assert not ops.rotary_(torch.zeros(4, 2, 64, dtype=torch.float16), cos, cos)


def test_shapes_that_disagree_are_declined(ops):
    x = torch.zeros(4, 64)
    assert ops.add_rms_norm(x, None, torch.ones(32), 1e-5) is None  # weight of another size
    assert ops.add_rms_norm(x, torch.zeros(2, 64), torch.ones(64), 1e-5) is None
    cos = torch.zeros(4, 1, 64)
    assert not ops.rotary_(torch.zeros(4, 2, 64), cos, cos[:2])


@pytest.mark.parametrize("width", [49152, 1000, 7, 1])
def test_argmax_picks_what_torchs_max_picks(ops, width):
    # The sampler's greedy pick: the first index of each row's largest value, ties, -0 against
    # +0, -inf rows and a NaN (which torch's max takes as the largest) included; widths that
    # are and are not a multiple of the vector lanes.
    x = randn(16, width, dtype=torch.float32, seed=width)
    x[1] = x[1].round()  # many ties
    x[2] = float("-inf")
    x[3, :] = -1.0
    x[3, width // 2] = 0.0
    x[3, width - 1] = -0.0
    x[4, width // 3] = float("nan")
    x[5, -1] = x[5].max() + 1  # the largest in the scalar tail
    x[6, 0] = x[6].max()  # a tie with the first element
    x[7] = 0.0
    got = ops.argmax(x)
    want = x.max(dim=-1).indices
    assert torch.equal(got, want), (got, want)
    assert torch.equal(ops.argmax(x[:1]), want[:1])  # one row: no threads


def test_argmax_declines_what_it_does_not_take(ops):
    x = randn(4, 64, dtype=torch.float32)
    assert ops.argmax(x.bfloat16()) is None
    assert ops.argmax(x.t()) is None  # not contiguous
    assert ops.argmax(x[0]) is None  # one dimension
