"""OpenAI's Responses API through the router: a continuation (`previous_response_id`), GET and
DELETE reach the replica holding the response, learnt from the answers or asked for; streams
end with their closing event; answers are charged their usage. Two replicas of the scripted
model (tests/scripted_model.py: exact answers, so token counts are known), the official client.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry, Histogram

from servelm.router.affinity import ResponseOwners
from servelm.router.app import Router, build_app
from servelm.router.config import RouterConfig
from servelm.router.metrics import RouterMetrics
from servelm.router.policies import PrefixAware, RouteRequest
from servelm.router.prefix import RESPONSES, prompt_text
from servelm.router.ratelimit import RateLimiter
from servelm.router.replicas import Lease, Replica, ReplicaSet, ReplicaState
from servelm.router.streaming import StreamState, relay, sse_events
from servelm.server.errors import APIError
from tests.router.conftest import MODEL, Proc, free_port, replica_proc, router, running
from tests.scripted_model import build_scripted_model


@pytest.fixture(scope="module")
def script_ids(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    folder = tmp_path_factory.mktemp("scripted")
    return folder, build_scripted_model(folder)


@pytest.fixture(scope="module")
def replicas(script_ids, log_dir: Path) -> Iterator[list[Proc]]:
    yield from running([replica_proc(script_ids[0], log_dir) for _ in range(2)])


@pytest.fixture(scope="module")
def pair(replicas: list[Proc], log_dir: Path) -> Iterator[Proc]:
    # round-robin alternates: a continuation sent by the policy would reach the other replica
    with router([p.url for p in replicas], "round-robin", log_dir) as r:
        yield r


@pytest.fixture(scope="module")
def plain(script_ids) -> dict:
    """What makes the scripted model answer "The weather is fine today." whatever it is asked."""
    return {"temperature": 0, "extra_body": {"logit_bias": {str(script_ids[1]["plain"]): 100}}}


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def lookups(r: Proc, outcome: str) -> float:
    """How often router `r` found a stored response's replica this way (known: it had learnt
    it; found: it asked the replicas; missing: none had it)."""
    name = f'servelm_router:response_owner_lookups_total{{outcome="{outcome}"}}'
    for line in httpx.get(r.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def chain(c: openai.OpenAI, plain: dict, steps: int = 3, previous: str | None = None):
    """`steps` responses, each continuing the one before: (response, replica header) each."""
    out = []
    for i in range(steps):
        more = {"previous_response_id": previous} if previous else {}
        raw = c.responses.with_raw_response.create(
            model=MODEL, input=f"And then {i}?", **more, **plain
        )
        response = raw.parse()
        out.append((response, raw.headers.get("x-servelm-replica")))
        previous = response.id
    return out


def test_a_chain_goes_on_where_each_response_is_held(
    replicas: list[Proc], pair: Proc, plain: dict
) -> None:
    alone = [r.usage.input_tokens for r, _ in chain(client(replicas[0].url), plain)]
    via = client(pair.url)
    known = lookups(pair, "known")
    made = chain(via, plain)
    assert lookups(pair, "known") == known + 2  # learnt from the answers, not asked for
    owner = made[0][1]
    assert [url for _, url in made] == [owner] * 3
    # each prompt holds the conversation before it, token for token as on one server
    assert [r.usage.input_tokens for r, _ in made] == alone
    first, _, last = (r for r, _ in made)
    assert made[1][0].usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    (other,) = [p.url for p in replicas if p.url != owner]
    assert httpx.get(f"{other}/v1/responses/{last.id}").status_code == 404  # only the owner can

    got = via.responses.with_raw_response.retrieve(last.id)
    assert got.parse().output_text == last.output_text and got.headers["x-servelm-replica"] == owner
    items = via.responses.input_items.list(last.id, order="asc", limit=1)  # a page, by query
    assert len(items.data) == 1 and items.data[0].type == "message"
    via.responses.delete(last.id)
    missing = lookups(pair, "missing")
    with pytest.raises(openai.NotFoundError):  # forgotten with the delete: asked, and missing
        via.responses.retrieve(last.id)
    assert lookups(pair, "missing") == missing + 1
    with pytest.raises(openai.NotFoundError) as exc:
        via.responses.create(model=MODEL, input="more", previous_response_id=last.id, **plain)
    assert exc.value.body["param"] == "previous_response_id"
    assert exc.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        via.responses.delete("resp_never_made")


def test_a_stream_ends_with_its_closing_event_and_teaches_the_router_its_owner(
    pair: Proc, plain: dict
) -> None:
    via = client(pair.url)
    known = lookups(pair, "known")
    with via.responses.stream(model=MODEL, input="Weather?", **plain) as s:
        events = list(s)
        final = s.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert final.output_text == "The weather is fine today."
    # a streamed continuation, as raw SSE: no [DONE], nothing the router added
    body = {
        "model": MODEL,
        "input": "And tomorrow?",
        "previous_response_id": final.id,
        "stream": True,
        "temperature": 0,
        **plain["extra_body"],
    }
    with httpx.stream("POST", pair.url + "/v1/responses", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        text = resp.read().decode()
    kinds = [ln.removeprefix("event: ") for ln in text.splitlines() if ln.startswith("event: ")]
    assert kinds[-1] == "response.completed" and "[DONE]" not in text and "error" not in kinds
    last = json.loads(text.strip().split("\n\n")[-1].split("data: ", 1)[1])["response"]
    assert last["previous_response_id"] == final.id
    assert last["usage"]["input_tokens"] > final.usage.input_tokens + final.usage.output_tokens
    assert lookups(pair, "known") == known + 1  # learnt from the stream's first event


def test_a_new_router_asks_the_replicas_who_holds_a_response(
    replicas: list[Proc], log_dir: Path, plain: dict
) -> None:
    urls = [p.url for p in replicas]
    with router(urls, "round-robin", log_dir) as first:
        ((made, owner),) = chain(client(first.url), plain, steps=1)
    with router(urls, "round-robin", log_dir) as second:  # knows nothing of `made`
        via = client(second.url)
        # two in a row: round-robin alone would send one of them to the other replica
        more = chain(via, plain, steps=2, previous=made.id)
        assert [url for _, url in more] == [owner, owner]
        assert lookups(second, "found") == 1  # asked once, then known
        assert via.responses.retrieve(made.id).output_text == made.output_text


def test_a_known_owner_out_of_rotation_is_a_503_not_another_replica(
    replicas: list[Proc], plain: dict
) -> None:
    r = Router(RouterConfig(replicas=[p.url for p in replicas], policy="round-robin", debug=True))
    for rep in r.replicas:
        rep.state, rep.models = ReplicaState.HEALTHY, {MODEL: {"id": MODEL}}
    ask = {"model": MODEL, "input": "Weather?", "temperature": 0, **plain["extra_body"]}

    async def run() -> None:
        transport = httpx.ASGITransport(app=build_app(r))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://router", timeout=60
        ) as http:
            made = await http.post("/v1/responses", json=ask)
            assert made.status_code == 200, made.text
            rid, owner = made.json()["id"], r.replicas.get(made.headers["x-servelm-replica"])
            owner.state = ReplicaState.EJECTED
            for resp, param in (
                (await http.post("/v1/responses", json={**ask, "previous_response_id": rid}), True),
                (await http.get(f"/v1/responses/{rid}"), False),
            ):
                assert resp.status_code == 503 and int(resp.headers["retry-after"]) >= 1
                error = resp.json()["error"]
                assert error["code"] == "replica_unavailable" and owner.url in error["message"]
                assert error["param"] == ("previous_response_id" if param else None)
            owner.state = ReplicaState.HEALTHY  # back: the conversation goes on
            more = await http.post("/v1/responses", json={**ask, "previous_response_id": rid})
            assert more.status_code == 200 and more.headers["x-servelm-replica"] == owner.url

    asyncio.run(run())


@pytest.fixture(scope="module")
def gated(replicas: list[Proc], log_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(
        json.dumps(
            {
                "default_max_tokens": 16,
                "keys": [  # one per test, each starting full
                    {"key": "sk-whole", "name": "whole", "tpm": 2000},
                    {"key": "sk-stream", "name": "stream", "tpm": 2000},
                ],
            }
        )
    )
    with router([replicas[0].url], "round-robin", log_dir, "--api-keys-file", str(keys)) as r:
        yield r


def remaining_tokens(r: Proc, key: str) -> int:
    """The key's tokens left, read from a /tokenize answer (which is charged none)."""
    resp = httpx.post(
        r.url + "/tokenize", headers={"Authorization": f"Bearer {key}"}, json={"prompt": "x"}
    )
    assert resp.status_code == 200, resp.text
    return int(resp.headers["x-ratelimit-remaining-tokens"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_is_admitted_on_max_output_tokens_and_charged_its_usage(
    gated: Proc, plain: dict, stream: bool
) -> None:
    """Estimated at 1,800 output tokens (of a 2,000 per minute budget), the answer uses a few
    dozen: the key gets the difference back, from the body's usage or the closing event's. The
    refill (33 tokens a second) would take most of a minute to make up for it."""
    key = "sk-stream" if stream else "sk-whole"
    c = client(gated.url, key)
    ask = {"model": MODEL, "input": "Weather?", "max_output_tokens": 1800, **plain}
    if stream:
        raw = c.responses.with_raw_response.create(**ask, stream=True)
        with raw.parse() as events:
            usage = [e for e in events if e.type == "response.completed"][0].response.usage
    else:
        raw = c.responses.with_raw_response.create(**ask)
        usage = raw.parse().usage
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) <= 2000 - 1800
    assert usage.total_tokens < 100
    assert remaining_tokens(gated, key) >= 2000 - 100
    # GET of a stored response takes a key too, and costs no tokens
    made = c.responses.create(model=MODEL, input="Weather?", max_output_tokens=20, **plain)
    got = c.responses.with_raw_response.retrieve(made.id)
    assert got.parse().id == made.id and "x-ratelimit-remaining-tokens" in got.headers
    with pytest.raises(openai.AuthenticationError):
        client(gated.url, "sk-wrong").responses.retrieve(made.id)


# -- parts, without processes --------------------------------------------------------------


def test_a_responses_body_reads_as_the_chat_it_means() -> None:
    """The same conversation through either API hashes alike (one prefix cache), and is
    estimated alike; an embeddings body that looks the same is not a conversation."""
    chat = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello"},
        ]
    }
    responses = {
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Hi there"}]},
            {"type": "message", "role": "assistant", "content": "Hello"},
        ],
    }
    assert prompt_text(responses, RESPONSES) == prompt_text(chat) != ""
    assert prompt_text({"input": "Hi"}, RESPONSES) == prompt_text(
        {"messages": [{"role": "user", "content": "Hi"}]}
    )
    assert prompt_text({"input": "Hi"}, "/v1/embeddings") == ""
    limiter = RateLimiter(default_max_tokens=100)
    prompt = limiter.estimate_tokens("/v1/chat/completions", {**chat, "max_tokens": 0})
    body = {**responses, "max_output_tokens": 50, "n": 7}  # (no `n` in this API)
    assert limiter.estimate_tokens(RESPONSES, body) == prompt + 50
    assert limiter.estimate_tokens(RESPONSES, responses) == prompt + 100

    policy = PrefixAware(block_chars=8)
    a, b = Replica("http://a:1", state=ReplicaState.HEALTHY), Replica("http://b:1")
    b.state = ReplicaState.HEALTHY
    long = {"instructions": "You answer questions about the weather. " * 4, "input": "Paris?"}
    first = policy.choose([a, b], RouteRequest(MODEL, long, RESPONSES))
    again = policy.choose([a, b], RouteRequest(MODEL, {**long, "input": "Oslo?"}, RESPONSES))
    assert again.reason == "prefix_hit" and again.replica is first.replica


