"""SimConfig: the deployment a simulation models, and how it resolves to engine settings.

A deployment is `replicas` identical copies of one engine (model, device profile, KV pool and
scheduler knobs) behind a router. KV blocks per replica come from the planner's memory math
(GPU memory x utilisation - weights - allowance) unless `num_blocks` is given; a measured (CPU)
profile has no GPU memory to size from, so it gets `kv_cache_gb` (default 1 GiB, the engine's
CPU default).

Scheduler limits left unset (`max_num_seqs`, `max_num_batched_tokens`,
`max_prefill_admit_tokens` = None) depend on what is simulated. A datasheet GPU profile models a
GPU deployment: 256 sequences per step (vLLM's default on most data-centre GPUs), a 2,048-token
step budget (chunked prefill) that new prompts may fill. A measured profile (`--profile` /
`--calibrate`, which times servelm's engine on a CPU) models servelm's own engine on the
measured machine, so it gets `servelm serve`'s defaults on a CPU, from
`servelm.config.EngineArgs`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from servelm.bench.stats import SLO
from servelm.bench.workload import WorkloadSpec, shortest_length
from servelm.config import EngineArgs
from servelm.engine.request import Request
from servelm.engine.sampling_params import SamplingParams
from servelm.engine.scheduler import Scheduler, SchedulerConfig
from servelm.planner.catalog import get_gpu, resolve_model
from servelm.planner.plan import context_length, plan
from servelm.planner.shapes import ModelShape
from servelm.sim.roofline import DeviceProfile, ModelCost, gpu_profile

POLICIES = ("round-robin", "least-loaded")
# Host (CPU) time per scheduled request per step on a GPU deployment: scheduling, input
# preparation, sampling and output handling grow with the batch, while the roofline's
# `step_overhead_s` is a flat 2 ms. An assumption, not a measurement of a GPU host: 20 us is
# what a tuned Python engine plausibly sustains (servelm's own figures: docs/performance.md).
# With it a 256-request decode step carries ~5 ms of host time. Override with `per_request_s`.
GPU_PER_REQUEST_S = 20e-6
CPU_KV_CACHE_GB = 2**30 / 1e9  # the engine's CPU default: 1 GiB
GPU_MAX_NUM_SEQS = 256  # vLLM's default on most data-centre GPUs
GPU_MAX_NUM_BATCHED_TOKENS = 2048  # chunked-prefill budget per step


@dataclass(frozen=True)
class SimConfig:
    """What to simulate. `profile=None` means the datasheet profile of `gpu`."""

    model: str = "llama-3.1-8b"  # catalog name, hub id or folder with config.json
    gpu: str = "h100-80gb"
    profile: DeviceProfile | None = None
    dtype: str = "bf16"
    kv_dtype: str = "bf16"
    tp: int = 1
    replicas: int = 1
    policy: str = "round-robin"
    num_blocks: int | None = None  # per replica; None: from the planner (or kv_cache_gb)
    gpu_memory_utilization: float = 0.9
    allowance_gb: float = 2.0
    kv_cache_gb: float | None = None  # KV pool per replica for a measured profile
    block_size: int = 16
    max_num_seqs: int | None = None  # None: GPU_MAX_NUM_SEQS, or serve's default (measured)
    max_num_batched_tokens: int | None = None  # likewise
    max_prefill_admit_tokens: int | None = None  # likewise (0 on a GPU: no cap)
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    per_request_s: float | None = None  # host time per request per step; None: see resolve()
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    num_requests: int = 2000
    seed: int = 0
    record_itl: bool = False  # keep every inter-token gap (memory and JSON grow per token)
    slo: SLO = field(default_factory=lambda: SLO(ttft_ms=1000.0, tpot_ms=None))
    capacity_threshold: float = 0.99  # 0.99 of requests within the TTFT SLO = p99 < SLO

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose from {POLICIES}")
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        # (the command line's flags are checked as they are parsed, by name and in their
        # units; these hold for a SimConfig made in Python)
        if self.tp < 1 or self.block_size < 1:
            raise ValueError(f"tp and block_size must be >= 1, got {self.tp}, {self.block_size}")
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.per_request_s is not None and not self.per_request_s >= 0:
            raise ValueError(f"per_request_s must be >= 0, got {self.per_request_s}")
        if not 0 < self.capacity_threshold <= 1:
            raise ValueError(
                f"capacity_threshold is a share of requests, in (0, 1]; got {self.capacity_threshold}"
            )

    def with_(self, **changes: Any) -> SimConfig:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, in the spirit of BenchConfig.to_dict (plots read model and slo)."""
        profile = device_profile(self)
        return {
            "source": "servelm simulate",
            "model": self.model,
            "gpu": self.gpu if self.profile is None else None,
            "profile": profile_dict(profile),
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
            "tp": self.tp,
            "replicas": self.replicas,
            "policy": self.policy,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            **scheduler_limits(self),
            "max_model_len": self.max_model_len,
            "enable_prefix_caching": self.enable_prefix_caching,
            "scheduling_policy": self.scheduling_policy,
            "workload": self.workload.to_dict(),
            "num_requests": self.num_requests,
            "seed": self.seed,
            "ignore_eos": True,
            "slo": self.slo.to_dict(),
            "capacity_threshold": self.capacity_threshold,
        }


