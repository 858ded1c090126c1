"""servelm matches transformers on the real default model (SmolLM2-135M-Instruct, float32;
last, bf16 as served).

Eight prompts of mixed lengths run as one continuous batch and must give transformers' greedy
tokens under the rule in tests/golden.py; then again with a shared system prompt (prefix cache
hits), with 32-token chunked prefill, and with a KV pool small enough to force preemption.
Transformers' answer for a prompt is computed once and reused by every scenario.
"""

from __future__ import annotations

import pytest
import torch

from servelm import LLM, SamplingParams
from servelm.kernels.build import compiler
from servelm.kernels.paged_prefill import PagedPrefillKernel
from tests.golden import TOP, assert_close_greedy, count_near_ties, hf_greedy, our_tops

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
# Bytes of one 16-token KV block: k+v, 30 layers, 3 kv heads, head dim 64, fp32.
BYTES_PER_BLOCK = 2 * 30 * 3 * 64 * 4 * 16

LONG = (
    " ".join(
        f"Step {i}: the scheduler admits request {i * 7 % 13}, gives it {i % 4 + 1} blocks of "
        f"sixteen tokens, and streams its tokens back to the client."
        for i in range(10)
    )
    + "\nSummary of the steps above:"
)

SYSTEM = " ".join(
    ["You are a careful assistant for an inference team. Answer in short, plain sentences."]
    + [
        f"Rule {i}: never invent numbers; when a value is unknown, say that it is unknown and "
        f"suggest how to measure it."
        for i in range(1, 8)
    ]
)


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(default_model_dir):
    engine = LLM(str(default_model_dir), dtype="float32", kv_cache_memory="128MiB")
    yield engine
    del engine


@pytest.fixture(scope="module")
def reference(hf_model):
    """transformers' greedy tokens and top-5 per prompt, computed once per distinct prompt."""
    cache: dict[tuple[int, ...], tuple[list[int], list[set[int]]]] = {}

    def get(prompt: list[int]) -> tuple[list[int], list[set[int]]]:
        key = tuple(prompt)
        if key not in cache:
            cache[key] = hf_greedy(hf_model, prompt, MAX_TOKENS)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    tok = llm.tokenizer
    out = [
        tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}]),
        tok.encode("The capital of France is"),
        tok.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
        tok.encode(LONG),
        tok.encode("Hello"),
        tok.encode("List three primary colors:\n1."),
        tok.encode_chat(
            [
                {"role": "system", "content": "You translate English to French."},
                {"role": "user", "content": "Good morning, how are you?"},
            ]
        ),
        tok.encode("import torch\n\nclass MLP(torch.nn.Module):\n    def __init__(self"),
    ]
    assert 280 <= len(out[3]) <= 340, len(out[3])
    return out


