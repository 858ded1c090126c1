"""Paged attention on plain torch: writes this step's K/V into the cache, reads it back by block.

The cache of one layer is two tensors of shape [num_blocks * block_size, Hkv, D]; a token's
slot is `block_id * block_size + offset`. A request's block table lists its blocks in order:

    block table  [ 7, 2, 9 ]          block_size = 4, context of 10 tokens
    slots        28 29 30 31 | 8 9 10 11 | 36 37

Decode requests (one query token each) are attended together: on the CPU by servelm's C kernel
(`kernels/paged_decode.c`), which reads K/V in place through the block table; elsewhere in one
padded SDPA batch whose K/V is gathered a whole block at a time (one contiguous copy per block,
not one per token). Prefill chunks run one request at a time: on a CPU with AMX tiles or AVX2
through `kernels/paged_prefill.c`, which reads the cache in place too and needs no mask;
elsewhere through SDPA with a causal mask offset by the tokens already cached. Batch invariant
(`invariant`) with that kernel, a decode token is a prompt chunk of one instead. The slot
indices are built once per step (`AttentionMetadata`) and shared by every layer.

The last layer needs attention only for the rows the step samples from: a prompt chunk's last
token, none of a chunk that does not finish its prompt. `kept_rows` names them (every decode
row stays), and `attn(..., kept_only=True)` stores every token's K/V as usual but attends for
those rows alone, in their order: the layer's projections and MLP then run on them alone too.
A request that scores its prompt (prompt logprobs) keeps every row of its chunk (`keep_all`).

Per layer, from the model's spec (`for_model`): a sliding window W (`spec.window(i)`: a query
at position p sees keys p - W < key <= p, transformers' Mistral / Gemma mask), the scale
(`spec.attn_scale`, else head_dim ** -0.5) and soft-capping (`spec.attn_logit_softcap`: each
scaled score s becomes c tanh(s / c) before the mask and softmax, Gemma 2). Every path honours
all three: the C kernels take them as arguments; the torch path masks per window (the masks
made once per step and window) and, with soft-capping, which SDPA cannot do, computes the
scores itself. Blocks wholly before every layer's window may have been given back to the pool
(engine/kv_cache): their entries in a block table are placeholders, which the C kernels never
read and the torch path reads and masks (a pool's contents are always finite).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from servelm.kernels.paged_decode import PagedDecodeKernel
from servelm.kernels.paged_prefill import PagedPrefillKernel
from servelm.model.config import ModelSpec


@dataclass
class PrefillChunk:
    start: int  # first row of this request in the step's flattened tokens
    num_tokens: int  # query tokens in this step
    context_len: int  # tokens so far, these included
    context_blocks: torch.Tensor  # [ceil(context_len / block_size)] blocks holding them
    causal: torch.Tensor | None  # [num_tokens, context_len] 0 / -inf; None: context == queries
    # (or a prefill kernel that needs no mask)
    kept: int = -1  # its last token's row among the kept rows; -1: the chunk samples nothing
    all_rows: bool = False  # every row of the chunk is kept (ending at `kept`), not the last alone
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> its causal

    def mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """The torch path's mask for a layer with this window (None: `causal`), made once per
        step and window: query i (position context_len - num_tokens + i) sees keys in
        (position - window, position]."""
        if window is None or window >= self.context_len:
            return self.causal
        mask = self.window_masks.get(window)
        if mask is None:
            pos = np.arange(self.context_len - self.num_tokens, self.context_len)[:, None]
            keys = np.arange(self.context_len)[None, :]
            allowed = (keys <= pos) & (keys > pos - window)
            mask = additive_mask(allowed, dtype, self.context_blocks.device)
            self.window_masks[window] = mask
        return mask


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    decode_rows: torch.Tensor | None  # [Bd] rows of the decode tokens (None: all rows are)
    decode_blocks: torch.Tensor | None  # [Bd, max_blocks] block ids to read, padded per row
    decode_lens: torch.Tensor | None  # [Bd] context length of each decode token, itself included
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, max_blocks * block_size] 0 real, -inf padding
    prefills: list[PrefillChunk]
    all_decode: bool = False
    decode_max_len: int = 0
    kept_rows: torch.Tensor | None = None  # [K] rows the last layer computes; None: all rows
    decode_kept: torch.Tensor | None = None  # [Bd] the decode rows' places among those
    sample_rows: torch.Tensor | None = None  # [S] each sampling request's last row among the
    # rows the model returns (the kept rows, or all)
    # runs of consecutive decode rows, for the C layer loop: (first step row, first and end
    # index among the decode rows, the first's place among the kept rows)
    decode_runs: list[tuple[int, int, int, int]] = field(default_factory=list)
    # keep_all requests: request index -> its first row's place among the rows the model returns
    all_rows_places: dict[int, int] = field(default_factory=dict)
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> decode mask

    def decode_window_mask(self, window: int | None) -> torch.Tensor | None:
        """The padded decode batch's mask for a layer with this window (None: `decode_mask`),
        made once per step and window: each row sees its last `window` positions."""
        if window is None or window >= self.decode_max_len:
            return self.decode_mask
        mask = self.window_masks.get(window)
        if mask is None:
            n, _, _, max_ctx = self.decode_mask.shape
            lens = self.decode_lens.cpu().numpy()[:, None]
            keys = np.arange(max_ctx)[None, :]
            allowed = (keys < lens) & (keys >= lens - window)
            mask = additive_mask(allowed, self.decode_mask.dtype, self.decode_mask.device)
            self.window_masks[window] = mask.view(n, 1, 1, max_ctx)
        return self.window_masks[window]


def additive_mask(allowed: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """0 where attention is allowed, -inf elsewhere: what SDPA makes of a boolean mask in every
    call, made once per step instead of once per layer."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill_(torch.from_numpy(~allowed), float("-inf")).to(device)


