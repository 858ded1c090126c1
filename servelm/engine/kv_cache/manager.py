"""KVCacheManager: which blocks each request holds, prefix-cache lookups, and slot allocation.

A request's blocks cover its tokens in order: token i lives in block i // block_size at offset
i % block_size. `allocate_slots` returns None when the pool cannot cover the step; the
scheduler (not this class) decides whom to preempt.

Sliding windows (`window`: set only when EVERY layer has one, the largest): a query at position
p reads keys after p - window, and the next query of a request sits at its num_computed_tokens
at least, so a block wholly before num_computed_tokens - window + 1 is never read again. Each
allocation gives such blocks back to the pool (a Mistral-style model's KV use stops growing past
the window); their places in the request's table keep a placeholder id (DROPPED_BLOCK_ID, which
the attention never reads: worker/attention.py), so token i still lives in entry
i // block_size. With one full-attention layer (Gemma's global layers) nothing can be given
back. A given-back block keeps its prefix hash in the free queue until it is evicted, exactly as
a finished request's blocks do: its contents are still that prefix's, so a later hit on it is
correct, and a hit only ever counts the contiguous run of cached blocks from the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

from servelm.engine.kv_cache.block_pool import BlockPool, KVBlock, hash_block_chain, root_hash
from servelm.engine.request import Request

_BLOCK_ID = attrgetter("block_id")
_NO_BLOCKS: list[int] = []  # shared, never changed
# The table entry of a block given back (out of every layer's window): any real block id, so
# that a path which reads before masking (the torch one) reads finite numbers from the pool.
DROPPED_BLOCK_ID = 0


def kv_window(layer_windows) -> int | None:
    """The window beyond which no layer reads (the largest of the per-layer windows), or None
    where some layer attends to the whole context (or none has a window): nothing is freed."""
    if not layer_windows or any(w is None for w in layer_windows):
        return None
    return max(layer_windows)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached

    def record(self, queried: int, hit: int) -> None:
        self.queries += queried
        self.hits += hit

    def reset(self) -> PrefixCacheStats:
        snapshot = PrefixCacheStats(self.queries, self.hits)
        self.queries = self.hits = 0
        return snapshot


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        window: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.window = window  # see the top of the file (None: every block is kept)
        self._num_dropped: dict[str, int] = {}  # leading blocks given back, per request
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # req_blocks as ids, kept in step. Each list is replaced, never changed in place, when a
        # request gains blocks, so `shared_block_ids` can hand out the list itself.
        self._req_block_ids: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (those given back out of the window not counted)."""
        held = self.req_blocks.get(request_id, ())
        return len(held) - self._num_dropped.get(request_id, 0)

    def held_block_ids(self, request_id: str) -> list[int]:
        """The ids of the blocks the request holds now: its table without the placeholders of
        blocks given back (for a view of the pool, such as engine/dashboard.py's)."""
        return self.shared_block_ids(request_id)[self._num_dropped.get(request_id, 0) :]

    def blocks_needed(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one sequence of `num_tokens` holds at once, computed in steps of up
        to `chunk` tokens: all of them, or with a window those reaching back `window` tokens
        from a step's first query to its last token."""
        every = cdiv(num_tokens, self.block_size)
        if self.window is None:
            return every
        return min(every, cdiv(self.window - 1 + chunk, self.block_size) + 1)

    def _drop_out_of_window(self, request: Request, held: list[KVBlock]) -> None:
        """Give back the request's blocks that no later query reads (wholly before
        num_computed_tokens - window + 1), newest first, as `free` does."""
        first_needed = request.num_computed_tokens - self.window + 1
        rid = request.request_id
        start = self._num_dropped.get(rid, 0)
        end = min(first_needed // self.block_size, len(held)) if first_needed > 0 else 0
        if end <= start:
            return
        gone = held[start:end]
        held[start:end] = [None] * (end - start)
        ids = self._req_block_ids[rid]
        self._req_block_ids[rid] = ids[:start] + [DROPPED_BLOCK_ID] * (end - start) + ids[end:]
        self._num_dropped[rid] = end
        self.pool.free_blocks(reversed(gone))

    def block_ids(self, request_id: str) -> list[int]:
        ids = self._req_block_ids.get(request_id)
        return [] if ids is None else ids.copy()  # a copy: O(blocks) in C, not in Python

    def shared_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids without a copy: a snapshot that this manager never changes
        (it replaces the list when blocks are added). Callers must not change it either."""
        return self._req_block_ids.get(request_id, _NO_BLOCKS)

    def _update_block_hashes(self, request: Request, num_full_blocks: int) -> None:
        """Extend the request's chained block hashes to cover its first `num_full_blocks`."""
        hashes = request.block_hashes
        start = len(hashes)
        if start >= num_full_blocks:
            return
        bs = self.block_size
        parent = hashes[-1] if hashes else root_hash(request.cache_salt)
        tokens = request.token_ids_slice(start * bs, num_full_blocks * bs)
        hashes.extend(hash_block_chain(parent, tokens, bs))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of the request, as blocks and as a token count.

        The last token is never covered: its logits must be computed to sample from them.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_blocks)
        hit: list[KVBlock] = []
        for h in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
    ) -> list[KVBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request` (after any prefix hit).

        Returns the newly allocated blocks, or None (changing nothing else) if the pool is
        short. Blocks out of the window are given back first, either way.
        """
        held = self.req_blocks.get(request.request_id)
        if held and self.window is not None:
            self._drop_out_of_window(request, held)
        if held and not new_computed_blocks:
            # Fast path (most decode steps): no prefix hit to take and no block to add.
            num_total = request.num_computed_tokens + num_new_tokens
            if -(-num_total // self.block_size) <= len(held):  # cdiv, inlined
                if self.enable_caching and num_total // self.block_size > (
                    self._num_cached_blocks.get(request.request_id, 0)
                ):
                    self._cache_full_blocks(request, num_total)
                return []
        new_computed_blocks = new_computed_blocks or []
        held = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        needed = (
            cdiv(num_computed + num_new_tokens, self.block_size)
            - len(held)
            - len(new_computed_blocks)
        )
        # Hit blocks that sit in the free queue stop being allocatable once we take them.
        reclaimed = (
            sum(1 for b in new_computed_blocks if b.ref_cnt == 0) if new_computed_blocks else 0
        )
        if max(needed, 0) > self.pool.num_free_blocks - reclaimed:
            if not held:
                del self.req_blocks[request.request_id]
            return None
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(needed) if needed > 0 else []
        added = new_computed_blocks + new_blocks
        held.extend(added)
        self._add_block_ids(request.request_id, added)
        if self.enable_caching:
            self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def _add_block_ids(self, request_id: str, blocks: list[KVBlock]) -> None:
        ids = self._req_block_ids.get(request_id, _NO_BLOCKS)
        self._req_block_ids[request_id] = ids + list(map(_BLOCK_ID, blocks))  # a new list

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the hashes of blocks that this step fills (their token ids are known)."""
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request, num_full)
        held = self.req_blocks[request.request_id]
        hashes = request.block_hashes
        cache_block = self.pool.cache_block
        for i in range(start, num_full):
            if held[i] is not None:  # (one given back was published when it was filled)
                cache_block(held[i], hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Give back every block of the request, tail first (the tail is evicted first)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self._req_block_ids.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        dropped = self._num_dropped.pop(request.request_id, 0)
        self.pool.free_blocks(reversed(blocks[dropped:]))

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for rid, blocks in self.req_blocks.items():
            dropped = self._num_dropped.get(rid, 0)
            if any(b is not None for b in blocks[:dropped]) or None in blocks[dropped:]:
                raise AssertionError(f"{rid}: given-back blocks are not its first {dropped}")
            ids = [DROPPED_BLOCK_ID] * dropped + [b.block_id for b in blocks[dropped:]]
            if self._req_block_ids.get(rid, []) != ids:
                raise AssertionError(f"block ids of {rid} disagree with its blocks")
            for b in blocks[dropped:]:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            if refs.get(block.block_id, 0) != block.ref_cnt:
                raise AssertionError(
                    f"{block} has ref_cnt {block.ref_cnt} but {refs.get(block.block_id, 0)} holders"
                )
