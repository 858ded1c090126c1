"""Each policy's distribution over three real replicas, seen by the official OpenAI client."""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from servelm.text.tokenizer import TextTokenizer
from tests.live_server import LiveServer
from tests.router.conftest import MODEL, Proc, admin_replicas, router, scrape, wait_for
from tests.server.test_access import log_lines


def served_by(r: Proc, n: int, **kw) -> list[str]:
    """Send `n` short chat requests through router `r`; the replica that answered each."""
    client = openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0, timeout=60)
    out = []
    for i in range(n):
        messages = kw.get("messages") or [{"role": "user", "content": f"hello {i}"}]
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=2
        )
        raw.parse()
        out.append(raw.headers["x-servelm-replica"])
    return out


@pytest.fixture(scope="module")
def rr(cluster: list[Proc], log_dir: Path) -> Iterator[Proc]:
    with router([p.url for p in cluster], "round-robin", log_dir) as r:
        yield r


def test_round_robin_is_even(cluster: list[Proc], rr: Proc) -> None:
    assert Counter(served_by(rr, 30)) == {p.url: 10 for p in cluster}


def test_a_request_id_names_the_routers_log_line_and_the_replicas(
    tiny_model_dir: Path, log_dir: Path
) -> None:
    replica = LiveServer(tiny_model_dir, "--served-model-name", MODEL)  # logs at info
    try:
        with router([replica.url], "round-robin", log_dir, "--log-level", "info") as r:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            }
            for sent in ("trace-route-1", None):
                headers = {"X-Request-Id": sent} if sent else {}
                answer = httpx.post(
                    r.url + "/v1/chat/completions", json=body, headers=headers, timeout=60
                )
                assert answer.status_code == 200
                request_id = answer.headers["x-request-id"]
                assert request_id == (sent or request_id) and len(request_id) >= 8
                for log in (r.log.read_text, replica.log):
                    said = log_lines(log, request_id)
                    assert len(said) == 1 and '"POST /v1/chat/completions" 200' in said[0]
    finally:
        replica.stop()


def test_canary_weight_splits_traffic(cluster: list[Proc], log_dir: Path) -> None:
    stable, canary = cluster[0].url, cluster[1].url
    with router([stable, canary], "round-robin", log_dir, "--weight", f"{canary}=0.1") as r:
        assert Counter(served_by(r, 22)) == {stable: 20, canary: 2}


def hold_streams(url: str, n: int, stop: threading.Event) -> list[threading.Thread]:
    """`n` long streams straight to a replica (not through the router), open until `stop`."""

    def one() -> None:
        body = {
            "model": MODEL,
            "prompt": "busy",
            "max_tokens": 20000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            for _ in resp.iter_raw():
                if stop.is_set():
                    return  # closing the connection aborts the request on the replica

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_least_loaded_steers_away_from_a_busy_replica(cluster: list[Proc], log_dir: Path) -> None:
    busy = cluster[0]
    with router([p.url for p in cluster], "least-loaded", log_dir) as r:
        stop = threading.Event()
        threads = hold_streams(busy.url, 6, stop)
        try:
            wait_for(
                lambda: next(x for x in admin_replicas(r.url) if x["url"] == busy.url)["load"] >= 6,
                10,
                "the router to see the busy replica's load",
            )
            picks = Counter(served_by(r, 12))
        finally:
            stop.set()
            for t in threads:
                t.join(10)
        assert busy.url not in picks
        assert set(picks) == {cluster[1].url, cluster[2].url}  # the idle two share the rest


def long_system_prompt(model_dir: Path, tokens: int = 512) -> str:
    """A system prompt of at least `tokens` tokens, unique to this run (no stale cache hits)."""
    tok = TextTokenizer(model_dir)
    words = (
        "serving engine batches requests streams tokens blocks prefix cache quick brown fox".split()
    )
    rng = random.Random()
    text = f"Run {rng.randrange(10**9)}."
    while len(tok.encode(text)) < tokens:
        text += " " + " ".join(rng.choice(words) for _ in range(20))
    return text


def test_prefix_aware_keeps_a_shared_prompt_on_one_replica(
    cluster: list[Proc], log_dir: Path, router_model_dir: Path
) -> None:
    system = long_system_prompt(router_model_dir)
    hits = "servelm:prefix_cache_hits_total"
    with router([p.url for p in cluster], "prefix-aware", log_dir) as r:
        before = {p.url: scrape(p.url, hits) for p in cluster}
        picks = []
        for i in range(20):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"question {i}?"},
            ]
            picks += served_by(r, 1, messages=messages)
        after = {p.url: scrape(p.url, hits) for p in cluster}
    assert len(set(picks)) == 1
    home = picks[0]
    assert after[home] - before[home] >= 19 * 500  # 19 requests found the ~512-token prefix cached
    assert all(after[u] == before[u] for u in after if u != home)


