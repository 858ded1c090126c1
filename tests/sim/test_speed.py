"""Issue #5: 10,000 requests simulate in under 10 seconds of CPU on this (2-core) machine.

The same run as `benchmarks/simulate_speed.py`: chat requests near one H100's capacity, so
every step carries a full batch (about 2.5 million request-steps through the real scheduler).
CPU time, not wall time, but still this machine's: other jobs on the cores slow it down too,
hence `slow` (it takes about as long as it measures).
"""

import time

import pytest

from servelm.bench.results import Load
from servelm.bench.workload import WorkloadSpec
from servelm.sim.config import SimConfig, resolve
from servelm.sim.simulator import paused_gc, simulate
from servelm.sim.workload import build_requests


@pytest.mark.slow
def test_ten_thousand_requests_in_under_ten_cpu_seconds():
    config = SimConfig(num_requests=10_000, workload=WorkloadSpec.from_preset("chat"))
    deployment = resolve(config)
    c0 = time.process_time()
    with paused_gc():
        requests = build_requests(
            config.workload, Load(rate=28.0), 10_000, vocab_size=deployment.shape.vocab_size
        )
    outcome = simulate(deployment, requests)
    cpu_s = time.process_time() - c0
    assert sum(r.output_tokens for r in outcome.requests) == 10_000 * 250
    assert cpu_s < 10.0
