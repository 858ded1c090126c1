"""POST /v1/chat/completions: render the template, run the choices, answer in one body or as SSE."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from servelm.engine.outputs import Logprobs
from servelm.engine.sampling_params import SamplingParams
from servelm.server.errors import APIError
from servelm.server.protocol import ChatCompletionRequest, ChatMessage, TokenizeRequest
from servelm.server.serving import (
    Choices,
    OpenAIServing,
    cancel_on_disconnect,
    chunk_writer,
    collect,
    new_id,
    stream_events,
)
from servelm.server.serving_tools import (
    ToolSetup,
    constrain,
    finish_reason,
    message_of,
    resolve,
    server_parser,
    stream_tool_calls,
)
from servelm.server.sse import SSE_HEADERS
from servelm.server.structured import checked_structure
from servelm.text.chat_messages import prepare_chat
from servelm.text.chat_template import ChatTemplateError, TemplateKwargsError


@dataclass
class ChatRun:
    """A chat request started: its answer id, prompt, parameters, tools and running choices."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    tools: ToolSetup | None
    choices: Choices


class ServingChat(OpenAIServing):
    def __init__(self, state) -> None:
        super().__init__(state)
        # (the template that renders tools: a named `tool_use` one where the model has it)
        tool_template = self.tokenizer.chat_template_for(tools=True)
        self.tool_parser = server_parser(state.tool_call_parser, tool_template)

    def tool_setup(self, req: ChatCompletionRequest | TokenizeRequest) -> ToolSetup | None:
        """What the request's `tools`, `tool_choice` and `parallel_tool_calls` mean."""
        return resolve(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_parser)

    async def encode_messages(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        setup: ToolSetup | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt ids of a conversation (chat completions and /tokenize alike), tools and
        tool turns as `text/tool_prompt.py` writes them, `template_kwargs` (a request's
        `chat_template_kwargs`) as the template's own variables."""
        tools, parallel = (setup.tools, setup.parallel) if setup else (None, True)
        dumped = [m.model_dump(exclude_none=True) for m in messages]
        try:  # (shared with LLM.chat; a message it cannot carry is a ChatTemplateError)
            msgs, tools, template = prepare_chat(
                self.tokenizer, dumped, tools, parallel, self.tool_parser
            )
            return await self.encode_chat(
                msgs,
                add_generation_prompt,
                tools=tools,
                template_kwargs=template_kwargs,
                chat_template=template,
            )
        except TemplateKwargsError as exc:
            raise APIError(400, str(exc), "chat_template_kwargs") from None
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), "messages") from None

    async def start(
        self,
        req: ChatCompletionRequest,
        raw: Request,
        id_prefix: str,
        sep: str = "-",
        clamp_output: bool = False,
    ) -> ChatRun:
        """Check the request, render its prompt and start its choices (chat completions, and
        the Responses API, which asks the same of the engine and answers in its own shape).
        `clamp_output`: a max_tokens past the context is cut to the room left, not refused."""
        self.check_model(req.model)
        self.check_logprobs(req.top_logprobs, "top_logprobs")
        for legacy in ("functions", "function_call"):
            if getattr(req, legacy) is not None:
                message = f"{legacy} is the deprecated form of tools; send tools and tool_choice."
                raise APIError(400, message, legacy)
        if req.top_logprobs is not None and not req.logprobs:  # OpenAI's rule, not ignored
            raise APIError(
                400, "top_logprobs is only allowed when logprobs is true.", "top_logprobs"
            )
        self.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        tools = self.tool_setup(req)
        prompt_ids = await self.encode_messages(
            req.messages, req.add_generation_prompt, tools, req.chat_template_kwargs
        )
        self.check_prompt_length(prompt_ids)
        max_tokens = req.max_completion_tokens or req.max_tokens
        asked = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        room = self.state.max_model_len - len(prompt_ids)
        if clamp_output and max_tokens is not None:
            max_tokens = min(max_tokens, room)
        self.check_output_room([prompt_ids], max_tokens, asked)
        if max_tokens is None:  # a chat answer runs to its end (OpenAI, vLLM), not 16 tokens
            max_tokens = room
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        structure = await constrain(tools, await checked_structure(req, self.tokenizer))
        params = self.sampling_params(
            req,
            max_tokens,
            logprobs,
            structure,
            prompt_logprobs=req.prompt_logprobs,
        )
        self.check_admission(params.n)
        rid = new_id(id_prefix, raw.scope, sep)
        choices = self.run_choices(rid, [prompt_ids], params, req.priority, req.cache_salt)
        return ChatRun(rid, prompt_ids, params, tools, choices)

    async def create(self, req: ChatCompletionRequest, raw: Request):
        run = await self.start(req, raw, "chatcmpl")
        created, model, n, num_prompt = (
            int(time.time()),
            self.state.model_name,
            run.params.n,
            len(run.prompt_ids),
        )
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            choices = run.choices
            if run.tools is not None:
                choices = stream_tool_calls(choices, run.tools)
            body = self._stream(
                run.rid, created, model, n, num_prompt, choices, include_usage, req.prompt_logprobs
            )
            return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
        full = self._full(
            run.rid, created, model, n, num_prompt, run.choices, run.tools, req.prompt_logprobs
        )
        return JSONResponse(await cancel_on_disconnect(raw, full))

    def logprobs_entry(self, lp: Logprobs) -> dict[str, Any]:
        """One token's logprobs as OpenAI writes them (chat's `logprobs.content`, and each
        Responses `output_text` part's `logprobs`)."""

        def tok(t: int, v: float) -> dict[str, Any]:
            s = self.tokenizer.decode([t], skip_special_tokens=False)
            return {"token": s, "logprob": v, "bytes": list(self.tokenizer.token_bytes(t))}

        entry = tok(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [tok(t, v) for t, v in lp.top]
        return entry

    async def _full(
        self,
        rid,
        created,
        model,
        n,
        num_prompt,
        choices,
        tools: ToolSetup | None,
        prompt_logprobs: int | None = None,
    ) -> dict[str, Any]:
        done = await collect(choices, n, num_prompt)
        messages = [message_of(text, tools) for text in done.texts]
        out = []
        for i in range(n):
            choice = {
                "index": i,
                "message": messages[i][0],
                "logprobs": self._logprobs(done.logprobs[i]) if done.logprobs[i] else None,
                "finish_reason": finish_reason(done.reasons[i], messages[i][1]),
            }
            if prompt_logprobs is not None and done.prompt_logprobs[i] is not None:
                choice["prompt_logprobs"] = self.prompt_logprobs_json(
                    done.prompt_logprobs[i], prompt_logprobs
                )
            out.append(choice)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": out,
            "usage": done.usage,
        }

    def _logprobs(self, lps: list[Logprobs]) -> dict[str, Any]:
        return {"content": [self.logprobs_entry(lp) for lp in lps]}

    def _stream(
        self, rid, created, model, n, num_prompt, choices, include_usage, prompt_logprobs=None
    ):
        chunk = chunk_writer(rid, "chat.completion.chunk", created, model)

        def choice_of(i: int, delta) -> dict[str, Any]:
            d: dict[str, Any] = {"content": delta.text} if delta.text else {}
            if delta.tool_calls:
                d["tool_calls"] = delta.tool_calls
            choice = {
                "index": i,
                "delta": d,
                "logprobs": self._logprobs(delta.logprobs) if delta.logprobs else None,
                "finish_reason": delta.finish_reason,
            }
            if prompt_logprobs is not None and delta.prompt_logprobs is not None:
                # (in the choice's first chunk with content, as vLLM sends it)
                choice["prompt_logprobs"] = self.prompt_logprobs_json(
                    delta.prompt_logprobs, prompt_logprobs
                )
            return choice

        role = {"role": "assistant", "content": ""}
        first = (
            chunk([{"index": i, "delta": role, "logprobs": None, "finish_reason": None}])
            for i in range(n)
        )
        return stream_events(choices, num_prompt, include_usage, chunk, choice_of, first)
