"""What chat and completions share: validation, sampling parameters, admission, fan-out of `n`.

`OpenAIServing.run_choices` starts one engine request per prompt and choice and yields
`(choice_index, TextDelta)` as they arrive, with metrics taken on the way. `collect` (a whole
answer) and `stream_events` (an SSE body) consume them the same way for both endpoints; the
shape of each choice and chunk is left to `serving_chat` / `serving_completion`.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from servelm.engine.client import AsyncEngineClient, EngineDeadError, RequestsStopped
from servelm.engine.output_processor import TextDelta
from servelm.engine.outputs import ErrorKind, Logprobs
from servelm.engine.requests import choice_params, default_sampling_params
from servelm.engine.sampling_params import (
    MAX_LOGPROBS,
    InvalidParamError,
    SamplingParams,
    StructuredOutput,
)
from servelm.server.access import note_response_id
from servelm.server.errors import APIError
from servelm.server.metrics import RequestTimer, ServerMetrics
from servelm.server.protocol import SamplingFields
from servelm.server.sse import DONE, error_event, event


@dataclass
class ServerState:
    engine: AsyncEngineClient
    metrics: ServerMetrics
    model_name: str
    max_model_len: int  # what one sequence may use: min(context, KV capacity)
    max_queued_requests: int
    in_flight: int = 0  # engine requests (one per choice) admitted and not yet finished
    tool_call_parser: str | None = None  # --tool-call-parser (None: from the chat template)
    responses_store_size: int = 0  # --responses-store-size


# Text at least this long is tokenized on a worker thread: the tokenizer releases the GIL, so the
# event loop goes on answering and streaming meanwhile. Shorter text is encoded in place, where
# the hop to a thread and back would be a sizeable share of the encode. The measurements:
# docs/performance.md, "server/serving.py: THREAD_ENCODE_CHARS".
THREAD_ENCODE_CHARS = 8192


def _yield_to_the_engine() -> None:
    """The tokenizer thread runs at SCHED_IDLE (Linux): only on a core nothing else wants. On a
    small CPU box the engine's OpenMP threads stall at every barrier while any other thread
    holds a core, which shows as gaps in every stream (docs/performance.md). The cost: under
    full load a long prompt's tokenizing waits for idle moments (its prefill would wait for the
    engine anyway)."""
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # not permitted here: stay at normal priority
            pass


# One thread on a small box (2 cores here), a few where cores are plenty (a GPU host).
_TOKENIZE_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2 - 1))
_TOKENIZE_POOL = ThreadPoolExecutor(
    _TOKENIZE_THREADS, "servelm-tokenize", initializer=_yield_to_the_engine
)


async def off_loop(text_chars: int, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """`fn(*args, **kw)`, on a worker thread when it tokenizes `text_chars` or more characters."""
    if text_chars < THREAD_ENCODE_CHARS:
        return fn(*args, **kw)
    return await asyncio.get_running_loop().run_in_executor(
        _TOKENIZE_POOL, functools.partial(fn, *args, **kw)
    )


def message_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of content in chat messages: what `off_loop` weighs a chat prompt by."""
    return sum(len(m.get("content") or "") for m in messages)


def new_id(prefix: str, scope: dict, sep: str = "-") -> str:
    """A new answer id, noted on the request's log line (`access`)."""
    answer_id = f"{prefix}{sep}{uuid.uuid4().hex[:24]}"
    note_response_id(scope, answer_id)
    return answer_id


class OpenAIServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = state.engine
        self.tokenizer = state.engine.tokenizer

    def check_model(self, name: str | None) -> None:
        if name and name != self.state.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")

    def check_admission(self, sequences: int = 1) -> None:
        """503 unless the engine runs and the waiting queue has room for what of this request's
        `sequences` (prompts x n, each a request of the engine's) would wait; 400 when they
        could never all be taken (more than the batch and the whole queue hold)."""
        if not self.engine.is_alive:
            raise APIError(
                503,
                f"The engine is not running: {self.engine.dead_reason}.",
                headers={"Retry-After": "5"},
            )
        batch, queue_cap = self.engine.args.max_num_seqs, self.state.max_queued_requests
        if sequences > batch + queue_cap:
            raise APIError(
                400,
                f"This request makes {sequences} sequences (prompts x n); this server takes at "
                f"most {batch + queue_cap} at once (--max-num-seqs + --max-queued-requests).",
                "n",
            )
        queued = self.num_queued()
        # (with --max-queued-requests 0, refused only when some would have to wait)
        room = max(0, batch - self.state.in_flight) if queued == 0 else 0
        would_wait = max(0, sequences - room)
        if would_wait and queued + would_wait > queue_cap:
            raise APIError(
                503,
                "The server is at capacity (waiting queue full); retry later.",
                code="queue_full",
                headers={"Retry-After": "1"},
            )

    def num_queued(self) -> int:
        """Admitted requests that wait for a place in the running batch, as far as this process
        can tell: those beyond what `max_num_seqs` holds, or the engine's waiting queue at its
        last step (where the KV cache, not the batch, is what they wait for), whichever is more.
        A request admitted and already in prefill is not waiting."""
        beyond_batch = self.state.in_flight - self.engine.args.max_num_seqs
        stats = self.engine.last_stats
        return max(beyond_batch, stats.num_waiting if stats is not None else 0)

    def check_prompt_length(self, prompt_ids: list[int]) -> None:
        limit = self.state.max_model_len
        if len(prompt_ids) >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{len(prompt_ids)} input tokens; reduce the length of the prompt.",
                "prompt",
                "context_length_exceeded",
            )

    def check_output_room(
        self, prompts: list[list[int]], max_tokens: int | None, param: str = "max_tokens"
    ) -> None:
        """A 400 when the request asks for more tokens than the context has room for after its
        longest prompt, as OpenAI and vLLM answer (without max_tokens: the room left)."""
        limit = self.state.max_model_len
        longest = max(len(p) for p in prompts)
        if max_tokens is not None and longest + max_tokens > limit:
            raise APIError(
                400,
                f"{param} is too large: {max_tokens}. This model's maximum context length is "
                f"{limit} tokens and your request has {longest} input tokens "
                f"({max_tokens} > {limit} - {longest}).",
                param,
                "context_length_exceeded",
            )

    def sampling_params(
        self,
        req: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        structured_output: StructuredOutput | None = None,
        prompt_logprobs: int | None = None,
        echo: bool = False,
    ) -> SamplingParams:
        """`prompt_logprobs`: how many top tokens the engine reports at each prompt position
        (None: the prompt is not scored); `echo`: max_tokens may be 0 (only the prompt)."""
        if req.stream_options is not None and not req.stream:
            message = "stream_options is only allowed when stream is true."
            raise APIError(400, message, "stream_options")
        if req.stream_options is not None and req.stream_options.continuous_usage_stats:
            # (vLLM's usage in every chunk: not done here, so refused rather than ignored)
            message = "stream_options.continuous_usage_stats is not supported."
            raise APIError(400, message, "stream_options")
        if max_tokens is not None and max_tokens < 1 and not (echo and max_tokens == 0):
            raise APIError(
                400,
                f"max_tokens must be at least 1 (0 only with echo), got {max_tokens}.",
                "max_tokens",
            )
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if req.stop_token_ids:
            self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        try:
            return default_sampling_params(
                self.tokenizer,
                n=req.n,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                min_p=req.min_p,
                seed=req.seed,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                stop=stop,
                stop_token_ids=req.stop_token_ids,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                logit_bias=self._logit_bias(req.logit_bias),
                structured_output=structured_output,
                prompt_logprobs=prompt_logprobs,
            )
        except InvalidParamError as exc:
            raise APIError(400, exc.message, exc.param) from None

    async def encode(
        self, text: str, add_special_tokens: bool = True, bounded: bool = True
    ) -> list[int]:
        """The tokenizer's `encode`, off the event loop for long text (`off_loop`). `bounded`:
        text that cannot fit the context whatever its tokens is refused before it is tokenized."""
        if bounded:
            self.check_text_length(len(text))
        return await off_loop(len(text), self.tokenizer.encode, text, add_special_tokens)

    def check_text_length(self, chars: int) -> None:
        """A prompt of `chars` characters is at least chars / longest_token_chars tokens: over
        the context, refuse it without spending a tokenizer's time on all of it."""
        least = -(-chars // self.tokenizer.longest_token_chars)
        if least >= self.state.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.state.max_model_len} tokens. "
                f"However, your prompt is at least {least} tokens; reduce its length.",
                "prompt",
                "context_length_exceeded",
            )

    async def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, **kw: Any
    ) -> list[int]:
        """The tokenizer's `encode_chat`, off the event loop for long conversations."""
        chars = message_chars(messages)
        self.check_text_length(chars)
        return await off_loop(
            chars, self.tokenizer.encode_chat, messages, add_generation_prompt, **kw
        )

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """A 400 naming `param` unless every id is in the vocabulary (negative ones and those
        that are not integers the request models refuse already)."""
        vocab = self.tokenizer.vocab_size
        if ids and not 0 <= min(ids) <= max(ids) < vocab:  # min/max: C speed on long prompts
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise APIError(400, f"{param}: token ids must be in [0, {vocab}), got {bad}.", param)

    def _logit_bias(self, raw: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's `{"token id": bias}` as {token id: bias}, every id in the vocabulary."""
        if not raw:
            return None
        vocab = self.tokenizer.vocab_size
        bias = {}
        for key, value in raw.items():
            # decimal digits only: int() would also take " 5", "+5", "5_0" and non-ASCII digits
            if not (key.isascii() and key.isdigit()):
                raise APIError(
                    400, f"logit_bias keys must be token ids, got {key!r}.", "logit_bias"
                )
            if len(key) > len(str(vocab)) or not 0 <= int(key) < vocab:  # (int() of 5,000
                # digits is Python's ValueError)
                got = key if len(key) <= 20 else key[:20] + "..."
                raise APIError(
                    400, f"logit_bias token ids must be in [0, {vocab}), got {got}.", "logit_bias"
                )
            token = int(key)
            bias[token] = value
        return bias

    @staticmethod
    def check_logprobs(k: int | None, param: str) -> None:
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise APIError(400, f"{param} must be between 0 and {MAX_LOGPROBS}, got {k}.", param)

    def prompt_logprobs_json(
        self, entries: list[Logprobs | None], k: int
    ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
        rank, decoded_token}} for the prompt's token and the `k` most likely there."""
        dec = self.tokenizer.decode
        out: list[dict[str, dict[str, Any]] | None] = []
        for lp in entries:
            if lp is None:
                out.append(None)
                continue
            ranked = [(lp.token_id, lp.logprob, lp.rank)]  # the prompt's token first
            ranked += [(t, v, r) for r, (t, v) in enumerate(lp.top[:k], start=1)]
            out.append(
                {
                    str(t): {"logprob": v, "rank": r, "decoded_token": dec([t], False)}
                    for t, v, r in ranked
                }
            )
        return out

    def run_choices(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None = None,
    ) -> AsyncIterator[tuple[int, TextDelta]]:
        """Start every choice of every prompt now; iterate to get `(choice index, delta)` as they come.

        Choice i of prompt p has index p*n+i. The requests count as waiting (for admission
        control) from this call until each produces its first token.
        """
        if priority and self.engine.args.scheduling_policy != "priority":  # (vLLM's rule)
            message = "priority is only honoured with --scheduling-policy priority."
            raise APIError(400, message, "priority")
        arrival = time.time()
        n = params.n
        state = self.state
        queue: asyncio.Queue[tuple[int, TextDelta] | Exception | None] = asyncio.Queue()

        async def one(index: int, prompt: list[int], p: SamplingParams) -> None:
            timer, finished, cut = RequestTimer(state.metrics, arrival, len(prompt)), False, "abort"
            try:
                async for delta in self.engine.generate(
                    f"{request_id}-{index}", prompt, p, priority, arrival, cache_salt
                ):
                    now = time.time()
                    timer.on_tokens(now, len(delta.token_ids), delta.queued_time)
                    if delta.finished:
                        timer.on_finish(now, delta.finish_reason, delta.num_prompt_tokens)
                        finished = True
                    await queue.put((index, delta))
            except Exception as exc:  # engine death or a bug: surface it to the response
                cut = "abort" if isinstance(exc, RequestsStopped) else "error"
                await queue.put(exc)
            finally:
                if not finished:  # cancelled (the client left), stopped or failed: still served
                    ran = len(prompt) if timer.first is not None else 0
                    timer.on_finish(time.time(), cut, ran)
                await queue.put(None)

        tasks = []
        for pi, prompt in enumerate(prompts):
            for ci in range(n):
                p = choice_params(params, ci)
                # counted now, not when the task first runs (admission reads it), and uncounted
                # when it is done, even cancelled before it ever ran
                state.in_flight += 1
                task = asyncio.create_task(one(pi * n + ci, prompt, p))
                task.add_done_callback(self._done_in_flight)
                tasks.append(task)
        return self._merge(queue, tasks)

    def _done_in_flight(self, task: asyncio.Task) -> None:
        self.state.in_flight -= 1

    @staticmethod
    async def _merge(
        queue: asyncio.Queue, tasks: list[asyncio.Task]
    ) -> AsyncIterator[tuple[int, TextDelta]]:
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()  # the consumer went away: each generator aborts its request
            await asyncio.gather(*tasks, return_exceptions=True)


