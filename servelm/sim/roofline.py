"""Step-time model: how long one engine step takes on a device, from a roofline.

One scheduler step runs one forward pass over a mixed batch (prefill chunks and
one-token decodes). Its time is

    max(matmul FLOPs / (peak_flops x compute_efficiency)
          + attention FLOPs / (peak_flops x attention_efficiency),
        bytes / (mem_bandwidth x bandwidth_efficiency))
    + tensor-parallel all-reduce time + step_overhead_s + per_request_s x requests

where bytes = the weights, streamed once per step whatever the batch size, plus the KV
cache of every token the step's requests attend to, plus the KV written for new tokens.
FLOPs = 2 x matmul params per new token (LM head only for tokens that get sampled) +
4 x layers x query heads x head_dim per (query, key) attention pair (QK^T and PV).
Activations are ignored: small next to weights and KV at serving batch sizes.

Invariants: every figure on a ModelCost is per GPU (one TP rank); `step_time` is
monotonic in every token count within one path (a profile's own steps, or its decode
stack's); an empty step costs nothing.

The built-in GPU profiles take datasheet peaks from the planner's GPU catalog and one
set of default efficiencies, chosen from what serving engines sustain, never fitted to
a case:

- compute_efficiency 0.40: large GEMMs reach 60-70 % of the dense tensor-core peak, but a
  whole step also runs norms, rotary, activation and sampling kernels on ragged shapes, so
  the step's matmul FLOPs land near 40 % of peak.
- attention_efficiency 0.60: attention runs in its own kernel, FlashAttention-class, whose
  forward pass sustains about 60 % of the dense peak at prefill lengths (FlashAttention-3 on
  H100, head_dim 128, causal: roughly 560-650 TFLOP/s of 989 from 2k to 16k tokens;
  FlashAttention-2 on A100: 50-70 % of 312). It matters for long prompts: at 6,000 tokens
  attention is a tenth of a prefill's FLOPs, at 500 under 2 %.
- bandwidth_efficiency 0.75: HBM copy kernels reach ~90 % of the datasheet rate; the
  skinny GEMMs of a decode step stream weights at ~70-80 %.
- step_overhead_s 2 ms: CPU work a Python engine does every step (schedule, build input
  tensors, launch the CUDA graph, sample, hand tokens back), 1-3 ms in practice.
- allreduce_latency_s 10 us: one small NCCL all-reduce inside an NVLink server.

A CPU (or any device) profile comes from measured rates via `measured_profile`; measured
rates are already achieved rates, so its efficiencies are 1 (attention included: the fit
prices all FLOPs at one rate). `per_request_s` is host work that
grows with the batch (per-sequence input building, attention set-up, sampling); it is 0 for the
GPU profiles (a few microseconds there) and fitted for a CPU by `servelm.sim.calibrate`.

Two cost curves on one device: a step in which every request decodes one token, up to
`decode_stack_max_tokens` of them, is priced as servelm's CPU engine runs it through its decode
stack (all layers in one C call, `worker/decode_stack.py`), every other step on the other curve
(fitted to those steps, though the engine runs prompt steps in that C call too where it has the
C prefill attention). A profile fitted to such an engine carries a second profile,
`decode_stack`, that prices those steps; `profile_for_step` picks. The GPU profiles have none.

A third curve: on an AVX2-only CPU (an AMD EPYC before Zen 4) with x in float32 and paths by row
count (`--int4-activations float32 --no-batch-invariant`), steps of at least
`wide_step_min_tokens` tokens run their int4 matmuls through float32 copies of the weights,
dequantized for the step, and torch's float32 matmul (`QuantMatmul.sgemm_min_rows`):
a fixed cost per step at a higher FLOP rate than the C kernels that take smaller steps. Such a
profile carries `wide_step`, which prices those steps. `step_path` decides, for the fit too.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelm.planner.catalog import GPUS, GpuSpec, get_gpu
from servelm.planner.shapes import KV_BYTES, UNQUANTISED_BYTES, ModelShape

GPU_COMPUTE_EFFICIENCY = 0.40
GPU_ATTENTION_EFFICIENCY = 0.60
GPU_BANDWIDTH_EFFICIENCY = 0.75
GPU_STEP_OVERHEAD_S = 2e-3
ALLREDUCE_LATENCY_S = 10e-6


@dataclass(frozen=True)
class DeviceProfile:
    """What one device sustains: peaks, the fraction of them reached, and fixed costs."""

    name: str
    peak_flops: float  # dense FLOP/s for the matmul dtype
    mem_bandwidth: float  # bytes/s between device memory and compute
    compute_efficiency: float  # fraction of peak_flops a whole step sustains (0-1]
    bandwidth_efficiency: float  # fraction of mem_bandwidth a whole step sustains (0-1]
    step_overhead_s: float  # fixed seconds per step, independent of batch (CPU-side work)
    link_bandwidth: float = 0.0  # GPU-to-GPU bytes/s one direction, for TP all-reduces
    allreduce_latency_s: float = ALLREDUCE_LATENCY_S  # fixed cost of one all-reduce
    per_request_s: float = 0.0  # extra seconds per scheduled request in a step (host work)
    # fraction of peak_flops the attention kernels sustain (0-1]; None: compute_efficiency
    attention_efficiency: float | None = None
    # seconds a request spends outside the engine's steps before the client sees a token
    # (HTTP, tokenizing, IPC both ways, detokenizing, streaming): added to TTFT and e2e
    frontend_latency_s: float = 0.0
    # the API process's work on each step's outputs: per step (receiving and unpacking the
    # engine's message) and per token (detokenizing, framing, sending; each request's own
    # handling spread over its tokens). It handles them one step after another, so a server
    # streaming many requests queues their tokens there (0 and 0: no such queue)
    frontend_per_step_s: float = 0.0
    frontend_per_token_s: float = 0.0
    # the engine's second path: decode-only steps of at most this many tokens cost what
    # `decode_stack` says (see the module docstring); None / 0: one path for every step
    decode_stack: DeviceProfile | None = None
    decode_stack_max_tokens: int = 0
    # the engine's float32 path: steps of at least this many tokens (prompt and decode
    # together) cost what `wide_step` says; None / 0: no such path
    wide_step: DeviceProfile | None = None
    wide_step_min_tokens: int = 0

    def effective_flops(self) -> float:
        return self.peak_flops * self.compute_efficiency

    def effective_attention_flops(self) -> float:
        eff = (
            self.compute_efficiency
            if self.attention_efficiency is None
            else self.attention_efficiency
        )
        return self.peak_flops * eff

    def effective_bandwidth(self) -> float:
        return self.mem_bandwidth * self.bandwidth_efficiency

    def profile_for_step(self, prefill_tokens: int, decode_tokens: int) -> DeviceProfile:
        """The profile that prices a step: `decode_stack` for the steps the engine runs
        through it (no prompt tokens, 1 .. decode_stack_max_tokens decodes), `wide_step` for
        steps of at least wide_step_min_tokens tokens, else this one."""
        stack_max = self.decode_stack_max_tokens if self.decode_stack is not None else 0
        wide_min = self.wide_step_min_tokens if self.wide_step is not None else 0
        path = step_path(prefill_tokens, decode_tokens, stack_max, wide_min)
        return {"decode stack": self.decode_stack, "wide": self.wide_step}.get(path) or self


def step_path(prefill_tokens: int, decode_tokens: int, stack_max: int, wide_min: int) -> str:
    """Which code path an engine runs a step on: "decode stack" (no prompt tokens, 1 ..
    `stack_max` decodes), "wide" (at least `wide_min` tokens; 0: no such path) or "layers"."""
    if prefill_tokens == 0 and 0 < decode_tokens <= stack_max:
        return "decode stack"
    if 0 < wide_min <= prefill_tokens + decode_tokens:
        return "wide"
    return "layers"


def gpu_profile(gpu: str | GpuSpec, dtype: str = "bf16") -> DeviceProfile:
    """A catalog GPU with default efficiencies; `dtype` picks the tensor-core peak (fp8/bf16)."""
    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    return DeviceProfile(
        name=f"{spec.name} ({dtype})",
        peak_flops=spec.peak_flops(dtype),
        mem_bandwidth=spec.mem_bandwidth,
        compute_efficiency=GPU_COMPUTE_EFFICIENCY,
        bandwidth_efficiency=GPU_BANDWIDTH_EFFICIENCY,
        step_overhead_s=GPU_STEP_OVERHEAD_S,
        link_bandwidth=spec.link_bandwidth,
        attention_efficiency=GPU_ATTENTION_EFFICIENCY,
    )


PROFILES: dict[str, DeviceProfile] = {key: gpu_profile(spec) for key, spec in GPUS.items()}


def measured_profile(
    flops: float,
    bandwidth: float,
    step_overhead_s: float = 0.0,
    name: str = "cpu",
    per_request_s: float = 0.0,
) -> DeviceProfile:
    """A profile from measured (achieved) FLOP/s and bytes/s, e.g. a CPU after calibration."""
    if flops <= 0 or bandwidth <= 0 or step_overhead_s < 0 or per_request_s < 0:
        raise ValueError("measured flops and bandwidth must be positive, overheads non-negative")
    return DeviceProfile(
        name, flops, bandwidth, 1.0, 1.0, step_overhead_s, per_request_s=per_request_s
    )


@dataclass(frozen=True)
class ModelCost:
    """Per-GPU work of one model: FLOPs per token and pair, bytes per step and per token."""

    name: str
    linear_flops_per_token: float  # 2 x decoder-block matmul params on this rank
    lm_head_flops_per_token: float  # 2 x vocab x hidden / tp, for sampled tokens only
    attention_flops_per_pair: float  # 4 x layers x query heads on rank x head_dim
    weight_bytes_per_step: float  # weights streamed from memory once per step
    kv_bytes_per_token: float  # KV bytes of one token on this rank
    tp: int = 1
    allreduces_per_step: int = 0  # ModelShape.collectives_per_step (tp > 1)
    allreduce_bytes_per_token: float = 0.0  # hidden x 2 bytes (bf16 activations)

    @classmethod
    def from_shape(
        cls, shape: ModelShape, weight_dtype: str = "bf16", kv_dtype: str = "bf16", tp: int = 1
    ) -> ModelCost:
        q_heads, kv_heads = shape.heads_per_gpu(tp)
        q_o, k_v = shape.attention_params()
        # A mixture of experts multiplies each token by its chosen experts only.
        linear = shape.num_layers * (q_o / tp + k_v * kv_heads // shape.num_kv_heads)
        linear += shape.all_mlp_params(active=True) / tp
        # An untied input embedding is only gathered row by row, never streamed whole.
        untied_embedding = 0 if shape.tie_embeddings else shape.embedding_params() / tp
        return cls(
            name=f"{shape.name} {weight_dtype}/{kv_dtype} tp={tp}",
            linear_flops_per_token=2 * linear,
            lm_head_flops_per_token=2 * shape.embedding_params() / tp,
            attention_flops_per_pair=4 * shape.num_layers * q_heads * shape.head_dim,
            weight_bytes_per_step=shape.weight_bytes(weight_dtype, tp)
            - untied_embedding * UNQUANTISED_BYTES,
            kv_bytes_per_token=shape.kv_bytes_per_token(kv_dtype, tp),
            tp=tp,
            allreduces_per_step=shape.collectives_per_step(tp),
            allreduce_bytes_per_token=shape.hidden_size * KV_BYTES["bf16"],
        )


@dataclass(frozen=True)
class StepCost:
    """One step's time split by resource; `total_s` is what the simulator advances by."""

    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float
    total_s: float

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


