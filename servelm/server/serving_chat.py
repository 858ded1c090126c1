"""POST /v1/chat/completions: render the template, run the choices, answer in one body or as SSE."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from servelm.engine.client import EngineDeadError
from servelm.engine.outputs import Logprobs
from servelm.server.errors import APIError
from servelm.server.protocol import ChatCompletionRequest
from servelm.server.serving import OpenAIServing, cancel_on_disconnect, new_id
from servelm.server.sse import DONE, SSE_HEADERS, error_event, event
from servelm.text.chat_template import ChatTemplateError


class ServingChat(OpenAIServing):
    async def create(self, req: ChatCompletionRequest, raw: Request):
        self.check_model(req.model)
        self.check_logprobs(req.top_logprobs, "top_logprobs")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        for m in messages:  # content parts [{"type": "text", "text": ...}] -> plain text
            if isinstance(m.get("content"), list):
                m["content"] = "".join(
                    p.get("text", "") for p in m["content"] if p.get("type") == "text"
                )
        try:
            prompt_ids = self.tokenizer.encode_chat(
                messages, req.add_generation_prompt, tools=req.tools
            )
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), "messages") from None
        self.check_prompt_length(prompt_ids)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, req.max_completion_tokens or req.max_tokens, logprobs)
        self.check_admission()
        rid = new_id("chatcmpl")
        created = int(time.time())
        model = self.state.model_name
        choices = self.run_choices(rid, [prompt_ids], params, req.priority)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._stream(
                rid, created, model, params.n, len(prompt_ids), choices, include_usage
            )
            return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(
            await cancel_on_disconnect(
                raw, self._full(rid, created, model, params.n, len(prompt_ids), choices)
            )
        )

    def _logprobs_entry(self, lp: Logprobs) -> dict[str, Any]:
        def tok(t: int, v: float) -> dict[str, Any]:
            s = self.tokenizer.decode([t], skip_special_tokens=False)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}

        entry = tok(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [tok(t, v) for t, v in lp.top]
        return entry

    async def _full(self, rid, created, model, n, num_prompt, choices) -> dict[str, Any]:
        texts = [""] * n
        reasons: list[str | None] = [None] * n
        lps: list[list[dict[str, Any]] | None] = [None] * n
        completion_tokens, cached = 0, 0
        async for i, delta in choices:
            texts[i] += delta.text
            completion_tokens += len(delta.token_ids)
            cached = max(cached, delta.num_cached_tokens)
            if delta.logprobs:
                lps[i] = (lps[i] or []) + [self._logprobs_entry(lp) for lp in delta.logprobs]
            if delta.finished:
                if delta.error:
                    raise APIError(500, delta.error)
                reasons[i] = delta.finish_reason
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": texts[i]},
                    "logprobs": {"content": lps[i]} if lps[i] is not None else None,
                    "finish_reason": reasons[i],
                }
                for i in range(n)
            ],
            "usage": usage(num_prompt, completion_tokens, cached),
        }

    async def _stream(
        self, rid, created, model, n, num_prompt, choices, include_usage
    ) -> AsyncIterator[str]:
        def chunk(choice_list: list[dict[str, Any]], **extra: Any) -> str:
            return event(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": choice_list,
                    **extra,
                }
            )

        completion_tokens, cached = 0, 0
        try:
            for i in range(n):
                yield chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            async for i, delta in choices:
                completion_tokens += len(delta.token_ids)
                cached = max(cached, delta.num_cached_tokens)
                if delta.error:
                    yield error_event(500, delta.error)
                    break
                if not delta.text and not delta.finished and not delta.logprobs:
                    continue
                c: dict[str, Any] = {
                    "index": i,
                    "delta": {"content": delta.text} if delta.text else {},
                    "logprobs": None,
                    "finish_reason": delta.finish_reason,
                }
                if delta.logprobs:
                    c["logprobs"] = {"content": [self._logprobs_entry(lp) for lp in delta.logprobs]}
                yield chunk([c])
            if include_usage:
                yield chunk([], usage=usage(num_prompt, completion_tokens, cached))
        except EngineDeadError as exc:
            yield error_event(503, f"The engine failed mid-stream: {exc}")
        except Exception as exc:  # after the first byte an error can only go in-band
            yield error_event(500, f"{type(exc).__name__}: {exc}")
        yield DONE


def usage(num_prompt: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": num_prompt + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
