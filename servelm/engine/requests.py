"""Turning a prompt and sampling parameters into engine `Request`s (shared by LLM and server)."""

from __future__ import annotations

import dataclasses
import logging
import time
from functools import lru_cache
from typing import Any

from servelm.engine.request import Request
from servelm.engine.sampling_params import INT64, InvalidParamError, SamplingParams
from servelm.text.tokenizer import TextTokenizer

logger = logging.getLogger("servelm")


def default_sampling_params(tokenizer: TextTokenizer, **overrides) -> SamplingParams:
    """SamplingParams with the model's generation_config defaults, then `overrides` on top."""
    base = dict(model_defaults(tokenizer))
    base.update({k: v for k, v in overrides.items() if v is not None})
    return SamplingParams(**base)


@lru_cache(maxsize=8)  # once per model: a server or an LLM has one tokenizer for good
def model_defaults(tokenizer: TextTokenizer) -> dict[str, Any]:
    """The model's generation_config.json sampling defaults that SamplingParams takes. A bad one
    ("temperature": "hot") is left out with a warning, not a 500 on every request relying on
    it, nor a 400 blaming the client for a field it never sent."""
    d = tokenizer.generation_defaults
    usable = {}
    for name, value in (
        ("temperature", d.temperature),
        ("top_p", d.top_p),
        ("top_k", d.top_k),
        ("repetition_penalty", d.repetition_penalty),
    ):
        if value is None:
            continue
        try:
            SamplingParams(**{name: value})
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        except (InvalidParamError, TypeError, ValueError):
            ok = False
        if ok:
            usable[name] = value
        else:
            logger.warning(
                "generation_config.json: %s = %r is not a usable default; ignored", name, value
            )
    return usable


def child_requests(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    eos_token_ids: list[int],
    priority: int = 0,
    arrival_time: float | None = None,
) -> list[Request]:
    """One engine request per choice (`n`); choice i of a seeded request uses seed + i (wrapping
    around within the 64-bit seed range)."""
    arrival = arrival_time or time.time()
    out = []
    for i in range(params.n):
        p = params if params.n == 1 else choice_params(params, i)
        rid = request_id if params.n == 1 else f"{request_id}-{i}"
        out.append(
            Request(rid, list(prompt_token_ids), p, frozenset(eos_token_ids), arrival, priority)
        )
    return out


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """Choice i of a request for `n`, as a request of its own: seed + i, wrapping around within
    the 64-bit seed range (seed 2**63 - 1 with n = 2 is a valid request)."""
    seed = params.seed
    if seed is not None:
        low, high = INT64
        seed = (seed + i - low) % (high - low + 1) + low
    return dataclasses.replace(params, n=1, seed=seed)
