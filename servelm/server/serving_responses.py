"""POST /v1/responses (OpenAI's Responses API), and GET / DELETE of a stored response.

A request runs as the chat completion it means (`protocol_responses.chat_request`, then
`ServingChat.start`): the same prompt, tool prompt, grammar and engine requests. What differs
is the answer's shape: `output` items (an assistant `message` with `output_text`, and one
`function_call` item per tool call), and a stream of typed, numbered events
(`response.created` ... `response.completed`) rather than chunks and `[DONE]`.

Responses are kept in memory (`store`, true by default as in OpenAI's API) so that a later
request can go on from one with `previous_response_id` and a client can fetch it again; the
newest `--responses-store-size` are kept, per server process. Behind `servelm route`, a
continuation reaches the replica that holds its response (router/affinity.py).
"""

from __future__ import annotations

import copy
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from servelm.engine.client import EngineDeadError, RequestsStopped
from servelm.engine.outputs import Logprobs
from servelm.server.errors import APIError
from servelm.server.protocol_responses import (
    ResponsesRequest,
    chat_request,
    is_strict,
    text_config,
)
from servelm.server.serving import Choices, cancel_on_disconnect, collect, error_status
from servelm.server.serving_chat import ChatRun, ServingChat
from servelm.server.serving_tools import message_of, stream_tool_calls
from servelm.server.sse import SSE_HEADERS, typed_event


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Stored:
    """A finished response, and the chat messages it ended (its input and its answer) that a
    continuation's prompt starts with."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    input_items: list[dict[str, Any]]  # what the request's `input` held, with ids


class ResponseStore:
    """The newest `capacity` stored responses, by id (least recently used dropped first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, stored: Stored) -> None:
        if self.capacity <= 0:
            return
        self._items[stored.response["id"]] = stored
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


# The chat request's fields, as the Responses request that made it names them.
RESPONSES_PARAMS = {
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "prompt": "input",
    "response_format": "text",
    "logprobs": "include",
}


