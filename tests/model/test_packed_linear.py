"""CPU bf16 weights repacked for oneDNN give exactly what `F.linear` gives; on a CPU whose oneDNN
has no bf16 path (AVX2 only) nothing is packed and the layers still give the same."""

import pytest
import torch
import torch.nn.functional as F

from servelm import LLM, SamplingParams
from servelm.kernels.paths import BF16_VIA_F32_MIN_ROWS, cpu_has_bf16_matmul
from servelm.model.layers import linear as linear_mod
from servelm.model.layers.linear import Linear, LogitsHead, plain_linear

BF16_PACKING = cpu_has_bf16_matmul()  # AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT


def unpacked_linear(x, w, b):
    """What a bf16 layer gives: F.linear where oneDNN packs (bit-identical) or at few rows,
    else F.linear in float32, rounded to bf16 once."""
    if not BF16_PACKING and x.shape[0] >= BF16_VIA_F32_MIN_ROWS:
        return F.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()
    return F.linear(x, w, b)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_packed_linear_is_bitwise_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    layer = Linear(96, 200, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(200, 96, generator=g))
        if bias:
            layer.bias.copy_(torch.randn(200, generator=g))
    weight, b = layer.weight.detach().clone(), None if not bias else layer.bias.detach().clone()
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    layer.pack_for_cpu()
    if BF16_PACKING:
        assert layer.packed is not None and layer.weight.numel() == 0  # the plain copy is freed
    else:
        assert layer.packed is None and torch.equal(layer.weight, weight)
    with torch.inference_mode():
        assert torch.equal(layer(x), unpacked_linear(x, weight, b))
        logits = LogitsHead(weight)(x)  # in float32, not rounded to bf16
        assert logits.dtype == torch.float32
        assert torch.equal(logits, F.linear(x.float(), weight.float()))


def test_float32_is_left_alone():
    layer = Linear(8, 4)
    layer.pack_for_cpu()
    assert layer.packed is None and layer.weight.shape == (4, 8)


@pytest.mark.skipif(not BF16_PACKING, reason="oneDNN has no bf16 path on this CPU")
def test_bf16_engine_gives_the_same_tokens_packed_or_not(tiny_model_dir, monkeypatch):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (4, 19, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run() -> tuple[list[list[int]], int]:
        # Packing is a CPU feature (oneDNN's blocked layout), so the test pins the CPU.
        llm = LLM(str(tiny_model_dir), dtype="bfloat16", kv_cache_memory="4MiB", device="cpu")
        layers = [m for m in llm.engine.executor.model.modules() if isinstance(m, Linear)]
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        return tokens, sum(m.packed is not None for m in layers)

    packed, num_packed = run()
    monkeypatch.setattr(linear_mod, "can_pack", lambda weight: False)
    plain, num_plain = run()
    assert num_packed > 0 and num_plain == 0
    assert packed == plain
    assert all(len(t) == 12 for t in packed)


@pytest.mark.parametrize("rows", [1, BF16_VIA_F32_MIN_ROWS - 1, BF16_VIA_F32_MIN_ROWS, 40])
def test_unpacked_bf16_goes_through_float32_where_the_cpu_has_no_bf16_matmul(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(48, 64, generator=g).bfloat16(), torch.randn(48, generator=g).bfloat16()
    x = torch.randn(rows, 64, generator=g).bfloat16()
    want = unpacked_linear(x, w, b)
    assert torch.equal(plain_linear(x, w, b), want)
    # an unpacked Linear takes that path too
    layer = Linear(64, 48).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(w), layer.bias.copy_(b)
    with torch.inference_mode():
        assert torch.equal(layer(x), want)
