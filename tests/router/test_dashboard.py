"""/dashboard on `servelm route`: each replica's own feed relayed into one page (a panel per
replica, drawn in a real headless Chromium), the router's replicas and its policy decisions."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai

from tests.router.conftest import MODEL, Proc, router
from tests.server.test_dashboard import launch, login_in_a_browser
from tests.server.test_drain_signals import feed_open_through_a_signal


def router_events(url: str, headers: dict | None = None, timeout: float = 30.0):
    """The router's feed, event by event, for up to `timeout` seconds (across the reconnects
    a page makes: each stream ends after a while)."""
    deadline = time.monotonic() + timeout
    while True:
        with httpx.stream("GET", url + "/dashboard/feed", headers=headers, timeout=10) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    yield json.loads(line[6:])
                if time.monotonic() > deadline:
                    raise AssertionError("the router's feed never showed what the test waits for")


def test_the_router_page_has_a_panel_per_replica_and_its_decisions(
    cluster: list[Proc], log_dir: Path
) -> None:
    from playwright.sync_api import sync_playwright

    urls = sorted(p.url for p in cluster[:2])
    with router(urls, "prefix-aware", log_dir) as r:
        page = httpx.get(r.url + "/dashboard", timeout=10)
        assert page.status_code == 200 and 'data-kind="router"' in page.text
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0, timeout=60)
        system = "You answer questions about the weather in one word. " * 8
        for i in range(4):
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}],
                max_tokens=2,
            )  # fmt: skip
        for event in router_events(r.url):
            feeds = {rep["url"]: rep.get("feed") for rep in event["replicas"]}
            if sorted(feeds) == urls and all(f and f.get("engine") for f in feeds.values()):
                break
        assert event["kind"] == "router" and event["policy"] == "prefix-aware"
        assert sum(event["decisions"].values()) == 4  # every request was routed once
        assert set(event["decisions"]) <= {
            "prefix_hit",
            "prefix_miss",
            "prefix_short",
            "prefix_overloaded",
        }
        assert [d["replica"] in urls for d in event["recent"]] == [True] * 4
        # the relayed feeds are the replicas' own: their pools, their served model
        for feed in feeds.values():
            assert feed["kind"] == "server" and feed["model"] == MODEL
            assert feed["engine"]["num_blocks"] > 0
        with sync_playwright() as pw:
            browser = launch(pw)
            tab = browser.new_page(viewport={"width": 1500, "height": 1400})
            tab.goto(r.url + "/dashboard")
            tab.wait_for_function(
                "document.querySelectorAll('.replica .kv-map .cell').length > 0 && "
                "document.querySelectorAll('.replica').length === 2"
            )
            shown = tab.eval_on_selector_all(".replica", "els => els.map(e => e.dataset.replica)")
            assert sorted(shown) == urls
            rows = tab.inner_text(".decision-rows")
            assert "prefix_" in rows
            shot = log_dir / "router-dashboard.png"
            tab.screenshot(path=str(shot), full_page=True)
            print(f"\nrouter dashboard screenshot: {shot}")
            browser.close()


def test_with_api_keys_the_router_page_needs_one(
    cluster: list[Proc], log_dir: Path, tmp_path
) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "sk-dash", "name": "dash"}]}))
    with router([cluster[0].url], "round-robin", log_dir, "--api-keys-file", str(keys)) as r:
        for path in ("/dashboard", "/dashboard/feed"):
            resp = httpx.get(r.url + path, timeout=10)
            assert resp.status_code == 401
            assert resp.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.get(
            r.url + "/dashboard", headers={"Authorization": "Bearer sk-dash"}, timeout=10
        )
        assert ok.status_code == 200
        # in a browser: the key typed into the login box its 401 makes it offer
        assert login_in_a_browser(r.url, "sk-dash") == 200
        event = next(router_events(r.url, {"Authorization": "Bearer sk-dash"}))
        assert event["kind"] == "router"


def test_an_open_router_dashboard_does_not_hold_up_the_drain(log_dir: Path) -> None:
    from servelm.server.dashboard import STREAM_SECONDS

    with router(["http://127.0.0.1:9"], "round-robin", log_dir, wait_healthy=False) as r:
        assert feed_open_through_a_signal(r.url, r.popen.pid) < STREAM_SECONDS / 3
        assert r.popen.wait(STREAM_SECONDS / 2) == 0
