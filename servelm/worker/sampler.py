"""Sampler: one path from logits to next tokens for a whole batch, with per-request settings.

Order of operations (each skipped when no request in the batch uses it):
  grammar masks (structured outputs, their rows only) -> raw logprobs (what `logprobs`
  reports) -> penalties -> logit bias -> min_tokens masking -> greedy argmax, or
  temperature -> top-k -> top-p -> min-p -> sample.
A request with a seed draws from its own generator, so its tokens do not depend on what else
is in the batch.

`prompt_logprobs` scores prompt tokens (raw log-softmax of each position's logits, float32) a
block of rows at a time, so a long prompt never holds its whole prompt x vocabulary matrix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import inf
from typing import TYPE_CHECKING

import numpy as np
import torch

from servelm.engine.outputs import Logprobs, ScheduledRequest

if TYPE_CHECKING:
    from servelm.kernels.cpu_ops import CpuOps


@dataclass
class SamplingBatch:
    requests: list[ScheduledRequest]
    generators: list[torch.Generator | None]
    # Structured outputs: the rows (indices into `requests`) that a grammar constrains, and
    # their token masks (int32 [len(grammar_rows), ceil(vocab / 32)], bit j of word w: token
    # 32 * w + j may be sampled).
    grammar_rows: list[int] | None = None
    grammar_bits: torch.Tensor | None = None


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], bits: torch.Tensor) -> torch.Tensor:
    """`logits` with every token a row's grammar forbids at -inf; the other rows untouched."""
    batch, vocab = logits.shape
    # int32 words in memory order, least significant bit first: token 32 * w + j is bit j of
    # word w (little-endian, as every host torch runs on).
    flags = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    allowed = np.ones((batch, vocab), dtype=np.bool_)
    allowed[rows] = flags.view(np.bool_)
    # One select over the batch: no per-token branch (masked_fill's cost grows with a mask's
    # disorder), no copy and scatter of the constrained rows.
    return torch.where(torch.from_numpy(allowed).to(logits.device), logits, float("-inf"))


def _token_counts(ids_per_row: list[list[int]], vocab: int, device) -> torch.Tensor:
    counts = torch.zeros(len(ids_per_row), vocab, device=device)
    for i, ids in enumerate(ids_per_row):
        if ids:
            t = torch.tensor(ids, device=device)
            counts[i].index_add_(0, t, torch.ones_like(t, dtype=counts.dtype))
    return counts


def apply_penalties(logits: torch.Tensor, reqs: list[ScheduledRequest]) -> torch.Tensor:
    vocab = logits.shape[1]
    device = logits.device
    rep = torch.tensor([r.sampling_params.repetition_penalty for r in reqs], device=device)
    if bool((rep != 1.0).any()):
        seen = (
            _token_counts([r.prompt_token_ids + r.output_token_ids for r in reqs], vocab, device)
            > 0
        )
        penalized = torch.where(logits > 0, logits / rep[:, None], logits * rep[:, None])
        logits = torch.where(seen, penalized, logits)
    pres = torch.tensor([r.sampling_params.presence_penalty for r in reqs], device=device)
    freq = torch.tensor([r.sampling_params.frequency_penalty for r in reqs], device=device)
    if bool((pres != 0).any() or (freq != 0).any()):
        counts = _token_counts([r.output_token_ids for r in reqs], vocab, device)
        logits = logits - freq[:, None] * counts - pres[:, None] * (counts > 0).float()
    return logits


def apply_logit_bias(logits: torch.Tensor, reqs: list[ScheduledRequest]) -> torch.Tensor:
    """Adds each request's `logit_bias` values to its row (a copy of `logits`)."""
    logits = logits.clone()
    for i, r in enumerate(reqs):
        bias = r.sampling_params.logit_bias
        if bias:
            ids = torch.tensor(list(bias), device=logits.device)
            values = torch.tensor(list(bias.values()), device=logits.device, dtype=logits.dtype)
            logits[i].index_add_(0, ids, values)
    return logits


def mask_stop_tokens_before_min(logits: torch.Tensor, reqs: list[ScheduledRequest]) -> torch.Tensor:
    for i, r in enumerate(reqs):
        p = r.sampling_params
        # (a grammar's end wins: masking it could leave a constrained row nothing to sample)
        if len(r.output_token_ids) < p.min_tokens and p.structured_output is None:
            stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
            if stop_ids:
                logits[i, stop_ids] = float("-inf")
    return logits


