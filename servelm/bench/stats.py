"""Benchmark statistics: percentiles, throughput, goodput under an SLO, capacity at SLO.

Pure functions of request records. Percentiles interpolate linearly between closest ranks
(numpy's default), so p50 of [1, 2, 3, 4] is 2.5. Failed requests count in `failed` and in the
SLO denominator (a refused request did not meet the SLO) but in no latency or token figure.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from servelm.bench.results import RequestRecord

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class SLO:
    """Latency targets a request must meet to count towards goodput; None means no limit."""

    ttft_ms: float | None = 300.0
    tpot_ms: float | None = 50.0

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name} must be > 0 (None: no limit), got {value}")

    def to_dict(self) -> dict[str, float | None]:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms}


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean, p50, p90, p95, p99 and max of `values`, each multiplied by `scale`."""
    scaled = [v * scale for v in values]
    out: dict[str, float | None] = {"mean": sum(scaled) / len(scaled) if scaled else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(scaled, q)
    out["max"] = max(scaled) if scaled else None
    return out


def tpot(e2e_s: float, ttft_s: float, output_tokens: int) -> float | None:
    """Time per output token after the first; None when there is no second token."""
    if output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    """True if the request succeeded within both targets (one-token answers have no TPOT). An
    empty answer has no first token: its whole answer came at e2e, which the TTFT limit holds."""
    first = record.ttft_s if record.ttft_s is not None else record.e2e_s
    if not record.ok or first is None:
        return False
    if slo.ttft_ms is not None and first * 1000 > slo.ttft_ms:
        return False
    per_token = record.tpot_s
    return slo.tpot_ms is None or per_token is None or per_token * 1000 <= slo.tpot_ms


def goodput(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> float:
    """Requests per second that succeeded within the SLO."""
    if duration_s <= 0:
        return 0.0
    return sum(1 for r in records if meets_slo(r, slo)) / duration_s


def error_counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Failed requests by error kind (HTTP status or connect/timeout/stream-error)."""
    counts = Counter(r.error for r in records if r.error is not None)
    return dict(sorted(counts.items()))


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> dict[str, Any]:
    """The summary of one load level: counts, throughput, latency distributions in ms, goodput."""
    ok = [r for r in records if r.ok]
    input_tokens = sum(r.server_prompt_tokens or r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    meeting = sum(1 for r in records if meets_slo(r, slo))
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": error_counts(records),
        "duration_s": duration_s,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(ok) * per_s,
        "output_throughput": output_tokens * per_s,
        "total_token_throughput": (input_tokens + output_tokens) * per_s,
        "ttft_ms": distribution([r.ttft_s for r in ok if r.ttft_s is not None], 1000),
        "tpot_ms": distribution([t for r in ok if (t := r.tpot_s) is not None], 1000),
        "itl_ms": distribution([gap for r in ok for gap in r.itl_s], 1000),
        "e2e_ms": distribution([r.e2e_s for r in ok if r.e2e_s is not None], 1000),
        "slo": slo.to_dict(),
        "goodput": meeting * per_s,
        "slo_attainment": meeting / len(records) if records else 0.0,
    }


def capacity_at_slo(
    levels: Sequence[tuple[float | None, float]], threshold: float = 0.9
) -> int | None:
    """Index of the highest load level that still meets the SLO, or None if the first misses.

    `levels` are (load, slo_attainment) pairs. A level passes when at least `threshold` of its
    requests met the SLO. Levels are walked in increasing load and the walk stops at the first
    miss, so a noisy pass above a miss does not count: capacity is the last load before the knee.
    """
    order = sorted(range(len(levels)), key=lambda i: _sort_key(levels[i][0]))
    best: int | None = None
    for i in order:
        if levels[i][1] < threshold:
            break
        best = i
    return best


def _sort_key(load: float | None) -> float:
    return math.inf if load is None else load
