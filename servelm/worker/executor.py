"""Builds a ready EngineCore for a model: resolve the folder, load weights, size the KV cache.

This is where torch meets the torch-free engine: the model runner is the engine's executor.
Start-up stages are logged with their timings.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from servelm.config import EngineArgs
from servelm.engine.core import EngineCore
from servelm.engine.kv_cache import kv_window
from servelm.engine.scheduler import SchedulerConfig
from servelm.model.config import ModelSpec, load_spec
from servelm.model.loader import checkpoint_names
from servelm.model.parallel import check_supported
from servelm.store.fetch import resolve_model_dir
from servelm.structured.matcher import StructuredOutputs
from servelm.worker.model_runner import ModelRunner
from servelm.worker.tp import TPRunner

logger = logging.getLogger("servelm")


@dataclass
class EngineInfo:
    model_dir: Path
    spec: ModelSpec
    max_model_len: int
    num_blocks: int
    block_size: int
    device: str
    dtype: str


def create_engine_core(
    args: EngineArgs, model_dir: Path | None = None
) -> tuple[EngineCore, EngineInfo]:
    model_dir = model_dir or resolve_model_dir(args)
    spec = load_spec(model_dir)
    max_model_len = args.max_model_len or spec.max_position_embeddings
    if max_model_len > spec.max_position_embeddings and not spec.rope_scaling:
        raise ValueError(
            f"--max-model-len {max_model_len} exceeds the model's context {spec.max_position_embeddings}"
        )
    runner_kwargs = dict(
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        kernels=args.kernels,
        int4_activations=args.int4_activations,
        batch_invariant=args.batch_invariant,
        block_size=args.block_size,
        max_model_len=max_model_len,
        seed=args.seed,
        num_threads=args.num_threads,
    )
    tp = args.tensor_parallel_size
    if tp > 1:
        check_supported(spec, checkpoint_names(model_dir), tp)  # before any rank starts
        runner = TPRunner(model_dir, spec, tp, **runner_kwargs)
        runner.log_ranks()
    else:
        runner = ModelRunner(model_dir, spec, **runner_kwargs)
    int4 = f", int4 weights for {runner.int4_layers} projections" if runner.int4_layers else ""
    if runner.model.int4_kept:
        int4 += ", kept from the last start"
    logger.info(
        "weights loaded in %.2f s: %.3f GiB (%s, %s%s)",
        runner.load_seconds,
        runner.weight_bytes / 2**30,
        runner.dtype,
        runner.device,
        int4,
    )
    t0 = time.perf_counter()
    num_blocks = runner.profile_num_blocks(
        args.kv_cache_memory, args.gpu_memory_utilization, args.max_num_batched_tokens
    )
    if num_blocks < 1:
        raise ValueError(
            "no memory left for the KV cache; raise --kv-cache-memory or --gpu-memory-utilization"
        )
    tokens = num_blocks * args.block_size
    window = kv_window(spec.layer_windows)
    if tokens < max_model_len and window is None:
        if args.max_model_len is not None:  # asked for, so not quietly less (as vLLM refuses)
            raise ValueError(
                f"--max-model-len {max_model_len} does not fit the KV cache, which holds "
                f"{tokens} tokens: raise --kv-cache-memory or lower --max-model-len"
            )
        logger.warning(
            "the KV cache holds %d tokens, fewer than the model's context of %d: a request may "
            "use at most %d (raise --kv-cache-memory for more)",
            tokens,
            max_model_len,
            tokens,
        )
    runner.allocate_kv_cache(num_blocks)
    logger.info("kernels: %s", runner.kernel_summary)
    logger.info(
        "KV cache: %d tokens in %d blocks of %d (%.3f GiB, %d B/token); max concurrency at "
        "%d tokens: %.2fx",
        tokens,
        num_blocks,
        args.block_size,
        num_blocks * runner.bytes_per_block / 2**30,
        runner.bytes_per_block // args.block_size,
        max_model_len,
        tokens / max_model_len,
    )
    if window is not None:
        logger.info(
            "KV cache: every layer's window ends %d tokens back: blocks behind it are "
            "given back to the pool",
            window,
        )
    runner.warm_up(args.max_num_batched_tokens)
    logger.info("warm-up done in %.2f s", time.perf_counter() - t0)
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_admit_tokens=args.prefill_admit_tokens(runner.device.type),
        max_model_len=max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        policy=args.scheduling_policy,
        sliding_window=window,
    )
    info = EngineInfo(
        model_dir,
        spec,
        max_model_len,
        num_blocks,
        args.block_size,
        str(runner.device),
        str(runner.dtype).replace("torch.", ""),
    )
    # Grammars read the tokenizer and mask the logits' full width (lazily: nothing is loaded
    # until a request asks for structure).
    structured = StructuredOutputs(Path(model_dir) / "tokenizer.json", spec.vocab_size)
    return EngineCore(config, runner, structured), info
