"""Mixtures of experts (Mixtral, Qwen3-MoE) against transformers, and experts run sparsely.

Tiny random-weight models made with transformers' own config classes and save_pretrained
(tests/model/family_harness.py), served by servelm's loader and engine: greedy tokens and
logprobs equal transformers' float32, batched, prefix-cached, chunked and preempted. The
sparsity test counts the rows each expert's MLP sees in a step against the tokens its router
sent it.
"""

from __future__ import annotations

import pytest
import torch

from servelm import LLM, SamplingParams
from servelm.model.config import ModelConfigError, load_spec, spec_from_dict
from servelm.model.llama import LlamaMLP
from servelm.model.moe import MoeMLP
from tests.model.family_harness import check_against_transformers, make_tiny_model

EXPERTS, TOP_K = 4, 2


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    # No window here (the windowed Mixtral is its own test below)
    return make_tiny_model(
        tmp_path_factory.mktemp("moe"),
        "MixtralConfig",
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        sliding_window=None,
    )


def test_mixtral_matches_transformers(mixtral_dir):
    # C kernels where they build (how a CPU serves); torch ops only in the Qwen3-MoE test.
    seen = check_against_transformers(mixtral_dir, kernels=("auto",))
    assert seen["preemptions_auto"] > 0


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    # Layer 1 keeps a dense MLP (mlp_only_layers); the chosen weights renormalised, as
    # Qwen3-30B-A3B's config asks (transformers' default is not to).
    return make_tiny_model(
        tmp_path_factory.mktemp("moe"),
        "Qwen3MoeConfig",
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[1],
        norm_topk_prob=True,
    )


@pytest.mark.slow  # about a minute on 2 shared cores
def test_qwen3_moe_matches_transformers(qwen3_moe_dir):
    seen = check_against_transformers(qwen3_moe_dir)
    assert seen["preemptions_torch"] > 0


@pytest.mark.slow  # about 40 s on 2 shared cores
def test_mixtral_with_a_window_shorter_than_its_prompts(tmp_path):
    # Mixtral's attention is Mistral's: sliding_window on every layer; prompts of 45-88 tokens.
    model_dir = make_tiny_model(
        tmp_path,
        "MixtralConfig",
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        sliding_window=16,
    )
    assert load_spec(model_dir).layer_windows == (16, 16)
    # Blocks behind the window go back to the pool: 8 blocks still force preemption.
    seen = check_against_transformers(model_dir, kernels=("auto",), tight_blocks=8)
    assert seen["preemptions_auto"] > 0


def moe_layers(llm) -> list[MoeMLP]:
    return [m for m in llm.engine.executor.model.modules() if isinstance(m, MoeMLP)]


def test_experts_run_on_the_tokens_routed_to_them_only(mixtral_dir):
    llm = LLM(str(mixtral_dir), dtype="float32", kv_cache_memory="4MiB", kernels="torch")
    layers = moe_layers(llm)
    assert len(layers) == 2 and all(len(m.experts) == EXPERTS for m in layers)
    calls: list[tuple[torch.Tensor, list[int]]] = []  # (the MLP's input, rows per expert)

    def count_rows(layer):
        def before(module, args):
            calls.append((args[0].detach().clone(), [0] * EXPERTS))

        def expert_rows(i):
            def hook(module, args):
                calls[-1][1][i] += args[0].shape[0]

            return hook

        layer.register_forward_pre_hook(before)
        for i, expert in enumerate(layer.experts):
            expert.register_forward_pre_hook(expert_rows(i))

    for layer in layers:
        count_rows(layer)
    prompts = [[5, 9, 31, 7, 100, 42, 17, 3, 64, 8, 11, 250], [77, 12, 5]]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(calls) >= 2 * 4 and len(calls) % 2 == 0  # two layers, >= 4 steps
    for step, (x, rows) in enumerate(calls):
        layer = layers[step % 2]
        # The router's choice, worked out here from its weight: softmax, top-2.
        logits = x @ layer.gate.weight.T
        chosen = torch.softmax(logits, -1).topk(TOP_K, -1).indices
        routed = torch.bincount(chosen.flatten(), minlength=EXPERTS).tolist()
        assert rows == routed, (step, rows, routed)
        # Not dense: top-2 of 4 experts is half of the rows a dense MLP would run.
        assert sum(rows) == TOP_K * x.shape[0] < EXPERTS * x.shape[0]


