"""The C quantized matmuls give x W^T for 4-bit (Q4_1) and 8-bit (Q8_0) weights: against a
float64 reference (each result is the exact sum rounded once to bfloat16, or for q8, the logits,
kept in float32, up to float32's error in the sum), batch invariant (the default) and by row
count (`--no-batch-invariant`), in every build this host can run (AMX tiles, AVX-512 with and without BF16, AVX2,
plain C: tests/kernels/variants.py), and as the `Int4Weight` / `Q8Weight` the model uses. On AMX
tiles, q4 multiplies by the bfloat16 weight the loader makes from the same file (each weight
rounded once from float32), which the reference then uses."""

from __future__ import annotations

import pytest
import torch

from servelm.kernels import variants
from servelm.kernels.build import compiler
from servelm.kernels.cpu_ops import CpuOps
from servelm.kernels.paths import (
    ALL_ROWS,
    AMX_MIN_ROWS,
    C_INT4_VECTOR_MAX_ROWS,
    HEAD_Q8_MAX_ROWS,
    TORCH_INT4_MAX_ROWS,
    cpu_has_bf16_matmul,
)
from servelm.kernels.quant_matmul import ACTIVATIONS, QuantMatmul
from servelm.model.layers.linear import Int4Weight, Linear, LogitsHead, Q8Weight, _on_grid
from tests.kernels.variants import (
    INTEGER_PATHS,
    INTEGERS,
    TILES,
    flags,
    native,
    params,
)

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler on this machine")


@pytest.fixture(scope="module")
def kernel(variant) -> QuantMatmul:
    """The kernel as built for `variant`: each test that takes it runs on every build."""
    loaded = QuantMatmul.load(extra_flags=flags(variant))
    assert loaded is not None, f"quant_matmul.c does not build as {variant}"
    return loaded


@pytest.fixture(scope="module")
def plain_c() -> QuantMatmul:
    """The plain C build, the one every other build is compared with."""
    loaded = QuantMatmul.load(extra_flags=flags("c"))
    assert loaded is not None
    return loaded


# the tests of x taken in integers, in the builds that have that path; the head (q8) takes it
# only in the builds that take it by default (with AVX-512 BF16 its own path is faster)
in_integers = pytest.mark.parametrize("variant", params(INTEGER_PATHS), indirect=True)
head_in_integers = pytest.mark.parametrize("variant", params(INTEGERS), indirect=True)


@pytest.fixture
def by_row_count(kernel):
    """The kernel picking its paths by row count (not batch invariant) for one test: a setting
    of the whole process, put back after."""
    kernel.batch_invariant(False)
    yield kernel
    kernel.batch_invariant(True)


def q4_weight(rows: int, cols: int, seed: int = 0, magnitude: float = 1.0):
    """A weight on a Q4_1 grid: quants, float16 scales and lows, and the float64 weight."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols), generator=g)
    q.view(rows, -1, 32)[..., :2] = torch.tensor([0, 15])  # as a Q4_1 quantizer's groups span
    scale = ((torch.rand(rows, cols // 32, generator=g) * 0.02 + 1e-3) * magnitude).half()
    low = (-torch.rand(rows, cols // 32, generator=g) * 0.15 * magnitude).half()
    w = q.double().view(rows, -1, 32) * scale.double()[..., None] + low.double()[..., None]
    return q, scale.float(), low.float(), w.view(rows, cols)


def assert_rounded_once(got: torch.Tensor, want: torch.Tensor) -> None:
    # One bfloat16 rounding is at most half a step, 2^-8 relative; float32 sums add ~1e-6.
    assert got.dtype == torch.bfloat16
    err = (got.double() - want).abs()
    floor = 1e-4 * want.abs().max().item()  # float32's error in the sum, for results near 0
    assert (err <= want.abs() * 2.0**-8 + floor).all(), err.max().item()


def assert_summed_in_float32(got: torch.Tensor, want: torch.Tensor, rel: float = 2.0**-16) -> None:
    # q8 (the logits) is not rounded to bfloat16: float32's error in the sum alone
    assert got.dtype == torch.float32
    err = (got.double() - want).abs()
    floor = 1e-4 * want.abs().max().item()
    assert (err <= want.abs() * rel + floor).all(), err.max().item()


def on_tiles(kernel: QuantMatmul, batch: int) -> bool:
    return 0 < kernel.tile_min_rows <= batch


def loaded_bf16(w: torch.Tensor) -> torch.Tensor:
    """The bfloat16 weight the loader makes: the file's float32 values, rounded once."""
    return w.float().bfloat16().double()


