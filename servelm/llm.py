"""The offline API: `LLM(model).generate(prompts, params)` and `.chat(conversations, params)`.

Runs the engine core in this process: no server, no sockets. The same scheduler, model runner
and output processor as `servelm serve`, and the same bound on OpenMP's spin-waiting (it takes
effect when the first `LLM` is what loads torch; OMP_WAIT_POLICY / GOMP_SPINCOUNT win).
"""

from __future__ import annotations

import itertools
import logging
import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from servelm.config import EngineArgs
from servelm.engine.core_process import bound_openmp_spin
from servelm.engine.output_processor import OutputProcessor
from servelm.engine.outputs import ErrorKind, SchedulerStats
from servelm.engine.outputs_api import CompletionOutput, RequestOutput
from servelm.engine.requests import child_requests, default_sampling_params
from servelm.engine.sampling_params import InvalidParamError, SamplingParams
from servelm.store.fetch import resolve_model_dir
from servelm.text.chat_messages import prepare_chat
from servelm.text.tokenizer import TextTokenizer

logger = logging.getLogger("servelm")

# A prompt's text or token ids, or vLLM's TextPrompt / TokensPrompt: {"prompt": text} or
# {"prompt_token_ids": ids}
Prompt = str | list[int] | dict[str, Any]
PROMPT_KEYS = ("prompt", "prompt_token_ids")


