"""Offline throughput: servelm's `LLM.generate` (one continuous batch) vs transformers' `generate`.

transformers runs one request at a time, as someone without a serving engine would. Both sides
get the same prompts (random token ids), the same dtype, the same number of torch threads and
greedy decoding with EOS ignored, so every request yields exactly `--output-len` tokens.

    python benchmarks/offline_throughput.py --num-requests 32 --input-len 128 --output-len 64
    python benchmarks/offline_throughput.py --dtype bfloat16 --repeat 2 --hf-requests 8 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from servelm import LLM, SamplingParams


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    # Stay clear of the low ids, where byte-level vocabularies keep their special tokens.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size, (num, length), generator=g).tolist()


@dataclass
class Timing:
    """Output tokens, wall seconds and CPU seconds (all threads of this process) of one side."""

    tokens: int
    wall_s: float
    cpu_s: float

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def tok_per_cpu_s(self) -> float:
        return self.tokens / self.cpu_s

    def line(self, name: str) -> str:
        return (
            f"{name:<13}: {self.tokens} tokens in {self.wall_s:7.2f} s = {self.tok_per_s:7.1f} "
            f"output tok/s  ({self.cpu_s:7.2f} CPU s = {self.tok_per_cpu_s:6.1f} tok per CPU s)"
        )


def timed(fn) -> Timing:
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = fn()
    return Timing(tokens, time.perf_counter() - wall, time.process_time() - cpu)


def run_servelm(llm: LLM, prompts: list[list[int]], output_len: int) -> Timing:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    return timed(lambda: sum(len(r.outputs[0].token_ids) for r in llm.generate(prompts, params)))


def run_transformers(model, prompts: list[list[int]], output_len: int) -> Timing:
    model.generation_config.eos_token_id = None  # like ignore_eos: always output_len tokens

    def generate(prompt: list[int], max_new_tokens: int) -> int:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
        return out.shape[1] - len(prompt)

    generate(prompts[0][:16], 2)  # warm-up, as servelm's engine warms up when it starts
    return timed(lambda: sum(generate(p, output_len) for p in prompts))


def print_profile(llm: LLM, prompts: list[list[int]], output_len: int, top: int = 15) -> None:
    """Profiles a run on fresh prompts (the measured ones would now hit the prefix cache)."""
    profiler = cProfile.Profile()
    profiler.enable()
    timing = run_servelm(llm, prompts, output_len)
    profiler.disable()
    print(f"\ncProfile of one more servelm run, on new prompts (top {top} by own time):")
    print(timing.line("servelm+prof"))
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


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
        "--hf-requests",
        type=int,
        default=None,
        help="time transformers on only the first N prompts (its one-at-a-time throughput "
        "does not depend on how many there are; default: all)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of both sides, alternating, on new prompts each; the best round counts",
    )
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

    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    vocab = llm.info.spec.vocab_size

    # Alternate the two sides, with new prompts each round (old ones would hit the prefix
    # cache), and keep each side's best round: on a shared machine, the least disturbed one.
    ours: list[Timing] = []
    hf: list[Timing] = []
    for r in range(args.repeat):
        prompts = random_prompts(args.num_requests, args.input_len, vocab, args.seed + r)
        ours.append(run_servelm(llm, prompts, args.output_len))
        print(ours[-1].line("servelm"), flush=True)
        hf.append(run_transformers(model, prompts[: args.hf_requests], args.output_len))
        print(hf[-1].line("transformers"), flush=True)
    ours_best = max(ours, key=lambda t: t.tok_per_s)
    hf_best = max(hf, key=lambda t: t.tok_per_s)
    ratio = ours_best.tok_per_s / hf_best.tok_per_s
    per_cpu = ours_best.tok_per_cpu_s / hf_best.tok_per_cpu_s
    print(
        f"best of {args.repeat}: servelm {ours_best.tok_per_s:.1f} tok/s, transformers "
        f"{hf_best.tok_per_s:.1f} tok/s; ratio {ratio:.2f}x ({per_cpu:.2f}x per CPU second)"
    )

    if args.profile or ratio < 6:
        del model
        fresh = random_prompts(args.num_requests, args.input_len, vocab, args.seed + args.repeat)
        print_profile(llm, fresh, args.output_len)


if __name__ == "__main__":
    main()