# AMX: from 1 row (by row count, 6), in tiles of 16 rows; 32 columns a pass (48: one block of
# 16 left over); 1,108 rows of K = 576 and 400 of K = 1,536 take two passes over W (1 MiB of x
# each).
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 6, 8, 9, 16, 17, 35, 108])
@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (960, 576), (576, 1536)])
def test_matches_the_exact_product(kernel, batch, shape):
    rows, cols = shape
    q, scale, low, w = q4_weight(rows, cols, seed=batch)
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(7)).bfloat16()
    got = kernel.q4(x, QuantMatmul.pack_q4(q, scale, low), rows)
    assert got.shape == (batch, rows)
    assert_rounded_once(got, x.double() @ (loaded_bf16(w) if on_tiles(kernel, batch) else w).T)


@pytest.mark.parametrize(("batch", "shape"), [(1108, (960, 576)), (400, (576, 1536))])
def test_prompt_sized_inputs_in_more_than_one_pass(kernel, batch, shape):
    rows, cols = shape
    q, scale, low, w = q4_weight(rows, cols, seed=batch)
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(9)).bfloat16()
    got = kernel.q4(x, QuantMatmul.pack_q4(q, scale, low), rows)
    assert_rounded_once(got, x.double() @ (loaded_bf16(w) if on_tiles(kernel, batch) else w).T)


@pytest.fixture
def activations(kernel):
    """Sets how q4 takes x for one test (a setting of the whole process), then the default."""
    yield kernel.use_activations
    kernel.use_activations("auto")


def test_without_tiles_many_rows_go_to_a_float32_matmul(kernel, by_row_count, activations):
    if kernel.tile_min_rows:  # the tiles serve them
        assert kernel.sgemm_min_rows == 0
        return
    activations("float32")  # (with x in integers, the C code serves every row)
    q, scale, low, w = q4_weight(576, 1536, seed=3)
    packed = QuantMatmul.pack_q4(q, scale, low)
    # q * scale is exact in float32 and + low rounds once: the float64 weight rounded once
    assert torch.equal(kernel.dequantize_q4(packed, 576), w.float())
    for rows in (kernel.sgemm_min_rows - 1, kernel.sgemm_min_rows):  # C, then torch
        x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows)).bfloat16()
        assert_rounded_once(kernel.q4(x, packed, 576), x.double() @ w.T)


