"""A GGUF whose projections are Q4_1, like the default model's file, is served from 4-bit copies
that hold exactly the file's weights; a file with other projection types is not."""

import pytest

from servelm.store.gguf_import import import_gguf

torch = pytest.importorskip("torch")
if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
    pytest.skip("this torch build has no CPU int4 kernel", allow_module_level=True)

from servelm import LLM, SamplingParams  # noqa: E402
from servelm.model.layers.linear import Linear  # noqa: E402

# Our fused projections -> the checkpoint tensors stacked in their rows.
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def test_q4_1_projections_are_served_from_exact_int4_copies(make_tiny_gguf, tmp_path, tiny):
    src, expected = make_tiny_gguf(all_q4_1=True)
    folder = import_gguf(src, tmp_path / "model")
    llm = LLM(str(folder), dtype="bfloat16", kv_cache_memory="4MiB", device="cpu")
    assert llm.engine.executor.int4_layers == 4 * tiny.layers
    model = llm.engine.executor.model
    for i in range(tiny.layers):
        for ours, theirs in FUSED.items():
            layer = model.get_submodule(f"layers.{i}.{ours}")
            assert isinstance(layer, Linear) and layer.int4 is not None
            want = torch.cat(
                [torch.from_numpy(expected[f"model.layers.{i}.{t}.weight"]) for t in theirs]
            )
            # Multiplying by the identity reads the 4-bit copy back. Its scales and offsets,
            # and the product, are bf16: it is as far from the file's weights as a plain bf16
            # copy is, within 3x (rounding ordinary weights to 4 bits is tens of times as far).
            eye = torch.eye(want.shape[1], dtype=torch.bfloat16)
            error = (layer.int4(eye).float().T - want).abs().mean()
            bf16_error = (want.bfloat16().float() - want).abs().mean()
            assert error <= 3 * bf16_error, (i, ours, error, bf16_error)
    # The head (the embedding, tied) is Q8_0 in the file, as in the default model's, but its 24
    # rows are not whole blocks of 16 for the q8 kernel: it is served from the file's own
    # Q8_0 blocks (tests/store/test_gguf_types.py; the default model's golden test covers the
    # q8 head).
    assert model.head_q8 is not None and model.head_q8.qtype == 8
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6


def test_other_projection_types_keep_bf16_weights(make_tiny_gguf, tmp_path):
    src, _ = make_tiny_gguf()  # down_proj Q8_0, q/v/o float32: not 4-bit
    folder = import_gguf(src, tmp_path / "model")
    llm = LLM(str(folder), dtype="bfloat16", kv_cache_memory="4MiB", device="cpu")
    assert llm.engine.executor.int4_layers == 0