def profile_dict(profile: DeviceProfile) -> dict[str, Any]:
    return asdict(profile)  # a decode-stack profile nests as a dict


@dataclass(frozen=True)
class Deployment:
    """A SimConfig resolved: the numbers every replica is built from."""

    config: SimConfig
    shape: ModelShape
    cost: ModelCost
    profile: DeviceProfile
    scheduler: SchedulerConfig

    @property
    def replicas(self) -> int:
        return self.config.replicas


def resolve(config: SimConfig) -> Deployment:
    """Look up the model and GPU, size the KV pool, build the per-replica scheduler config.

    Raises ValueError for a max_model_len beyond the model's context (PlanError, as `servelm
    plan` does) and where the engine would refuse every request of the workload."""
    shape = resolve_model(config.model)
    cost = ModelCost.from_shape(shape, config.dtype, config.kv_dtype, config.tp)
    profile = device_profile(config)
    max_len = context_length(shape, config.max_model_len)
    num_blocks = config.num_blocks or kv_blocks(config, shape, max_len)
    scheduler = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=config.block_size,
        **scheduler_limits(config),
        max_model_len=max_len,
        enable_prefix_caching=config.enable_prefix_caching,
        policy=config.scheduling_policy,
    )
    check_servable(config.workload, scheduler)
    return Deployment(config, shape, cost, profile, scheduler)


def check_servable(workload: WorkloadSpec, scheduler: SchedulerConfig) -> None:
    """Raise ValueError where the engine would refuse even the workload's shortest prompt: it
    would then refuse them all, every level would serve nothing, and a capacity search would
    probe rate after rate of refusals. The engine's own scheduler decides (its context is
    max_model_len, or less where one sequence of it would not fit the KV pool)."""
    least_input = shortest_length(workload.input_len, workload.len_dist, workload.len_spread)
    shortest = max(1, workload.prefix_len + least_input)  # an empty prompt is sent as 1 token
    pool = scheduler.num_blocks * scheduler.block_size
    if shortest < min(scheduler.max_model_len, pool):
        return  # within the context and the pool: taken (no need to build a KV pool to ask)
    request = Request("shortest", [1] * shortest, SamplingParams(max_tokens=1))
    try:
        Scheduler(scheduler).add_request(request)
    except ValueError as exc:
        cap = ""
        if pool < scheduler.max_model_len:
            blocks = f"{scheduler.num_blocks:,} block{'s' if scheduler.num_blocks > 1 else ''}"
            cap = (
                f" The KV pool ({blocks} of {scheduler.block_size} tokens per replica) caps it "
                f"below max_model_len {scheduler.max_model_len:,}."
            )
        raise ValueError(f"every request would be refused: {exc}{cap}") from None


def scheduler_limits(config: SimConfig) -> dict[str, int]:
    """The scheduler's limits, by their SchedulerConfig names: the config's, else the defaults
    of what is simulated (a GPU deployment, or servelm's engine for a measured profile)."""
    if config.profile is None:
        defaults = {
            "max_num_seqs": GPU_MAX_NUM_SEQS,
            "max_num_batched_tokens": GPU_MAX_NUM_BATCHED_TOKENS,
            "max_prefill_admit_tokens": 0,
        }
    else:
        serve = EngineArgs()
        defaults = {
            "max_num_seqs": serve.max_num_seqs,
            "max_num_batched_tokens": serve.max_num_batched_tokens,
            "max_prefill_admit_tokens": serve.prefill_admit_tokens("cpu"),
        }
    return {
        name: default if (given := getattr(config, name)) is None else given
        for name, default in defaults.items()
    }


def device_profile(config: SimConfig) -> DeviceProfile:
    """The given profile, or the GPU's datasheet one with the simulator's host-time term."""
    if config.profile is not None:
        profile = config.profile
    else:
        profile = replace(gpu_profile(config.gpu, config.dtype), per_request_s=GPU_PER_REQUEST_S)
    if config.per_request_s is not None:
        profile = replace(profile, per_request_s=config.per_request_s)
    return profile


def kv_blocks(config: SimConfig, shape: ModelShape, max_len: int) -> int:
    """Blocks per replica: the planner's pool on a GPU, `kv_cache_gb` on a measured profile."""
    if config.profile is not None and config.kv_cache_gb is None:
        kv_gb = CPU_KV_CACHE_GB
    else:
        kv_gb = config.kv_cache_gb
    if kv_gb is not None:
        per_block = shape.kv_bytes_per_token(config.kv_dtype, config.tp) * config.block_size
        blocks = int(kv_gb * 1e9 // per_block)
    else:
        blocks = plan(
            shape,
            get_gpu(config.gpu),
            config.dtype,
            config.kv_dtype,
            config.tp,
            config.gpu_memory_utilization,
            max_len,
            config.allowance_gb,
            config.block_size,
        ).kv_capacity_blocks
    if blocks < 1:
        raise ValueError(f"no room for a KV cache: {shape.name} leaves no memory on {config.gpu}")
    return blocks
