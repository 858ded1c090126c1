"""KVCacheManager with a sliding window: blocks behind every layer's window go back to the pool,
the request's table keeps placeholders in their places, prefix hits stay correct, and the
scheduler admits a long sequence whose window fits a pool its whole length would not."""

import pytest

from servelm.engine.kv_cache import KVCacheManager, kv_window
from servelm.engine.kv_cache.manager import DROPPED_BLOCK_ID
from servelm.engine.outputs import ModelRunnerOutput
from servelm.engine.request import Request
from servelm.engine.sampling_params import SamplingParams
from servelm.engine.scheduler import Scheduler, SchedulerConfig


def req(rid, tokens, max_tokens=8):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def decode_to(kv, r, total):
    """Grow r one token at a time to `total` tokens (as decode steps do); the most blocks held."""
    most = kv.num_held_blocks(r.request_id)
    while r.num_computed_tokens < total:
        if r.num_tokens == r.num_computed_tokens:
            r.output_token_ids.append(7)
        assert kv.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
        most = max(most, kv.num_held_blocks(r.request_id))
        kv.check_integrity()
    return most


def test_the_window_is_every_layers():
    assert kv_window((16, 16, 32)) == 32
    assert kv_window((16, None)) is None  # a full-attention layer reads every block
    assert kv_window(()) is None


def test_blocks_behind_the_window_go_back_and_a_full_model_keeps_all():
    for window, bound in ((8, 8 // 4 + 1), (None, 200 // 4)):
        kv = KVCacheManager(num_blocks=64, block_size=4, window=window)
        r = req("a", range(10))
        kv.allocate_slots(r, 10)
        r.num_computed_tokens = 10
        most = decode_to(kv, r, 200)
        assert most <= bound, (window, most)
        if window is None:
            assert kv.num_held_blocks("a") == 50
            continue
        ids = kv.block_ids("a")
        assert len(ids) == 50  # token i still lives in entry i // block_size
        # the next query (position 200) reads keys 193 ..: entries from 48 on are held
        assert ids[:48] == [DROPPED_BLOCK_ID] * 48 and kv.num_held_blocks("a") == 2
        assert kv.held_block_ids("a") == ids[48:]
        assert kv.pool.num_free_blocks == 62
        kv.free(r)
        assert kv.pool.num_free_blocks == 64
        kv.check_integrity()


def test_a_prefix_hit_after_blocks_were_given_back():
    # The first request's early blocks were given back, but keep their hashes in the free queue
    # (their contents are still that prefix's): a second request with the same prompt hits the
    # contiguous run of them from the first block, and allocation evicts nothing it holds.
    kv = KVCacheManager(num_blocks=14, block_size=4, window=8)
    prompt = list(range(40))
    a = req("a", prompt)
    assert kv.allocate_slots(a, 40) is not None
    a.num_computed_tokens = 40
    decode_to(kv, a, 41)  # the next allocation gives back the blocks behind the window
    assert kv.num_held_blocks("a") < 10
    b = req("b", prompt)
    hit, n = kv.get_computed_blocks(b)
    assert n == 36 and len(hit) == 9  # the last token is never covered
    assert kv.allocate_slots(b, 40 - n, hit) is not None
    kv.check_integrity()
    # a third request takes the last 2 free blocks: never one that b holds
    held_by_b = {blk.block_id for blk in kv.req_blocks["b"] if blk is not None}
    c = req("c", range(100, 108))
    new = kv.allocate_slots(c, 8)
    assert new is not None and not held_by_b & {blk.block_id for blk in new}
    kv.check_integrity()


def test_a_long_sequence_fits_a_pool_its_length_would_not():
    # 20 blocks of 16 tokens hold 320 tokens; with a 64-token window a 2,000-token request needs
    # (64 - 1 + 32) / 16 + 1 = 7 blocks at most, stepping 32 tokens a time.
    config = dict(num_blocks=20, block_size=16, max_num_batched_tokens=32, max_model_len=2048)
    full = Scheduler(SchedulerConfig(**config))
    with pytest.raises(ValueError, match="maximum context length is 320 tokens"):
        full.add_request(req("a", range(1000), max_tokens=1000))
    windowed = Scheduler(SchedulerConfig(**config, sliding_window=64))
    windowed.add_request(req("a", range(1000), max_tokens=1000))
    assert windowed.requests["a"].max_output_tokens == 1000
    most = steps = 0
    while windowed.has_unfinished_requests():
        out = windowed.schedule()
        most = max(most, windowed.kv.num_held_blocks("a"))
        assert out.num_preempted == 0
        sampled = {s.request_id: 5 for s in out.requests if s.sample}
        windowed.update_from_output(out, ModelRunnerOutput(sampled))
        windowed.kv.check_integrity()
        steps += 1
    assert steps == 1000 // 32 + 1 + 999  # the prompt in chunks of 32, then one token a step
    assert most <= 7, most
    assert windowed.kv.pool.num_free_blocks == 20
