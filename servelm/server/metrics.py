"""Prometheus metrics of one server (its own registry: two servers in a process never mix).

Names follow vLLM's with the `servelm:` prefix, so dashboards and autoscalers port over.
Gauges and cache counters come from the engine's per-step stats; latencies are measured here,
in the API process, on one clock.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from servelm.engine.outputs import SchedulerStats

# How a request ends, as `request_success_total` labels it (vLLM's set; `error`: the engine's)
FINISH_REASONS = ("stop", "length", "abort", "error")

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,  # vLLM's tail (to 2,560 s for TTFT, 7,680 s end to end): a long answer on a CPU
    640.0,  # under load runs past 80 s, and quantiles would read it as 80
    2560.0,
    7680.0,
)
# Tokens per request (prompt, generation): 1, 2, 5, 10, ... 1e6, as vLLM's 1-2-5 series
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,  # vLLM's tail to 80 s: a CPU under load stalls streams for seconds (a long prompt
    7.5,  # admitted beside them), and quantiles would read every such stall as 2.5 s
    10.0,
    20.0,
    40.0,
    80.0,
)


class ServerMetrics:
    def __init__(self, model_name: str, block_size: int, num_blocks: int) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total etc. of the API process
        labels = ["model_name"]
        p = "servelm:"
        self.running = Gauge(
            p + "num_requests_running", "Requests in the running batch.", labels, registry=r
        )
        self.waiting = Gauge(
            p + "num_requests_waiting", "Requests waiting to be scheduled.", labels, registry=r
        )
        self.kv_usage = Gauge(
            p + "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", labels, registry=r
        )
        self.prefix_queries = Counter(
            p + "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            labels,
            registry=r,
        )
        self.prefix_hits = Counter(
            p + "prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels, registry=r
        )
        self.engine_steps = Counter(
            p + "engine_steps",
            "Engine steps whose outputs this (API) process handled.",
            labels,
            registry=r,
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "Prompt tokens of requests served.", labels, registry=r
        )
        self.generation_tokens = Counter(
            p + "generation_tokens", "Tokens generated.", labels, registry=r
        )
        self.preemptions = Counter(
            p + "num_preemptions", "Requests preempted for lack of KV blocks.", labels, registry=r
        )
        self.success = Counter(
            p + "request_success",
            "Finished requests by finish reason.",
            labels + ["finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Time between tokens of a stream.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            p + "request_time_per_output_token_seconds",
            "Per request: first to last token over the tokens after the first (TPOT).",
            labels,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "Arrival to last token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            p + "request_prefill_time_seconds",
            "First schedule to first token (the prompt's compute, chunks and waits included).",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_time = Histogram(
            p + "request_decode_time_seconds",
            "First token to last.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_prompt_tokens = Histogram(
            p + "request_prompt_tokens",
            "Prompt tokens per finished request.",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            p + "request_generation_tokens",
            "Generated tokens per finished request.",
            labels,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            p + "request_queue_time_seconds",
            "Arrival to first schedule.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # Counted at the outermost layer, so 401/413 answered by middleware count too.
        self.http_requests = Counter(
            p + "http_requests",
            "HTTP requests answered, by status code (probes, scrapes, dashboard left out).",
            labels + ["status"],
            registry=r,
        )
        info = Gauge(
            p + "cache_config_info",
            "KV cache configuration.",
            ["model_name", "block_size", "num_gpu_blocks"],
            registry=r,
        )
        info.labels(model_name, str(block_size), str(num_blocks)).set(1)
        self.model_name = model_name
        for m in (
            self.running,
            self.waiting,
            self.kv_usage,
            self.prefix_queries,
            self.prefix_hits,
            self.prompt_tokens,
            self.generation_tokens,
            self.preemptions,
            self.engine_steps,
            self.ttft,
            self.itl,
            self.tpot,
            self.e2e,
            self.queue_time,
            self.prefill_time,
            self.decode_time,
            self.request_prompt_tokens,
            self.request_generation_tokens,
        ):
            m.labels(model_name)  # present (at zero) from the start, histograms included
        for reason in FINISH_REASONS:  # so rate() sees each one's first increment too
            self.success.labels(model_name, reason)

    def on_stats(self, stats: SchedulerStats) -> None:
        m = self.model_name
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_cache_usage)
        self.engine_steps.labels(m).inc()
        if stats.prefix_cache_queries:
            self.prefix_queries.labels(m).inc(stats.prefix_cache_queries)
            self.prefix_hits.labels(m).inc(stats.prefix_cache_hits)
        if stats.num_preemptions:
            self.preemptions.labels(m).inc(stats.num_preemptions)

    def on_http_status(self, status: int) -> None:
        self.http_requests.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Per-request latency bookkeeping: first token, gaps between tokens, end-to-end."""

    def __init__(self, metrics: ServerMetrics, arrival: float, num_prompt_tokens: int) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.num_prompt_tokens = num_prompt_tokens
        self.prompt_counted = False
        self.first: float | None = None
        self.last: float | None = None
        self.queued: float | None = None  # arrival to first schedule, as the engine says
        self.num_tokens = 0

    def on_tokens(self, now: float, num_tokens: int, queued_time: float | None = None) -> None:
        m, name = self.metrics, self.metrics.model_name
        if queued_time is not None:  # (also on a prompt-only answer, max_tokens 0)
            m.queue_time.labels(name).observe(queued_time)
            self.queued = queued_time
        if num_tokens <= 0:
            return
        m.generation_tokens.labels(name).inc(num_tokens)
        if self.last is None:
            # the prompt has run: counted now, not at the end (a rate panel would lag by
            # the whole answer and spike)
            m.prompt_tokens.labels(name).inc(self.num_prompt_tokens)
            self.prompt_counted = True
            m.ttft.labels(name).observe(now - self.arrival)
            if self.queued is not None:
                m.prefill_time.labels(name).observe(max(0.0, now - self.arrival - self.queued))
            self.first = now
        else:
            m.itl.labels(name).observe(now - self.last)
        self.last = now
        self.num_tokens += num_tokens

    def on_finish(self, now: float, reason: str, num_prompt_tokens: int) -> None:
        """Once per request, however it ends: a client gone or an engine failure ends it as
        `abort` or `error`, its prompt counted only if it was run (a token came)."""
        m, name = self.metrics, self.metrics.model_name
        m.e2e.labels(name).observe(now - self.arrival)
        if self.num_tokens > 1:  # (a one-token answer has no time per output token)
            tpot = (self.last - self.first) / (self.num_tokens - 1)
            m.tpot.labels(name).observe(tpot)
        if self.first is not None:
            m.decode_time.labels(name).observe(self.last - self.first)
        if not self.prompt_counted:  # (a prompt-only answer, max_tokens 0)
            m.prompt_tokens.labels(name).inc(num_prompt_tokens)
        m.request_prompt_tokens.labels(name).observe(num_prompt_tokens)
        m.request_generation_tokens.labels(name).observe(self.num_tokens)
        m.success.labels(name, reason).inc()
