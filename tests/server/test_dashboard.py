"""The live dashboard (issue #36): /dashboard in a real headless Chromium (Debian's, driven by
Playwright) on the default model under load with a shared system prompt, read from the page's
DOM; and the API key guarding the page and its feed."""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.live_server import LiveServer

CHROMIUM = "/usr/bin/chromium"
LAUNCH_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
KEY = "dash-secret"
MODEL = "default"
SYSTEM = (
    "You are the support assistant of a small bakery in Lyon. Answer in one short paragraph, "
    "politely, in English. The bakery opens at seven, closes at seven, and is closed on "
    "Mondays. It sells bread, croissants, pains au chocolat, brioche, tarts and cakes made to "
    "order; orders need two days' notice and a deposit of a third of the price. Delivery is "
    "possible inside the city for orders over forty euros. Never invent prices."
)
QUESTIONS = [
    "When are you open?", "Can I order a cake for Saturday?", "Do you deliver?",
    "Do you sell brioche?", "How much is the deposit?", "What do you bake?",
]  # fmt: skip
MAX_TOKENS = 96  # each wave of 3 runs for seconds: a snapshot every 0.25 s sees it
BLOCK_SIZE = 16  # the default


def launch(pw):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run deploy/tools/install-chromium.sh as root")
    return pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS, headless=True)


# Counts read from the page, the way a person reads it: cells by state, the counter, the rows.
READ_PAGE = """() => {
  const q = (s) => document.querySelectorAll(s);
  const inUse = document.querySelector('.blocks-in-use');
  return {
    updates: +(document.body.dataset.updates || 0),
    cells: q('.kv-map .cell').length,
    used: q('.kv-map .cell[data-state=used]').length,
    shared: q('.kv-map .cell[data-state=used][data-shared="1"]').length,
    cached: q('.kv-map .cell[data-state=cached]').length,
    never: q('.kv-map .cell[data-state=never]').length,
    counter: inUse ? inUse.textContent : '',
    running: [...q('.queue-rows tr[data-state=running]')].map((r) => r.dataset.requestId),
    runningBlocks: [...q('.queue-rows tr[data-state=running]')]
      .reduce((n, r) => n + +r.cells[7].textContent, 0),
    waiting: q('.queue-rows tr[data-state=waiting]').length,
    numWaiting: +document.querySelector('.num-waiting').textContent.replace(/,/g, ''),
  };
}"""


@pytest.fixture(scope="module")
def served(default_model_dir):
    # Three at a time and 128-token steps: the rest of the burst waits, prompts are chunked.
    srv = LiveServer(
        default_model_dir, "--served-model-name", MODEL, "--max-num-seqs", "3",
        "--max-num-batched-tokens", "128",
    )  # fmt: skip
    yield srv
    srv.stop()


def ask(client, question, seen_ids, first_token=None):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in stream:
        seen_ids.add(chunk.id)
        if first_token is not None:
            first_token.set()