def build_metadata(
    seqs: list[tuple[int, int, list[int]]],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    decode_mask: bool = True,
    prefill_masks: bool = True,
    sample: list[bool] | None = None,
    decodes_as_chunks: bool = False,
    keep_all: list[bool] | None = None,
) -> AttentionMetadata:
    """seqs: per request (num_computed_tokens, num_new_tokens, block_ids), in batch order;
    dtype: the model's (attention masks are made in it); decode_mask / prefill_masks: build the
    padded decode batch's mask and the offset causal masks of prefill chunks after cached
    tokens (only SDPA reads them; the C kernels work from lengths); sample: per request,
    whether the step samples its next token (None: every request does), for `kept_rows`;
    decodes_as_chunks: a decode token is a prompt chunk of one (batch invariance: one attention
    path for a prompt token and a generated one); keep_all: per request, whether the last layer
    computes every row of its chunk (None: none does).

    Built with numpy on the host (one small array op per request, not one torch op per token),
    then moved to the device once.
    """
    slot_parts, prefills = [], []
    decode_rows, decode_blocks, decode_lens = [], [], []
    kept, decode_kept = [], []
    last_rows, kept_places = [], []  # of the requests that sample
    runs = []  # of consecutive decode rows: [first row, first index, end index, kept place]
    all_rows = []  # of keep_all requests: (request index, first row, first place among kept)
    row = 0
    for i, (num_computed, num_new, block_ids) in enumerate(seqs):
        ctx = num_computed + num_new
        samples = sample is None or sample[i]
        used_blocks = block_ids[: -(-ctx // block_size)]
        new_pos = np.arange(num_computed, ctx)
        table = np.asarray(used_blocks, dtype=np.int64)
        slot_parts.append(table[new_pos // block_size] * block_size + new_pos % block_size)
        if num_new == 1 and num_computed > 0 and not decodes_as_chunks:
            run = runs[-1] if runs else None
            if run and run[0] + run[2] - run[1] == row:  # the row after the last run's
                run[2] += 1
            else:  # (the place among the kept rows is the row itself where all are kept)
                runs.append([row, len(decode_rows), len(decode_rows) + 1, len(kept)])
            decode_rows.append(row)
            decode_blocks.append(used_blocks)
            decode_lens.append(ctx)
            decode_kept.append(len(kept))
            if keep_all is not None and keep_all[i]:
                all_rows.append((i, row, len(kept)))
            kept.append(row)
        else:
            causal = None
            if num_computed and prefill_masks:
                # query i (at position num_computed + i) sees keys 0 .. its own
                causal = additive_mask(np.arange(ctx)[None, :] <= new_pos[:, None], dtype, device)
            blocks = torch.from_numpy(table).to(device)
            keeps_all = keep_all is not None and keep_all[i]
            if keeps_all:
                all_rows.append((i, row, len(kept)))
                kept.extend(range(row, row + num_new))
            elif samples:
                kept.append(row + num_new - 1)
            place = len(kept) - 1 if keeps_all or samples else -1
            prefills.append(PrefillChunk(row, num_new, ctx, blocks, causal, place, keeps_all))
        if samples:
            last_rows.append(row + num_new - 1)
            kept_places.append(len(kept) - 1)
        row += num_new

    meta = AttentionMetadata(
        torch.from_numpy(np.concatenate(slot_parts)).to(device), None, None, None, None, prefills
    )
    meta.decode_runs = [tuple(run) for run in runs]
    if len(kept) < row:
        meta.kept_rows = torch.tensor(kept, dtype=torch.long, device=device)
        meta.decode_kept = torch.tensor(decode_kept, dtype=torch.long, device=device)
    for i, first_row, first_kept in all_rows:
        meta.all_rows_places[i] = first_kept if meta.kept_rows is not None else first_row
    places = kept_places if meta.kept_rows is not None else last_rows
    meta.sample_rows = torch.tensor(places, dtype=torch.long, device=device)
    if decode_rows:
        n, max_blocks = len(decode_rows), max(len(b) for b in decode_blocks)
        padded = np.zeros((n, max_blocks), dtype=np.int64)
        for i, blocks in enumerate(decode_blocks):
            padded[i, : len(blocks)] = blocks
        max_ctx = max_blocks * block_size
        lens = np.asarray(decode_lens, dtype=np.int64)
        # When every token is a decode, rows are 0..n-1 and no gather/scatter is needed.
        meta.decode_rows = None if n == row else torch.tensor(decode_rows, device=device)
        meta.all_decode = n == row
        meta.decode_blocks = torch.from_numpy(padded).to(device)
        meta.decode_lens = torch.from_numpy(lens).to(device)
        meta.decode_max_len = int(lens.max())
        if decode_mask:
            allowed = np.arange(max_ctx)[None, :] < lens[:, None]
            meta.decode_mask = additive_mask(allowed, dtype, device).view(n, 1, 1, max_ctx)
    return meta


class TorchPagedAttention:
    """Paged attention from index ops and SDPA, correct on CPU and CUDA; decode tokens go to
    `decode_kernel` and prefill chunks to `prefill_kernel` (the CPU C kernels) when given."""

    def __init__(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        scale: float,
        block_size: int,
        decode_kernel: PagedDecodeKernel | None = None,
        prefill_kernel: PagedPrefillKernel | None = None,
        invariant: bool = False,
        layer_windows: Sequence[int | None] = (),
        softcap: float | None = None,
    ) -> None:
        self.kv_caches = kv_caches
        self.scale = scale
        self.block_size = block_size
        self.layer_windows = tuple(layer_windows)  # per layer (empty: no layer has a window)
        self.softcap = softcap
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel
        # Batch invariant: decode tokens go through the prefill kernel too, whose arithmetic
        # for a query depends only on its position and context (tests/kernels), so that a
        # token's attention is the same as a prompt's token, a generated one or recomputed.
        self.decodes_as_chunks = invariant and prefill_kernel is not None
        self.meta: AttentionMetadata | None = None

    @classmethod
    def for_model(
        cls,
        spec: ModelSpec,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        decode_kernel: PagedDecodeKernel | None = None,
        prefill_kernel: PagedPrefillKernel | None = None,
        invariant: bool = False,
    ) -> TorchPagedAttention:
        """Attention with the model's per-layer options: windows, scale, soft-capping."""
        scale = spec.attn_scale if spec.attn_scale is not None else spec.head_dim**-0.5
        return cls(
            kv_caches,
            scale,
            block_size,
            decode_kernel,
            prefill_kernel,
            invariant,
            spec.layer_windows,
            spec.attn_logit_softcap,
        )

    def window(self, layer_idx: int) -> int | None:
        return self.layer_windows[layer_idx] if self.layer_windows else None

    def plan(
        self,
        seqs: list[tuple[int, int, list[int]]],
        device: torch.device,
        dtype: torch.dtype,
        sample: list[bool] | None = None,
        keep_all: list[bool] | None = None,
    ) -> None:
        """This step's metadata (see `build_metadata`), shared by every layer."""
        decode_mask, prefill_masks = self.decode_kernel is None, self.prefill_kernel is None
        self.meta = build_metadata(
            seqs,
            self.block_size,
            device,
            dtype,
            decode_mask,
            prefill_masks,
            sample,
            self.decodes_as_chunks,
            keep_all,
        )

    @property
    def kept_rows(self) -> torch.Tensor | None:
        """The rows the step's last layer computes (see the top of the file); None: all."""
        return self.meta.kept_rows

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kept_only=False
    ) -> torch.Tensor:
        """Stores this step's k/v and returns attention for every row of q, or with
        `kept_only` for the kept rows alone (in their order)."""
        meta = self.meta
        kept_only = kept_only and meta.kept_rows is not None
        k_cache, v_cache = self.kv_caches[layer_idx]
        window = self.window(layer_idx)
        if meta.all_decode and self.decode_kernel is not None:  # stores k/v and attends
            return self._decode_kernel(q, k, v, k_cache, v_cache, window, meta.slot_mapping)
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        gqa = q.shape[1] != k.shape[1]
        if meta.all_decode:
            return self._decode(q, k_cache, v_cache, meta, gqa, window)
        out = q.new_empty((len(meta.kept_rows), *q.shape[1:])) if kept_only else torch.empty_like(q)
        if meta.decode_rows is not None:
            into = meta.decode_kept if kept_only else meta.decode_rows
            out[into] = self._decode(q[meta.decode_rows], k_cache, v_cache, meta, gqa, window)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.num_tokens)
            if not kept_only:
                self._prefill(q, k, v, k_cache, v_cache, chunk, rows, rows, out, gqa, window)
                continue
            if chunk.kept < 0:  # samples nothing and scores nothing
                continue
            last, last_into = slice(rows.stop - 1, rows.stop), slice(chunk.kept, chunk.kept + 1)
            if chunk.all_rows and chunk.num_tokens > 1:  # a scored prompt: its other rows too,
                # attended apart from the last, which then takes the very path it takes alone
                others = slice(rows.start, rows.stop - 1)
                into = slice(chunk.kept + 1 - chunk.num_tokens, chunk.kept)
                self._prefill(
                    q, k, v, k_cache, v_cache, chunk, others, into, out, gqa, window, ends=1
                )
            # its last token alone, which sees the whole context (or its window)
            self._prefill(
                q, k, v, k_cache, v_cache, chunk, last, last_into, out, gqa, window, last=True
            )
        return out

    def _prefill(
        self, q, k, v, k_cache, v_cache, chunk: PrefillChunk, queries, into, out, gqa, window,
        last=False, ends=0,
    ) -> None:  # fmt: skip
        """Attention of a prompt chunk's `queries` (its rows, or its `last` row alone, or all
        but the last `ends`) into `out[into]`, for a layer with this window."""
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        if self.prefill_kernel is not None:  # reads its K/V from the cache, stored before
            self.prefill_kernel(
                q[queries],
                k_cache,
                v_cache,
                chunk.context_blocks,
                self.block_size,
                chunk.context_len - ends,  # its queries are the context's last ones
                self.scale,
                out[into],
                window,
                self.softcap,
            )
            return
        causal = chunk.mask(window, q.dtype)
        if causal is not None and (last or ends):
            causal = causal[-1:] if last else causal[:-ends]
        qp = q[queries].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if chunk.context_len == chunk.num_tokens:  # nothing cached before: its own K/V is all
            kp, vp = k[rows], v[rows]
        else:
            kp = self._read_blocks(k_cache, chunk.context_blocks)[: chunk.context_len]
            vp = self._read_blocks(v_cache, chunk.context_blocks)[: chunk.context_len]
        kp = kp.transpose(0, 1).unsqueeze(0)
        vp = vp.transpose(0, 1).unsqueeze(0)
        op = self._sdpa(
            qp,
            kp,
            vp,
            causal,
            # one last query sees every key; the first n queries of a chunk see keys 0 .. own
            # (SDPA's causal mask is aligned to the top left)
            causal is None and not last,
            gqa,
        )
        out[into] = op.squeeze(0).transpose(0, 1)

    def _sdpa(self, q, k, v, mask, is_causal: bool, gqa: bool) -> torch.Tensor:
        """SDPA with this model's scale, or with soft-capping (which SDPA lacks) the same in
        float32 from its parts: scores, c tanh(s / c), mask, softmax, values."""
        if self.softcap is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale, enable_gqa=gqa
            )
        if gqa:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is not None:
            scores = scores + mask
        elif is_causal:
            n, ctx = scores.shape[-2:]
            scores = scores.masked_fill(
                torch.ones(n, ctx, dtype=torch.bool, device=q.device).triu(1), float("-inf")
            )
        return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)

    def _read_blocks(self, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """The tokens of `blocks`, in order, as [len(blocks) * block_size, Hkv, D]: one
        contiguous copy per block rather than one per token."""
        hkv, d = cache.shape[1], cache.shape[2]
        whole = cache.view(-1, self.block_size, hkv, d).index_select(0, blocks)
        return whole.view(-1, hkv, d)

    def _decode_kernel(self, q, k, v, k_cache, v_cache, window, slots=None) -> torch.Tensor:
        """Decode tokens through the C kernel; with `slots` it stores this step's k/v too."""
        meta = self.meta
        return self.decode_kernel(
            q,
            k,
            v,
            k_cache,
            v_cache,
            slots,
            meta.decode_blocks,
            self.block_size,
            meta.decode_lens,
            meta.decode_max_len,
            self.scale,
            window,
            self.softcap,
        )

    def _decode(
        self, q, k_cache, v_cache, meta: AttentionMetadata, gqa: bool, window: int | None
    ) -> torch.Tensor:
        """One query token per request, all requests in one padded SDPA call (or the kernel)."""
        if self.decode_kernel is not None:  # k/v are in the cache already
            return self._decode_kernel(q, None, None, k_cache, v_cache, window)
        bd, hkv, d = q.shape[0], k_cache.shape[1], k_cache.shape[2]
        blocks = meta.decode_blocks.view(-1)
        kd = self._read_blocks(k_cache, blocks).view(bd, -1, hkv, d).transpose(1, 2)
        vd = self._read_blocks(v_cache, blocks).view(bd, -1, hkv, d).transpose(1, 2)
        # kd, vd: [Bd, Hkv, max_blocks * block_size, D]
        mask = meta.decode_window_mask(window)
        return self._sdpa(q.unsqueeze(2), kd, vd, mask, False, gqa).squeeze(2)