def test_mixtral_in_bfloat16_and_int4(mixtral_dir):
    """bfloat16 (router, experts and their packed CPU matmuls): each prompt's first token and
    its logprob near transformers' float32 (0.006-0.021 apart here); int4: every expert's
    projections get a 4-bit copy (the router none) and serve."""
    from servelm.model.layers.linear import Linear
    from tests.model.family_harness import _hf_model, prompts_sharing_prefix

    prompts = prompts_sharing_prefix(380)
    hf = _hf_model(str(mixtral_dir))
    with torch.no_grad():
        reference = [torch.log_softmax(hf(torch.tensor([p])).logits[0, -1], -1) for p in prompts]
    llm = LLM(str(mixtral_dir), dtype="bfloat16", kv_cache_memory="4MiB")
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    for res, theirs in zip(llm.generate(prompts, params), reference, strict=True):
        step = res.outputs[0].logprobs[0]
        assert res.outputs[0].token_ids == [int(theirs.argmax())]
        assert abs(step.logprob - theirs[step.token_id].item()) < 0.05
    del llm
    # with servelm's C int4 kernels (an untied head is the logits head's, not an int4 Linear)
    llm = LLM(str(mixtral_dir), dtype="bfloat16", quantization="int4", kv_cache_memory="4MiB")
    model = llm.engine.executor.model
    experts = [e for layer in moe_layers(llm) for e in layer.experts]
    assert all(e.gate_up_proj.int4 is not None and e.down_proj.int4 is not None for e in experts)
    assert not isinstance(moe_layers(llm)[0].gate, Linear)
    linears = sum(1 for m in model.modules() if isinstance(m, Linear))
    assert model.int4_layers == linears  # every projection; the head stays the head's
    # but the routers multiply in torch, whose paths depend on the row count: the log says so
    routers = len(moe_layers(llm))
    summary = llm.engine.executor.kernel_summary
    assert summary.startswith(f"batch invariant but for {routers} projections in torch"), summary
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(r.outputs[0].token_ids) == 8 for r in out)


def test_moe_mlp_equals_the_dense_weighted_sum():
    """The grouped computation equals every expert on every token, weighted by the router's
    renormalised top-k probabilities (zero elsewhere), in float32; and without renormalising."""
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_experts": 6,
        "num_experts_per_tok": 3,
    }
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 32, generator=g)
    for norm in (True, False):
        spec = spec_from_dict({**cfg, "norm_topk_prob": norm})
        mlp = MoeMLP(spec)
        with torch.no_grad():
            for p in mlp.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            probs = torch.softmax(x @ mlp.gate.weight.T, -1)
            top, idx = probs.topk(3, -1)
            if norm:
                top = top / top.sum(-1, keepdim=True)
            dense = torch.stack([e(x) for e in mlp.experts], 1)  # [T, E, hidden]
            weights = torch.zeros(20, 6).scatter(1, idx, top)
            want = (dense * weights[..., None]).sum(1)
            torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)


def test_moe_config_fields():
    base = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
    }
    mixtral = spec_from_dict(
        {
            **base,
            "architectures": ["MixtralForCausalLM"],
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
        }
    )
    assert (mixtral.num_experts, mixtral.experts_per_tok, mixtral.moe_intermediate_size) == (
        8,
        2,
        48,
    )
    assert mixtral.norm_topk_prob and mixtral.moe_layers == (0, 1, 2, 3)
    assert mixtral.rope_theta == 1e6  # transformers 5 writes it in rope_parameters alone
    qwen = spec_from_dict(
        {
            **base,
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
        }
    )
    assert (qwen.num_experts, qwen.experts_per_tok, qwen.moe_intermediate_size) == (16, 4, 8)
    assert qwen.norm_topk_prob and qwen.moe_layers == (1,)  # 1 and 3 sparse by step; 3 dense
    for bad, field in (({"num_experts_per_tok": 9}, "num_experts_per_tok"), ({}, "num_local")):
        cfg = {**base, "architectures": ["MixtralForCausalLM"], "num_experts_per_tok": 2, **bad}
        if bad:
            cfg["num_local_experts"] = 8
        with pytest.raises(ModelConfigError, match=field):
            spec_from_dict(cfg)


def test_mixtral_layers_and_checkpoint_names():
    from servelm.model.registry import model_class

    spec = spec_from_dict(
        {
            "architectures": ["MixtralForCausalLM"],
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_local_experts": 3,
            "num_experts_per_tok": 1,
        }
    )
    with torch.device("meta"):
        model = model_class(spec)(spec)
    assert all(isinstance(layer.mlp, MoeMLP) for layer in model.layers)
    assert all(isinstance(e, LlamaMLP) for layer in model.layers for e in layer.mlp.experts)
    names = {model.checkpoint_name(n) for n, _ in model.named_parameters()}
    assert "model.layers.1.block_sparse_moe.experts.2.w2.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names


def test_qwen3_moe_layers_and_checkpoint_names():
    from servelm.model.registry import model_class
    from servelm.model.variants import QKNormAttention

    spec = spec_from_dict(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 48,
            "moe_intermediate_size": 16,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mlp_only_layers": [1],
        }
    )
    with torch.device("meta"):
        model = model_class(spec)(spec)
    kinds = [type(layer.mlp) for layer in model.layers]
    assert kinds[1] is LlamaMLP and all(issubclass(k, MoeMLP) for k in kinds[::2])
    assert model.layers[1].mlp.inter == 48 and model.layers[0].mlp.experts[3].inter == 16
    assert all(isinstance(layer.self_attn, QKNormAttention) for layer in model.layers)
    names = {model.checkpoint_name(n) for n, _ in model.named_parameters()}
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.0.mlp.gate.weight" in names