def test_models_is_the_union_and_unknown_models_are_404(rr: Proc) -> None:
    client = openai.OpenAI(base_url=rr.url + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert exc.value.body["code"] == "model_not_found"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_admin_add_drain_remove_and_replicas_file(
    cluster: list[Proc], log_dir: Path, tmp_path: Path
) -> None:
    a, b, c = (p.url for p in cluster)
    pool = tmp_path / "replicas.txt"
    pool.write_text(f"{a}\n")
    auth = {"Authorization": "Bearer admin-secret"}
    with router([], "round-robin", log_dir, "--replicas-file", str(pool), wait_healthy=False) as r:
        wait_for(
            lambda: [x["state"] for x in admin_replicas(r.url)] == ["healthy"], 10, "file replica"
        )
        assert httpx.post(r.url + "/admin/replicas", json={"url": b}).status_code == 401
        added = httpx.post(r.url + "/admin/replicas", json={"url": b, "weight": 1}, headers=auth)
        assert added.status_code == 201 and added.json()["state"] == "healthy"
        assert set(served_by(r, 4)) == {a, b}
        # drain b while a stream is open on it: no new requests, it leaves when the stream ends
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0)
        stream = None
        while stream is None:  # open streams until one lands on b
            raw = client.completions.with_raw_response.create(
                model=MODEL,
                prompt="drain me",
                max_tokens=3000,  # long enough to still be running when the drain arrives
                stream=True,
                extra_body={"ignore_eos": True},
            )
            s = raw.parse()
            if raw.headers["x-servelm-replica"] == b:
                stream = s
            else:
                s.close()
        first = next(iter(stream))
        drained = httpx.post(r.url + "/admin/replicas/drain", params={"url": b}, headers=auth)
        assert drained.status_code == 202
        assert (drained.json()["draining"], drained.json()["in_flight"]) == (
            True,
            1,
        )  # kept for now
        assert set(served_by(r, 3)) == {a}
        text = first.choices[0].text + "".join(ch.choices[0].text for ch in stream if ch.choices)
        assert text  # the drained replica's stream finished
        wait_for(
            lambda: b not in [x["url"] for x in admin_replicas(r.url)],
            5,
            "drained replica to leave",
        )
        # the replicas file changes: c joins, a leaves
        pool.write_text(f"# new pool\n{c}\n")
        wait_for(
            lambda: (
                [x["url"] for x in admin_replicas(r.url)] == [c]
                and admin_replicas(r.url)[0]["state"] == "healthy"
            ),
            10,
            "file reload",
        )
        assert set(served_by(r, 2)) == {c}
        # a file with a bad entry changes nothing (c was drained before the bad weight was read)
        pool.write_text(f"{a}\n{c} 0\n")
        wait_for(lambda: "line 2: weight must be > 0" in r.log.read_text(), 10, "the refusal")
        assert [(x["url"], x["state"]) for x in admin_replicas(r.url)] == [(c, "healthy")]
        assert "kept the configuration in use" in r.log.read_text()
        removed = httpx.delete(r.url + "/admin/replicas", params={"url": c}, headers=auth)
        assert removed.status_code == 200 and admin_replicas(r.url) == []
        resp = httpx.post(r.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert resp.status_code == 503 and resp.headers["retry-after"]
