"""What structured outputs cost (issue #30): decode speed of 16 constrained requests against 16
plain ones, and the compile of a 30-field nested schema, first and cached.

    .venv/bin/python -m benchmarks.structured_outputs [--model DIR] [--rounds 2] [--out FILE]

One fresh `servelm serve` (default flags). Each round sends 16 streamed chat requests at once,
plain (greedy, EOS ignored, OUTPUT tokens each) and then constrained (greedy, a JSON array of
exactly ITEMS integers: about as many tokens, ending when the grammar completes); per request
TPOT = (last chunk - first chunk) / (tokens - 1), and decode throughput = tokens / wall time.
Compile: the same 30-field schema (nested objects, enums, arrays) in-process through the
engine's `GrammarCompiler` (first compile, then a cached one plus the per-request copy), and
through the server as the time to a 1-token answer, first with that schema and then again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

from benchmarks.serve_latency import MODEL_NAME, Server
from servelm.engine.sampling_params import StructuredOutput

CONCURRENCY = 16
OUTPUT = 128
ITEMS = 32  # about OUTPUT tokens on the default model (4 tokens an item)
ARRAY = {"type": "array", "items": {"type": "integer"}, "minItems": ITEMS, "maxItems": ITEMS}


def wide_schema(fields: int = 30) -> dict[str, Any]:
    """A schema of `fields` properties: strings, integers, enums, arrays and nested objects."""
    kinds = [
        {"type": "string"},
        {"type": "integer"},
        {"enum": ["low", "medium", "high"]},
        {"type": "array", "items": {"type": "string"}},
        {
            "type": "object",
            "properties": {"x": {"type": "number"}, "tags": {"type": "array",
                                                              "items": {"type": "string"}}},
            "required": ["x", "tags"],
            "additionalProperties": False,
        },
    ]  # fmt: skip
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}  # fmt: skip


def one(client: openai.OpenAI, i: int, constrained: bool) -> tuple[int, float, float]:
    """(tokens, first chunk time, last chunk time) of one streamed request."""
    extra: dict[str, Any] = {"guided_json": ARRAY} if constrained else {"ignore_eos": True}
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": f"List {ITEMS} numbers starting at {i}."}],
        temperature=0,
        max_tokens=4 * OUTPUT if constrained else OUTPUT,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    first = last = 0.0
    tokens = 0
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or now
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens, first, last


def load(client: openai.OpenAI, constrained: bool) -> dict[str, float]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        runs = list(pool.map(lambda i: one(client, i, constrained), range(CONCURRENCY)))
    wall = time.perf_counter() - t0
    tpots = [(last - first) / (n - 1) for n, first, last in runs if n > 1]
    return {
        "tokens": sum(n for n, _, _ in runs),
        "wall_s": wall,
        "decode_tok_per_s": sum(n for n, _, _ in runs) / wall,
        "tpot_ms_median": 1000 * statistics.median(tpots),
    }


def compile_in_process(model_dir: Path, schema: dict[str, Any]) -> dict[str, float]:
    from servelm.model.config import load_spec
    from servelm.structured.compiler import GrammarCompiler
    from servelm.text.tokenizer import TextTokenizer

    compiler = GrammarCompiler(model_dir / "tokenizer.json", load_spec(model_dir).vocab_size)
    eos = frozenset(TextTokenizer(model_dir).eos_token_ids)
    t0 = time.perf_counter()
    compiler.submit(StructuredOutput("regex", "a"), eos).result()  # the vocabulary, once
    t1 = time.perf_counter()
    spec = StructuredOutput("json", json.dumps(schema))
    compiler.submit(spec, eos).result()
    t2 = time.perf_counter()
    compiler.submit(spec, eos).result().deep_copy()
    t3 = time.perf_counter()
    return {"tokenizer_s": t1 - t0, "first_compile_ms": 1000 * (t2 - t1),
            "cached_ms": 1000 * (t3 - t2)}  # fmt: skip


def compile_through_server(client: openai.OpenAI, schema: dict[str, Any]) -> dict[str, float]:
    def timed() -> float:
        t0 = time.perf_counter()
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Fill it in."}], max_tokens=1,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
        )  # fmt: skip
        return 1000 * (time.perf_counter() - t0)

    return {"first_ms": timed(), "again_ms": timed()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the default model)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.model is None:
        from servelm.store.default import ensure_default_model

        args.model = ensure_default_model(None)
    model_dir = Path(args.model)
    schema = wide_schema()
    result: dict[str, Any] = {"in_process": compile_in_process(model_dir, schema)}
    log = Path(tempfile.mkdtemp(prefix="servelm-bench-")) / "server.log"
    server = Server(model_dir, [], log)
    try:
        server.wait_ready(300)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        result["through_server"] = compile_through_server(client, schema)
        one(client, 0, True)  # warm: the array grammar compiled, caches filled
        rounds = []
        for _ in range(args.rounds):
            rounds.append({"plain": load(client, False), "constrained": load(client, True)})
        result["rounds"] = rounds
    finally:
        server.stop()
    for r in result["rounds"]:
        p, c = r["plain"], r["constrained"]
        ratio = c["decode_tok_per_s"] / p["decode_tok_per_s"]
        print(f"plain {p['decode_tok_per_s']:.1f} tok/s (TPOT {p['tpot_ms_median']:.1f} ms), "
              f"constrained {c['decode_tok_per_s']:.1f} tok/s (TPOT {c['tpot_ms_median']:.1f} "
              f"ms): {ratio:.3f}x")  # fmt: skip
    print("compile, in process:", json.dumps(result["in_process"]))
    print("compile, through the server:", json.dumps(result["through_server"]))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