def quantized_x(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, K] as q4's integer path takes it, per group of 32: integers a and a scale d with
    x ~ a * d, in the same float32 steps as the C code (see there)."""
    B, K = x.shape
    groups = x.float().view(B, K // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    if bits == 16:  # d = 2^(E - 14) for 2^E <= amax < 2^(E + 1): a power of two
        exponent = torch.frexp(amax).exponent - 1
        d = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), exponent - 14), 1.0)
        a = (groups / d).round()
    else:  # GGUF's Q8_0
        # (tensor / tensor: 127 / amax would multiply by a rounded reciprocal)
        inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, 0.0)
        a, d = (groups * inv).round(), amax / 127
    return a, d


def integer_reference(x, q, scale, low, bits) -> torch.Tensor:
    """y = sum_g scale * d * sum_j q_j a_j + low * sum_j x_j, exactly (float64); q8 has no
    low (None)."""
    a, d = quantized_x(x, bits)
    B, K = x.shape
    dots = torch.einsum("bgj,ngj->bng", a.double(), q.double().view(-1, K // 32, 32))
    y = (dots * scale.double() * d.double().view(B, 1, -1)).sum(-1)
    if low is None:
        return y
    return y + x.double().view(B, K // 32, 32).sum(-1) @ low.double().T


def test_the_builds_with_an_avx2_q4_path_take_x_in_integers(kernel, variant):
    # int16 by default there, where it is faster than x as it is; the others keep x as it is
    assert kernel.activation_bits == (16 if variant in INTEGERS else 0)


def test_integers_are_taken_where_asked_and_auto_is_the_builds_choice(kernel, variant, activations):
    """AVX-512 BF16 takes x in integers only when asked (int8 is twice its bfloat16 rate);
    the AMX tiles, and builds without AVX2, never do."""
    for kind, bits in [("int8", 8), ("int16", 16), ("float32", 0)]:
        activations(kind)
        assert kernel.activation_bits == (bits if variant in INTEGER_PATHS else 0), kind
    activations("auto")
    assert kernel.activation_bits == (16 if variant in INTEGERS else 0)


@in_integers
@pytest.mark.parametrize("kind", ["int16", "int8"])
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 33, 300])
@pytest.mark.parametrize("shape", [(48, 96), (960, 576), (576, 1536)])
def test_x_in_integers_gives_their_exact_products(kernel, activations, kind, batch, shape):
    """Every tile shape (1-4 rows with AVX2, 1-12 in AVX-512's wide tiles; 33 ends in a tile of
    1 or 9; 300 rows take more than one chunk of x), against the exact sums of the same
    integers, rounded once; int16 against the exact product too. (Batch invariant, one row
    takes integers too; by row count it stays in float32, as the test below checks.)"""
    activations(kind)
    rows, cols = shape
    q, scale, low, w = q4_weight(rows, cols, seed=batch)
    x = (torch.randn(batch, cols, generator=torch.Generator().manual_seed(5)) * 4).bfloat16()
    got = kernel.q4(x, QuantMatmul.pack_q4(q, scale, low), rows)
    assert_rounded_once(got, integer_reference(x, q, scale, low, ACTIVATIONS[kind]))
    exact = x.double() @ w.T
    if kind == "int16":
        assert_rounded_once(got, exact)
    else:  # each x off by up to half a step of 1/127 of its group's largest
        assert (got.double() - exact).norm() / exact.norm() < 0.02


@in_integers
def test_one_row_stays_in_float32(kernel, by_row_count, activations):
    """By row count, a decode step of one request reads the weights once, and the float32 path,
    which unpacks each group straight into its FMAs, is as fast there: even with int8 chosen,
    one row's product is exact (int8's would be about 0.7 % off)."""
    activations("int8")
    q, scale, low, w = q4_weight(960, 576, seed=1)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(5)).bfloat16()
    assert_rounded_once(kernel.q4(x, QuantMatmul.pack_q4(q, scale, low), 960), x.double() @ w.T)


@in_integers
@pytest.mark.parametrize("kind", ["int16", "int8"])
@pytest.mark.parametrize("sign", [1, -1])
def test_the_largest_sums_do_not_overflow(kernel, activations, kind, sign):
    """Every quant 15 and every x its group's largest: int8's 16-bit lanes reach 16 * 15 * 127
    = 30,480 (of 32,767), int16's x its largest integer, 32,640 (255 / 128 * 2^14)."""
    activations(kind)
    q = torch.full((32, 128), 15)
    scale, low = torch.full((32, 4), 0.25), torch.zeros(32, 4)
    x = torch.full((2, 128), sign * 255 / 128, dtype=torch.bfloat16)
    got = kernel.q4(x, QuantMatmul.pack_q4(q, scale, low), 32)
    exact = sign * 128 * 15 * 0.25 * 255 / 128  # 956.25, rounded once: 956
    assert torch.equal(got, torch.full((2, 32), exact).bfloat16())


def integer_path_results(kernel: QuantMatmul, head: bool = True) -> list[torch.Tensor]:
    """q4 with x as int16 and as int8, and q8 (`head`), at every tile shape of both widths'
    tiles and in more than one chunk of x, on the default model's shapes."""
    out = []
    g = torch.Generator().manual_seed(12)
    batches = [1, 2, 3, 4, 5, 8, 11, 12, 13, 25, 256]
    for kind in ("int16", "int8"):
        kernel.use_activations(kind)
        for rows, cols in [(48, 96), (960, 576), (576, 1536)]:
            q, scale, low, _ = q4_weight(rows, cols, seed=rows)
            packed = QuantMatmul.pack_q4(q, scale, low)
            for batch in batches:  # magnitudes 2^-10 .. 2^4, as the model's activations spread
                x = torch.randn(batch, cols, generator=g) * 2.0 ** torch.randint(
                    -10, 5, (1,), generator=g
                )
                out.append(kernel.q4(x.bfloat16(), packed, rows))
    kernel.use_activations("int16")
    q, scale, _ = q8_weight(4096, 576, seed=4)
    packed = QuantMatmul.pack_q8(q, scale)
    for batch in batches if head else []:
        out.append(kernel.q8(torch.randn(batch, 576, generator=g).bfloat16(), packed, 4096))
    kernel.use_activations("auto")
    return out


def assert_same_bits(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    differ = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if not torch.equal(a, b)]
    assert differ == [], f"{len(differ)} of {len(want)} products differ"


@pytest.fixture(scope="module")
def avx2() -> QuantMatmul:
    """The AVX2 build: the integer path every other build's must match bit for bit."""
    if variants.unavailable(variants.get("avx2")) is not None:
        pytest.skip("this host cannot run the avx2 build")
    loaded = QuantMatmul.load(extra_flags=flags("avx2"))
    assert loaded is not None
    return loaded


