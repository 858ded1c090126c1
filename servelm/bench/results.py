"""The benchmark result schema: per-request records, per-load runs, and their JSON form.

The JSON written by `servelm bench --out` (and, later, by the simulator) has this shape, so runs
from different sources overlay in one plot (`config.source` may name the producer):

    {"schema": "servelm.bench/1",
     "config": {...},                    # BenchConfig.to_dict() plus the resolved model; no key
     "runs": [{"load": {"concurrency": 4}  # or {"rate": 2.0, "burstiness": 1.0,
                                           #     "max_concurrency": null}; rate null = infinite
               "summary": {...},           # stats.summarize(): counts, errors, throughput,
                                           # {ttft,tpot,itl,e2e}_ms percentiles, goodput
               "server": {...} | null,     # server_metrics.server_report(), null if not scraped
               "requests": [RequestRecord.to_dict(), ...],
               "interrupted": false}],     # true: stopped part-way (Ctrl-C); the summary and
                                           # requests are those that finished
     "capacity": {"load": {...}, "goodput": 3.1, "slo_attainment": 0.95, "threshold": 0.9}
                 | null}                   # highest level meeting the SLO; null if none did

Per-request times are seconds (`*_s`), summary latencies are milliseconds (`*_ms`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from servelm.bench.stats import capacity_at_slo, tpot

SCHEMA = "servelm.bench/1"


@dataclass(frozen=True)
class Load:
    """One load level: a closed loop at `concurrency`, or an open loop at `rate` requests/s.

    An open loop may also cap in-flight requests with `max_concurrency`; `rate=math.inf` sends
    everything at once. `burstiness` is the gamma shape of inter-arrival gaps (1.0 = Poisson).
    """

    concurrency: int | None = None
    rate: float | None = None
    burstiness: float = 1.0
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("a load level sets exactly one of concurrency and rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None:
            if self.concurrency is not None:
                raise ValueError("max_concurrency caps an open loop (a rate), not a concurrency")
            if self.max_concurrency < 1:
                raise ValueError(
                    f"max_concurrency must be >= 1 (unset: no cap), got {self.max_concurrency}"
                )

    @property
    def kind(self) -> str:
        return "concurrency" if self.concurrency is not None else "rate"

    @property
    def value(self) -> float | None:
        """The x coordinate of this level in a sweep (None for an infinite rate)."""
        if self.concurrency is not None:
            return float(self.concurrency)
        return None if self.rate is None or math.isinf(self.rate) else self.rate

    def label(self) -> str:
        if self.concurrency is not None:
            return f"c={self.concurrency}"
        return "inf/s" if self.value is None else f"{self.rate:g}/s"

    def to_dict(self) -> dict[str, Any]:
        if self.concurrency is not None:
            return {"concurrency": self.concurrency}
        return {
            "rate": self.value,
            "burstiness": self.burstiness,
            "max_concurrency": self.max_concurrency,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Load:
        if "concurrency" in data:
            return cls(concurrency=int(data["concurrency"]))
        rate = data.get("rate")
        return cls(
            rate=math.inf if rate is None else float(rate),
            burstiness=float(data.get("burstiness", 1.0)),
            max_concurrency=data.get("max_concurrency"),
        )


@dataclass
class RequestRecord:
    """What one request did, as seen by the client. `error` is None for a success."""

    index: int
    start_s: float  # when it was sent, relative to the start of its run
    prompt_tokens: int | None = None  # the prompt's length under the local tokenizer
    requested_output_tokens: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    output_tokens: int = 0
    server_prompt_tokens: int | None = None  # usage.prompt_tokens, if reported
    error: str | None = None  # HTTP status ("401") or "connect" / "timeout" / "stream-error"
    error_message: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (tokens - 1)."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None:
            return None
        return tpot(self.e2e_s, self.ttft_s, self.output_tokens)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tpot_s"] = self.tpot_s
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class RunResult:
    """One load level: its records, summary statistics and server-side metric deltas.
    `interrupted`: the level was stopped part-way, and holds the requests that finished."""

    load: Load
    summary: dict[str, Any]
    server: dict[str, Any] | None
    requests: list[RequestRecord]
    interrupted: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "load": self.load.to_dict(),
            "summary": self.summary,
            "server": self.server,
            "requests": [r.to_dict() for r in self.requests],
            "interrupted": self.interrupted,
        }


@dataclass
class BenchResult:
    """A whole benchmark: the config it ran and one RunResult per load level."""

    config: dict[str, Any]
    runs: list[RunResult]
    capacity: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "config": self.config,
            "runs": [run.to_dict() for run in self.runs],
            "capacity": self.capacity,
        }

    def write_json(self, path: str | Path) -> None:
        """Write strict JSON: a NaN or infinity (say, from a server gauge) becomes null. A
        folder missing on the way is made (`outputs.check_out_file` checked it can be)."""
        data = _finite(self.to_dict())
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")

    @property
    def failed(self) -> int:
        return sum(1 for run in self.runs for r in run.requests if not r.ok)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def load_results(path: str | Path) -> dict[str, Any]:
    """Read a result file written by `servelm bench --out` (or the simulator)."""
    data = json.loads(Path(path).read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a {SCHEMA} result file (schema={data.get('schema')!r})")
    return data


def capacity_block(runs: list[RunResult], threshold: float) -> dict[str, Any] | None:
    """Capacity at SLO: walking up the loads, the last level before the first whose SLO
    attainment is below `threshold` (None if the lowest is; `stats.capacity_at_slo`). A level
    that was interrupted is left out: its slowest requests may be the ones cut."""
    runs = [run for run in runs if not run.interrupted]
    best = capacity_at_slo(
        [(run.load.value, run.summary["slo_attainment"]) for run in runs], threshold
    )
    if best is None:
        return None
    run = runs[best]
    return {
        "load": run.load.to_dict(),
        "goodput": run.summary["goodput"],
        "slo_attainment": run.summary["slo_attainment"],
        "threshold": threshold,
    }