def check(llm, reference, prompts: list[list[int]]) -> list[int]:
    """Runs all prompts as one batch; asserts the golden rule; returns leading tokens agreed."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    results = llm.generate(prompts, params)
    agreed, ties = [], 0
    for prompt, res in zip(prompts, results, strict=True):
        comp = res.outputs[0]
        assert comp.finish_reason == "length" and len(comp.token_ids) == MAX_TOKENS
        ties += count_near_ties(comp)
        theirs, tops = reference(prompt)
        agreed.append(assert_close_greedy(comp.token_ids, our_tops(comp), theirs, tops))
    llm.engine.check_integrity()
    assert llm.engine.scheduler.kv.usage() == 0.0
    print(f"agreed tokens: {agreed}; steps with a top-2 gap below 1e-6: {ties}", llm.totals)
    return agreed


def test_batched_greedy_matches_transformers(llm, reference, prompts):
    agreed = check(llm, reference, prompts)
    assert sum(a == MAX_TOKENS for a in agreed) >= 6, agreed


def test_shared_system_prompt_hits_prefix_cache(llm, reference):
    questions = [
        "How many GPUs do I need for a 7B model?",
        "What is a KV cache?",
        "Hello!",
        "Explain prefix caching in one sentence.",
        "What does TTFT mean?",
        "Is batching good for latency?",
        "Write a haiku about tokens.",
        "Say yes or no.",
    ]
    prompts = [
        llm.tokenizer.encode_chat(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        )
        for q in questions
    ]
    assert 190 <= len(llm.tokenizer.encode(SYSTEM)) <= 230
    hits_before = llm.totals.prefix_cache_hits
    check(llm, reference, prompts)
    assert llm.totals.prefix_cache_hits - hits_before > 0


def test_chunked_prefill_matches(default_model_dir, reference, prompts):
    llm = LLM(
        str(default_model_dir), dtype="float32", kv_cache_memory="128MiB", max_num_batched_tokens=32
    )
    check(llm, reference, prompts)


def test_preemption_recomputes_correctly(default_model_dir, reference, prompts):
    # Enough blocks for the longest request alone, far fewer than the whole batch needs.
    longest = max(-(-(len(p) + MAX_TOKENS) // 16) for p in prompts)
    total = sum(-(-(len(p) + MAX_TOKENS) // 16) for p in prompts)
    blocks = longest + 4
    assert blocks < total
    llm = LLM(str(default_model_dir), dtype="float32", kv_cache_memory=blocks * BYTES_PER_BLOCK)
    assert llm.info.num_blocks == blocks
    check(llm, reference, prompts)
    assert llm.totals.num_preemptions > 0


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_bfloat16_serving_weights_match(default_model_dir, reference, prompts, quantization):
    """What `servelm serve` runs by default: bf16, and the model's Q4_1 projections as int4.

    bf16 flips near-ties sooner than float32, and one flip sends the rest of a greedy answer
    elsewhere, so how many of 8 answers agree to the end is a lottery (on 24 other prompts,
    16-17 of 24). Teacher-forced, each position is its own trial: given the prompt and
    transformers' first i tokens, servelm's next token must be transformers', but for near-ties
    (measured: 6-8 misses of 256 with bf16 logits; 2-3 with float32 logits, AMX, batch
    invariant)."""
    llm = LLM(
        str(default_model_dir),
        dtype="bfloat16",
        quantization=quantization,
        kv_cache_memory="128MiB",
    )
    int4 = quantization == "auto" and llm.engine.executor.device.type == "cpu"
    assert llm.engine.executor.int4_layers == (120 if int4 else 0)
    # with the C kernels, the file's Q8_0 head is served from its int8 values
    q8_head = int4 and compiler() is not None
    assert (llm.engine.executor.model.head_q8 is not None) == q8_head
    # on an AMX CPU the prompts (and, teacher-forced below, their cached prefixes) go through
    # the prefill attention kernel
    amx = PagedPrefillKernel.load(torch.bfloat16, 64, 16) is not None
    summary = llm.engine.executor.kernel_summary
    assert ("prefill attention: C paged_prefill_bf16" in summary) == amx, summary
    check(llm, reference, prompts)  # the golden rule, free-running
    misses, positions = teacher_forced_misses(llm, reference, prompts)
    assert misses <= positions // 20, misses


def teacher_forced_misses(llm, reference, prompts) -> tuple[int, int]:
    """Given the prompt and transformers' first i tokens, servelm's next token at every i: how
    many differ from transformers' (each must be a near-tie: ours among transformers' top
    tokens, theirs among ours), of how many positions."""
    forced, want = [], []
    for prompt in prompts:
        theirs, tops = reference(prompt)
        for i in range(MAX_TOKENS):
            forced.append(prompt + theirs[:i])
            want.append((theirs[i], tops[i]))
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=TOP)
    misses = 0
    for res, (token, their_top) in zip(llm.generate(forced, params), want, strict=True):
        comp = res.outputs[0]
        if comp.token_ids[0] != token:
            misses += 1
            assert comp.token_ids[0] in their_top and token in our_tops(comp)[0]
    print(f"teacher-forced misses: {misses} of {len(forced)}")
    return misses, len(forced)


def test_int8_activations_miss_only_near_ties(default_model_dir, reference, prompts):
    """`--int4-activations int8` (the projections' x as GGUF's Q8_0, about 0.7 % off, where a
    build has the integer path): fewer tokens agree, but each miss is still a near-tie
    (measured: 18 of 256 on the Zen 4, against 4 with its default; the integer path gives the
    same bits on every build that has it)."""
    llm = LLM(
        str(default_model_dir),
        dtype="bfloat16",
        int4_activations="int8",
        kv_cache_memory="128MiB",
    )
    kernel = llm.engine.executor.quant_kernel
    if kernel is None or kernel.activation_bits != 8:
        pytest.skip("this build takes x as it is (AMX tiles, or no AVX2)")
    misses, positions = teacher_forced_misses(llm, reference, prompts)
    assert misses <= positions // 8, misses
