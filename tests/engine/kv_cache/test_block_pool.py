"""BlockPool: allocation order, reference counts, free-queue order, hash map, eviction."""

import pytest

from servelm.engine.kv_cache.block_pool import ROOT_HASH, BlockPool, hash_block_tokens


def ids(blocks):
    return [b.block_id for b in blocks]


def test_allocates_from_head_and_frees_to_tail():
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(3)
    assert ids(a) == [0, 1] and ids(b) == [2, 3, 4]
    assert pool.free_block_ids() == [5]
    pool.free_blocks(reversed(a))  # tail first
    assert pool.free_block_ids() == [5, 1, 0]
    assert [blk.ref_cnt for blk in pool.blocks] == [0, 0, 1, 1, 1, 0]
    pool.check_integrity()
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)


def test_hash_chain_depends_on_parent():
    h1 = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    h2 = hash_block_tokens(h1, [5, 6, 7, 8])
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 4]) == h1
    assert hash_block_tokens(ROOT_HASH, [5, 6, 7, 8]) != h2  # same tokens, other parent
    assert hash_block_tokens(h1, [5, 6, 7, 9]) != h2


def test_cached_block_survives_free_until_evicted():
    pool = BlockPool(3)
    [blk] = pool.get_new_blocks(1)
    h = hash_block_tokens(ROOT_HASH, [1, 2])
    pool.cache_block(blk, h)
    pool.free_blocks([blk])
    assert pool.get_cached_block(h) is blk  # freed but still reusable
    pool.touch([blk])  # a prefix hit takes it back off the free queue
    assert blk.ref_cnt == 1 and pool.free_block_ids() == [1, 2]
    pool.free_blocks([blk])
    assert pool.free_block_ids() == [1, 2, 0]
    pool.get_new_blocks(3)  # reaching block 0 evicts its contents
    assert pool.get_cached_block(h) is None and blk.block_hash is None
    pool.check_integrity()


def test_shared_block_reference_counts():
    pool = BlockPool(4)
    [blk] = pool.get_new_blocks(1)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and 0 not in pool.free_block_ids()
    pool.free_blocks([blk])
    assert pool.free_block_ids()[-1] == 0
    with pytest.raises(RuntimeError):
        pool.free_blocks([blk])


def test_usage_counts_only_referenced_blocks():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    assert pool.usage() == 0.5
    pool.free_blocks(blocks)
    assert pool.usage() == 0.0
