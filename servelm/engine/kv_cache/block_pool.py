"""The pool of fixed-size KV blocks: reference counts, the free queue and the prefix-hash map.

Invariants (checked by `check_integrity`):
- every block is either in use (ref_cnt > 0) or in the free queue (ref_cnt == 0), never both;
- a block in the free queue may still carry a hash and be found by `get_cached_block`: freeing
  keeps its contents reusable until it is evicted;
- the free queue is eviction order: the head is evicted first. Callers free a request's blocks
  tail first, so a shared head outlives the tails that hang off it (least recently used first).

    free queue:  head -> [7] [3] [9] ... [2] <- tail      (new frees are appended at the tail)
    hash map:    h(parent, tokens) -> block               (full blocks only)
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes
ROOT_HASH: BlockHash = b""


def root_hash(cache_salt: str | None) -> BlockHash:
    """Where a request's chain of block hashes starts: ROOT_HASH, or for a salted request a
    digest of its salt, so that its blocks match only those of requests with the same salt."""
    if cache_salt is None:
        return ROOT_HASH
    return hashlib.blake2b(cache_salt.encode(), digest_size=16, person=b"cache_salt").digest()


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The chained hash of one full block: depends on every token before it, not only its own.

    A deterministic digest (not Python's salted `hash`) so another process, such as a
    prefix-aware router, can compute the same value.
    """
    return hash_block_chain(parent_hash, token_ids, len(token_ids))[0]


def hash_block_chain(
    parent_hash: BlockHash, token_ids: Sequence[int], block_size: int
) -> list[BlockHash]:
    """The chained hashes of each full block of `token_ids`, starting from `parent_hash`
    (a partial tail is ignored). The ids become bytes once, not once per block."""
    ids = array("i", token_ids)
    raw = memoryview(ids.tobytes())
    width = block_size * ids.itemsize  # bytes per block
    out = []
    for start in range(0, len(raw) - width + 1, width):
        h = hashlib.blake2b(parent_hash, digest_size=16)
        h.update(raw[start : start + width])
        parent_hash = h.digest()
        out.append(parent_hash)
    return out


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt})"


class BlockPool:
    """Hands out blocks, takes them back, and remembers which full blocks hold which prefix."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}

    # -- queries -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached-but-unused ones included)."""
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks held by live requests (0.0 when idle, cached blocks count free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """The free queue in eviction order (for tests and debugging)."""
        return list(self._free)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def cached_block_ids(self) -> list[int]:
        """Ids of the blocks that hold a cached prefix, in use or free (for the dashboard)."""
        return [b.block_id for b in self._cached.values()]

    def next_free_block_id(self) -> int | None:
        """The block the next allocation takes (the free queue's head), None when none is free.
        Fresh blocks leave in id order before any block given back, so while some are left this
        is the lowest never-used id (the dashboard tells never-used blocks by it)."""
        return next(iter(self._free), None)

    # -- changes -----------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop `n` blocks from the head of the free queue, evicting their cached contents."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out = []
        popitem = self._free.popitem
        for _ in range(n):
            _, block = popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take another reference to cached blocks (a prefix hit), pulling them off the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the queue tail in order."""
        free = self._free
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free[block.block_id] = block
            elif block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than allocated")

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Record that `block` holds the full block whose chained hash is `block_hash`."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # identical contents computed twice (two requests raced); keep the first
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_cnt == 0:
                self._evict(block)

    def check_integrity(self) -> None:
        """free + used == total; no block both free and used; the hash map points at its blocks."""
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        if used + len(self._free) != self.num_blocks:
            raise AssertionError(
                f"{used} used + {len(self._free)} free != {self.num_blocks} blocks"
            )
        for block in self._free.values():
            if block.ref_cnt != 0:
                raise AssertionError(f"{block} is in the free queue but referenced")
        for h, block in self._cached.items():
            if block.block_hash != h:
                raise AssertionError(f"hash map entry for {block} disagrees with the block")
