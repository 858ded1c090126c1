"""POST /v1/completions: prompts as a string, strings, token ids or lists of token ids."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from servelm.engine.client import EngineDeadError
from servelm.engine.outputs import Logprobs
from servelm.server.errors import APIError
from servelm.server.protocol import CompletionRequest
from servelm.server.serving import OpenAIServing, cancel_on_disconnect, new_id
from servelm.server.serving_chat import usage
from servelm.server.sse import DONE, SSE_HEADERS, error_event, event

MAX_PROMPTS = 64


class ServingCompletion(OpenAIServing):
    def _prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [self.tokenizer.encode(prompt)]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        elif prompt and all(isinstance(p, str) for p in prompt):
            prompts = [self.tokenizer.encode(p) for p in prompt]
        elif prompt and all(isinstance(p, list) for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            raise APIError(
                400, "prompt must be a string, a list of strings, or token ids.", "prompt"
            )
        if len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request.", "prompt")
        vocab = self.tokenizer.vocab_size
        for ids in prompts:
            if not ids:
                raise APIError(400, "prompt must not be empty.", "prompt")
            if any(not 0 <= t < vocab for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab}).", "prompt")
            self.check_prompt_length(ids)
        return prompts

    async def create(self, req: CompletionRequest, raw: Request):
        self.check_model(req.model)
        self.check_logprobs(req.logprobs, "logprobs")
        prompts = self._prompts(req.prompt)
        params = self.sampling_params(req, req.max_tokens, req.logprobs)
        self.check_admission()
        rid = new_id("cmpl")
        created = int(time.time())
        choices = self.run_choices(rid, prompts, params, req.priority)
        num_prompt = sum(len(p) for p in prompts)
        total = len(prompts) * params.n
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._stream(rid, created, total, num_prompt, choices, include_usage)
            return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(
            await cancel_on_disconnect(raw, self._full(rid, created, total, num_prompt, choices))
        )

    def _logprobs(self, lps: list[Logprobs], offset: int) -> dict[str, Any]:
        dec = self.tokenizer.decode
        tokens = [dec([lp.token_id], skip_special_tokens=False) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [
                {dec([t], skip_special_tokens=False): v for t, v in lp.top} for lp in lps
            ],
            "text_offset": offsets,
        }

    async def _full(self, rid, created, total, num_prompt, choices) -> dict[str, Any]:
        texts, reasons = [""] * total, [None] * total
        lps: list[list[Logprobs]] = [[] for _ in range(total)]
        completion_tokens, cached = 0, 0
        async for i, delta in choices:
            texts[i] += delta.text
            completion_tokens += len(delta.token_ids)
            cached = max(cached, delta.num_cached_tokens)
            lps[i] += delta.logprobs or []
            if delta.finished:
                if delta.error:
                    raise APIError(500, delta.error)
                reasons[i] = delta.finish_reason
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.state.model_name,
            "choices": [
                {
                    "index": i,
                    "text": texts[i],
                    "finish_reason": reasons[i],
                    "logprobs": self._logprobs(lps[i], 0) if lps[i] else None,
                }
                for i in range(total)
            ],
            "usage": usage(num_prompt, completion_tokens, cached),
        }

    async def _stream(
        self, rid, created, total, num_prompt, choices, include_usage
    ) -> AsyncIterator[str]:
        model = self.state.model_name
        completion_tokens, cached = 0, 0
        offsets = [0] * total
        try:
            async for i, delta in choices:
                completion_tokens += len(delta.token_ids)
                cached = max(cached, delta.num_cached_tokens)
                if delta.error:
                    yield error_event(500, delta.error)
                    break
                if not delta.text and not delta.finished and not delta.logprobs:
                    continue
                c = {
                    "index": i,
                    "text": delta.text,
                    "finish_reason": delta.finish_reason,
                    "logprobs": None,
                }
                if delta.logprobs:
                    c["logprobs"] = self._logprobs(delta.logprobs, offsets[i])
                offsets[i] += len(delta.text)
                yield event(
                    {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [c],
                    }
                )
            if include_usage:
                yield event(
                    {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": usage(num_prompt, completion_tokens, cached),
                    }
                )
        except EngineDeadError as exc:
            yield error_event(503, f"The engine failed mid-stream: {exc}")
        except Exception as exc:
            yield error_event(500, f"{type(exc).__name__}: {exc}")
        yield DONE
