"""How fast the simulator runs: 10,000 chat requests near one H100's capacity, wall time.

    .venv/bin/python benchmarks/simulate_speed.py [--requests 10000] [--rate 28] [--preset chat]

Prints the wall time of building the workload and of the simulation, steps per second and
request-steps (scheduled requests summed over steps) per second.
"""

from __future__ import annotations

import argparse
import time

from servelm.bench.results import Load
from servelm.bench.workload import WorkloadSpec
from servelm.sim.config import SimConfig, resolve
from servelm.sim.simulator import paused_gc, simulate
from servelm.sim.workload import build_requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=28.0)
    parser.add_argument("--preset", default="chat")
    parser.add_argument("--replicas", type=int, default=1)
    args = parser.parse_args()
    config = SimConfig(
        num_requests=args.requests,
        workload=WorkloadSpec.from_preset(args.preset),
        replicas=args.replicas,
    )
    deployment = resolve(config)
    c0, t0 = time.process_time(), time.perf_counter()
    with paused_gc():
        requests = build_requests(
            config.workload,
            Load(rate=args.rate),
            args.requests,
            vocab_size=deployment.shape.vocab_size,
        )
    t1 = time.perf_counter()
    outcome = simulate(deployment, requests)
    c2, t2 = time.process_time(), time.perf_counter()
    steps = sum(r.steps for r in outcome.replicas)
    tokens = sum(r.output_tokens for r in outcome.requests)
    print(
        f"{args.requests} {args.preset} requests at {args.rate:g}/s on {args.replicas} replica(s): "
        f"workload {t1 - t0:.2f} s, simulation {t2 - t1:.2f} s, total {t2 - t0:.2f} s "
        f"(CPU {c2 - c0:.2f} s; {steps} steps, {steps / (t2 - t1):,.0f} steps/s, "
        f"{tokens / (t2 - t1):,.0f} generated tokens/s; {outcome.duration_s:.0f} s simulated)"
    )


if __name__ == "__main__":
    main()