def test_the_page_shows_the_blocks_the_shared_prefix_and_the_queue(served, tmp_path):
    from playwright.sync_api import sync_playwright

    client = openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=300)
    # The prompt tokens every request shares: its full blocks are the shared ones.
    prompts = [
        httpx.post(
            served.url + "/tokenize",
            json={
                "model": MODEL,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                "add_generation_prompt": True,
            },  # fmt: skip
        ).json()["tokens"]
        for q in QUESTIONS
    ]
    common = len(os.path.commonprefix(prompts))  # (it takes lists as well as strings)
    shared_blocks = common // BLOCK_SIZE
    assert shared_blocks >= 4
    # Two questions may share a word or two past the system prompt: at most this many blocks.
    most_shared = max(
        len(os.path.commonprefix([p, q])) for k, p in enumerate(prompts) for q in prompts[k + 1:]
    ) // BLOCK_SIZE  # fmt: skip

    with sync_playwright() as pw:
        browser = launch(pw)
        page = browser.new_page(viewport={"width": 1500, "height": 1150})
        page.goto(served.url + "/dashboard")
        page.wait_for_function("+(document.body.dataset.updates || 0) >= 1 && "
                               "document.querySelectorAll('.kv-map .cell').length > 0")  # fmt: skip
        idle = page.evaluate(READ_PAGE)
        num_blocks = int(idle["counter"].split("/")[1].replace(",", ""))
        assert idle["cells"] == num_blocks  # a pool this size: one cell per block
        assert idle["used"] == 0 and idle["counter"].startswith("0 /")
        assert idle["running"] == [] and idle["waiting"] == 0

        t0 = time.monotonic()
        seen_ids: set[str] = set()
        first = threading.Event()
        threads = [threading.Thread(target=ask, args=(client, QUESTIONS[0], seen_ids, first))]
        threads[0].start()
        assert first.wait(120)  # its prompt is in the cache now: the others hit it
        threads += [threading.Thread(target=ask, args=(client, q, seen_ids)) for q in QUESTIONS[1:]]
        for t in threads[1:]:
            t.start()
        # Under load: several running requests share the system prompt's blocks, others wait.
        page.wait_for_function(
            f"""() => {{ const s = ({READ_PAGE})();
                return s.running.length >= 2 && s.waiting >= 1 && s.shared >= {shared_blocks}; }}""",
            timeout=120_000,
        )
        busy = page.evaluate(READ_PAGE)
        print(f"\nunder load after {time.monotonic() - t0:.1f} s: {busy}")
        # the counter is the map: one used cell per block in use
        assert busy["counter"] == f"{busy['used']:,} / {num_blocks:,}"
        # ... and the requests' own blocks, the shared ones drawn once
        n = len(busy["running"])
        assert busy["runningBlocks"] - (n - 1) * most_shared <= busy["used"]
        assert busy["used"] <= busy["runningBlocks"] - (n - 1) * shared_blocks
        # only the system prompt's blocks are held by several requests
        assert shared_blocks <= busy["shared"] <= most_shared
        assert busy["waiting"] == busy["numWaiting"] >= 1
        assert 2 <= len(busy["running"]) <= 3
        # the rows are the server's own requests (engine ids are the response id + choice)
        assert all(rid.rsplit("-", 1)[0] in seen_ids for rid in busy["running"])

        # hovering a shared block names the request holding it, its tokens and blocks
        page.hover(".kv-map .cell[data-state=used][data-shared='1']")
        tip = page.inner_text("#tooltip")
        assert "shared" in tip and "request chatcmpl-" in tip and "tokens" in tip
        assert "blocks" in tip
        shot = tmp_path / "dashboard.png"  # under load, the tooltip showing
        page.screenshot(path=str(shot), full_page=True)
        print(f"dashboard screenshot (under load): {shot}")
        if os.environ.get("SERVELM_DASHBOARD_SCREENSHOT"):  # the README's: some steps in
            page.wait_for_function("document.querySelectorAll('.steps-chart rect').length > 12")
            page.hover(".kv-map .cell[data-state=used][data-shared='1']")
            page.screenshot(path=os.environ["SERVELM_DASHBOARD_SCREENSHOT"], full_page=True)

        for t in threads:
            t.join(300)
        assert len(seen_ids) == len(QUESTIONS)
        # Idle again: nothing in use, the prompts' full blocks cached but free.
        page.wait_for_function(
            f"() => {{ const s = ({READ_PAGE})(); return s.used === 0 && s.running.length === 0"
            " && s.cached > 0; }", timeout=30_000,
        )  # fmt: skip
        done = page.evaluate(READ_PAGE)
        print(f"idle again after {time.monotonic() - t0:.1f} s")
        assert done["counter"].startswith("0 /") and done["waiting"] == 0
        assert done["cached"] >= shared_blocks and done["never"] > 0
        latency = page.inner_text(".latency-rows")
        assert "TTFT" in latency and ("ms" in latency or " s" in latency)
        browser.close()


@pytest.fixture(scope="module")
def keyed(tiny_model_dir):
    srv = LiveServer(
        tiny_model_dir, "--api-key", KEY, "--kv-cache-memory", "4MiB",
        "--served-model-name", "tiny",
    )  # fmt: skip
    yield srv
    srv.stop()


def first_engine_event(url: str, headers: dict[str, str]) -> dict:
    """The first event of the feed that holds an engine snapshot."""
    with httpx.stream("GET", url + "/dashboard/feed", headers=headers, timeout=10) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event.get("engine"):
                    return event
    raise AssertionError("the feed ended")


