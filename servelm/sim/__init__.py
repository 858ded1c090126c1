"""Sizing by simulation: the REAL scheduler and KV manager on a virtual clock (no GPU needed).

    from servelm.sim.config import SimConfig
    from servelm.sim.sweep import run_sweep, search_capacity
    result = run_sweep(SimConfig(model="llama-3.1-8b", gpu="h100-80gb"), [Load(rate=16.0)])
    result.write_json("sim.json")            # the `servelm bench` schema: plots overlay

Modules: roofline (step-time model), executor (SimExecutor: the engine's executor, priced by
the roofline), workload (requests and arrivals as `servelm bench` draws them), config
(SimConfig -> Deployment: KV blocks, scheduler knobs), simulator (the event loop over replicas),
sweep (levels, capacity search, replicas for a rate, bench-schema results), fit + calibrate
(a profile fitted to this machine's real engine), profiles (profile JSON), command
(`servelm simulate`). Nothing is imported here, so `servelm.sim.roofline` stays light.
"""
