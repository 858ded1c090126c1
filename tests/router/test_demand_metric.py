"""The router's scale-from-zero signal: refusals for want of a replica, counted from 0."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.live_server import free_port
from tests.router.conftest import router, scrape

REFUSED = 'servelm_router:requests_total{replica="none",status="503"}'


def test_refusals_without_replicas_are_counted_from_zero(tmp_path: Path) -> None:
    # an engine Service with no ready pods: the port answers nothing
    dead = f"http://127.0.0.1:{free_port()}"
    with router([dead], "least-loaded", tmp_path, wait_healthy=False) as proc:
        text = httpx.get(proc.url + "/metrics", timeout=5).text
        assert REFUSED + " 0.0" in text.splitlines()  # present before any request
        for _ in range(2):
            resp = httpx.post(
                proc.url + "/v1/completions",
                json={"model": "m", "prompt": "hi", "max_tokens": 1},
                timeout=10,
            )
            assert resp.status_code == 503
            assert resp.json()["error"]["code"] == "no_replica"
        assert scrape(proc.url, "servelm_router:requests_total") == 2.0
        # the gauge the ScaledObject adds to it is there too, at 0
        assert scrape(proc.url, "servelm_router:replica_in_flight") == 0.0
        assert f'servelm_router:replica_in_flight{{replica="{dead}"}} 0.0' in (
            httpx.get(proc.url + "/metrics", timeout=5).text.splitlines()
        )
