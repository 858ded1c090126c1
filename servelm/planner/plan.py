"""The sizing plan: does a model fit a GPU, how much KV cache is left, how fast it starts.

`plan()` is a pure function of a model shape, a GPU and the serving knobs. The memory
budget per GPU is the engine's view (decimal GB, like the GPU catalog):

    usable   = GPU memory x gpu_memory_utilization
    KV pool  = usable - weights on this GPU - activation/graph allowance
    blocks   = KV pool // (KV bytes per token per GPU x block_size)
    tokens   = blocks x block_size

Concurrency counts whole blocks per request (a 2,500-token request holds 157 blocks),
the way an engine reports "maximum concurrency". The plan fits when the pool holds at
least one request of `max_model_len` tokens. Where every layer has a sliding window
(`ModelShape.kv_window`, Mistral's), the engine gives back the blocks behind it, so a
request holds at most window + one block of tokens, whatever its length; one
full-attention layer (Gemma's global ones) keeps every block.

Cold start per weight source = weights / storage read bandwidth + this GPU's weights /
PCIe bandwidth + a warm-up allowance (profiling, CUDA-graph capture). The defaults are
sustained rates, container image already cached; with TP all ranks share one storage
link, so the read term uses the full model size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from servelm.planner.catalog import GB, GpuSpec
from servelm.planner.shapes import ModelShape, ShapeError

# Sustained read bandwidth of each weight source, bytes/s (illustrative, not measured).
STORAGE_BANDWIDTH: dict[str, float] = {
    "local NVMe": 3 * GB,
    "network volume": 1 * GB,
    "internet download": 0.1 * GB,
}
PCIE_BANDWIDTH = 25 * GB  # host -> one GPU, PCIe Gen4/5 x16 sustained
WARMUP_S = 40.0  # KV profiling + CUDA-graph capture
TP_CANDIDATES = (1, 2, 4, 8)


class PlanError(ValueError):
    """Settings the planner rejects (bad utilisation, context beyond the model's)."""


@dataclass(frozen=True)
class ColdStart:
    """Seconds from a fresh process to ready, for one weight source."""

    source: str
    bandwidth: float  # bytes/s
    read_s: float
    copy_s: float
    warmup_s: float
    total_s: float


@dataclass(frozen=True)
class Plan:
    """Everything `servelm plan` reports; bytes are per GPU unless named total."""

    model: str
    gpu: str
    weight_dtype: str
    kv_dtype: str
    tp: int
    gpu_memory_utilization: float
    max_model_len: int
    typical_len: int
    block_size: int
    num_params: int
    active_params: int  # what one token is computed with (a mixture's chosen experts only)
    gpu_memory_bytes: float
    usable_bytes: float
    allowance_bytes: float
    weight_bytes_total: float
    weight_bytes: float
    kv_bytes_per_token_total: float  # all KV heads, one copy each
    kv_bytes_per_token: float  # on one GPU
    kv_pool_bytes: float
    kv_capacity_blocks: int
    kv_capacity_tokens: int
    max_concurrency: float  # requests of max_model_len tokens
    typical_concurrency: float  # requests of typical_len tokens
    fits: bool
    verdict: str
    min_tp: int | None  # smallest power-of-two TP <= 8 that fits, None if none does
    q_heads_per_gpu: int
    kv_heads_per_gpu: int
    collectives_per_step: int  # all-reduces and all-gathers of one forward across the ranks
    cold_start: list[ColdStart] = field(default_factory=list)


def blocks_per_request(tokens: int, block_size: int, window: int = 0) -> int:
    """Blocks one request of `tokens` tokens holds (the last one may be partly empty); with
    every layer's `window` (0: none), those of its last window + one block at most."""
    if window:
        tokens = min(tokens, window + block_size)
    return -(-tokens // block_size)


def context_length(model: ModelShape, max_model_len: int | None = None) -> int:
    """`max_model_len`, or the model's whole context if None; a PlanError outside 1..the
    model's context (`servelm simulate` holds to the same range)."""
    max_len = model.max_context if max_model_len is None else max_model_len
    if not 0 < max_len <= model.max_context:
        raise PlanError(f"max_model_len {max_len} outside 1..{model.max_context} for {model.name}")
    return max_len


def plan(
    model: ModelShape,
    gpu: GpuSpec,
    weight_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    tp: int = 1,
    gpu_memory_utilization: float = 0.9,
    max_model_len: int | None = None,
    allowance_gb: float = 2.0,
    block_size: int = 16,
    typical_len: int = 2500,
    storage: dict[str, float] | None = None,
    warmup_s: float = WARMUP_S,
    pcie_bandwidth: float = PCIE_BANDWIDTH,
) -> Plan:
    """Size `model` on `tp` x `gpu`; raises PlanError / ShapeError on impossible settings.

    `allowance_gb` is the flat per-GPU reserve for activations and CUDA graphs (decimal
    GB); `storage` maps weight-source names to read bandwidth in bytes/s.
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise PlanError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if block_size < 1 or typical_len < 1 or allowance_gb < 0:
        raise PlanError("block_size and typical_len must be positive, allowance non-negative")
    allowance_bytes = allowance_gb * GB
    max_len = context_length(model, max_model_len)

    q_heads, kv_heads = model.heads_per_gpu(tp)
    weights = model.weight_bytes(weight_dtype, tp)
    kv_token = model.kv_bytes_per_token(kv_dtype, tp)
    usable = gpu.memory_bytes * gpu_memory_utilization
    pool = usable - weights - allowance_bytes
    blocks = max(0, int(pool // (kv_token * block_size)))
    tokens = blocks * block_size
    window = model.kv_window
    fits = blocks >= blocks_per_request(max_len, block_size, window)
    min_tp = _smallest_fitting_tp(
        model, gpu, weight_dtype, kv_dtype, usable, allowance_bytes, block_size, max_len
    )
    total_weights = model.weight_bytes(weight_dtype, 1)
    sources = STORAGE_BANDWIDTH if storage is None else storage
    cold = [
        _cold_start(s, bw, total_weights, weights, pcie_bandwidth, warmup_s)
        for s, bw in sources.items()
    ]
    return Plan(
        model=model.name,
        gpu=gpu.name,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        tp=tp,
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_len,
        typical_len=typical_len,
        block_size=block_size,
        num_params=model.num_params(),
        active_params=model.active_params(),
        gpu_memory_bytes=gpu.memory_bytes,
        usable_bytes=usable,
        allowance_bytes=allowance_bytes,
        weight_bytes_total=total_weights,
        weight_bytes=weights,
        kv_bytes_per_token_total=model.kv_bytes_per_token(kv_dtype, 1),
        kv_bytes_per_token=kv_token,
        kv_pool_bytes=pool,
        kv_capacity_blocks=blocks,
        kv_capacity_tokens=tokens,
        max_concurrency=blocks / blocks_per_request(max_len, block_size, window),
        typical_concurrency=blocks / blocks_per_request(typical_len, block_size, window),
        fits=fits,
        verdict=_verdict(fits, weights, usable, allowance_bytes, tokens, max_len, tp, min_tp)
        + (
            f" (sliding window {window:,}: a request holds at most {window + block_size:,})"
            if window
            else ""
        ),
        min_tp=min_tp,
        q_heads_per_gpu=q_heads,
        kv_heads_per_gpu=kv_heads,
        collectives_per_step=model.collectives_per_step(tp),
        cold_start=cold,
    )


def _smallest_fitting_tp(
    model: ModelShape,
    gpu: GpuSpec,
    weight_dtype: str,
    kv_dtype: str,
    usable: float,
    allowance: float,
    block_size: int,
    max_len: int,
) -> int | None:
    for tp in TP_CANDIDATES:
        try:
            pool = usable - model.weight_bytes(weight_dtype, tp) - allowance
            kv_block = model.kv_bytes_per_token(kv_dtype, tp) * block_size
        except ShapeError:
            continue  # heads do not split this way
        need = blocks_per_request(max_len, block_size, model.kv_window)
        if pool > 0 and int(pool // kv_block) >= need:
            return tp
    return None


def _cold_start(
    source: str, bandwidth: float, total: float, per_gpu: float, pcie: float, warmup: float
) -> ColdStart:
    read, copy = total / bandwidth, per_gpu / pcie
    return ColdStart(source, bandwidth, read, copy, warmup, read + copy + warmup)


def _verdict(
    fits: bool,
    weights: float,
    usable: float,
    allowance: float,
    tokens: int,
    max_len: int,
    tp: int,
    min_tp: int | None,
) -> str:
    hint = f"; smallest TP that fits: {min_tp}" if min_tp and min_tp != tp else ""
    if not min_tp:
        hint = "; no TP up to 8 fits: quantise weights/KV or lower max_model_len"
    if fits:
        return f"fits: KV holds {tokens:,} tokens >= max_model_len {max_len:,}"
    if weights + allowance >= usable:
        return (
            f"does not fit: weights {weights / GB:.2f} GB + allowance {allowance / GB:.2f} GB "
            f">= {usable / GB:.2f} GB usable per GPU{hint}"
        )
    return (
        f"does not fit: KV cache holds {tokens:,} tokens < max_model_len {max_len:,} "
        f"(lower --max-model-len){hint}"
    )
