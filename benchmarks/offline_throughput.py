"""Offline throughput: servelm's `LLM.generate` (one continuous batch) vs transformers' `generate`.

transformers runs one request at a time, as someone without a serving engine would. Both sides
get the same prompts (random token ids), the same dtype, the same number of torch threads and
greedy decoding with EOS ignored, so every request yields exactly `--output-len` tokens.

    python benchmarks/offline_throughput.py --num-requests 32 --input-len 128 --output-len 64
    python benchmarks/offline_throughput.py --dtype bfloat16 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time
from pathlib import Path

import torch

from servelm import LLM, SamplingParams


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    # Stay clear of the low ids, where byte-level vocabularies keep their special tokens.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size, (num, length), generator=g).tolist()


def run_servelm(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[int, float]:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    return sum(len(r.outputs[0].token_ids) for r in results), elapsed


def run_transformers(model, prompts: list[list[int]], output_len: int) -> tuple[int, float]:
    model.generation_config.eos_token_id = None  # like ignore_eos: always output_len tokens
    tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=output_len,
                pad_token_id=0,
            )
            tokens += out.shape[1] - len(prompt)
    return tokens, time.perf_counter() - t0


def print_profile(llm: LLM, prompts: list[list[int]], output_len: int, top: int = 15) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    run_servelm(llm, prompts, output_len)
    profiler.disable()
    print(f"\ncProfile of a second servelm run (top {top} by cumulative time):")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(top)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--model", default=None, help="model folder (default: servelm's default model)"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch CPU threads for both sides (default: all cores)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print a cProfile of the servelm run (always done when < 6x)",
    )
    args = parser.parse_args(argv)

    tokens_needed = args.num_requests * (args.input_len + args.output_len)
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads)
    model_dir = Path(llm.info.model_dir)
    kv_tokens = llm.info.num_blocks * llm.info.block_size
    print(
        f"model {model_dir.name}, dtype {args.dtype}, {args.threads} threads, device {llm.info.device}; "
        f"{args.num_requests} requests x ({args.input_len} in, {args.output_len} out); "
        f"KV cache {kv_tokens} tokens (batch needs {tokens_needed})"
    )
    prompts = random_prompts(args.num_requests, args.input_len, llm.info.spec.vocab_size, args.seed)

    ours_tokens, ours_s = run_servelm(llm, prompts, args.output_len)
    ours = ours_tokens / ours_s
    print(f"servelm      : {ours_tokens} tokens in {ours_s:7.2f} s = {ours:8.1f} output tok/s")

    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    hf_tokens, hf_s = run_transformers(model, prompts, args.output_len)
    hf = hf_tokens / hf_s
    print(f"transformers : {hf_tokens} tokens in {hf_s:7.2f} s = {hf:8.1f} output tok/s")
    ratio = ours / hf
    print(f"ratio servelm / transformers: {ratio:.2f}x")

    if args.profile or ratio < 6:
        del model
        print_profile(llm, prompts, args.output_len)


if __name__ == "__main__":
    main()
