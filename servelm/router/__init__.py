"""Multi-replica front door (`servelm route`): one OpenAI-compatible address for many replicas.

Modules, in the order a request meets them:
    app          routes: proxied OpenAI endpoints, /v1/models (union), /health, /metrics
    admin        run-time replica management behind the admin key
    ratelimit    API keys, requests/tokens per minute, OpenAI's x-ratelimit-* headers
    policies     round-robin, least-loaded, prefix-aware (prefix: the prompt hashing it uses)
    proxy        send to the chosen replica, retry once before the first byte
    streaming    relay SSE event by event; in-band error + [DONE] when a replica dies mid-stream
    health       probes, /metrics scraping, circuit breaker (eject, cool-down, re-admit)
    replicas     the replica set: state, weights, models, load, leases, replicas file
    metrics      the router's own Prometheus registry
    config       RouterConfig; command: the CLI

The router talks HTTP only and imports no engine code: it can front vLLM replicas too.
"""