@pytest.mark.parametrize("variant", params(INTEGER_PATHS - {"avx2"}), indirect=True)
def test_avx512s_wide_integer_tiles_give_the_avx2_builds_bits(kernel, variant, avx2, activations):
    """AVX-512 (here with AVX512-VNNI's vpdpwssd and vpdpbusd) sums the same integers in 512-bit
    tiles of up to 12 rows and combines them in the same float32 steps: the same bits as the
    AVX2 build, so greedy output does not change between these CPUs (with AVX-512 BF16 too,
    where x is taken in integers when asked)."""
    head = variant in INTEGERS
    assert_same_bits(integer_path_results(kernel, head), integer_path_results(avx2, head))


def other_integer_builds() -> list:
    """Builds of the integer path's other instruction choices, which no variant makes: AVX-512
    BW without VNNI (Skylake-X: vpmaddwd and vpmaddubsw in 512 bits) and AVX2 with AVX-VNNI
    (Alder Lake: 256-bit vpdpwssd)."""
    builds = {
        "avx512bw-novnni": (flags("avx512-nobf16") + ("-mno-avx512vnni",), "avx512bw", None),
        "avx2-avxvnni": (
            tuple(f for f in flags("avx2") if f != "-mno-avxvnni"),
            "avx_vnni",
            "__AVXVNNI__",
        ),
    }
    out = []
    for name, (extra, cpu_flag, macro) in builds.items():
        reason = None
        if cpu_flag not in variants.cpu_flags():
            reason = f"this CPU lacks {cpu_flag}"
        elif macro and macro not in variants.macros(extra):
            reason = f"the C compiler does not define {macro} here"
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        out.append(pytest.param(extra, id=name, marks=marks))
    return out


@pytest.mark.slow  # two more builds of the kernel, about a minute each
@pytest.mark.parametrize("extra", other_integer_builds())
def test_other_integer_instructions_give_the_avx2_builds_bits(extra, avx2):
    other = QuantMatmul.load(extra_flags=extra)
    assert other is not None
    assert_same_bits(integer_path_results(other), integer_path_results(avx2))


def test_activations_are_one_of_three(kernel):
    with pytest.raises(ValueError, match="int4"):
        kernel.use_activations("int4")


@pytest.mark.parametrize("variant", params(TILES), indirect=True)
def test_tiles_multiply_by_exactly_the_loaded_bf16_weight(kernel):
    q, scale, low, w = q4_weight(48, 96, seed=2)
    # one-hot rows pick out single weights: each output is one product, w * 1, exact
    cols = torch.tensor([0, 1, 2, 31, 32, 33, 50, 63, 64, 90, 94, 95, 7, 40, 77, 18, 66])
    x = torch.zeros(len(cols), 96, dtype=torch.bfloat16)
    x[torch.arange(len(cols)), cols] = 1
    got = kernel.q4(x, QuantMatmul.pack_q4(q, scale, low), 48)
    assert torch.equal(got, w.float().bfloat16()[:, cols].T)


@pytest.mark.parametrize("variant", params(TILES), indirect=True)
@pytest.mark.parametrize("shape", [(48, 1536), (80, 576)])  # a block left over; 48 groups
def test_tiles_give_decode_rows_the_bits_of_prompt_rows(kernel, shape):
    """The tile path's forms for few rows (up to 16: x read where it lies; up to 32: W tiles in
    a ring of a few groups, with 48 groups here) and for many (x copied, every group's W tile
    kept) give each row the same bits, and all of them the exact product rounded once."""
    rows, cols = shape
    q, scale, low, w = q4_weight(rows, cols, seed=5)
    packed = QuantMatmul.pack_q4(q, scale, low)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(11)).bfloat16()
    many = kernel.q4(x, packed, rows)
    assert_rounded_once(many, x.double() @ loaded_bf16(w).T)
    for batch in (1, 3, 16, 17, 32):
        assert torch.equal(kernel.q4(x[:batch], packed, rows), many[:batch]), batch


