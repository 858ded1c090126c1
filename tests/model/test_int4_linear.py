"""4-bit copies of projection weights: exact for weights on a 4-bit grid, used for decode-sized
inputs only, and refused where they would lose precision the user did not ask to lose."""

import pytest
import torch
import torch.nn.functional as F

from servelm import LLM, SamplingParams
from servelm.kernels.paths import TORCH_INT4_MAX_ROWS as INT4_MAX_ROWS
from servelm.model.layers.linear import (
    INT4_GROUP,
    INT4_LOSSLESS_STEPS,
    Int4Weight,
    Linear,
    can_int4,
)

pytestmark = pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
    reason="this torch build has no CPU int4 kernel",
)


def grid_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """A weight laid out like a dequantized GGUF Q4_1 tensor: per 32 inputs, q * d + m with
    q in 0..15 (0 and 15 both used), d and m float16 numbers."""
    g = torch.Generator().manual_seed(seed)
    groups = cols // INT4_GROUP
    q = torch.randint(0, 16, (rows, groups, INT4_GROUP), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(rows, groups, 1, generator=g) * 0.01 + 1e-4).half().float()
    m = (torch.randn(rows, groups, 1, generator=g) * 0.05).half().float()
    return (q * d + m).view(rows, cols)


def test_a_weight_on_the_grid_is_recovered_exactly():
    weight = grid_weight(48, 96, seed=0)
    int4 = Int4Weight(weight, torch.bfloat16)
    assert int4.error <= INT4_LOSSLESS_STEPS
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    got = int4(x.bfloat16()).float()
    want = x @ weight.T
    # Only bf16 arithmetic separates the two (the activations, the scales and the sums).
    assert torch.allclose(got, want, rtol=0.02, atol=0.02 * want.abs().max().item())
    # And the 4-bit copy is a quarter of the bf16 weight, plus a scale and zero per group.
    assert int4.nbytes == 48 * 96 // 2 + 48 * (96 // INT4_GROUP) * 2 * 2


def test_an_ordinary_weight_is_measured_as_lossy():
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(2))
    assert 0.4 < Int4Weight(weight, torch.bfloat16).error <= 0.5


def test_constant_groups_do_not_divide_by_zero():
    weight = torch.full((16, 64), 0.25)
    int4 = Int4Weight(weight, torch.bfloat16)
    assert int4.error == 0
    out = int4(torch.ones(1, 64, dtype=torch.bfloat16))
    assert torch.allclose(out.float(), torch.full((1, 16), 16.0))


@pytest.mark.parametrize("bias", [False, True])
def test_decode_sized_inputs_read_the_int4_copy_and_larger_ones_the_bf16_weight(bias):
    # A lossy int4 copy differs from the bf16 weight, which shows which one a forward read.
    g = torch.Generator().manual_seed(3)
    layer = Linear(96, 48, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 96, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(48, generator=g))
    int4 = Int4Weight(layer.weight, torch.bfloat16)
    layer.to(torch.bfloat16)
    weight, b = layer.weight.detach().clone(), None if not bias else layer.bias.detach().clone()
    layer.int4 = int4
    layer.pack_for_cpu()
    with torch.inference_mode():
        for rows in (1, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 40):
            x = torch.randn(rows, 96, generator=g).bfloat16()
            from_int4 = int4(x) if b is None else int4(x) + b
            dense = F.linear(x, weight, b)
            assert not torch.equal(from_int4, dense)
            assert torch.equal(layer(x), from_int4 if rows <= INT4_MAX_ROWS else dense)


def test_only_bf16_on_cpu_with_whole_groups_and_rows_in_sixteens():
    assert can_int4(torch.empty(48, 96), torch.bfloat16)
    assert not can_int4(torch.empty(48, 96), torch.float32)
    assert not can_int4(torch.empty(40, 96), torch.bfloat16)
    assert not can_int4(torch.empty(48, 80), torch.bfloat16)


def test_auto_leaves_ordinary_weights_alone_and_int4_quantizes_them(tiny_model_dir):
    # The tiny model's weights are random floats: 4-bit would round them.
    auto = LLM(str(tiny_model_dir), dtype="bfloat16", kv_cache_memory="4MiB", device="cpu")
    assert auto.engine.executor.int4_layers == 0
    forced = LLM(
        str(tiny_model_dir),
        dtype="bfloat16",
        quantization="int4",
        kv_cache_memory="4MiB",
        device="cpu",
    )
    layers = [m for m in forced.engine.executor.model.modules() if isinstance(m, Linear)]
    assert forced.engine.executor.int4_layers == len(layers) > 0
    assert all(m.int4 is not None and m.weight.dtype == torch.bfloat16 for m in layers)


def test_int4_needs_bf16_on_the_cpu(tiny_model_dir):
    with pytest.raises(ValueError, match="int4 needs the CPU and bfloat16"):
        LLM(str(tiny_model_dir), dtype="float32", quantization="int4", kv_cache_memory="4MiB")


def test_the_serve_flag_reaches_the_engine_args():
    import argparse

    from servelm.config import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args([])).quantization == "auto"
    assert (
        EngineArgs.from_cli_args(parser.parse_args(["--quantization", "none"])).quantization
        == "none"
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int3"])


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_the_start_up_line_the_benchmarks_read(tiny_model_dir, caplog, quantization):
    # benchmarks/serve_latency.py and memory.py record what was loaded from this one line.
    from benchmarks.serve_latency import WEIGHTS_LINE

    with caplog.at_level("INFO", logger="servelm"):
        llm = LLM(str(tiny_model_dir), dtype="bfloat16", quantization=quantization,
                  kv_cache_memory="4MiB", device="cpu")  # fmt: skip
    found = WEIGHTS_LINE.search(caplog.text)
    assert found is not None, caplog.text
    assert (found["dtype"], found["device"]) == ("bfloat16", "cpu")
    assert int(found["int4"] or 0) == llm.engine.executor.int4_layers
    assert float(found["gib"]) == pytest.approx(llm.engine.executor.weight_bytes / 2**30, abs=1e-3)


def test_int4_on_a_model_with_its_own_head(tmp_path):
    # An untied head is the logits head's to serve (exact Q8_0 or bf16), never an int4 Linear:
    # an int4 copy there freed the weight the head reads, and loading failed.
    from tests.tiny_model import build_tiny_model

    folder = build_tiny_model(tmp_path / "untied", tie=False)
    llm = LLM(str(folder), dtype="bfloat16", quantization="int4", kv_cache_memory="4MiB")
    model = llm.engine.executor.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert llm.engine.executor.int4_layers == len(layers) == 2 * 4  # 2 layers x 4 projections
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4