async def cancel_on_disconnect(raw: Request, coro):
    """Run `coro`; if the client disconnects first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(coro)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.1)
        if not done and await raw.is_disconnected():
            task.cancel()
            raise APIError(499, "client disconnected")
    return task.result()


# -- what both endpoints do with the deltas -------------------------------------------------
Choices = AsyncIterator[tuple[int, TextDelta]]


@dataclass
class Collected:
    """A finished non-streaming request: per choice text, finish reason and logprobs."""

    texts: list[str]
    reasons: list[str | None]
    logprobs: list[list[Logprobs]]
    usage: dict[str, Any]
    prompt_logprobs: list[list[Logprobs | None] | None] = field(default_factory=list)


def error_status(delta: TextDelta) -> int:
    """The status of a request the engine ended with an error: 400 where the engine says the
    request caused it (a grammar that did not compile), else 500."""
    return 400 if delta.error_kind == ErrorKind.REQUEST else 500


async def collect(choices: Choices, n: int, num_prompt: int) -> Collected:
    texts, reasons = [""] * n, [None] * n
    lps: list[list[Logprobs]] = [[] for _ in range(n)]
    prompt_lps: list[list[Logprobs | None] | None] = [None] * n
    completion_tokens, cached = 0, 0
    try:
        async for i, delta in choices:
            if delta.prompt_logprobs is not None:
                prompt_lps[i] = delta.prompt_logprobs
            texts[i] += delta.text
            completion_tokens += len(delta.token_ids)
            cached = max(cached, delta.num_cached_tokens)
            lps[i] += delta.logprobs or []
            if delta.finished:
                if delta.error:
                    raise APIError(error_status(delta), delta.error)
                reasons[i] = delta.finish_reason
    except EngineDeadError as exc:  # what a new request would hear, not an unexpected 500
        raise APIError(503, f"The engine failed: {exc}", headers={"Retry-After": "5"}) from None
    except RequestsStopped as exc:
        raise APIError(503, str(exc), headers={"Retry-After": "5"}) from None
    return Collected(texts, reasons, lps, usage(num_prompt, completion_tokens, cached), prompt_lps)


def chunk_writer(rid: str, object_name: str, created: int, model: str) -> Callable[..., str]:
    """`chunk(choices, **extra)` -> one SSE event of a streamed response's chunk object."""

    envelope = {"id": rid, "object": object_name, "created": created, "model": model}

    def chunk(choice_list: list[dict[str, Any]], **extra: Any) -> str:
        return event({**envelope, "choices": choice_list, **extra})

    return chunk


async def stream_events(
    choices: Choices,
    num_prompt: int,
    include_usage: bool,
    chunk: Callable[..., str],
    choice_of: Callable[[int, TextDelta], dict[str, Any]],
    first: Iterable[str] = (),
) -> AsyncIterator[str]:
    """The SSE body: `first` events, then `chunk([choice_of(i, delta)])` for each delta that
    carries text, logprobs or an end; a usage chunk if asked; errors in-band; then [DONE]."""
    completion_tokens, cached = 0, 0
    try:
        for e in first:
            yield e
        async for i, delta in choices:
            completion_tokens += len(delta.token_ids)
            cached = max(cached, delta.num_cached_tokens)
            if delta.error:
                yield error_event(error_status(delta), delta.error)
                break
            if (
                delta.text
                or delta.finished
                or delta.logprobs
                or delta.tool_calls
                or delta.prompt_logprobs
            ):
                yield chunk([choice_of(i, delta)])
        if include_usage:
            yield chunk([], usage=usage(num_prompt, completion_tokens, cached))
    except EngineDeadError as exc:
        yield error_event(503, f"The engine failed mid-stream: {exc}")
    except RequestsStopped as exc:
        yield error_event(503, str(exc))
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