async def relayed(*events: str, count_output: bool = False) -> tuple[str, StreamState]:
    async def chunks():
        for e in events:
            yield e.encode()

    replica = Replica("http://r:1")
    state = StreamState(
        replica, Lease(replica), httpx.Response(200), False, lambda _: None, None, count_output
    )
    state.typed = True
    stream = sse_events(chunks())
    first = await stream.__anext__()
    state.head = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
    delay = Histogram("d", "d", registry=CollectorRegistry())
    return b"".join([out async for out in relay(first, stream, state, delay)]).decode(), state


def typed(kind: str, n: int, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': n, **fields})}\n\n"


def test_a_typed_stream_ends_with_its_event_or_the_failure_the_replica_would_send() -> None:
    head = {"id": "resp_1", "status": "in_progress", "usage": None}
    usage = {"input_tokens": 7, "output_tokens": 2, "total_tokens": 9}
    whole = [
        typed("response.created", 0, response=head),
        typed("response.output_text.delta", 1, delta="Hi"),
        typed("response.output_text.delta", 2, delta="!"),
        typed("response.completed", 3, response={**head, "status": "completed", "usage": usage}),
    ]
    body, state = asyncio.run(relayed(*whole, count_output=True))
    assert body == "".join(whole) and state.outcome == "200" and state.usage_total == 9
    assert state.output_seen == 2

    body, state = asyncio.run(relayed(*whole[:3], count_output=True))  # the replica went away
    assert state.outcome == "stream_error" and state.output_seen == 2 and state.usage_total is None
    *_, end = body.strip().split("\n\n")
    kind, data = end.split("\n")
    failed = json.loads(data.removeprefix("data: "))
    assert kind == "event: response.failed" and failed["type"] == "response.failed"
    assert failed["sequence_number"] == 3 and failed["response"]["id"] == "resp_1"
    assert failed["response"]["status"] == "failed" and "[DONE]" not in body


def test_the_owner_table_is_bounded_and_forgets_unstored_responses() -> None:
    async def run() -> None:
        replicas = ReplicaSet()
        rep = replicas.add(f"http://127.0.0.1:{free_port()}")  # nobody listens there
        rep.state = ReplicaState.HEALTHY
        async with httpx.AsyncClient() as http:
            owners = ResponseOwners(replicas, http, RouterMetrics(), capacity=2, timeout_s=2)
            for i in range(3):
                owners.learn(rep, {"id": f"resp_{i}", "store": True})
            owners.learn(rep, {"id": "resp_unstored", "store": False})
            assert len(owners) == 2
            assert await owners.owner("resp_2") is rep and await owners.owner("resp_1") is rep
            for gone in ("resp_0", "resp_unstored"):  # asked for: the replica cannot say
                with pytest.raises(APIError) as exc:
                    await owners.owner(gone, "previous_response_id")
                assert (exc.value.status, exc.value.param) == (404, "previous_response_id")

    asyncio.run(run())
