"""BenchConfig: everything one benchmark (a single load level or a sweep) is asked to do."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from servelm.bench.results import Load
from servelm.bench.stats import SLO
from servelm.bench.workload import WorkloadSpec


@dataclass(frozen=True)
class BenchConfig:
    """A benchmark against one OpenAI-compatible server.

    Each entry of `loads` is run in turn (more than one makes a sweep). A level stops issuing
    requests after `num_requests` or `duration_s`, whichever comes first, then waits for the
    requests in flight. `warmup` extra requests run before each level and are not counted.
    """

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first id listed by GET /v1/models
    api_key: str | None = None
    endpoint: str = "chat"  # "chat" | "completions"
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    tokenizer: str | None = None  # folder with tokenizer.json; None: the default model's
    loads: tuple[Load, ...] = (Load(concurrency=1),)
    num_requests: int | None = 100
    duration_s: float | None = None
    warmup: int = 0
    seed: int = 0
    ignore_eos: bool = True
    temperature: float | None = 0.0
    timeout_s: float = 600.0
    slo: SLO = field(default_factory=SLO)
    capacity_threshold: float = 0.9  # share of requests that must meet the SLO at a level
    server_metrics: bool = True
    metrics_interval_s: float = 0.5

    def __post_init__(self) -> None:
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be chat or completions, got {self.endpoint!r}")
        if not self.loads:
            raise ValueError("need at least one load level")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("set num_requests or duration_s (or both)")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration_s must be > 0")
        if self.warmup < 0:
            raise ValueError("warmup must be >= 0")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout_s:g}")
        if not 0 < self.capacity_threshold <= 1:
            raise ValueError(
                "the SLO threshold is a share of requests, in (0, 1]; "
                f"got {self.capacity_threshold:g}"
            )
        if len({load.kind for load in self.loads}) > 1:
            raise ValueError("a sweep varies either concurrency or rate, not both")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready config; the API key is never written out."""
        return {
            "base_url": self.base_url,
            "model": self.model,
            "endpoint": self.endpoint,
            "workload": self.workload.to_dict(),
            "tokenizer": self.tokenizer,
            "loads": [load.to_dict() for load in self.loads],
            "num_requests": self.num_requests,
            "duration_s": self.duration_s,
            "warmup": self.warmup,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "temperature": self.temperature,
            "timeout_s": self.timeout_s,
            "slo": self.slo.to_dict(),
            "capacity_threshold": self.capacity_threshold,
        }
