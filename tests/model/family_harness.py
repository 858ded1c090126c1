"""A model family against transformers: tiny random weights, servelm's real loader and engine.

    model_dir = make_tiny_model(tmp_path, "Qwen3Config", num_hidden_layers=3)
    check_against_transformers(model_dir)

`make_tiny_model` builds the folder with transformers' own config class, `from_config` and
`save_pretrained` (safetensors), plus the tiny byte-level tokenizer of tests/tiny_model.py.
`check_against_transformers` serves it with `servelm.LLM` in float32 and asserts that greedy
tokens equal transformers' float32 greedy tokens on 4 prompts sharing a long prefix, and that
their logprobs agree within `LOGPROB_ATOL`:
- batched (the 4 prompts in one run) and again in the same engine, which must hit the prefix
  cache;
- chunked and preempted: a small step budget splits the prompts into chunks, and a KV cache
  too small for the 4 at once forces preemption (counted by the engine's stats), once with the
  C kernels (where they build) and once with torch ops only.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import torch

from tests.golden import assert_close_greedy, count_near_ties, our_tops
from tests.tiny_model import build_tokenizer

# Both sides run in float32; what is left is the order of summation (and C vs torch ops).
LOGPROB_ATOL = 2e-3
TOP = 5

# Small defaults every family's config class takes; a family's test overrides what it needs.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def make_tiny_model(
    tmp_path: Path, config_cls_name: str, *, seed: int = 0, **config_overrides: Any
) -> Path:
    """A random-weight model of transformers' `config_cls_name` (e.g. "Gemma2Config") saved
    in the Hugging Face layout under `tmp_path`, with the tiny test tokenizer; returns the
    folder. `config_overrides` go to the config class over the tiny defaults (TINY)."""
    import transformers
    from transformers import AutoModelForCausalLM

    out = Path(tmp_path) / config_cls_name.removesuffix("Config").lower()
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    config = getattr(transformers, config_cls_name)(
        **{**TINY, "vocab_size": vocab, **config_overrides}
    )
    config.dtype = "float32"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # larger weights than the default init: sharper, less tie-prone
                p.normal_(0, 0.15)
            else:  # norms (Gemma's are stored as w in (1 + w): zeros) and biases, not their init
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return out


def prompts_sharing_prefix(
    vocab: int, shared: int = 40, lengths=(5, 17, 33, 48), seed: int = 0
) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (shared,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@cache
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    # eager: the attention that honours every family's soft-capping and windows
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def hf_greedy_logprobs(model, prompts: list[list[int]], max_tokens: int):
    """transformers' greedy tokens, their top-5 sets and each step's log-softmax [vocab], for
    every prompt: one forward of the whole batch per step, without a cache. The sequences are
    padded on the right, which a causal model's logits at each one's last token never see, so
    no attention mask or position shift is needed (and none of generate's per-step cost)."""
    seqs = [list(p) for p in prompts]
    steps: list[list[torch.Tensor]] = [[] for _ in prompts]
    # One thread: a tiny model's forward is all overhead, and OpenMP's threads spinning on
    # 2 busy cores made each one 10x slower (0.7 s against 0.07 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _greedy(model, prompts, seqs, steps, max_tokens)
    finally:
        torch.set_num_threads(threads)


def _greedy(model, prompts, seqs, steps, max_tokens):
    with torch.no_grad():
        for _ in range(max_tokens):
            width = max(len(s) for s in seqs)
            ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
            logits = model(input_ids=ids, use_cache=False).logits
            for i, s in enumerate(seqs):
                lp = torch.log_softmax(logits[i, len(s) - 1].float(), -1)
                steps[i].append(lp)
                s.append(int(lp.argmax()))
    return [
        (s[len(p) :], [set(lp.topk(TOP).indices.tolist()) for lp in lps], lps)
        for p, s, lps in zip(prompts, seqs, steps, strict=True)
    ]


def _engine_run(llm, prompts, reference, max_tokens: int, what: str) -> None:
    from servelm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP)
    results = llm.generate(prompts, params)
    for i, (res, (theirs, tops, hf_lps)) in enumerate(zip(results, reference, strict=True)):
        theirs, tops, hf_lps = theirs[:max_tokens], tops[:max_tokens], hf_lps[:max_tokens]
        comp = res.outputs[0]
        assert comp.finish_reason == "length" and len(comp.token_ids) == max_tokens, what
        count_near_ties(comp)
        agreed = assert_close_greedy(comp.token_ids, our_tops(comp), theirs, tops)
        assert agreed == max_tokens, f"{what}: prompt {i} agreed on {agreed} of {max_tokens}"
        for step, (lp, hf_lp) in enumerate(zip(comp.logprobs, hf_lps, strict=True)):
            ref = hf_lp[lp.token_id].item()
            assert abs(lp.logprob - ref) <= LOGPROB_ATOL, (
                f"{what}: prompt {i} step {step}: logprob {lp.logprob} vs transformers' {ref}"
            )
            for token, value in lp.top:
                assert abs(value - hf_lp[token].item()) <= LOGPROB_ATOL, (what, i, step, token)