@pytest.mark.parametrize("batch", [1, 3, 16, 17, 33, 108])
@pytest.mark.parametrize(("inter", "cols"), [(1536, 576), (48, 96), (16, 32)])
def test_gate_up_with_silu_in_the_tile_stores_gives_the_two_kernels_bits(
    kernel, variant, batch, inter, cols
):
    """q4_silu (the gate/up projection with silu_and_mul in its stores, on whichever path q4
    takes: the tiles, integer x or the vector passes) gives what q4 and then silu_and_mul give,
    bit for bit, at decode and prompt row counts, an odd number of blocks a half included, with
    x as the build takes it and, where it can, in int8; the plain C build declines it (None)."""
    ops = CpuOps.load(flags(variant))
    q, scale, low, _ = q4_weight(2 * inter, cols, seed=7)
    packed = QuantMatmul.pack_q4(q, scale, low)
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(3)).bfloat16()
    fused = kernel.q4_silu(x, packed, 2 * inter)
    if variant == "c":
        assert fused is None
        return
    assert fused is not None and fused.shape == (batch, inter)
    assert torch.equal(fused, ops.silu_and_mul(kernel.q4(x, packed, 2 * inter)))
    if variant in INTEGER_PATHS:
        kernel.use_activations("int8")
        try:
            fused = kernel.q4_silu(x, packed, 2 * inter)
            assert torch.equal(fused, ops.silu_and_mul(kernel.q4(x, packed, 2 * inter)))
        finally:
            kernel.use_activations("auto")


@pytest.mark.parametrize("batch", [1, 4, 9])
@pytest.mark.parametrize("magnitude", [1.0, 1e-3])  # 1e-3: scales below float16's normal range
def test_every_build_computes_what_plain_c_does(kernel, plain_c, batch, magnitude):
    q, scale, low, w = q4_weight(64, 160, seed=3, magnitude=magnitude)
    x = torch.randn(batch, 160, generator=torch.Generator().manual_seed(8)).bfloat16()
    packed = QuantMatmul.pack_q4(q, scale, low)
    got = plain_c.q4(x, packed, 64)
    assert_rounded_once(got, x.double() @ w.T)
    if on_tiles(kernel, batch):  # this build's path multiplies by the loaded bf16 weight
        assert_rounded_once(kernel.q4(x, packed, 64), x.double() @ loaded_bf16(w).T)
    else:  # the two paths differ at most in the order of float32 sums: one rounding apart
        torch.testing.assert_close(got, kernel.q4(x, packed, 64), rtol=2**-7, atol=1e-4)


def test_int4_weight_holds_a_q4_1_grid_exactly_and_agrees_with_torchs_kernel(kernel):
    q, scale, low, w = q4_weight(96, 192, seed=11)
    ours = Int4Weight(w.float(), torch.bfloat16, kernel)
    assert ours.kernel is kernel and ours.error < 1e-3
    theirs = Int4Weight(w.float(), torch.bfloat16)  # torch's kernel, bf16 scales
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert_rounded_once(ours(x), x.double() @ (loaded_bf16(w) if on_tiles(kernel, 3) else w).T)
    # torch's rounds its scales to bfloat16, so it is the less exact of the two
    torch.testing.assert_close(ours(x), theirs(x), rtol=0.02, atol=0.02)
    assert ours.nbytes == theirs.nbytes == 96 * 192 // 2 + 96 * (192 // 32) * 2 * 2


def test_scales_beyond_float16_fall_back_to_torchs_kernel(kernel):
    w = torch.randn(16, 32) * 1e6  # steps of ~1e5 are fine, lows of -2e6 are not float16
    weight = Int4Weight(w, torch.bfloat16, kernel)
    assert weight.kernel is None
    assert weight.max_rows == TORCH_INT4_MAX_ROWS  # torch's kernel: its own cut


def int4_layer(kernel: QuantMatmul, w: torch.Tensor) -> Linear:
    layer = Linear(64, 32, bias=False)
    layer.weight = torch.nn.Parameter(torch.zeros(32, 64, dtype=torch.bfloat16), False)
    layer.use_int4(Int4Weight(w.float(), torch.bfloat16, kernel))  # differs from the zero weight
    return layer


def test_a_batch_invariant_linear_reads_the_int4_copy_for_every_input(kernel):
    q, scale, low, w = q4_weight(32, 64, seed=5)
    layer = int4_layer(kernel, w)
    assert layer.int4.max_rows == ALL_ROWS and layer.weight.numel() == 0  # bf16 copy freed
    for rows in (1, 17, 300):  # on tiles the bf16 weight, else the exact product
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).bfloat16()
        want = x.double() @ (loaded_bf16(w) if on_tiles(kernel, rows) else w.double()).T
        assert_rounded_once(layer(x), want)


