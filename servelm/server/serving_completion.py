"""POST /v1/completions: prompts as a string, strings, token ids or lists of token ids."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from servelm.engine.outputs import Logprobs
from servelm.server.errors import APIError
from servelm.server.protocol import CompletionRequest
from servelm.server.serving import (
    OpenAIServing,
    cancel_on_disconnect,
    chunk_writer,
    collect,
    new_id,
    stream_events,
)
from servelm.server.sse import SSE_HEADERS
from servelm.server.structured import checked_structure

MAX_PROMPTS = 64


class ServingCompletion(OpenAIServing):
    async def _prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [await self.encode(prompt)]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        elif prompt and all(isinstance(p, str) for p in prompt):
            prompts = [await self.encode(p) for p in prompt]
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
        if req.suffix:
            raise APIError(400, "suffix is not supported.", "suffix")
        if req.best_of is not None and req.best_of > req.n:
            raise APIError(400, "best_of is not supported: ask for n choices instead.", "best_of")
        prompts = await self._prompts(req.prompt)
        params = self.sampling_params(
            req, req.max_tokens, req.logprobs, await checked_structure(req)
        )
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
        done = await collect(choices, total, num_prompt)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.state.model_name,
            "choices": [
                {
                    "index": i,
                    "text": done.texts[i],
                    "finish_reason": done.reasons[i],
                    "logprobs": self._logprobs(done.logprobs[i], 0) if done.logprobs[i] else None,
                }
                for i in range(total)
            ],
            "usage": done.usage,
        }

    def _stream(self, rid, created, total, num_prompt, choices, include_usage):
        model = self.state.model_name
        offsets = [0] * total  # each choice's text so far, for the logprobs' text_offset

        chunk = chunk_writer(rid, "text_completion", created, model)

        def choice_of(i: int, delta) -> dict[str, Any]:
            lps = self._logprobs(delta.logprobs, offsets[i]) if delta.logprobs else None
            offsets[i] += len(delta.text)
            return {
                "index": i,
                "text": delta.text,
                "finish_reason": delta.finish_reason,
                "logprobs": lps,
            }

        return stream_events(choices, num_prompt, include_usage, chunk, choice_of)