@dataclass
class EngineTotals:
    """Counters summed over every step this LLM ran (for tests and curious users)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    steps: int = 0

    def add(self, stats: SchedulerStats) -> None:
        self.prefix_cache_queries += stats.prefix_cache_queries
        self.prefix_cache_hits += stats.prefix_cache_hits
        self.num_preemptions += stats.num_preemptions
        self.steps += 1


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        self.args = EngineArgs(model=model, **engine_kwargs)
        model_dir = resolve_model_dir(self.args)
        self.tokenizer = TextTokenizer(model_dir)
        bound_openmp_spin()  # before torch, and with it libgomp, is loaded just below
        from servelm.worker.executor import create_engine_core

        self.engine, self.info = create_engine_core(self.args, model_dir)
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.totals = EngineTotals()
        # One call drives the engine at a time: it is not thread-safe (a second thread stepping
        # it mid-step corrupts the runner's batch, or kills the process), so others wait.
        self._lock = threading.Lock()
        self._interrupted = False  # a Ctrl-C held until the current step ends

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        return default_sampling_params(self.tokenizer, **overrides)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt together (one continuous batch); results in prompt order.

        Every prompt and its parameters are checked before any runs (a ValueError or TypeError
        naming the prompt); if anything fails or is interrupted (Ctrl-C) part-way, what was
        started is aborted, so the next call starts clean. `priority` (one per prompt, lower
        first) needs `scheduling_policy="priority"`. Calls from several threads take turns."""
        if isinstance(prompts, (str, bytes, Mapping)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # (a generator too)
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        sampling_params = list(sampling_params)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"{len(prompts)} prompts but {len(sampling_params)} sampling params: give one, "
                "or one per prompt"
            )
        priority = self._checked_priority(priority, len(prompts))
        requests = [
            (self._prompt_ids(i, prompt), self._checked_params(i, params))
            for i, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True))
        ]
        with self._lock, self._ctrl_c_between_steps():
            return self._generate(prompts, requests, priority)

    @contextmanager
    def _ctrl_c_between_steps(self) -> Iterator[None]:
        """Ctrl-C taken between two engine steps, never inside one. A step publishes the
        prefix-cache hashes of the KV blocks it is about to fill before it fills them: a
        KeyboardInterrupt raised mid-step left them cached unwritten once the request was
        aborted, and a later prompt sharing the prefix read garbage from them. So SIGINT only
        marks the interrupt and `_run` raises it before the next step. (Only where signals
        arrive, the main thread, and only over Python's own handler: a program's own stays.)"""
        if (
            threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        ):
            yield
            return

        def mark(signum: int, frame: object) -> None:
            self._interrupted = True

        self._interrupted = False
        previous = signal.signal(signal.SIGINT, mark)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
        if self._interrupted:  # (during the last step: the answers are whole, but the user asked)
            self._interrupted = False
            raise KeyboardInterrupt

    def _generate(
        self,
        prompts: list[Prompt],
        requests: list[tuple[list[int], SamplingParams]],
        priority: Sequence[int] | None,
    ) -> list[RequestOutput]:
        results: list[RequestOutput] = []
        by_child: dict[str, tuple[RequestOutput, CompletionOutput]] = {}
        try:
            for i, (prompt, (ids, params)) in enumerate(zip(prompts, requests, strict=True)):
                rid = f"offline-{next(self._ids)}"
                result = RequestOutput(rid, _prompt_text(prompt), ids, [])
                eos = self.tokenizer.eos_token_ids
                for j, req in enumerate(
                    child_requests(rid, ids, params, eos, priority[i] if priority else 0)
                ):
                    completion = CompletionOutput(index=j)
                    result.outputs.append(completion)
                    self.engine.add_request(req)  # (a prompt over the context: ValueError)
                    by_child[req.request_id] = (result, completion)
                    self.processor.add_request(req.request_id, req.sampling_params, ids)
                results.append(result)
            self._run(by_child)
        except BaseException:
            self._abort(list(by_child))
            raise
        return results

    def _prompt_ids(self, i: int, prompt: Any) -> list[int]:
        """A prompt's token ids, checked as the server checks them (never an empty prompt or an
        id outside the vocabulary, which the model would index with)."""
        if isinstance(prompt, Mapping):
            prompt = _prompt_of_dict(i, prompt)
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            ids = list(prompt)
        else:
            raise TypeError(
                f"prompt {i} must be a string, a list of token ids (integers), "
                f"{{'prompt': text}} or {{'prompt_token_ids': ids}}; got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        vocab = self.info.spec.vocab_size  # the model's rows (a tokenizer may use fewer)
        if not 0 <= min(ids) <= max(ids) < vocab:
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise ValueError(f"prompt {i}: token ids must be in [0, {vocab}), got {bad}")
        return ids

    def _checked_params(self, i: int, params: Any) -> SamplingParams:
        """`params` checked again (a field may have changed since it was made), and its token
        ids against the model's vocabulary, as the server checks a request's."""
        if not isinstance(params, SamplingParams):
            kind = type(params).__name__
            raise TypeError(f"sampling params {i} must be a SamplingParams, got {kind}")
        try:
            params.validate()
            params.check_token_ids(self.info.spec.vocab_size)
        except InvalidParamError as exc:
            raise InvalidParamError(exc.param, f"sampling params {i}: {exc.message}") from None
        return params

    def _checked_priority(self, priority: Any, num_prompts: int) -> list[int] | None:
        """One integer per prompt, and only under the priority policy (vLLM's rule, and the
        server's: a priority the scheduler would ignore is refused, not dropped)."""
        if priority is None:
            return None
        priority = list(priority)
        if len(priority) != num_prompts:
            raise ValueError(f"{num_prompts} prompts but {len(priority)} priorities: give one each")
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in priority):
            raise TypeError("priority must be a list of integers")
        if any(priority) and self.args.scheduling_policy != "priority":
            raise ValueError(
                "priority scheduling is not enabled: a priority other than 0 needs "
                'LLM(..., scheduling_policy="priority")'
            )
        return priority

    def _abort(self, request_ids: list[str]) -> None:
        self.engine.abort_requests(request_ids)
        for rid in request_ids:
            self.processor.remove(rid)

    def chat(
        self,
        conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """The conversations' prompts built as the server builds them (`prepare_chat`:
        developer turns, text parts, tool calls and tool results), then `generate`."""
        if conversations and isinstance(conversations[0], Mapping):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = []
        for c in conversations:
            messages, _, template = prepare_chat(self.tokenizer, c)
            prompts.append(
                self.tokenizer.encode_chat(messages, add_generation_prompt, chat_template=template)
            )
        return self.generate(prompts, sampling_params)

    def _run(self, by_child: dict[str, tuple[RequestOutput, CompletionOutput]]) -> None:
        pending = set(by_child)
        while pending:
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"engine stopped with {len(pending)} requests unanswered")
            if self._interrupted:  # (see _ctrl_c_between_steps)
                self._interrupted = False
                raise KeyboardInterrupt
            outputs, stats = self.engine.step()
            self.totals.add(stats)
            for out in outputs:
                delta = self.processor.process(out)
                if delta is None:
                    continue
                if delta.error is not None:  # what the server answers 400 / 500, raised
                    fault = ValueError if delta.error_kind == ErrorKind.REQUEST else RuntimeError
                    raise fault(delta.error)
                result, completion = by_child[out.request_id]
                completion.text += delta.text
                completion.token_ids.extend(delta.token_ids)
                if delta.logprobs:
                    completion.logprobs = (completion.logprobs or []) + delta.logprobs
                if delta.prompt_logprobs is not None:
                    result.prompt_logprobs = delta.prompt_logprobs
                result.num_cached_tokens = max(result.num_cached_tokens, delta.num_cached_tokens)
                if delta.finished:
                    completion.finish_reason = delta.finish_reason
                    pending.discard(out.request_id)
                    if delta.abort_engine:
                        self.engine.abort_requests([out.request_id])


def _prompt_of_dict(i: int, prompt: Mapping[str, Any]) -> str | list[int]:
    """The text or ids of vLLM's TextPrompt / TokensPrompt (its ids where it has both)."""
    other = [key for key in prompt if key not in PROMPT_KEYS]
    if other or not prompt:
        raise ValueError(
            f"prompt {i}: a dict prompt takes 'prompt' (text) or 'prompt_token_ids'; "
            f"servelm does not take {', '.join(map(repr, other)) or 'an empty dict'}"
        )
    key = "prompt_token_ids" if "prompt_token_ids" in prompt else "prompt"
    value = prompt[key]
    if isinstance(value, str) != (key == "prompt"):  # (the ids' own type is checked by the caller)
        what = "a string" if key == "prompt" else "a list of token ids"
        raise TypeError(f"prompt {i}: {key!r} must be {what}; got {type(value).__name__}")
    return value


def _prompt_text(prompt: Prompt) -> str | None:
    """RequestOutput.prompt: the prompt's text where it was given as text."""
    if isinstance(prompt, Mapping):
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None
