"""What crosses the socket between the API process and the engine-core process (msgpack).

Into the engine: `("add", EngineCoreRequest)`, `("abort", [request ids])`, `("shutdown", None)`,
`("dashboard", seconds)` (a dashboard watches: a snapshot at most every `seconds`; 0.0: stop).
Out of the engine: `("ready", EngineReady)` once, then `("step", EngineCoreOutputs)` per step
(and after aborts; one with no stats carries only a dashboard snapshot), or `("error", message)`
if the engine fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from servelm.engine.dashboard import DashboardSnapshot
from servelm.engine.outputs import EngineCoreOutput, SchedulerStats
from servelm.engine.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None  # see Request.cache_salt


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    stats: SchedulerStats | None = None
    dashboard: DashboardSnapshot | None = None  # only while a dashboard watches, when one is due


@dataclass
class EngineReady:
    model_dir: str
    max_model_len: int
    num_blocks: int
    block_size: int
    device: str
    dtype: str
    startup_seconds: float


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(tuple[str, Any])
_PAYLOAD_TYPES: dict[str, Any] = {
    "add": EngineCoreRequest,
    "abort": list[str],
    "shutdown": None,
    "dashboard": float,
    "ready": EngineReady,
    "step": EngineCoreOutputs,
    "error": str,
}


def encode(kind: str, payload: Any = None) -> bytes:
    return _encoder.encode((kind, payload))


def decode(data: bytes) -> tuple[str, Any]:
    kind, raw = _decoder.decode(data)
    typ = _PAYLOAD_TYPES[kind]
    return kind, raw if typ is None else msgspec.convert(raw, typ)
