"""Routing policies and prompt prefix hashing, on hand-made replicas (no processes)."""

from __future__ import annotations

from collections import Counter

from servelm.router.policies import LeastLoaded, PrefixAware, RoundRobin, RouteRequest
from servelm.router.prefix import block_hashes, estimate_prompt_tokens, prompt_text
from servelm.router.replicas import Lease, Replica, ReplicaState

SYSTEM = "You are a careful assistant. " * 40  # ~1100 characters: several 128-char blocks


def replica(name: str, load: float = 0.0, weight: float = 1.0, kv: float = 0.0) -> Replica:
    r = Replica(f"http://{name}:8000", weight, state=ReplicaState.HEALTHY)
    r.on_scrape(0.0, load, kv)
    return r


def chat(system: str, user: str) -> RouteRequest:
    return RouteRequest(
        "m",
        {
            "model": "m",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        },
    )


def test_round_robin_is_even() -> None:
    reps = [replica(n) for n in "abc"]
    policy = RoundRobin()
    picks = [policy.choose(reps, RouteRequest(None)).replica.url for _ in range(30)]
    assert Counter(picks) == {r.url: 10 for r in reps}
    assert picks[:3] == [r.url for r in reps]  # rotation, not bursts


def test_round_robin_honours_weights_for_a_canary() -> None:
    stable, canary = replica("stable"), replica("canary", weight=0.1)
    policy = RoundRobin()
    picks = Counter(
        policy.choose([stable, canary], RouteRequest(None)).replica.url for _ in range(110)
    )
    assert picks == {stable.url: 100, canary.url: 10}


def test_least_loaded_picks_fewest_requests_then_lowest_kv() -> None:
    busy, idle, idle_full = (
        replica("busy", load=5),
        replica("idle", kv=0.2),
        replica("idle2", kv=0.9),
    )
    policy = LeastLoaded()
    assert {
        policy.choose([busy, idle, idle_full], RouteRequest(None)).replica.url for _ in range(20)
    } == {idle.url}


def test_least_loaded_counts_requests_sent_since_the_last_scrape() -> None:
    a, b = replica("a"), replica("b")
    policy = LeastLoaded()
    leases = [Lease(policy.choose([a, b], RouteRequest(None)).replica) for _ in range(10)]
    assert a.load == b.load == 5  # the router's own dispatches keep them even between scrapes
    for lease in leases:
        lease.release()
    assert a.load == b.load == 0


def test_least_loaded_without_metrics_uses_in_flight() -> None:
    a, b = replica("a"), replica("b")
    a.waiting = a.running = b.waiting = b.running = None
    Lease(a)
    assert LeastLoaded().choose([a, b], RouteRequest(None)).replica is b


def test_least_loaded_weights_split_ties() -> None:
    stable, canary = replica("stable"), replica("canary", weight=0.1)
    policy = LeastLoaded(seed=1)
    picks = Counter(
        policy.choose([stable, canary], RouteRequest(None)).replica.url for _ in range(2000)
    )
    assert 120 < picks[canary.url] < 250  # about 1/11 of idle-time picks


def test_prefix_aware_keeps_a_prefix_on_one_replica() -> None:
    reps = [replica(n) for n in "abc"]
    policy = PrefixAware()
    decisions = [policy.choose(reps, chat(SYSTEM, f"question {i}")) for i in range(20)]
    assert len({d.replica.url for d in decisions}) == 1
    assert decisions[0].reason == "prefix_miss"
    assert {d.reason for d in decisions[1:]} == {"prefix_hit"}


def test_prefix_aware_spreads_distinct_prefixes_by_load() -> None:
    reps = [replica(n) for n in "ab"]
    policy = PrefixAware()
    homes = {}
    for p in range(4):
        r = policy.choose(reps, chat(f"prompt {p}: " + SYSTEM, "hi")).replica
        Lease(r)  # each prefix keeps a request open: the next new prefix sees the load
        homes[p] = r.url
    assert Counter(homes.values()) == {reps[0].url: 2, reps[1].url: 2}
    for p in range(4):  # and each prefix sticks to its home
        assert policy.choose(reps, chat(f"prompt {p}: " + SYSTEM, "again")).replica.url == homes[p]


def test_prefix_aware_keeps_salted_prompts_apart() -> None:
    # a replica shares KV blocks only between prompts of one cache_salt: another salt's prefix
    # sitting there is no reason to go to it
    reps = [replica(n) for n in "ab"]
    policy = PrefixAware()
    salted = chat(SYSTEM, "q")
    salted.body["cache_salt"] = "tenant-a"
    assert policy.choose(reps, salted).reason == "prefix_miss"
    assert policy.choose(reps, chat(SYSTEM, "q2")).reason == "prefix_miss"
    assert policy.choose(reps, salted).reason == "prefix_hit"


def test_prefix_aware_spills_a_hot_prefix_when_unbalanced() -> None:
    a, b = replica("a"), replica("b")
    policy = PrefixAware(imbalance_abs=4, imbalance_rel=1.5)
    home = policy.choose([a, b], chat(SYSTEM, "q")).replica
    other = b if home is a else a
    home.on_scrape(0, 4, 0.0)  # 4 ahead of the other: not yet unbalanced
    assert policy.choose([a, b], chat(SYSTEM, "q2")).replica is home
    home.on_scrape(3, 6, 0.0)  # 9 vs 0: unbalanced
    d = policy.choose([a, b], chat(SYSTEM, "q3"))
    assert (d.replica, d.reason) == (other, "prefix_overloaded")


def test_prefix_aware_ignores_replicas_that_left() -> None:
    a, b = replica("a"), replica("b")
    policy = PrefixAware()
    home = policy.choose([a, b], chat(SYSTEM, "q")).replica
    other = b if home is a else a
    assert policy.choose([other], chat(SYSTEM, "q")).replica is other
    assert policy.choose([a, b], chat(SYSTEM, "q")).replica is other  # the prefix moved with it


def test_block_hashes_are_chained_and_seeded_by_model() -> None:
    text = "x" * 300
    h = block_hashes(text, 128, 64, "m")
    assert len(h) == 2  # the 44-character tail is not a full block
    assert block_hashes(text + "different tail", 128, 64, "m") == h
    assert block_hashes("y" + text[1:], 128, 64, "m")[1] != h[1]  # block 1 depends on block 0
    assert block_hashes(text, 128, 64, "other")[0] != h[0]
    assert len(block_hashes("x" * 10_000, 128, 8, "m")) == 8


def test_prompt_text_covers_chat_completions_and_token_ids() -> None:
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    assert "hello" in prompt_text(parts)
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"prompt": [1, 2, 3]}) == "1,2,3,"
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}) == 3
    assert estimate_prompt_tokens({"prompt": "x" * 40}) == 10


def test_odd_bodies_still_get_a_prefix_for_the_replica_to_refuse() -> None:
    # The router routes; judging the body is the replica's job (a 400 there), so no body may
    # break the policy: a text part that is not text, a lone surrogate in a long prompt.
    odd = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    assert '"text": 5' in prompt_text(odd)
    assert len(block_hashes("\ud800" + "x" * 300, 128, 64, "m")) == 2
