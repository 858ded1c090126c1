"""Prefix-aware against round-robin routing over two replicas: TTFT and prefix-cache hit rates.

    .venv/bin/python benchmarks/routing.py [--model DIR] [--prefixes 4] [--prefix-tokens 768]
        [--requests 48] [--concurrency 4] [--kv-prefixes 2.5] [--out DIR]

Starts two `servelm serve` replicas on loopback, each with a KV cache that holds about
`--kv-prefixes` of the `--prefixes` system prompts: fewer than all of them, so where a request
goes decides whether its prefix is still cached (with room for everything on every replica,
round-robin would catch up after one miss per prefix and replica). For each policy: a fresh
router, a workload of its own (fresh system prompts, so one policy's cache cannot help the
next), `servelm bench` against the router (its programmatic API, a closed loop at
`--concurrency`), and each replica's `servelm:prefix_cache_{hits,queries}_total` before and
after. Prints a table and writes each bench result JSON plus a summary into `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from servelm.bench import BenchConfig, Load, WorkloadSpec, run_benchmark
from servelm.bench.ready import wait_healthy
from servelm.bench.workload import PromptBuilder, load_tokenizer

POLICIES = ("round-robin", "prefix-aware")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "servelm.cli", *args, "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, f"http://127.0.0.1:{port}"


def kv_bytes_per_token(model_dir: Path) -> int:
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    dtype = c.get("torch_dtype") or c.get("dtype") or "float32"
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 4)


def prefix_counters(url: str) -> tuple[float, float]:
    hits = queries = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("servelm:prefix_cache_hits_total"):
            hits += float(line.rsplit(" ", 1)[1])
        elif line.startswith("servelm:prefix_cache_queries_total"):
            queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def write_dataset(path: Path, builder: PromptBuilder, args: argparse.Namespace, seed: int) -> None:
    """`--requests` chats, each one of `--prefixes` system prompts (drawn at random) + a question."""
    rng = random.Random(seed)
    systems = [builder.build(rng, args.prefix_tokens)[0] for _ in range(args.prefixes)]
    lines = []
    for _ in range(args.requests):
        question = builder.build(rng, args.question_tokens)[0]
        messages = [
            {"role": "system", "content": rng.choice(systems)},
            {"role": "user", "content": question},
        ]
        lines.append(json.dumps({"messages": messages, "max_tokens": args.output_tokens}))
    path.write_text("\n".join(lines) + "\n")


def run_policy(
    policy: str,
    replicas: list[str],
    model: str,
    model_dir: Path,
    dataset: Path,
    args: argparse.Namespace,
    work: Path,
) -> dict[str, Any]:
    flags = ["route", "--policy", policy, "--log-level", "warning"]
    for url in replicas:
        flags += ["--replica", url]
    proc, url = start(flags, work / f"router-{policy}.log")
    try:
        wait_healthy(url + "/health", proc, 60, 0.3)
        before = {r: prefix_counters(r) for r in replicas}
        config = BenchConfig(
            base_url=url,
            model=model,
            endpoint="chat",
            workload=WorkloadSpec(
                preset="chat", dataset=str(dataset), output_len=args.output_tokens
            ),
            tokenizer=str(model_dir),
            loads=(Load(concurrency=args.concurrency),),
            num_requests=args.requests,
            server_metrics=False,
            timeout_s=1800,
        )
        result = asyncio.run(run_benchmark(config))
        after = {r: prefix_counters(r) for r in replicas}
        per_replica = requests_by_replica(url)
    finally:
        proc.terminate()
        proc.wait(30)
    result.write_json(args.out / f"bench-{policy}.json")
    summary = result.runs[0].summary
    hits = {r: (after[r][0] - before[r][0], after[r][1] - before[r][1]) for r in replicas}
    total_h, total_q = sum(h for h, _ in hits.values()), sum(q for _, q in hits.values())
    return {
        "policy": policy,
        "failed": result.failed,
        "ttft_ms": {k: summary["ttft_ms"][k] for k in ("p50", "p99", "mean")},
        "prefix_hit_rate": total_h / total_q if total_q else None,
        "replica_hit_rates": {r: h / q if q else None for r, (h, q) in hits.items()},
        "requests_by_replica": per_replica,
    }


def requests_by_replica(router_url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(router_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("servelm_router:requests_total{"):
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            out[replica] = out.get(replica, 0) + float(line.rsplit(" ", 1)[1])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder (default: the servelm default model)")
    p.add_argument("--prefixes", type=int, default=4, help="distinct system prompts")
    p.add_argument("--prefix-tokens", type=int, default=768)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--requests", type=int, default=48, help="per policy")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument(
        "--kv-prefixes", type=float, default=2.5, help="system prompts one KV cache holds"
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per replica")
    p.add_argument("--out", type=Path, default=Path("routing-bench"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model:
        model_dir = Path(args.model)
    else:
        from servelm.store.default import ensure_default_model

        model_dir = Path(ensure_default_model())
    tokens = int(
        args.kv_prefixes * args.prefix_tokens
        + args.concurrency * (args.question_tokens + args.output_tokens + 64)
    )
    kv_bytes = tokens * kv_bytes_per_token(model_dir)
    builder = PromptBuilder(load_tokenizer(model_dir))
    work = Path(tempfile.mkdtemp(prefix="routing-bench-"))
    procs, replicas = [], []
    try:
        for i in range(2):
            proc, url = start(
                [
                    "serve",
                    str(model_dir),
                    "--served-model-name",
                    "bench-model",
                    "--kv-cache-memory",
                    str(kv_bytes),
                    "--num-threads",
                    str(args.threads),
                    "--log-level",
                    "warning",
                ],
                work / f"replica-{i}.log",
            )
            procs.append(proc)
            replicas.append(url)
        for proc, url in zip(procs, replicas, strict=True):
            wait_healthy(url + "/health", proc, 300, 0.3)
            httpx.post(
                url + "/v1/completions",
                timeout=300,  # first-forward warm-up
                json={"model": "bench-model", "prompt": "warm up", "max_tokens": 2},
            )
        rows = []
        for seed, policy in enumerate(POLICIES):
            dataset = work / f"dataset-{policy}.jsonl"
            write_dataset(dataset, builder, args, seed)
            rows.append(run_policy(policy, replicas, "bench-model", model_dir, dataset, args, work))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    setup = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    setup.update(model=str(model_dir), kv_tokens_per_replica=tokens)
    (args.out / "summary.json").write_text(json.dumps({"setup": setup, "results": rows}, indent=1))
    print(
        f"{args.prefixes} system prompts x {args.prefix_tokens} tokens, {args.requests} requests, "
        f"concurrency {args.concurrency}, KV for ~{tokens} tokens per replica, model {model_dir.name}"
    )
    print(
        f"{'policy':<14}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'hit rate':>10}  per replica (hit rate, requests)"
    )
    for row in rows:
        per = ", ".join(
            f"{(rate or 0):.0%}/{row['requests_by_replica'].get(r, 0):.0f}"
            for r, rate in row["replica_hit_rates"].items()
        )
        print(
            f"{row['policy']:<14}{row['ttft_ms']['p50']:>12.1f}{row['ttft_ms']['p99']:>12.1f}"
            f"{(row['prefix_hit_rate'] or 0):>10.1%}  {per}"
            + (f"  FAILED {row['failed']}" if row["failed"] else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
