"""Step time at tensor-parallel size 1 and 2 on this machine's cores, servelm's real loader and
engine: one process with every core against two ranks sharing them (one thread each; their
all-reduces through shared memory, or through gloo with SERVELM_TP_SHM=0).

    .venv/bin/python -m benchmarks.tensor_parallel                     # 12 layers, hidden 1024
    .venv/bin/python -m benchmarks.tensor_parallel --rounds 3 --json out.json

A Llama-shaped model with random weights (16 query heads over 4 KV heads, so that 2 ranks can
split it; the default model's 9 heads cannot be) is written as a Q4_1 GGUF, the default model's
form, and imported; each rank then serves its slices from int4 copies. The sizes alternate
(1, 2, 1, 2, ...) so that the machine's drift falls on both. Per size: a decode token's time
((1 + N tokens) - (1 token)) / N, a 256-token prompt step's, the bytes each rank read from the
checkpoint and its resident memory after loading.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

# benchmarks/gguf_types.py's model: 16 query heads over 4 KV heads, so that 2 ranks can split it
DIMS = dict(layers=12, hidden=1024, ffn=2816, heads=16, kv_heads=4)


def make_model(folder: Path, layers: int) -> Path:
    from benchmarks.gguf_types import random_weights, write_gguf
    from servelm.store.gguf_import import import_gguf

    dims = {**DIMS, "layers": layers}
    write_gguf(folder / "model.gguf", random_weights(dims), "Q4_1", dims)
    return import_gguf(folder / "model.gguf", folder / "model")


def measure(model_dir: Path, tp: int, tokens: int) -> dict:
    from servelm import LLM, SamplingParams
    from servelm.worker.tp import rss_bytes

    llm = LLM(
        str(model_dir),
        dtype="bfloat16",
        kv_cache_memory="256MiB",
        tensor_parallel_size=tp,
        enable_prefix_caching=False,  # each run's prompt is computed, not found cached
    )
    runner = llm.engine.executor
    prompt = [3 + i % 20 for i in range(256)]  # (the test tokenizer has 24 tokens)

    def run(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([prompt], params)
        return time.perf_counter() - t0

    run(2)  # warm
    one = min(run(1) for _ in range(3))  # the prompt step
    many = min(run(1 + tokens) for _ in range(2))
    if tp > 1:
        ranks = [
            {"rank": r.rank, "bytes_read": r.bytes_read, "rss_bytes": r.rss_bytes}
            for r in runner.ranks
        ]
    else:
        # one process reads every tensor whole: the checkpoint's size
        size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        ranks = [{"rank": 0, "bytes_read": size, "rss_bytes": rss_bytes()}]
    llm = None  # (its ranks stop with it)
    return {
        "tp": tp,
        "prompt_step_ms": one * 1000,
        "decode_ms_per_token": (many - one) / tokens * 1000,
        "ranks": ranks,
    }


def main() -> None:
    from benchmarks.workloads import cpu_kind

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=DIMS["layers"])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp), args.layers)
        rows = []
        for _ in range(args.rounds):
            for tp in (1, 2):
                rows.append(measure(model_dir, tp, args.tokens))
                r = rows[-1]
                print(
                    f"tp={tp}: prompt step (256 tokens) {r['prompt_step_ms']:.1f} ms, decode "
                    f"{r['decode_ms_per_token']:.2f} ms/token; "
                    + "; ".join(
                        f"rank {x['rank']} read {(x['bytes_read'] or 0) / 2**20:.1f} MiB, "
                        f"RSS {x['rss_bytes'] / 2**20:.0f} MiB"
                        for x in r["ranks"]
                    ),
                    flush=True,
                )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"cpu": cpu_kind(), "dims": DIMS, "layers": args.layers, "runs": rows}, indent=1
            )
        )


if __name__ == "__main__":
    main()