def test_by_row_count_a_linear_reads_the_int4_copy_up_to_its_cut(kernel, by_row_count):
    q, scale, low, w = q4_weight(32, 64, seed=5)
    layer = int4_layer(kernel, w)
    if kernel.tile_min_rows:  # tiles serve every input: the bf16 copy is freed
        assert layer.int4.max_rows == ALL_ROWS and layer.weight.numel() == 0
        tiles = kernel.tile_min_rows  # from here the bf16 weight, below it the exact product
        for rows in (1, tiles - 1, tiles, 300):
            x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).bfloat16()
            want = x.double() @ (loaded_bf16(w) if rows >= tiles else w.double()).T
            assert_rounded_once(layer(x), want)
        return
    if not cpu_has_bf16_matmul():  # torch's bf16 matmul is slow here: C serves every input
        assert layer.int4.max_rows == ALL_ROWS and layer.weight.numel() == 0
        return
    cut = C_INT4_VECTOR_MAX_ROWS
    assert layer.int4.max_rows == cut > TORCH_INT4_MAX_ROWS and layer.weight.numel() == 32 * 64
    for rows in (1, cut, cut + 1):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).bfloat16()
        assert layer(x).any() == (rows <= cut)


def test_refuses_inputs_that_do_not_fit_the_packed_weight(kernel):
    q, scale, low, _ = q4_weight(32, 64)
    packed = QuantMatmul.pack_q4(q, scale, low)
    with pytest.raises(ValueError, match="does not fit"):
        kernel.q4(torch.zeros(1, 96, dtype=torch.bfloat16), packed, 32)  # another K
    with pytest.raises(ValueError, match="does not fit"):
        kernel.q4(torch.zeros(1, 64, dtype=torch.bfloat16), packed, 48)  # another N
    with pytest.raises(ValueError, match="does not fit"):
        kernel.q4(torch.zeros(1, 64), packed, 32)  # float32 x
    assert QuantMatmul.takes(48, 96) and not QuantMatmul.takes(40, 96)
    assert not QuantMatmul.takes(48, 80)


def q8_weight(rows: int, cols: int, seed: int = 0):
    """A weight on a Q8_0 grid (each group's largest |q| is 127, as the quantizer makes it)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows, cols), generator=g)
    q.view(rows, -1, 32)[..., 0] = 127
    scale = (torch.rand(rows, cols // 32, generator=g) * 0.01 + 1e-4).half().float()
    return q, scale, (q.double().view(rows, -1, 32) * scale.double()[..., None]).view(rows, cols)


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 11, 16, 19])
@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (4096, 576)])
def test_q8_matches_the_exact_product(kernel, batch, shape):
    rows, cols = shape
    q, scale, w = q8_weight(rows, cols, seed=batch)
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(5)).bfloat16()
    got = kernel.q8(x, QuantMatmul.pack_q8(q, scale), rows)
    assert got.shape == (batch, rows)
    assert_summed_in_float32(got, x.double() @ w.T)


@head_in_integers
@pytest.mark.parametrize("kind", ["int16", "int8"])
@pytest.mark.parametrize("batch", [2, 3, 5, 16, 33, 300])
@pytest.mark.parametrize("shape", [(48, 96), (4096, 576)])
def test_q8_takes_x_as_int16_whichever_width_q4_takes(kernel, activations, kind, batch, shape):
    """The logits head from 2 rows: the exact sums of x quantized to int16 (int8 would cost the
    logits 0.7 %), rounded once; every tile shape, and two chunks of x at 300 rows."""
    activations(kind)
    rows, cols = shape
    q, scale, w = q8_weight(rows, cols, seed=batch)
    x = (torch.randn(batch, cols, generator=torch.Generator().manual_seed(5)) * 4).bfloat16()
    got = kernel.q8(x, QuantMatmul.pack_q8(q, scale), rows)
    assert_summed_in_float32(got, integer_reference(x, q, scale, None, 16))
    assert_summed_in_float32(got, x.double() @ w.T, rel=2.0**-8)  # x's int16 rounding too


@in_integers
def test_q8_in_float32_keeps_what_int16_rounds_away(kernel, variant, activations):
    """x of 2^-12 in a group whose largest is 2^4 is a quarter of int16's step (2^(4 - 14)):
    with x in integers it rounds to 0; with activations float32 the head multiplies x as it is."""
    q = torch.zeros(16, 32, dtype=torch.long)
    q[:, 1:] = 100  # every input but the large first one
    scale = torch.full((16, 1), 0.5)
    x = torch.full((2, 32), 2.0**-12).bfloat16()
    x[:, 0] = 16.0
    packed = QuantMatmul.pack_q8(q, scale)
    as_it_is = torch.full((2, 16), 31 * 50 * 2.0**-12)
    for kind in ("int16", "int8"):  # (with AVX-512 BF16 the head keeps x as it is)
        activations(kind)
        got = kernel.q8(x, packed, 16)
        assert torch.equal(got, as_it_is) if variant not in INTEGERS else not got.any(), kind
    activations("float32")
    assert torch.equal(kernel.q8(x, packed, 16), as_it_is)


@in_integers
@pytest.mark.parametrize("sign", [1, -1])
def test_q8_largest_sums_do_not_overflow(kernel, sign):
    """Every quant 127 and every x its group's largest integer (32,640): a lane sums 32
    products of 4.1 M, 133 M of int32's 2,147 M."""
    q, scale = torch.full((16, 128), 127), torch.full((16, 4), 0.25)
    x = torch.full((2, 128), sign * 255 / 128, dtype=torch.bfloat16)
    got = kernel.q8(x, QuantMatmul.pack_q8(q, scale), 16)
    exact = sign * 128 * 127 * 0.25 * 255 / 128  # 8,096.25, exact in float32
    assert torch.equal(got, torch.full((2, 16), exact))