def check_against_transformers(
    model_dir: Path,
    *,
    prompts: list[list[int]] | None = None,
    max_tokens: int = 32,
    chunk_tokens: int = 16,
    tight_blocks: int = 12,
    kernels: tuple[str, ...] = ("auto", "torch"),
    roomy_kernels: str = "auto",
    cached_tokens: int = 8,
    **engine_kwargs: Any,
) -> dict[str, Any]:
    """Serve `model_dir` with servelm in float32 and assert its greedy tokens and logprobs equal
    transformers' on `prompts` (default: 4 prompts of 45-88 tokens sharing a 40-token prefix):
    batched, then prefix-cached (a roomy engine with `roomy_kernels`, run again for the first
    `cached_tokens` tokens), then chunked (`chunk_tokens` a step) and preempted (`tight_blocks`
    KV blocks of 16 tokens) for each of `kernels`. Returns what it counted, for a test's own
    assertions."""
    from servelm import LLM
    from servelm.model.config import load_spec

    spec = load_spec(model_dir)
    prompts = prompts or prompts_sharing_prefix(spec.vocab_size)
    hf = _hf_model(str(model_dir))
    reference = hf_greedy_logprobs(hf, prompts, max_tokens)
    seen: dict[str, Any] = {}

    llm = LLM(
        str(model_dir),
        dtype="float32",
        kv_cache_memory="8MiB",
        kernels=roomy_kernels,
        **engine_kwargs,
    )
    _engine_run(llm, prompts, reference, max_tokens, f"batched ({roomy_kernels})")
    hits = llm.totals.prefix_cache_hits
    _engine_run(llm, prompts, reference, cached_tokens, "batched, prefix-cached")
    seen["prefix_cache_hits"] = llm.totals.prefix_cache_hits - hits
    # The second run finds each prompt's full blocks cached (all but the last partial one).
    assert seen["prefix_cache_hits"] >= sum(len(p) // 16 - 1 for p in prompts) * 16, seen
    llm.engine.check_integrity()
    seen["kernel_summary"] = llm.engine.executor.kernel_summary
    del llm

    longest = max(len(p) for p in prompts) + max_tokens
    assert tight_blocks * 16 >= longest, "one request must fit the tight cache alone"
    assert tight_blocks * 16 < len(prompts) * longest, "the tight cache must force preemption"
    tp = engine_kwargs.get("tensor_parallel_size", 1)
    if tp > 1:  # the KV budget is per rank, and a rank holds its share of the KV heads
        from servelm.model.parallel import TPGroup, rank_spec

        spec = rank_spec(spec, TPGroup(0, tp))
    per_block = spec.kv_bytes_per_token(4) * 16
    for backend in kernels:
        llm = LLM(
            str(model_dir),
            dtype="float32",
            kv_cache_memory=tight_blocks * per_block,
            max_num_batched_tokens=chunk_tokens,
            kernels=backend,
            **engine_kwargs,
        )
        assert llm.info.num_blocks == tight_blocks, llm.info.num_blocks
        _engine_run(llm, prompts, reference, max_tokens, f"chunked, preempted ({backend})")
        assert llm.totals.num_preemptions > 0, f"no preemption with {tight_blocks} blocks"
        seen[f"preemptions_{backend}"] = llm.totals.num_preemptions
        llm.engine.check_integrity()
        assert llm.engine.scheduler.kv.usage() == 0.0
        del llm
    return seen
