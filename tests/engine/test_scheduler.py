"""Scheduler: token budget, chunked prefill, admission, preemption, policies, no block leaks."""

import pytest

from servelm.engine.outputs import ModelRunnerOutput
from servelm.engine.request import Request, RequestStatus
from servelm.engine.sampling_params import SamplingParams
from servelm.engine.scheduler import Scheduler, SchedulerConfig


def make(num_blocks=16, **kw):
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=4, max_model_len=64, **kw))


def req(rid, n_prompt, max_tokens=4, priority=0, arrival=0.0, start=0):
    return Request(
        rid,
        list(range(start, start + n_prompt)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        frozenset({2}),
        arrival_time=arrival,
        priority=priority,
    )


def step(s, token=7):
    out = s.schedule()
    runner = ModelRunnerOutput({r.request_id: token for r in out.requests if r.sample})
    return out, s.update_from_output(out, runner)


def run_to_end(s, limit=200):
    outputs = []
    for _ in range(limit):
        if not s.has_unfinished_requests():
            return outputs
        outputs += step(s)[1]
    raise AssertionError("scheduler did not finish")


def test_decode_and_chunked_prefill_share_a_step():
    s = make(max_num_batched_tokens=8)
    s.add_request(req("a", 4))
    out, _ = step(s)
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [("a", 4)]
    s.add_request(req("b", 20, start=100))
    out, _ = step(s)
    # a decodes one token; b gets the other 7 tokens of the budget as its first chunk
    assert [(r.request_id, len(r.token_ids), r.sample) for r in out.requests] == [
        ("a", 1, True),
        ("b", 7, False),
    ]
    out, _ = step(s)
    assert [(r.request_id, len(r.token_ids), r.num_computed_tokens) for r in out.requests] == [
        ("a", 1, 5),
        ("b", 7, 7),
    ]
    out, _ = step(s)
    assert [(r.request_id, len(r.token_ids), r.sample) for r in out.requests] == [
        ("a", 1, True),
        ("b", 6, True),
    ]


def test_exact_block_ids_and_no_leak():
    s = make(num_blocks=8)
    s.add_request(req("a", 5, max_tokens=4, start=0))
    s.add_request(req("b", 3, max_tokens=2, start=100))
    out, _ = step(s)
    assert {r.request_id: r.block_ids for r in out.requests} == {"a": [0, 1], "b": [2]}
    run_to_end(s)
    assert s.kv.usage() == 0.0
    s.kv.check_integrity()
    assert sorted(s.kv.pool.free_block_ids()) == list(range(8))


def test_max_num_seqs_limits_admission():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 4, start=10 * i))
    out, _ = step(s)
    assert [r.request_id for r in out.requests] == ["r0", "r1"] and len(s.waiting) == 1


def test_prefill_admit_cap_starts_prompts_a_few_at_a_time():
    s = make(num_blocks=64, max_num_batched_tokens=64, max_prefill_admit_tokens=8)
    for i in range(4):
        s.add_request(req(f"r{i}", 6, start=10 * i))
    out, _ = step(s)
    # r0 (6 tokens) leaves the step under 8 prompt tokens, so r1 comes in whole; r2 waits
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [("r0", 6), ("r1", 6)]
    out, _ = step(s)
    # the decodes do not count against the cap
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [
        ("r0", 1),
        ("r1", 1),
        ("r2", 6),
        ("r3", 6),
    ]


def test_prefill_admit_cap_counts_a_running_prompts_chunk():
    s = make(num_blocks=64, max_num_batched_tokens=10, max_prefill_admit_tokens=8)
    s.add_request(req("long", 30))
    s.add_request(req("short", 4, start=100))
    out, _ = step(s)
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [("long", 10)]
    out, _ = step(s)  # long's next chunk fills the cap: short still waits
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [("long", 10)]
    out, _ = step(s)
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [("long", 10)]
    out, _ = step(s)  # long decodes; short is admitted
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [("long", 1), ("short", 4)]
    run_to_end(s)
    assert s.kv.usage() == 0.0