@pytest.mark.parametrize("batch", [1, 3])
def test_q8_every_build_computes_what_plain_c_does(kernel, plain_c, batch):
    q, scale, w = q8_weight(32, 128, seed=2)
    x = torch.randn(batch, 128, generator=torch.Generator().manual_seed(6)).bfloat16()
    packed = QuantMatmul.pack_q8(q, scale)
    got = plain_c.q8(x, packed, 32)
    assert_summed_in_float32(got, x.double() @ w.T)
    torch.testing.assert_close(got, kernel.q8(x, packed, 32), rtol=2**-7, atol=1e-4)


def test_q8_weight_is_made_only_from_weights_on_the_grid(kernel):
    q, scale, w = q8_weight(32, 64, seed=4)
    exact = Q8Weight.exact(w.float(), kernel)
    assert exact is not None
    assert torch.equal(exact.packed, QuantMatmul.pack_q8(q, scale))  # the same q and scales
    off_grid = w.float() + 1e-3 * torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    assert Q8Weight.exact(off_grid, kernel) is None
    assert Q8Weight.exact(w.float()[:24], kernel) is None  # 24 rows: not whole blocks of 16


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "by row count"])
def test_logits_head_reads_the_q8_copy_for_decode_sized_inputs(kernel, invariant):
    q, scale, w = q8_weight(64, 96, seed=9)
    kernel.batch_invariant(invariant)
    try:
        # a head whose bf16 weight differs from its Q8 copy shows which one a call read
        q8 = Q8Weight(QuantMatmul.pack_q8(q, scale), 64, kernel)
        head = LogitsHead(torch.zeros(64, 96, dtype=torch.bfloat16), q8, invariant)
        # batch invariant, or where oneDNN has no bf16 matmul, the Q8 copy serves every input
        cut = HEAD_Q8_MAX_ROWS if cpu_has_bf16_matmul() and not invariant else ALL_ROWS
        assert head.q8_max_rows == cut
        for rows in (1, HEAD_Q8_MAX_ROWS, HEAD_Q8_MAX_ROWS + 1, 40):
            x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
            got = head(x)
            assert got.dtype == torch.float32  # logits are not rounded to bfloat16
            if rows <= cut:
                assert_summed_in_float32(got, x.double() @ w.T, rel=2.0**-8)
            else:
                assert not got.any()
    finally:
        kernel.batch_invariant(True)


@pytest.mark.parametrize("variant", params(TILES), indirect=True)
def test_tile_registers_are_shared_with_torchs_amx_kernels(kernel):
    # torch's flash SDPA and oneDNN's bf16 matmul use the same AMX tile registers on this CPU:
    # each configures its tiles, and the C q4 path releases its own, so interleaving them must
    # leave every result as it was alone.
    import torch.nn.functional as F

    from servelm.model.layers.linear import _pack, packed_linear

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 300, 64, generator=g).bfloat16() for h in (9, 3, 3))
    w, x = torch.randn(3072, 576, generator=g).bfloat16(), torch.randn(200, 576, generator=g)
    packed_bf16, x = _pack(w), x.bfloat16()
    q4, scale, low, _ = q4_weight(3072, 576, seed=6)
    packed_q4 = QuantMatmul.pack_q4(q4, scale, low)
    rows = torch.randn(16, 576, generator=g).bfloat16()

    def attention():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    alone = attention(), packed_linear(x, packed_bf16), kernel.q4(rows, packed_q4, 3072)
    for _ in range(20):
        assert torch.equal(kernel.q4(rows, packed_q4, 3072), alone[2])
        assert torch.equal(attention(), alone[0])
        assert torch.equal(kernel.q4(rows[:7], packed_q4, 3072), alone[2][:7])
        assert torch.equal(packed_linear(x, packed_bf16), alone[1])


