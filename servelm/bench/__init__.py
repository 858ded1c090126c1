"""Load generator and report for any OpenAI-compatible server (talks HTTP only).

    config = BenchConfig(base_url="http://127.0.0.1:8000", loads=(Load(concurrency=8),))
    result = asyncio.run(run_benchmark(config))
    result.write_json("results.json")

Modules: workload (what to send), client (one timed streaming request), runner (arrivals,
levels, sweeps), stats (percentiles, goodput, capacity), server_metrics (/metrics scraping),
results (the JSON schema), report (terminal), plots (PNGs), outputs (checks that the files
asked for can be written), command (`servelm bench`).
"""

from servelm.bench.config import BenchConfig
from servelm.bench.results import BenchResult, Load, RequestRecord, RunResult, load_results
from servelm.bench.runner import BenchError, run_benchmark, run_sweep
from servelm.bench.stats import SLO
from servelm.bench.workload import WorkloadSpec

__all__ = [
    "SLO",
    "BenchConfig",
    "BenchError",
    "BenchResult",
    "Load",
    "RequestRecord",
    "RunResult",
    "WorkloadSpec",
    "load_results",
    "run_benchmark",
    "run_sweep",
]
