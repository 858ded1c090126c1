"""The decode stack (all layers in one C call) gives what the Python layers give, bit for bit.

The tiny model in bfloat16 with int4 weights (`quantization="int4"`) runs every piece of a layer
in C on the CPU, so its small decode steps take the stack; so does a tiny GGUF model whose
projections are the file's own K-quant / Q8_0 / Q4_1 values (`GGUFWeight`, parts of different
types within one fused projection). Each test compares with the same engine's Python path
(`decode_stack = None`), which the golden tests hold to transformers (tests/store/
test_gguf_types.py for the GGUF types). Each test runs on every build of the C kernels this
host can run (tests/kernels/variants.py: the engine loads it through $SERVELM_KERNEL_VARIANT).
"""

import pytest
import torch

from servelm import LLM, SamplingParams
from servelm.kernels import variants
from servelm.kernels.build import compiler
from servelm.kernels.paths import ALL_ROWS, StepPaths
from servelm.kernels.quant_matmul import QuantMatmul
from servelm.model.layers.linear import GGUFWeight, Linear
from servelm.store.gguf_import import import_gguf
from tests.gguf_kquants import Q
from tests.kernels.variants import PREFILL, flags, params
from tests.store.gguf_models import TOKENS, q4_k_m, tiny_hf_model, write_family_gguf
from tests.tiny_model import build_tiny_model

pytestmark = pytest.mark.skipif(compiler() is None, reason="the C kernels need a C compiler")


def max_rows(variant: str) -> int:
    """Steps of up to this many tokens take the stack in this build (`StepPaths`: all of them,
    batch invariant)."""
    return StepPaths.of(QuantMatmul.load(flags(variant))).stack_max_rows


def batches(variant: str) -> list[int]:
    """Batches the stack takes; and, where the cut is low, one over it."""
    rows = max_rows(variant)
    return [1, 3, 9, 40] if rows > 40 else [1, 3, 9, rows, rows + 3]


# (variant, batch) for each variant this host runs (its kernel built here, at collection)
VARIANT_BATCHES = [
    pytest.param(p.values[0], batch, id=f"{p.id}-{batch}", marks=p.marks)
    for p in params()
    for batch in (batches(p.values[0]) if not p.marks and compiler() else [1])
]


def int4_llm(model_dir, variant: str, **kw) -> LLM:
    with pytest.MonkeyPatch.context() as env:  # the kernels load while the engine is built
        env.setenv(variants.ENV, variant)
        return LLM(str(model_dir), dtype="bfloat16", quantization="int4", kv_cache_memory="4MiB",
                   device="cpu", **kw)  # fmt: skip


