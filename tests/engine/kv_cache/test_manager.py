"""KVCacheManager: slot allocation, prefix hits in whole blocks, last token never cached, no leaks."""

from servelm.engine.kv_cache import KVCacheManager
from servelm.engine.request import Request
from servelm.engine.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def test_allocate_covers_tokens_in_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = req("a", range(10))
    new = kv.allocate_slots(r, 10)
    assert [b.block_id for b in new] == [0, 1, 2]
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2) == []  # 12 tokens still fit in 3 blocks
    r.num_computed_tokens = 12
    assert [b.block_id for b in kv.allocate_slots(r, 1)] == [3]
    assert kv.block_ids("a") == [0, 1, 2, 3]
    kv.free(r)
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1, 0]
    kv.check_integrity()


def test_returns_none_without_side_effects_when_short():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = req("a", range(12))
    assert kv.allocate_slots(r, 12) is None
    assert kv.pool.num_free_blocks == 2 and "a" not in kv.req_blocks


def test_prefix_hit_shares_blocks_and_skips_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", range(12))
    kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    b = req("b", list(range(12)))  # identical prompt: 3 full blocks cached
    hit, n = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hit] == [
        0,
        1,
    ] and n == 8  # the block holding the last token is recomputed
    assert kv.allocate_slots(b, 12 - n, hit) is not None
    assert kv.block_ids("b")[:2] == [0, 1] and kv.block_ids("b")[2] == 3
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    assert kv.usage() == 0.0
    # Freed tail-first: the tails (blocks 2, 3) are evicted before the shared head (0, 1).
    order = kv.pool.free_block_ids()
    assert order.index(2) < order.index(0) and order.index(3) < order.index(0)


def test_divergent_prompt_hits_only_common_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", range(16))
    kv.allocate_slots(a, 16)
    b = req("b", list(range(6)) + [99] * 10)
    hit, n = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hit] == [0] and n == 4


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    a = req("a", range(16))
    kv.allocate_slots(a, 16)
    assert kv.get_computed_blocks(req("b", range(16))) == ([], 0)


def test_hit_on_free_cached_blocks_counts_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = req("a", range(9))
    kv.allocate_slots(a, 9)
    kv.free(a)  # blocks 0, 1 cached (full), all three free
    b = req("b", list(range(8)) + [50, 51, 52, 53, 54])
    hit, n = kv.get_computed_blocks(b)
    assert n == 8
    # 13 tokens need 4 blocks; 2 come from the cache, but only 1 other block remains free.
    assert kv.allocate_slots(b, 5, hit) is None
    assert kv.pool.num_free_blocks == 3
    kv.check_integrity()
