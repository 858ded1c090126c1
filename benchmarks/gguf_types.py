"""Decode speed of one Llama-shaped model as a Q4_K_M-style GGUF, as Q4_1 and in bf16, served
by servelm's real loader and engine on this CPU.

    .venv/bin/python -m benchmarks.gguf_types                       # 12 layers, hidden 1024
    .venv/bin/python -m benchmarks.gguf_types --layers 4 --tokens 32
    .venv/bin/python -m benchmarks.gguf_types --threads 1   # one core: steadier when shared

The same random weights are written three times with the `gguf` package: Q4_K with v and down
in Q6_K (the Q4_K_M recipe; K-quants made with tests/gguf_kquants.py, since the `gguf` package
cannot), every projection Q4_1 (the default model's form), and F32 (served as bf16). Each file
is imported and served in bfloat16 with one request; a decode token's time is
(time of 1 + N tokens - time of 1 token) / N, the fastest of --rounds, the forms taking turns
round after round (every round is in the JSON). "bytes / token" is
what a decode step reads of the weights: every projection in the form it is served in, plus
the head (float32 here; the tiny vocabulary makes it negligible).
Prints a table and, with --json, writes it with the CPU's model name.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

from benchmarks.workloads import cpu_kind
from tests.gguf_kquants import Q, quantize_k
from tests.store.gguf_models import MERGES, SPECIALS, TOKENS

FORMS = {
    "Q4_K_M": lambda name: Q.Q6_K if name in ("attn_v", "ffn_down") else Q.Q4_K,
    "Q4_1": lambda name: Q.Q4_1,
    "bf16": lambda name: Q.F32,
}


def write_gguf(path: Path, weights: dict[str, np.ndarray], form: str, dims: dict) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(dims["layers"])
    writer.add_context_length(2048)
    writer.add_embedding_length(dims["hidden"])
    writer.add_feed_forward_length(dims["ffn"])
    writer.add_head_count(dims["heads"])
    writer.add_head_count_kv(dims["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, w in weights.items():
        part = name.split(".")[-2] if name.startswith("blk.") else ""
        qtype = FORMS[form](part) if w.ndim == 2 and part else Q.F32
        if qtype == Q.F32:
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, quantize_k(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def random_weights(dims: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, f, hd = dims["hidden"], dims["ffn"], dims["hidden"] // dims["heads"]

    def rand(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.05).astype(np.float32)

    out = {"token_embd.weight": rand(len(TOKENS), h), "output_norm.weight": np.ones(h, np.float32)}
    for i in range(dims["layers"]):
        p = f"blk.{i}."
        out[p + "attn_q.weight"] = rand(h, h)
        out[p + "attn_k.weight"] = rand(dims["kv_heads"] * hd, h)
        out[p + "attn_v.weight"] = rand(dims["kv_heads"] * hd, h)
        out[p + "attn_output.weight"] = rand(h, h)
        out[p + "ffn_gate.weight"] = rand(f, h)
        out[p + "ffn_up.weight"] = rand(f, h)
        out[p + "ffn_down.weight"] = rand(h, f)
        out[p + "attn_norm.weight"] = np.ones(h, np.float32)
        out[p + "ffn_norm.weight"] = np.ones(h, np.float32)
    return out


class Served:
    """One form's model loaded by servelm, timed a round at a time."""

    def __init__(self, folder: Path, threads: int | None = None) -> None:
        from servelm import LLM

        self.llm = llm = LLM(
            str(folder),
            dtype="bfloat16",
            kv_cache_memory="64MiB",
            device="cpu",
            num_threads=threads,
        )
        model = llm.engine.executor.model
        head = model.logits_head
        # bytes of weights a decode step reads
        self.read = model.weight_bytes - model.embed_tokens.weight.nbytes
        if (
            head.weight is not None
            and head.weight.data_ptr() != model.embed_tokens.weight.data_ptr()
        ):
            self.read += head.weight.nbytes
        self.served = (
            f"{model.gguf_layers} GGUF-kept, {model.int4_layers} int4 projections"
            f"{', C layer loop' if llm.engine.executor.decode_stack is not None else ''}"
        )
        self._run(4)  # warm-up

    def _run(self, n: int) -> float:
        from servelm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        self.llm.generate([[3, 4, 5, 6, 7, 8]], params)
        return time.perf_counter() - t0

    def round_ms(self, tokens: int) -> float:
        """ms per decode token: (time of 1 + N tokens - time of 1 token) / N."""
        return (self._run(1 + tokens) - self._run(1)) / tokens * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32, help="decode tokens timed per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument(
        "--threads",
        type=int,
        help="CPU threads (default: every core); on a machine shared with other work, 1 keeps "
        "each step from waiting for a second thread the scheduler has parked",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    dims = dict(
        layers=args.layers,
        hidden=args.hidden,
        ffn=args.ffn,
        heads=args.heads,
        kv_heads=args.kv_heads,
    )
    from servelm.store.gguf_import import import_gguf

    print(f"{cpu_kind()}: decode of a {dims} model, {args.tokens} tokens a round")
    weights = random_weights(dims)
    forms = args.forms.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        served = {}
        for form in forms:
            src = Path(tmp) / f"{form}.gguf"
            write_gguf(src, weights, form, dims)
            served[form] = Served(import_gguf(src, Path(tmp) / form), args.threads)
        # the forms in turn, round after round: the machine's drift meets each of them alike
        times: dict[str, list[float]] = {form: [] for form in forms}
        for _ in range(args.rounds):
            for form in forms:
                times[form].append(served[form].round_ms(args.tokens))
    rows = []
    for form in forms:
        ms, read = min(times[form]), served[form].read
        rows.append(
            dict(
                form=form,
                ms_per_token=ms,
                rounds_ms=times[form],
                bytes_per_token=read,
                served=served[form].served,
            )
        )
        print(
            f"{form:7s} {ms:8.2f} ms/token  {read / 2**20:8.1f} MiB/token  "
            f"{read / 1e6 / ms:6.2f} GB/s  ({served[form].served})",
            flush=True,
        )
    result = dict(cpu=cpu_kind(), dims=dims, tokens=args.tokens, threads=args.threads, results=rows)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