def filter_logits(logits: torch.Tensor, reqs: list[ScheduledRequest]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p, vectorised over the batch (rows are not greedy)."""
    device = logits.device
    temp = torch.tensor([max(r.sampling_params.temperature, 1e-5) for r in reqs], device=device)
    logits = logits / temp[:, None]
    vocab = logits.shape[1]
    top_k = torch.tensor(
        [r.sampling_params.top_k if r.sampling_params.top_k > 0 else vocab for r in reqs],
        device=device,
    )
    top_p = torch.tensor([r.sampling_params.top_p for r in reqs], device=device)
    min_p = torch.tensor([r.sampling_params.min_p for r in reqs], device=device)
    if bool((top_k < vocab).any() or (top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        drop = ranks >= top_k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest set whose mass reaches top_p (the token that crosses it stays).
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p[:, None]
        drop[:, 0] = False
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _argmax(x: torch.Tensor, ops: CpuOps | None = None) -> torch.Tensor:
    """The index of each row's largest value (the first, on ties), as `x.argmax(-1)` gives it:
    `cpu_ops.c` where the C kernels run (16 x 49,152 logits on the Zen 4: 0.11 ms against
    torch's 0.34-0.50; docs/performance.md, session 31), else torch's max reduction, 3x faster
    than its argmax on the AMX Xeon (0.17 against 0.50 ms; session 26)."""
    found = ops.argmax(x) if ops is not None else None
    return found if found is not None else x.max(dim=-1).indices


def sample(
    logits: torch.Tensor, batch: SamplingBatch, ops: CpuOps | None = None
) -> tuple[list[int], list[Logprobs | None]]:
    """logits: float32 [B, V], one row per request in `batch` order; `ops`: the C element-wise
    kernels, where they run (the greedy pick)."""
    reqs = batch.requests
    if batch.grammar_rows:
        logits = apply_grammar_masks(logits, batch.grammar_rows, batch.grammar_bits)
    want_logprobs = [r.sampling_params.logprobs for r in reqs]
    raw_logprobs = logits.log_softmax(dim=-1) if any(k is not None for k in want_logprobs) else None

    if any(_needs_penalty(r) for r in reqs):
        logits = apply_penalties(logits, reqs)
    if any(r.sampling_params.logit_bias for r in reqs):
        logits = apply_logit_bias(logits, reqs)
    if any(len(r.output_token_ids) < r.sampling_params.min_tokens for r in reqs):
        logits = mask_stop_tokens_before_min(logits.clone(), reqs)

    greedy = [r.sampling_params.greedy for r in reqs]
    tokens = _argmax(logits, ops)
    if not all(greedy):
        idx = [i for i, g in enumerate(greedy) if not g]
        sub_reqs = [reqs[i] for i in idx]
        probs = filter_logits(logits[idx], sub_reqs).softmax(dim=-1)
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p.
        noise = torch.empty_like(probs)
        for j, i in enumerate(idx):
            noise[j].exponential_(generator=batch.generators[i])
        tokens[idx] = _argmax(probs / noise, ops)

    token_list = tokens.tolist()
    lps: list[Logprobs | None] = [None] * len(reqs)
    if raw_logprobs is not None:
        for i, k in enumerate(want_logprobs):
            if k is None:
                continue
            row = raw_logprobs[i]
            tok = token_list[i]
            lp = float(row[tok])
            rank = int((row > row[tok]).sum()) + 1
            top = []
            if k > 0:
                vals, ids = row.topk(k)
                # (a grammar's forbidden tokens are no alternatives: -inf, and not JSON either)
                top = [(t, v) for t, v in zip(ids.tolist(), vals.tolist(), strict=True) if v > -inf]
            lps[i] = Logprobs(tok, lp, rank, top)
    return token_list, lps


def _needs_penalty(r: ScheduledRequest) -> bool:
    p = r.sampling_params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0 or p.frequency_penalty != 0


# Rows of logits one block of prompt scoring holds at once: [rows, vocab] float32 (12 MiB for a
# 49k vocabulary), a few times over for the log-softmax and the ranks.
PROMPT_LOGPROBS_ROWS = 64


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: list[int],
    k: int,
) -> list[Logprobs]:
    """The logprob and rank of `targets[i]` under the logits of `hidden[i]` (the next prompt
    token at each position), and the `k` most likely tokens there; no sampling setting applies
    (penalties, bias, grammar): it is the model's own distribution, as vLLM reports it."""
    out: list[Logprobs] = []
    for start in range(0, len(targets), PROMPT_LOGPROBS_ROWS):
        block = targets[start : start + PROMPT_LOGPROBS_ROWS]
        lps = compute_logits(hidden[start : start + len(block)]).float().log_softmax(dim=-1)
        ids = torch.tensor(block, dtype=torch.long, device=lps.device)[:, None]
        chosen = lps.gather(1, ids)
        ranks = ((lps > chosen).sum(dim=1) + 1).tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in block]
        if k > 0:
            values, top_ids = lps.topk(k, dim=1)
            tops = [
                list(zip(i, v, strict=True))
                for i, v in zip(top_ids.tolist(), values.tolist(), strict=True)
            ]
        for t, lp, rank, top in zip(block, chosen[:, 0].tolist(), ranks, tops, strict=True):
            out.append(Logprobs(t, lp, rank, top))
    return out
