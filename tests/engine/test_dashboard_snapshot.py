"""The dashboard's snapshot of a real Scheduler: blocks in use, shared prefixes, cached and
never-used blocks, the queue, and cells that stand for several blocks."""

from servelm.engine.dashboard import Feed, build_snapshot
from servelm.engine.messages import EngineCoreOutputs, decode, encode
from servelm.engine.outputs import ModelRunnerOutput
from servelm.engine.request import Request
from servelm.engine.sampling_params import SamplingParams
from servelm.engine.scheduler import Scheduler, SchedulerConfig

BS = 4
SYSTEM = list(range(100, 112))  # three full blocks shared by every request below


def make(num_blocks=32, **kw):
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=BS, max_model_len=64, **kw))


def req(rid, tail, max_tokens=3):
    return Request(rid, SYSTEM + tail, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(s):
    out = s.schedule()
    s.update_from_output(
        out, ModelRunnerOutput({r.request_id: 7 for r in out.requests if r.sample})
    )
    return out


def test_blocks_in_use_shared_prefix_and_the_queue():
    s = make(max_num_seqs=2)
    s.add_request(req("a", [1, 2, 3]))
    step(s)  # a's prompt is computed: its three system blocks are in the prefix cache
    s.add_request(req("b", [4, 5, 6, 7, 8]))
    s.add_request(req("c", [9]))  # no room in the batch (max_num_seqs 2): waits
    step(s)
    snap = build_snapshot(s)
    by_id = {r.request_id: r for r in snap.requests}
    assert [(r.request_id, r.state) for r in snap.requests] == [
        ("a", "running"), ("b", "running"), ("c", "waiting"),
    ]  # fmt: skip
    assert (snap.num_running, snap.num_waiting) == (2, 1)
    assert by_id["b"].cached_tokens == len(SYSTEM)  # its prefix came from the cache
    held = {rid: s.kv.block_ids(rid) for rid in ("a", "b")}
    assert by_id["a"].num_blocks == len(held["a"]) and by_id["c"].num_blocks == 0
    in_use = set(held["a"]) | set(held["b"])
    shared = set(held["a"]) & set(held["b"])
    assert len(shared) == len(SYSTEM) // BS
    assert snap.blocks_in_use == len(in_use) and snap.blocks_shared == len(shared)
    assert snap.blocks_per_cell == 1 and len(snap.cell_used) == 32
    assert {i for i, u in enumerate(snap.cell_used) if u} == in_use
    assert {i for i, x in enumerate(snap.cell_shared) if x} == shared
    # a shared block takes the colour of its oldest holder
    assert all(snap.cell_owner[i] == 0 for i in shared)
    assert all(snap.cell_owner[i] == 1 for i in set(held["b"]) - shared)
    assert snap.blocks_cached == 0  # every cached block is held
    assert snap.first_never_used == max(in_use) + 1  # fresh blocks go out in id order


def test_finished_requests_leave_cached_blocks_apart_from_never_used_ones():
    s = make()
    s.add_request(req("a", [1, 2, 3, 4, 5]))  # 17 tokens + 3 out: 5 blocks, 4 of them full
    while s.has_unfinished_requests():
        step(s)
    snap = build_snapshot(s)
    assert snap.blocks_in_use == 0 and snap.requests == []
    assert snap.blocks_cached == 4  # full blocks keep their prefix hash when freed
    assert sum(snap.cell_cached) == 4
    assert snap.first_never_used == 5  # blocks 5.. were never handed out
    # A new request with the same system prompt takes the cached blocks back: shared with none,
    # in use again, and no more cached-but-free.
    s.add_request(req("b", [8, 8]))
    step(s)
    snap = build_snapshot(s, seen_used=snap.first_never_used)
    assert snap.requests[0].cached_tokens == len(SYSTEM)
    assert snap.blocks_cached == 1 and snap.blocks_in_use == 4


def test_a_large_pool_is_aggregated_into_a_fixed_number_of_cells():
    s = make(num_blocks=10_000)
    for k in range(6):
        s.add_request(req(f"r{k}", [k] * 9))
    step(s)
    snap = build_snapshot(s, max_cells=1000)
    assert snap.blocks_per_cell == 10 and len(snap.cell_used) == 1000
    assert (
        sum(snap.cell_used)
        == snap.blocks_in_use
        == len({b for k in range(6) for b in s.kv.block_ids(f"r{k}")})
    )
    assert sum(snap.cell_shared) == snap.blocks_shared == 3  # the system prompt's blocks
    assert snap.cell_owner[0] == 0 and snap.cell_owner[-1] == -1


def test_the_feed_rides_on_a_step_message_and_is_rate_limited():
    class Core:  # what Feed needs of an EngineCore: its scheduler and executor
        def __init__(self):
            self.scheduler, self.executor = make(), object()

    core, feed = Core(), Feed()
    assert not feed.due()  # nobody watches: never built
    feed.set_interval(core, 60.0)
    assert feed.due() and feed.pending and core.executor is not None
    snap = feed.snapshot(core)
    assert not feed.due() and not feed.pending  # the next one is a minute away
    kind, payload = decode(encode("step", EngineCoreOutputs([], None, snap)))
    assert kind == "step" and payload.dashboard == snap
    inner = core.executor.inner
    feed.set_interval(core, 0.0)
    assert core.executor is inner and not feed.due()  # the recorder is taken off again


def test_with_a_sliding_window_blocks_given_back_are_not_drawn_as_held():
    s = make(num_blocks=32, sliding_window=8)
    s.add_request(Request("w", list(range(1, 10)), SamplingParams(max_tokens=20, ignore_eos=True)))
    for _ in range(12):  # 9 prompt tokens then decodes: blocks behind the window go back
        step(s)
    held = s.kv.held_block_ids("w")
    assert len(held) < len(s.kv.block_ids("w"))  # the table keeps placeholders
    snap = build_snapshot(s)
    assert snap.blocks_in_use == len(held) == snap.requests[0].num_blocks
    assert {i for i, u in enumerate(snap.cell_used) if u} == set(held)
    assert snap.blocks_shared == 0