def _in_responses_terms(exc: APIError) -> APIError:
    """An error the chat path raised, naming what the Responses request called it: its
    `param`, and in the message the field names and a tool's fields (no `function` level)."""
    message = exc.message.replace("max_completion_tokens", "max_output_tokens")
    message = re.sub(r"\b(tools\.\d+)\.function\.", r"\1.", message)
    param = RESPONSES_PARAMS.get(exc.param or "", exc.param)
    return APIError(exc.status, message, param, exc.code, exc.headers)


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's `input` as the items `GET /v1/responses/{id}/input_items` lists: each
    with an id, a message's text as parts (`input_text`; an assistant's, `output_text`)."""
    raw = (
        [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value
    )
    items = []
    for item in raw:
        item = copy.deepcopy(item)
        kind = item.setdefault("type", "message")
        if kind == "message":
            if isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
            item.setdefault("status", "completed")
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
        item.setdefault("id", _id(prefix.get(kind, "item")))
        items.append(item)
    return items


def _not_found(response_id: str, param: str | None = None) -> APIError:
    message = f"Response with id '{response_id}' not found."
    return APIError(404, message, param, "response_not_found")


@dataclass
class _Answer:
    """What a response's output is built from, filled as the choice's deltas come."""

    text: str = ""
    logprobs: list[Logprobs] = field(default_factory=list)
    reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0


class ServingResponses:
    def __init__(self, chat: ServingChat) -> None:
        self.chat = chat
        self.store = ResponseStore(chat.state.responses_store_size)

    # -- stored responses --------------------------------------------------------------------
    def get(self, response_id: str) -> dict[str, Any]:
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored.response

    def input_items(
        self, response_id: str, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> dict[str, Any]:
        """A page of a stored response's input items (OpenAI's list: newest first unless
        `order` is `asc`, `limit` of them (1-100, the route checks), after the item `after`)."""
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        items = stored.input_items if order == "asc" else stored.input_items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(404, f"No input item with id '{after}' in this response.", "after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    # -- a new response ----------------------------------------------------------------------
    async def create(self, req: ResponsesRequest, raw: Request):
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise _not_found(req.previous_response_id, "previous_response_id")
            history = previous.conversation
        try:
            chat_req, conversation = chat_request(req, history)
            # (max_output_tokens is a cap, as vLLM's Responses API takes it: an agent's fixed
            # cap would otherwise fail every turn once its conversation grew past the rest)
            run = await self.chat.start(chat_req, raw, "resp", sep="_", clamp_output=True)
        except APIError as exc:
            raise _in_responses_terms(exc) from None
        head = self._head(req, run)
        items = input_items(req.input)
        if req.stream:
            body = self._stream(req, run, head, conversation, items)
            return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
        done = await cancel_on_disconnect(raw, collect(run.choices, 1, len(run.prompt_ids)))
        answer = _Answer(done.texts[0], done.logprobs[0], done.reasons[0])
        answer.completion_tokens = done.usage["completion_tokens"]
        answer.cached_tokens = done.usage["prompt_tokens_details"]["cached_tokens"]
        message, _ = message_of(answer.text, run.tools)
        output = self._output(message, answer, req.logprobs)
        return JSONResponse(
            self._finish(req, run, head, output, answer, conversation, message, items)
        )

    def _head(self, req: ResponsesRequest, run: ChatRun) -> dict[str, Any]:
        """The response object before its output: what the request asked, echoed."""
        tools = [{**tool, "strict": is_strict(tool)} for tool in req.tools or []]
        return {
            "id": run.rid,
            "object": "response",
            "created_at": int(time.time()),
            "completed_at": None,
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.chat.state.model_name,
            "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": None,
            "store": req.store is not False,
            "temperature": req.temperature,
            "text": text_config(req.text),
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": tools,
            "top_logprobs": req.top_logprobs,
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def _output(
        self, message: dict[str, Any], answer: _Answer, with_logprobs: bool
    ) -> list[dict[str, Any]]:
        """The output items of a whole answer: its text as a message (unless it only calls
        tools), then its calls; the last one `incomplete` when max_output_tokens cut it."""
        items = []
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            lps = answer.logprobs if with_logprobs else None
            items.append(
                {
                    "id": _id("msg"),
                    "type": "message",
                    "status": "completed",
                    "role": "assistant",
                    "content": [self._text_part(message.get("content") or "", lps)],
                }
            )
        for call in calls:
            fn = call["function"]
            items.append(_call_item(_id("fc"), call["id"], fn["name"], fn["arguments"]))
        if answer.reason == "length":
            items[-1]["status"] = "incomplete"
        return items

    def _text_part(self, text: str, lps: list[Logprobs] | None) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if lps is not None:
            part["logprobs"] = [self.chat.logprobs_entry(lp) for lp in lps]
        return part

    def _finish(
        self,
        req: ResponsesRequest,
        run: ChatRun,
        head: dict[str, Any],
        output: list[dict[str, Any]],
        answer: _Answer,
        conversation: list[dict[str, Any]],
        message: dict[str, Any],
        items: list[dict[str, Any]],
    ) -> dict[str, Any]:
        """The whole response (stored when asked, with its input `items`), from its head,
        output and answer."""
        cut = answer.reason == "length"
        num_prompt = len(run.prompt_ids)
        response = {
            **head,
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "completed_at": None if cut else int(time.time()),
            "output": output,
            "usage": {
                "input_tokens": num_prompt,
                "input_tokens_details": {"cached_tokens": answer.cached_tokens},
                "output_tokens": answer.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": num_prompt + answer.completion_tokens,
            },
        }
        if req.store is not False:
            said = {k: v for k, v in message.items() if v is not None}
            said.setdefault("content", None)
            self.store.put(Stored(copy.deepcopy(response), [*conversation, said], items))
        return response

    async def _stream(
        self,
        req: ResponsesRequest,
        run: ChatRun,
        head: dict[str, Any],
        conversation: list[dict[str, Any]],
        items: list[dict[str, Any]],
    ) -> AsyncIterator[str]:
        """The SSE body: OpenAI's typed events, each numbered, ending in `response.completed`
        (or `.incomplete` when cut by max_output_tokens, `.failed` when the engine failed)."""
        events = _Events()
        choices: Choices = run.choices
        if run.tools is not None:
            choices = stream_tool_calls(choices, run.tools)
        writer = _OutputWriter(self, events, req.logprobs)
        answer = _Answer()
        yield events("response.created", response=head)
        yield events("response.in_progress", response=head)
        try:
            async for _, delta in choices:
                answer.completion_tokens += len(delta.token_ids)
                answer.cached_tokens = max(answer.cached_tokens, delta.num_cached_tokens)
                if delta.error:
                    status = error_status(delta)
                    yield self._failed(events, head, writer, delta.error, status)
                    return
                for e in writer.on_delta(delta.text, delta.tool_calls, delta.logprobs):
                    yield e
                if delta.finished:
                    answer.reason = delta.finish_reason
        except (EngineDeadError, RequestsStopped) as exc:
            yield self._failed(events, head, writer, f"The engine failed: {exc}", 503)
            return
        except Exception as exc:  # after the first byte an error can only go in-band
            yield self._failed(events, head, writer, f"{type(exc).__name__}: {exc}", 500)
            return
        for e in writer.close(answer):
            yield e
        message = writer.message(answer)
        response = self._finish(req, run, head, writer.items, answer, conversation, message, items)
        done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield events(done, response=response)

    def _failed(
        self, events: _Events, head: dict[str, Any], writer: _OutputWriter, why: str, status: int
    ) -> str:
        code = "invalid_request" if status == 400 else "server_error"
        response = {
            **head,
            "status": "failed",
            "error": {"code": code, "message": why},
            "output": writer.items,
        }
        return events("response.failed", response=response)


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"):
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


class _Events:
    """Server-sent events of the Responses API: `event: <type>` and the event as data, with a
    `sequence_number` counting from 0."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return typed_event(payload)


