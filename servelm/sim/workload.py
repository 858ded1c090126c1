"""Synthetic simulator requests: bench workload lengths, random token ids, gamma arrivals.

A simulated level sends what `servelm bench` would send with the same seed: request i of a
level has the lengths `bench.workload.Workload.request(i, stream)` draws (output length, then
input length, from the per-request stream `f"{seed}/{stream}/{i}"`), and arrivals follow
`bench.runner.inter_arrival` from the stream `f"{seed}/arrivals/{level}"`, the first at t=0.
Only the text differs: prompts here are random token ids, never decoded. The shared-prefix
preset puts one common run of ids (drawn from `f"{seed}/prefix"`) in front of every prompt, so
the real KV manager finds real prefix-cache hits; otherwise prompts share nothing.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from servelm.bench.results import Load
from servelm.bench.runner import inter_arrival
from servelm.bench.workload import WorkloadSpec, sample_length


@dataclass
class SimRequest:
    """One request to simulate: when it arrives, its prompt ids, and how many tokens it wants."""

    index: int
    arrival_s: float
    prompt_token_ids: list[int]
    output_len: int


def request_lengths(spec: WorkloadSpec, seed: int, stream: str, index: int) -> tuple[int, int]:
    """(input tokens, output tokens) of request `index`, drawn as the bench workload draws them.

    Input excludes the shared prefix. Keep in step with `Workload.request` (same stream name,
    same order of draws) so a simulated level and a measured one send the same lengths.
    """
    if spec.len_dist == "fixed":  # no draws: skip seeding a generator per request
        return spec.input_len, spec.output_len
    rng = random.Random(f"{seed}/{stream}/{index}")
    output_len = sample_length(rng, spec.output_len, spec.len_dist, spec.len_spread)
    input_len = sample_length(rng, spec.input_len, spec.len_dist, spec.len_spread)
    return input_len, output_len


def arrival_times(load: Load, count: int, seed: int, level: int) -> list[float]:
    """Open-loop arrival times (s) of `count` requests at `load.rate`, the first at 0."""
    if load.rate is None:
        raise ValueError("the simulator runs open-loop rate levels only (no --concurrency)")
    rng = random.Random(f"{seed}/arrivals/{level}")
    times, t = [], 0.0
    for _ in range(count):
        times.append(t)
        t += inter_arrival(rng, load.rate, load.burstiness)
    return times


def prefix_ids(spec: WorkloadSpec, seed: int, vocab_size: int) -> list[int]:
    """The shared system-prompt ids (empty unless the workload has a prefix)."""
    if spec.prefix_len <= 0:
        return []
    rng = random.Random(f"{seed}/prefix")
    return [rng.randrange(1, vocab_size) for _ in range(spec.prefix_len)]


def build_requests(
    spec: WorkloadSpec,
    load: Load,
    count: int,
    seed: int = 0,
    level: int = 0,
    vocab_size: int = 32000,
    stream: str | None = None,
) -> list[SimRequest]:
    """The `count` requests of one level, in arrival order.

    `stream` names the per-request length stream (default `f"level{level}"`, the bench's).
    Token ids are drawn in one numpy batch per level (fast; ids only need to be distinct).
    """
    if spec.dataset is not None:
        raise ValueError("the simulator draws synthetic prompts; --dataset is not supported")
    if count < 1:
        raise ValueError(f"need at least one request, got {count}")
    stream = f"level{level}" if stream is None else stream
    lengths = [request_lengths(spec, seed, stream, i) for i in range(count)]
    times = arrival_times(load, count, seed, level)
    prefix = prefix_ids(spec, seed, vocab_size)
    # Token id 0 is the simulator's dummy sample; prompts use 1..vocab-1.
    rng = np.random.default_rng(_numeric_seed(seed, stream))
    pool = rng.integers(1, vocab_size, size=sum(n for n, _ in lengths)).tolist()
    requests, offset = [], 0
    for i, ((n_in, n_out), t) in enumerate(zip(lengths, times, strict=True)):
        ids = prefix + pool[offset : offset + n_in]
        offset += n_in
        if not ids:
            ids = [1]  # a prompt needs at least one token
        requests.append(SimRequest(i, t, ids, n_out))
    return requests


def _numeric_seed(seed: int, stream: str) -> int:
    # random.Random hashes a string seed deterministically (sha512), unlike hash().
    return random.Random(f"{seed}/ids/{stream}").getrandbits(63)


def offered_duration_s(requests: list[SimRequest]) -> float:
    """When the last request arrives (0 for a single request or an infinite rate)."""
    last = requests[-1].arrival_s if requests else 0.0
    return last if math.isfinite(last) else 0.0