@pytest.mark.parametrize(
    "path", ["/dashboard", "/dashboard/feed", "/dashboard/static/dashboard.js"]
)
@pytest.mark.parametrize(
    "auth", [None, "Bearer wrong", "Basic " + base64.b64encode(b":no").decode()]
)
def test_without_the_key_the_page_and_its_feed_answer_401(keyed, path, auth):
    headers = {"Authorization": auth} if auth else {}
    resp = httpx.get(keyed.url + path, headers=headers, timeout=10)
    assert resp.status_code == 401
    assert resp.json() == {
        "error": {
            "message": "Invalid or missing API key.",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    # a browser shows its login box for a challenge that starts with Basic
    assert any(v.startswith("Basic ") for v in resp.headers.get_list("www-authenticate"))


def test_the_page_follows_the_feed_again_after_an_error_answer(served):
    """An EventSource that gets an answer other than 200 (an ingress's 502 while the pod
    restarts) is closed for good by the browser: the page must open a new one."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = launch(pw)
        tab = browser.new_page()
        tab.route("**/dashboard/feed", lambda route: route.fulfill(status=502, body="down"))
        tab.goto(served.url + "/dashboard")
        tab.wait_for_function("document.querySelector('#status').textContent.startsWith('dis')")
        assert tab.evaluate("+(document.body.dataset.updates || 0)") == 0
        tab.unroute("**/dashboard/feed")
        tab.wait_for_function("+(document.body.dataset.updates || 0) >= 2", timeout=20_000)
        assert tab.inner_text("#status") == "live"
        browser.close()


def test_a_page_open_in_a_browser_adds_no_client_requests(served):
    """The page, its files, its feed and the browser's own /favicon.ico (a 404 in the 4xx
    panel on every page load) stay out of http_requests_total."""
    from playwright.sync_api import sync_playwright

    before = served.metrics().get("servelm:http_requests_total", 0)
    with sync_playwright() as pw:
        browser = launch(pw)
        tab = browser.new_page()
        tab.goto(served.url + "/dashboard")
        tab.wait_for_function("+(document.body.dataset.updates || 0) >= 2", timeout=20_000)
        browser.close()
    assert served.metrics().get("servelm:http_requests_total", 0) == before


def login_in_a_browser(url: str, password: str) -> int:
    """The status a real Chromium ends with for the page when a person types `password` into
    the login box it offers (where it offers none, the 401 stays)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = launch(pw)
        try:
            login = {"username": "ops", "password": password}
            tab = browser.new_context(http_credentials=login).new_page()
            return tab.goto(url + "/dashboard").status
        finally:
            browser.close()


def test_a_browser_opens_the_page_with_the_key_typed_into_its_login_box(keyed):
    assert login_in_a_browser(keyed.url, KEY) == 200
    assert login_in_a_browser(keyed.url, "wrong") == 401


def test_with_the_key_the_page_and_its_feed_answer(keyed):
    bearer = {"Authorization": f"Bearer {KEY}"}
    page = httpx.get(keyed.url + "/dashboard", headers=bearer, timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'data-kind="server"' in page.text and "dashboard/static/dashboard.js" in page.text
    script = httpx.get(keyed.url + "/dashboard/static/dashboard.js", headers=bearer, timeout=10)
    assert script.status_code == 200 and "EventSource" in script.text
    missing = httpx.get(keyed.url + "/dashboard/static/nope.js", headers=bearer, timeout=10)
    assert missing.status_code == 404 and "error" in missing.json()
    # the key as a browser sends it after its login box: HTTP Basic, the key as the password
    basic = {"Authorization": "Basic " + base64.b64encode(f"me:{KEY}".encode()).decode()}
    for headers in (bearer, basic):
        event = first_engine_event(keyed.url, headers)
        engine = event["engine"]  # idle: sent once a page connects, without a step
        assert event["kind"] == "server" and event["model"] == "tiny"
        assert engine["num_blocks"] > 0 and engine["blocks_in_use"] == 0
        assert len(engine["cell_used"]) == -(-engine["num_blocks"] // engine["blocks_per_cell"])
        assert set(event["latency"]) == {"ttft", "tpot", "itl", "e2e"}
    # the routes are not API: /openapi.json leaves them out
    spec = httpx.get(keyed.url + "/openapi.json", headers=bearer, timeout=10).json()
    assert not any(p.startswith("/dashboard") for p in spec["paths"])


def test_requests_older_than_the_window_leave_it_even_with_no_step_since():
    """The last engine step's requests finish (and are recorded) just after its reading: five
    idle minutes later they showed as 'over the last 300 s'."""
    from types import SimpleNamespace

    from servelm.server.dashboard import WINDOW, DashboardHub
    from servelm.server.metrics import RequestTimer, ServerMetrics

    metrics = ServerMetrics("m", 16, 8)
    listeners = SimpleNamespace(dashboard_listeners=[], stats_listeners=[])  # (no engine here)
    hub = DashboardHub(listeners, metrics, "m")
    last_step = hub.samples[-1][0]
    timer = RequestTimer(metrics, arrival=last_step - 15, num_prompt_tokens=8)
    timer.on_tokens(last_step - 14, 1)
    timer.on_finish(last_step + 0.01, "stop", 8)  # recorded after the last reading
    soon = hub._server_part(last_step + 10)["latency"]["e2e"]
    assert soon["count"] == 1
    later = hub._server_part(last_step + WINDOW + 20)
    assert later["latency"]["e2e"]["count"] == 0 and later["window_seconds"] == WINDOW