class _OutputWriter:
    """A streamed answer's output items: opens a message item at its first text and a
    function_call item at each call's first delta, and writes each item's events."""

    def __init__(self, serving: ServingResponses, events: _Events, with_logprobs: bool) -> None:
        self.serving = serving
        self.events = events
        self.with_logprobs = with_logprobs
        self.items: list[dict[str, Any]] = []
        self._text: dict[str, Any] | None = None  # the open message item
        self._text_lps: list[Logprobs] = []
        self._call: dict[str, Any] | None = None  # the open function_call item

    def on_delta(
        self, text: str, tool_calls: list[dict] | None, lps: list[Logprobs] | None
    ) -> list[str]:
        out: list[str] = []
        if text:
            out += self._close_call()
            if self._text is None:
                out += self._open_message()
            self._text["content"][0]["text"] += text
        if self.with_logprobs and self._text is not None:  # (the end token's too, as whole)
            self._text_lps += lps or []
        if text:
            entries = [self.serving.chat.logprobs_entry(lp) for lp in lps or []]
            out.append(
                self._event(
                    "response.output_text.delta",
                    self._text,
                    delta=text,
                    content_index=0,
                    logprobs=entries if self.with_logprobs else [],
                )
            )
        for call in tool_calls or []:
            fn = call.get("function", {})
            if "id" in call:  # a new call
                out += self._close_message() + self._close_call()
                item = _call_item(_id("fc"), call["id"], fn["name"], "", "in_progress")
                self._call = item
                self.items.append(item)
                out.append(self._event("response.output_item.added", item, item=item))
            if fn.get("arguments") and self._call is not None:
                self._call["arguments"] += fn["arguments"]
                out.append(
                    self._event(
                        "response.function_call_arguments.delta", self._call, delta=fn["arguments"]
                    )
                )
        return out

    def close(self, answer: _Answer) -> list[str]:
        """The open items' done events; an answer of no text and no call still has its
        (empty) message, as a whole answer has."""
        opened = [] if self.items else self._open_message()
        return opened + self._close_message(answer) + self._close_call(answer)

    def message(self, answer: _Answer) -> dict[str, Any]:
        """The answer as a chat message (what a continuation's prompt carries)."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [
            {
                "id": i["call_id"],
                "type": "function",
                "function": {"name": i["name"], "arguments": i["arguments"]},
            }
            for i in self.items
            if i["type"] == "function_call"
        ]
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        return message

    def _event(self, kind: str, owner: dict[str, Any], **fields: Any) -> str:
        """An event about the output item `owner`: its place, and its id unless the event
        carries the item itself."""
        where = {"output_index": self.items.index(owner)}
        if "item" not in fields:
            where["item_id"] = owner["id"]
        return self.events(kind, **where, **fields)

    def _open_message(self) -> list[str]:
        item = {
            "id": _id("msg"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self.items.append(item)
        self._text = item
        added = self._event("response.output_item.added", item, item=copy.deepcopy(item))
        part = self.serving._text_part("", [] if self.with_logprobs else None)
        item["content"].append(part)
        return [
            added,
            self._event(
                "response.content_part.added", item, content_index=0, part=copy.deepcopy(part)
            ),
        ]

    def _close_message(self, answer: _Answer | None = None) -> list[str]:
        item = self._text
        if item is None:
            return []
        self._text = None
        cut = answer is not None and answer.reason == "length"
        item["status"] = "incomplete" if cut else "completed"
        part = self.serving._text_part(
            item["content"][0]["text"], self._text_lps if self.with_logprobs else None
        )
        item["content"][0] = part
        self._text_lps = []
        return [
            self._event(
                "response.output_text.done",
                item,
                content_index=0,
                text=part["text"],
                logprobs=part.get("logprobs", []),
            ),
            self._event("response.content_part.done", item, content_index=0, part=part),
            self._event("response.output_item.done", item, item=item),
        ]

    def _close_call(self, answer: _Answer | None = None) -> list[str]:
        item = self._call
        if item is None:
            return []
        self._call = None
        # (the last call of an answer cut by max_output_tokens is cut too)
        cut = answer is not None and answer.reason == "length"
        item["status"] = "incomplete" if cut else "completed"
        return [
            self._event(
                "response.function_call_arguments.done",
                item,
                arguments=item["arguments"],
                name=item["name"],
            ),
            self._event("response.output_item.done", item, item=item),
        ]