def test_preempts_newest_when_out_of_blocks_and_recomputes():
    s = make(num_blocks=4)  # 16 token slots
    s.add_request(req("old", 7, max_tokens=8, start=0))
    s.add_request(req("new", 7, max_tokens=8, start=100))
    step(s)  # both admitted: 2 blocks each
    outs = run_to_end(s)
    stats = s.make_stats()
    assert stats.num_preemptions >= 1
    finished = {o.request_id: o.finish_reason for o in outs if o.finish_reason}
    assert finished == {"old": "length", "new": "length"}
    assert s.kv.usage() == 0.0
    s.kv.check_integrity()


def test_priority_policy_preempts_lowest_priority():
    s = make(num_blocks=4, policy="priority")
    s.add_request(req("important", 7, max_tokens=8, priority=0, arrival=2.0, start=0))
    s.add_request(req("background", 7, max_tokens=8, priority=5, arrival=1.0, start=100))
    step(s)
    while s.make_stats().num_preemptions == 0:
        step(s)
    assert s.requests["background"].status in (RequestStatus.PREEMPTED, RequestStatus.WAITING)
    assert s.requests["important"].status == RequestStatus.RUNNING
    run_to_end(s)
    s.kv.check_integrity()


def test_priority_queue_admits_by_priority_then_arrival():
    s = make(policy="priority", max_num_seqs=1)
    s.add_request(req("late-high", 4, priority=0, arrival=5.0))
    s.add_request(req("early-low", 4, priority=1, arrival=1.0, start=50))
    out, _ = step(s)
    assert [r.request_id for r in out.requests] == ["late-high"]


def test_stop_conditions():
    s = make()
    r = Request("e", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=2), frozenset({2}))
    s.add_request(r)
    _, outs = step(s, token=2)  # eos before min_tokens: keeps going
    assert outs[0].finish_reason is None
    _, outs = step(s, token=2)
    assert outs[0].finish_reason == "stop" and outs[0].stop_token_id == 2
    s2 = make()
    s2.add_request(Request("x", [1], SamplingParams(max_tokens=3, stop_token_ids=[9]), frozenset()))
    _, outs = step(s2, token=9)
    assert outs[0].finish_reason == "stop"


def test_length_is_capped_by_max_model_len():
    s = make()
    r = Request(
        "long", list(range(60)), SamplingParams(max_tokens=100, ignore_eos=True), frozenset()
    )
    s.add_request(r)
    assert r.max_output_tokens == 4
    outs = run_to_end(s)
    assert outs[-1].finish_reason == "length" and len(r.output_token_ids) == 4


def test_prompt_longer_than_context_is_rejected():
    s = make()
    with pytest.raises(ValueError, match="maximum context length is 64"):
        s.add_request(Request("big", list(range(64)), SamplingParams(), frozenset()))


def test_abort_running_and_waiting_frees_blocks():
    s = make(max_num_seqs=1)
    s.add_request(req("run", 6))
    s.add_request(req("wait", 6, start=40))
    step(s)
    assert s.abort_requests(["run", "wait", "unknown"]) and not s.has_unfinished_requests()
    assert s.kv.usage() == 0.0
    s.kv.check_integrity()


def test_prefix_hit_counted_in_tokens():
    s = make(num_blocks=16)
    s.add_request(req("a", 9))
    run_to_end(s)
    s.make_stats()
    s.add_request(req("b", 9))
    out, _ = step(s)
    assert out.requests[0].num_computed_tokens == 8 and len(out.requests[0].token_ids) == 1
    stats = s.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (9, 8)


def test_without_prefix_caching_nothing_is_queried():
    s = make(num_blocks=16, enable_prefix_caching=False)
    for rid in "ab":
        s.add_request(req(rid, 9))
        run_to_end(s)
    stats = s.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)


@pytest.mark.parametrize(
    "limit", [{"max_num_seqs": 0}, {"max_num_batched_tokens": 0}, {"max_prefill_admit_tokens": -1}]
)
def test_limits_that_would_schedule_nothing_are_refused(limit):
    # a negative admission cap used to leave every request waiting, step after step
    (name,) = limit
    with pytest.raises(ValueError, match=f"{name} must be >= "):
        make(**limit)


def test_an_empty_prompt_is_refused_not_scheduled():
    # nothing to attend from: it would reach the kernels as a zero-length sequence
    s = make()
    with pytest.raises(ValueError, match="empty"):
        s.add_request(req("empty", 0))
    assert not s.has_unfinished_requests()