def test_it_says_whether_it_uses_tiles(kernel, variant):
    # batch invariant, every row on the tiles; by row count from the table's cut-off, where the
    # tile unit is faster in whole decode steps (kernels/paths.py)
    assert kernel.tile_min_rows == (1 if variant in TILES else 0)
    kernel.batch_invariant(False)
    try:
        assert kernel.tile_min_rows == (AMX_MIN_ROWS if variant in TILES else 0)
    finally:
        kernel.batch_invariant(True)


def test_the_engines_build_takes_this_cpus_path():
    kernel = QuantMatmul.load()
    assert kernel.tile_min_rows == (1 if native() in TILES else 0)
    assert kernel.activation_bits == (16 if native() in INTEGERS else 0)


# -- quantizing at load: the C quantizers against the same steps in torch ----------------------


def torch_q4(w: torch.Tensor):
    """The q4 layout of float32 `w` by torch operations: each group on 15 steps from its minimum,
    low and step rounded to float16 (None where they are not finite there), and the error."""
    rows, cols = w.shape
    groups = w.view(rows, -1, 32)
    low = groups.amin(-1, keepdim=True)
    low16 = low.half().float()
    step16 = ((groups.amax(-1, keepdim=True) - low) / 15).half().float()
    if not (low16.isfinite().all() and step16.isfinite().all()):
        return None
    q, error = _on_grid(groups, low16, step16)
    q = q.clamp_(0, 15).view(rows, cols)
    return QuantMatmul.pack_q4(q, step16.view(rows, -1), low16.view(rows, -1)), error


def torch_q8(w: torch.Tensor):
    """The q8 layout by torch operations: scales largest |w| / 127 in float16, and the error."""
    rows, cols = w.shape
    groups = w.view(rows, -1, 32)
    scale = (groups.abs().amax(-1, keepdim=True) / 127).half().float()
    if not scale.isfinite().all():
        return None
    q, error = _on_grid(groups, 0.0, scale)
    q = q.clamp_(-127, 127).view(rows, cols)
    return QuantMatmul.pack_q8(q, scale.view(rows, -1)), error


def quantizer_inputs() -> dict[str, torch.Tensor]:
    """Float32 weights [32, 256]: on the grids, off them, and groups whose scales are tiny
    (float16 subnormals), large, or zero (constant groups)."""
    g = torch.Generator().manual_seed(21)
    inputs = {
        "q4 grid": q4_weight(32, 256, seed=3)[3].float(),
        "q8 grid": q8_weight(32, 256, seed=3)[2].float(),
        "normal": torch.randn(32, 256, generator=g),
    }
    # each group scaled by its own power of two, 2^-30 .. 2^10
    powers = torch.randint(-30, 11, (32, 8, 1), generator=g).double().exp2().float()
    inputs["magnitudes"] = (torch.randn(32, 8, 32, generator=g) * powers).view(32, 256)
    constant = torch.randn(32, 8, 1, generator=g).expand(32, 8, 32).clone()
    constant[::3] = 0.0
    inputs["constant groups"] = constant.view(32, 256)
    return inputs


@pytest.mark.parametrize("name", list(quantizer_inputs()))
def test_quantizers_match_torchs_steps_bit_for_bit(kernel, name):
    w = quantizer_inputs()[name]
    for ours, theirs in (
        (kernel.quantize_q4(w), torch_q4(w)),
        (kernel.quantize_q8(w), torch_q8(w)),
    ):
        assert ours is not None and theirs is not None
        assert torch.equal(ours[0], theirs[0]), name
        assert ours[1] == theirs[1], name


def test_quantizers_refuse_what_float16_cannot_hold(kernel):
    big = torch.randn(16, 64) * 1e6  # q4 lows of -2e6 are not float16 (q8 scales of 2e4 are)
    assert kernel.quantize_q4(big) is None and torch_q4(big) is None
    assert kernel.quantize_q8(big) is not None and torch_q8(big) is not None
    huge = torch.randn(16, 64) * 1e8  # q8 scales of ~2e6
    assert kernel.quantize_q8(huge) is None and torch_q8(huge) is None
    nan = torch.randn(16, 64)
    nan[3, 40] = float("nan")
    assert kernel.quantize_q4(nan) is None and kernel.quantize_q8(nan) is None
    with pytest.raises(ValueError):
        kernel.quantize_q4(torch.randn(24, 64))  # 24 rows: not whole blocks of 16
