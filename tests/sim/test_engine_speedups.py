"""The engine fast paths the simulator relies on give the same answers as the plain ones."""

import dataclasses
import inspect
import random

from servelm.engine.kv_cache import KVCacheManager
from servelm.engine.kv_cache.block_pool import ROOT_HASH, hash_block_chain, hash_block_tokens
from servelm.engine.outputs import (
    EngineCoreOutput,
    ScheduledRequest,
    new_token_output,
    scheduled_request,
)
from servelm.engine.request import Request
from servelm.engine.sampling_params import SamplingParams


def test_hash_chain_equals_block_by_block():
    rng = random.Random(0)
    tokens = [rng.randrange(1 << 31) for _ in range(16 * 5 + 7)]  # five full blocks + a tail
    start = hash_block_tokens(ROOT_HASH, [9] * 16)  # chain on from an earlier block
    parent, expected = start, []
    for i in range(5):
        parent = hash_block_tokens(parent, tokens[16 * i : 16 * (i + 1)])
        expected.append(parent)
    assert hash_block_chain(start, tokens, 16) == expected
    assert hash_block_chain(ROOT_HASH, tokens[:15], 16) == []


def test_block_ids_follow_blocks_through_growth_hits_and_frees():
    kv = KVCacheManager(num_blocks=12, block_size=4)
    a = Request("a", list(range(10)), SamplingParams(max_tokens=8))
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    for _ in range(6):  # decode steps: the fast path, then a new block at the boundary
        a.output_token_ids.append(1)
        kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        assert kv.block_ids("a") == [b.block_id for b in kv.req_blocks["a"]]
    b = Request("b", list(range(10)) + [99], SamplingParams(max_tokens=8))
    hit, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    kv.allocate_slots(b, 3, hit)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    ids = kv.block_ids("b")
    ids.append(-1)  # a copy: callers cannot corrupt the manager's list
    assert -1 not in kv.block_ids("b")
    shared = kv.shared_block_ids("b")  # no copy, but a snapshot: growth replaces the list
    assert shared == kv.block_ids("b")
    b.num_computed_tokens = 11
    kv.allocate_slots(b, 9)
    assert len(kv.shared_block_ids("b")) == len(shared) + 2 and shared == ids[:-1]
    kv.check_integrity()
    kv.free(a)
    kv.free(b)
    assert kv.block_ids("a") == [] and kv.usage() == 0.0
    kv.check_integrity()


def test_keyword_factories_match_the_dataclasses():
    # scheduled_request / new_token_output call the classes positionally: same fields, in order
    names = [f.name for f in dataclasses.fields(ScheduledRequest)]
    assert list(inspect.signature(scheduled_request).parameters) == names
    values = {name: object() for name in names}  # distinct markers: a swap would show
    built = scheduled_request(**values)
    assert all(getattr(built, name) is value for name, value in values.items())
    out = new_token_output(request_id="a", token_id=7, num_prompt_tokens=5, num_cached_tokens=2)
    assert out == EngineCoreOutput(
        request_id="a", new_token_ids=[7], num_prompt_tokens=5, num_cached_tokens=2
    )