def pairs_for_request(new_tokens: int, prior_tokens: int) -> int:
    """(query, key) pairs one request computes: each new token sees the prior KV and
    the new tokens up to itself (causal). A decode step is pairs_for_request(1, context)."""
    return new_tokens * prior_tokens + new_tokens * (new_tokens + 1) // 2


def step_cost(
    profile: DeviceProfile,
    cost: ModelCost,
    prefill_tokens: int,
    decode_tokens: int,
    context_tokens_read: int,
    attention_pairs: int | None = None,
    sampled_tokens: int | None = None,
    num_requests: int | None = None,
) -> StepCost:
    """Cost of one step; see `step_time` for the arguments."""
    if min(prefill_tokens, decode_tokens, context_tokens_read) < 0:
        raise ValueError("token counts must be non-negative")
    new_tokens = prefill_tokens + decode_tokens
    if new_tokens == 0:
        return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    profile = profile.profile_for_step(prefill_tokens, decode_tokens)
    if attention_pairs is None:  # exact for decode-only steps and one fresh prefill
        attention_pairs = (
            context_tokens_read + decode_tokens + prefill_tokens * (prefill_tokens + 1) // 2
        )
    if sampled_tokens is None:
        sampled_tokens = decode_tokens + (1 if prefill_tokens else 0)
    matmul_flops = (
        cost.linear_flops_per_token * new_tokens + cost.lm_head_flops_per_token * sampled_tokens
    )
    attention_flops = cost.attention_flops_per_pair * attention_pairs
    flops = matmul_flops + attention_flops
    nbytes = cost.weight_bytes_per_step + cost.kv_bytes_per_token * (
        context_tokens_read + new_tokens
    )
    comm = 0.0
    if cost.tp > 1 and cost.allreduces_per_step:
        if profile.link_bandwidth <= 0:
            raise ValueError(f"{profile.name} has no link bandwidth for tp={cost.tp}")
        ring = 2 * (cost.tp - 1) / cost.tp  # share of the message each rank sends in a ring
        per_allreduce = ring * new_tokens * cost.allreduce_bytes_per_token / profile.link_bandwidth
        comm = cost.allreduces_per_step * (profile.allreduce_latency_s + per_allreduce)
    compute_s = matmul_flops / profile.effective_flops()
    compute_s += attention_flops / profile.effective_attention_flops()
    memory_s = nbytes / profile.effective_bandwidth()
    overhead = profile.step_overhead_s
    if profile.per_request_s:
        if num_requests is None:  # decodes are one request each; assume one prefill request
            num_requests = decode_tokens + (1 if prefill_tokens else 0)
        overhead += profile.per_request_s * num_requests
    total = max(compute_s, memory_s) + comm + overhead
    return StepCost(flops, nbytes, compute_s, memory_s, comm, overhead, total)


def step_time(
    profile: DeviceProfile,
    cost: ModelCost,
    prefill_tokens: int,
    decode_tokens: int,
    context_tokens_read: int,
    attention_pairs: int | None = None,
    sampled_tokens: int | None = None,
    num_requests: int | None = None,
) -> float:
    """Seconds one engine step takes.

    prefill_tokens: prompt tokens computed this step, summed over requests.
    decode_tokens: requests taking a one-token decode step.
    context_tokens_read: KV tokens already cached that the step's requests attend to
        (a decode's context; the earlier chunks or prefix hit of a prefill).
    attention_pairs: sum of `pairs_for_request(new, prior)` over the step's requests; when
        None it is estimated as exact for decode-only steps and a single fresh prefill.
    sampled_tokens: tokens that get logits (default: decodes + one if any prefill).
    num_requests: requests in the step, for `profile.per_request_s` (default: decodes + one
        if any prefill).
    """
    return step_cost(
        profile,
        cost,
        prefill_tokens,
        decode_tokens,
        context_tokens_read,
        attention_pairs,
        sampled_tokens,
        num_requests,
    ).total_s
