"""Scheduler: continuous batching with chunked prefill, prefix-cache hits and preemption.

There is no prefill phase and no decode phase. Each request has `num_computed_tokens` catching
up with `num_tokens`; every step hands out a token budget. Running requests go first (a decode
takes one token, an unfinished prompt takes a chunk of what is left), then waiting requests are
admitted while blocks, budget and `max_num_seqs` allow. When the pool runs dry the newest
running request (or, under the priority policy, the lowest-priority one) is preempted: its blocks
are freed and it is recomputed later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from servelm.config import SCHEDULER_LEAST
from servelm.engine.kv_cache import KVCacheManager
from servelm.engine.outputs import (
    EngineCoreOutput,
    ErrorKind,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
    new_token_output,
    scheduled_request,
)
from servelm.engine.request import Request, RequestStatus
from servelm.engine.request_queue import make_queue


@dataclass
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # New prompts are admitted only while the step's prompt tokens are fewer than this (0: no
    # limit but the budget). Where prompts are bound by arithmetic (a CPU), batching them buys
    # no speed, and every prompt of a batch gets its first token when the last one does.
    max_prefill_admit_tokens: int = 0
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    # Every layer's attention window, the largest (None: some layer sees the whole context):
    # blocks out of it go back to the pool, so a sequence holds about window / block_size.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        # Below these, no request would ever be scheduled: every caller (the command lines,
        # LLM, the simulator) gets an error instead of a server that waits for good.
        for name, least in SCHEDULER_LEAST.items():
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.sliding_window,
        )
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        self._num_preemptions = 0

    # -- requests in and out ----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        # The whole sequence must fit the context and, alone, the KV pool (else it never runs);
        # with a window it holds only the blocks its window and a step's chunk reach.
        config = self.config
        if request.num_prompt_tokens < 1:  # nothing to attend from: the kernels divide by it
            raise ValueError("the prompt must not be empty")
        max_len = config.max_model_len
        if self.kv.blocks_needed(max_len, config.max_num_batched_tokens) > config.num_blocks:
            max_len = min(max_len, config.num_blocks * config.block_size)
        room = max_len - request.num_prompt_tokens
        if room < 1:
            raise ValueError(
                f"This model's maximum context length is {max_len} tokens, but the prompt has "
                f"{request.num_prompt_tokens} tokens."
            )
        request.max_output_tokens = (
            room if params.max_tokens is None else min(params.max_tokens, room)
        )
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = []
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            aborted.append(request)
        return aborted

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.grammar = None
        self.kv.free(request)
        self._finished_ids.add(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = 0
        admit_cap = self.config.max_prefill_admit_tokens or budget

        i = 0
        running = self.running
        allocate_slots = self.kv.allocate_slots
        while i < len(running) and budget > 0:
            request = running[i]
            # request.num_tokens - computed, without the property call (once per request-step)
            num_new = (
                len(request.prompt_token_ids)
                + len(request.output_token_ids)
                - request.num_computed_tokens
            )
            if num_new > budget:
                num_new = budget
            while allocate_slots(request, num_new) is None:
                victim = self._pick_victim()
                if self.running.index(victim) < i:  # already scheduled this step: take it back
                    i -= 1
                    for k, (r, n) in enumerate(scheduled):
                        if r is victim:
                            budget += n
                            del scheduled[k]
                            break
                self._preempt(victim)
                preempted += 1
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                i += 1

        # Prompt tokens already in the step (chunks of unfinished prompts; a decode is one token)
        prefill = sum(n for _, n in scheduled if n > 1)
        # Admit waiting requests only in steps without preemption: the pool is known to be tight.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and prefill < admit_cap
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            if request.sampling_params.prompt_logprobs is not None:
                # Every prompt position is scored, so a cached prefix is computed again (its
                # blocks are still published for others), as vLLM does.
                hit_blocks, num_hit = [], 0
            num_new = min(request.num_tokens - num_hit, budget)
            if self.kv.allocate_slots(request, num_new, hit_blocks) is None:
                break
            self.waiting.pop()
            if self.kv.enable_caching:  # (off: no queries, so a hit-rate panel shows no data,
                # not 0 %; vLLM's rule too)
                self.kv.prefix_stats.record(request.num_tokens, num_hit)
            if request.num_cached_tokens < 0:  # first admission (not a resume after preemption)
                request.num_cached_tokens = num_hit
                request.scheduled_time = time.time()
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
            prefill += num_new

        # Describe each scheduled request (each appears once), then advance it. Runs once per
        # request per step, inline rather than through a method call.
        described = []
        block_ids = self.kv.shared_block_ids  # runners only read them (as the token lists)
        for request, n in scheduled:
            start = request.num_computed_tokens
            end = start + n
            rid = request.request_id
            described.append(
                scheduled_request(
                    request_id=rid,
                    token_ids=request.token_ids_slice(start, end),
                    num_computed_tokens=start,
                    block_ids=block_ids(rid),
                    sampling_params=request.sampling_params,
                    sample=end == request.num_tokens,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids,
                    eos_token_ids=request.eos_token_ids,
                )
            )
            request.num_computed_tokens = end
        out = SchedulerOutput(
            requests=described,
            finished_request_ids=self._finished_ids,
            num_preempted=preempted,
        )
        self._finished_ids = set()
        return out

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.add_front(request)

    # -- results ----------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs = []
        requests = self.requests
        sampled = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs
        running = RequestStatus.RUNNING
        max_model_len = self.config.max_model_len
        if runner_output.prompt_logprobs:
            self._add_prompt_logprobs(runner_output.prompt_logprobs)
        for sreq in scheduler_output.requests:  # once per request per step: keep it lean
            rid = sreq.request_id
            request = requests.get(rid)
            token = sampled.get(rid)
            if request is None or token is None or request.status != running:
                continue
            if request.max_output_tokens == 0:  # max_tokens 0: the prompt was all it asked for
                outputs.append(self._prompt_only(request))
                continue
            output_ids = request.output_token_ids
            output_ids.append(token)
            # Stop checks, inline: an eos / stop token once min_tokens are out, else the length.
            n_out = len(output_ids)
            params = request.sampling_params
            status = None
            if n_out >= params.min_tokens and (
                (token in request.eos_token_ids and not params.ignore_eos)
                or token in params.stop_token_ids
            ):
                request.stop_token_id = token
                status = RequestStatus.FINISHED_STOPPED
            elif (
                n_out >= request.max_output_tokens
                or n_out + len(request.prompt_token_ids) >= max_model_len
            ):
                status = RequestStatus.FINISHED_LENGTH
            error = None
            if request.grammar is not None and status is not RequestStatus.FINISHED_STOPPED:
                # The matcher follows the output (never steps): preemption cannot advance it twice.
                if request.grammar.accept(token):  # complete: a full answer, even at the length cap
                    error = request.grammar.error
                    status = (
                        RequestStatus.FINISHED_ERROR if error else RequestStatus.FINISHED_STOPPED
                    )
            out = new_token_output(
                request_id=rid,
                token_id=token,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_cached_tokens=request.num_cached_tokens,
            )
            if n_out == 1 and request.scheduled_time is not None:
                out.queued_time = max(0.0, request.scheduled_time - request.arrival_time)
            if logprobs:
                lp = logprobs.get(rid)
                if lp is not None:
                    out.logprobs = [lp]
            if request.prompt_logprobs is not None:  # with the first output, once
                out.prompt_logprobs = [None, *request.prompt_logprobs]
                request.prompt_logprobs = None
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
                out.finish_reason = request.finish_reason.value
                out.stop_token_id = request.stop_token_id
                out.error = error
                if error:  # a sampled token its grammar rejects: the engine's fault
                    out.error_kind = ErrorKind.ENGINE
            outputs.append(out)
        return outputs

    def _add_prompt_logprobs(self, scored: dict[str, tuple[int, list]]) -> None:
        """Keep each request's newly scored prompt positions; positions scored before (a
        recompute after preemption) are not added twice."""
        for rid, (first, entries) in scored.items():
            request = self.requests.get(rid)
            have = request.prompt_logprobs if request is not None else None
            if have is None:
                continue
            skip = len(have) + 1 - first  # entry i is prompt token first + i; have[j] is j + 1
            if 0 <= skip < len(entries):
                have.extend(entries[skip:])

    def _prompt_only(self, request: Request) -> EngineCoreOutput:
        """The one output of a request with max_tokens 0, once its prompt has run: no token
        (the one sampled is dropped), finished for its length."""
        self.running.remove(request)
        self._finish(request, RequestStatus.FINISHED_LENGTH)
        out = EngineCoreOutput(
            request.request_id,
            [],
            request.finish_reason.value,
            None,
            request.num_prompt_tokens,
            request.num_cached_tokens,
        )
        if request.scheduled_time is not None:
            out.queued_time = max(0.0, request.scheduled_time - request.arrival_time)
        if request.prompt_logprobs is not None:
            out.prompt_logprobs = [None, *request.prompt_logprobs]
            request.prompt_logprobs = None
        return out

    def make_stats(self) -> SchedulerStats:
        prefix = self.kv.prefix_stats.reset()
        stats = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage(),
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self._num_preemptions,
        )
        self._num_preemptions = 0
        return stats