@pytest.fixture(scope="module")
def llm32(tmp_path_factory, variant):
    """The tiny model with 32-wide heads, which the C prefill attention takes (every build but c)."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-llama-d32"), head_dim=32)
    return int4_llm(model_dir, variant, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def llm(tiny_model_dir, variant):
    # No prefix caching: a second run of the same prompts would start from cached blocks and
    # compute the rest in other batch shapes, which round differently in bfloat16.
    return int4_llm(tiny_model_dir, variant, enable_prefix_caching=False)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 380, (5 + 13 * i,), generator=g).tolist() for i in range(n)]


def test_it_is_built_and_named(llm, variant):
    runner = llm.engine.executor
    assert runner.decode_stack is not None
    rows = max_rows(variant)
    assert runner.decode_stack.max_rows == runner.decode_stack_max_tokens == rows
    steps = "decode steps" if rows == ALL_ROWS else f"decode steps of <= {rows} tokens"
    assert f"; {steps}: all layers in one C call" in runner.kernel_summary


def test_the_step_paths_say_from_which_step_size_matmuls_run_in_float32(llm, variant, monkeypatch):
    # What the simulator's fit is told (`step_paths`) against what the layers do: count the
    # int4 weights dequantized to float32 for torch's matmul in a one-prompt step of each size.
    runner = llm.engine.executor
    wide = runner.wide_step_min_tokens
    paths = {"decode_stack_max_tokens": max_rows(variant), "wide_step_min_tokens": wide}
    assert runner.step_paths == paths
    kernel = runner.quant_kernel
    calls = []
    dequantize = kernel.dequantize_q4
    monkeypatch.setattr(kernel, "dequantize_q4", lambda *a: calls.append(1) or dequantize(*a))
    params = SamplingParams(max_tokens=1, temperature=0)
    for tokens in (wide - 1, wide) if wide else (300,):
        calls.clear()
        llm.generate([[7] * tokens], params)
        assert bool(calls) == (wide > 0 and tokens >= wide), (tokens, len(calls))
    assert wide in (0, kernel.sgemm_min_rows)


def hidden_both_ways(llm, seqs, ids, sample=None):
    """The stack's and the Python layers' hidden states for one step of `seqs` (`sample`: which
    of them sample, None: all), and whether the two stored the same K/V."""
    runner = llm.engine.executor
    model, attn, stack = runner.model, runner.attn, runner.decode_stack
    pos = torch.cat([torch.arange(done, done + new) for done, new, _ in seqs])
    for layer_k, layer_v in attn.kv_caches:  # some history to attend over
        layer_k.normal_()
        layer_v.normal_()
    with torch.inference_mode():
        attn.plan(seqs, torch.device("cpu"), torch.bfloat16, sample)
        expected = model(ids, pos, attn)  # stores this step's K/V, then attends
        stored = [(k.clone(), v.clone()) for k, v in attn.kv_caches]
        for k, v in attn.kv_caches:  # forget the stored K/V: the stack must write them itself
            k[attn.meta.slot_mapping] = 0
            v[attn.meta.slot_mapping] = 0
        got = stack(ids, pos)
    same_kv = all(
        torch.equal(k, k0) and torch.equal(v, v0)
        for (k, v), (k0, v0) in zip(attn.kv_caches, stored, strict=True)
    )
    return got, expected, same_kv


@pytest.mark.parametrize("n", [3, 9])  # 9: the int4 matmuls run on AMX tiles where there are any
def test_one_step_gives_the_python_layers_hidden_states_bit_for_bit(llm, n):
    # n requests with 20, 7, 33, 46, ... tokens cached (blocks of 16), one new token each.
    seqs, first_block = [], 3
    for i in range(n):
        cached = [20, 7, 33][i] if i < 3 else 7 + 13 * i
        blocks = list(range(first_block, first_block + cached // 16 + 1))
        first_block += len(blocks)
        seqs.append((cached, 1, blocks))
    got, expected, same_kv = hidden_both_ways(llm, seqs, torch.arange(11, 11 + n))
    assert got is not None and torch.equal(got, expected) and same_kv


def test_prompt_and_mixed_steps_give_the_python_layers_hidden_states_bit_for_bit(llm32, variant):
    runner = llm32.engine.executor
    if variant == "c":  # no C prefill attention in this build: prompts take Python
        assert runner.attn.prefill_kernel is None and not runner.decode_stack.takes_prompts
        return
    assert runner.attn.prefill_kernel.name.endswith(f"({PREFILL[variant]})")
    assert runner.decode_stack.takes_prompts
    rows = max_rows(variant)
    steps = "every step" if rows == ALL_ROWS else f"steps of <= {rows} tokens"
    assert f"; {steps}" in runner.kernel_summary
    # (cached, new, blocks): decodes before, between and after two prompt chunks, one of
    # them after 20 cached tokens, the other a fresh prompt of 37
    seqs = [
        (5, 1, [1]),
        (40, 1, [2, 3, 4]),
        (20, 30, [5, 6, 7, 8]),
        (9, 1, [9]),
        (0, 37, [10, 11, 12]),
        (16, 1, [13, 14]),
    ]
    ids = torch.arange(3, 3 + sum(new for _, new, _ in seqs))
    got, expected, same_kv = hidden_both_ways(llm32, seqs, ids)
    assert got is not None and torch.equal(got, expected) and same_kv
    # The last layer on the sampled rows alone: the first chunk does not finish its prompt.
    sample = [True, True, False, True, True, True]
    got, expected, same_kv = hidden_both_ways(llm32, seqs, ids, sample)
    assert got.shape[0] == 5 and torch.equal(got, expected) and same_kv
    got, expected, same_kv = hidden_both_ways(llm32, seqs[2:3], ids[:30], [False])
    assert got.shape[0] == 0 and expected.shape[0] == 0 and same_kv  # K/V stored, no rows
    got, expected, same_kv = hidden_both_ways(llm32, [(0, 50, [1, 2, 3, 4])], ids[:50])
    assert got is not None and torch.equal(got, expected) and same_kv
    # With prefix caching a request may read blocks that another request of the same step is
    # computing: here a decode (row 0) reads block 5, which the prompt after it writes. Every
    # token's K/V must be stored before any part attends, as the Python layers do.
    shared = [(16, 1, [5, 6]), (3, 1, [8]), (0, 20, [5, 7])]
    got, expected, same_kv = hidden_both_ways(llm32, shared, ids[:22])
    assert got is not None and torch.equal(got, expected) and same_kv


def assert_same_generation_without_it(llm, reqs, params) -> None:
    runner = llm.engine.executor
    stack = runner.decode_stack
    with_stack = llm.generate(reqs, params)
    runner.decode_stack = None
    try:
        without = llm.generate(reqs, params)
    finally:
        runner.decode_stack = stack
    for a, b in zip(with_stack, without, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    llm.engine.check_integrity()
    assert llm.engine.scheduler.kv.usage() == 0.0


def test_generation_with_prompts_through_it_is_the_same(llm32):
    params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, logprobs=2) for i in range(6)]
    assert_same_generation_without_it(llm32, prompts(6, seed=4), params)


@pytest.mark.parametrize(("variant", "batch"), VARIANT_BATCHES, indirect=["variant"])
def test_generation_is_the_same_with_and_without_it(llm, batch):
    # batch > MAX_ROWS: the first steps are too big for the stack and fall back, the last
    # ones (as requests finish at different lengths) take it again. With AMX tiles the stack
    # takes every decode step, and 40 requests go through the scratch rows grown from 9.
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, logprobs=2) for i in range(batch)]
    assert_same_generation_without_it(llm, prompts(batch, seed=batch), params)


def test_steps_it_does_not_take(llm, variant):
    runner = llm.engine.executor
    stack, attn = runner.decode_stack, runner.attn
    with torch.inference_mode():
        # a prefill (no tokens cached yet): this model's 16-wide heads have no C prefill attention
        attn.plan([(0, 4, [1])], torch.device("cpu"), torch.bfloat16)
        assert stack(torch.tensor([5, 6, 7, 8]), torch.arange(4)) is None
        if max_rows(variant) == ALL_ROWS:  # no decode step is too big
            return
        # one more decode token than the int4 weights serve
        n = max_rows(variant) + 1
        attn.plan([(3, 1, [i]) for i in range(n)], torch.device("cpu"), torch.bfloat16)
        assert stack(torch.full((n,), 5), torch.full((n,), 3)) is None


@pytest.mark.parametrize(
    "settings",
    [
        {"dtype": "bfloat16"},  # random weights: auto keeps them bf16, no int4 matmuls
        {"dtype": "bfloat16", "quantization": "int4", "kernels": "torch"},
        {"dtype": "float32"},
    ],
)
def test_not_built_unless_every_layer_runs_in_c(tiny_model_dir, settings):
    llm = LLM(str(tiny_model_dir), kv_cache_memory="4MiB", device="cpu", **settings)
    assert llm.engine.executor.decode_stack is None
    assert "one C call" not in llm.engine.executor.kernel_summary


# -- a GGUF file's own quantized projections (GGUFWeight) ------------------------------------


def every_part_kind(name: str) -> Q:
    """Each kind of GGUFWeight part, and fused projections of mixed parts: q, k, v as Q5_K
    blocks, Q8_0 (the q8 layout) and Q4_1 (the q4 layout); gate Q4_K, up Q6_K; down Q8_0."""
    for proj, qtype in {
        "q_proj": Q.Q5_K,
        "k_proj": Q.Q8_0,
        "v_proj": Q.Q4_1,
        "o_proj": Q.Q6_K,
        "gate_proj": Q.Q4_K,
        "up_proj": Q.Q6_K,
        "down_proj": Q.Q8_0,
    }.items():
        if f".{proj}." in name:
            return qtype
    return Q.Q6_K  # the embedding and the head


GGUF_MIXES = {"Q4_K_M": q4_k_m, "mixed": every_part_kind}
GGUF_KINDS = {  # what the loader makes of each mix: layer 0's (qkv, gate_up, down) parts
    "Q4_K_M": (["Q4_K", "Q4_K", "Q6_K"], ["Q4_K", "Q4_K"], ["Q6_K"]),
    "mixed": (["Q5_K", "Q8_0", "Q4_1"], ["Q4_K", "Q6_K"], ["Q8_0"]),
}


@pytest.fixture(scope="module")
def gguf_folders(tmp_path_factory):
    llama = tiny_hf_model("llama")
    folders = {}
    for name, mix in GGUF_MIXES.items():
        d = tmp_path_factory.mktemp(f"gguf-{name}")
        folders[name] = import_gguf(write_family_gguf(d / "m.gguf", llama, "llama", mix), d / "m")
    return folders


@pytest.fixture(scope="module", params=list(GGUF_MIXES))
def gguf_llm(request, gguf_folders, variant):
    with pytest.MonkeyPatch.context() as env:
        env.setenv(variants.ENV, variant)
        llm = LLM(str(gguf_folders[request.param]), dtype="bfloat16", kv_cache_memory="4MiB",
                  device="cpu", enable_prefix_caching=False)  # fmt: skip
    return request.param, llm


def gguf_ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, len(TOKENS), (n,), generator=torch.Generator().manual_seed(seed))


def test_gguf_model_takes_it_and_says_so(gguf_llm):
    mix, llm = gguf_llm
    runner = llm.engine.executor
    layer = runner.model.layers[0]
    mats = (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    assert all(isinstance(m.quant, GGUFWeight) for m in mats)
    assert tuple(m.quant.kinds() for m in mats) == GGUF_KINDS[mix]
    assert all(m.int4 is None for m in runner.model.modules() if isinstance(m, Linear))
    assert runner.decode_stack is not None
    assert runner.decode_stack.max_rows == runner.decode_stack_max_tokens
    assert "all layers in one C call" in runner.kernel_summary


def test_gguf_steps_give_the_python_layers_hidden_states_bit_for_bit(gguf_llm):
    _, llm = gguf_llm
    # 9 decode rows (AMX tiles for a q4 part where there are any) after 20, 7, 33, ... tokens
    seqs, first = [], 3
    for i in range(9):
        cached = [20, 7, 33][i] if i < 3 else 7 + 13 * i
        blocks = list(range(first, first + cached // 16 + 1))
        first += len(blocks)
        seqs.append((cached, 1, blocks))
    got, expected, same_kv = hidden_both_ways(llm, seqs, gguf_ids(9))
    assert got is not None and torch.equal(got, expected) and same_kv
    if not llm.engine.executor.decode_stack.takes_prompts:
        return
    # decodes around two prompt chunks, the last layer on the sampled rows alone
    seqs = [(5, 1, [1]), (20, 30, [5, 6, 7, 8]), (9, 1, [9]), (0, 37, [10, 11, 12])]
    ids = gguf_ids(69, seed=1)
    for sample in (None, [True, False, True, True]):
        got, expected, same_kv = hidden_both_ways(llm, seqs, ids, sample)
        assert got is not None and torch.equal(got, expected) and same_kv


def test_gguf_generation_is_the_same_with_and_without_it(gguf_llm):
    _, llm = gguf_llm
    reqs = [gguf_ids(4 + 5 * i, seed=i).tolist() for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, logprobs=2) for i in range(5)]
    assert_same_generation_without_it(llm, reqs, params)
