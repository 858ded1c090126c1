"""The Grafana dashboard the chart ships (files/grafana-dashboard.json): the panels issue #31 asks
for, on the data source chosen in the `datasource` variable, filtered by `model_name`. Whether
each expression returns data is tests/deploy/test_prometheus.py's job; Grafana's model, the
chart test's."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/helm/servelm/files/grafana-dashboard.json"


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def exprs_of(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_variables_and_data_source():
    d = load()
    assert d["schemaVersion"] >= 39
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    model = variables["model_name"]
    assert model["datasource"]["uid"] == "${datasource}"
    assert "label_values(servelm:" in model["query"]["query"]
    for panel in d["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            # every engine series is filtered by the model; the router's have no model label
            if "servelm:" in target["expr"]:
                assert target["expr"].count("servelm:") == target["expr"].count(
                    'model_name=~"$model_name"'
                ), target["expr"]


def test_the_panels_the_issue_asks_for():
    exprs = exprs_of(load())

    def has(pattern: str) -> bool:
        return any(re.search(pattern, e) for e in exprs)

    for histogram in (
        "time_to_first_token_seconds",
        "request_time_per_output_token_seconds",  # TPOT
        "inter_token_latency_seconds",
    ):
        for q in ("0.5", "0.95", "0.99"):
            assert has(rf"histogram_quantile\({q}, .*servelm:{histogram}_bucket"), (histogram, q)
    for pattern in (
        r"rate\(servelm:prompt_tokens_total",  # tokens/s in
        r"rate\(servelm:generation_tokens_total",  # and out
        r"servelm:num_requests_running",
        r"servelm:num_requests_waiting",
        r"servelm:kv_cache_usage_perc",
        r"prefix_cache_hits_total.*/.*prefix_cache_queries_total",
        r"rate\(servelm:num_preemptions_total",
        r'http_requests_total\{[^}]*status=~"4\.\."',
        r'http_requests_total\{[^}]*status=~"5\.\."',
        r'http_requests_total\{[^}]*status="503"',
        r"servelm_router:rate_limit_rejections_total",  # 429s: only the router limits rates
    ):
        assert has(pattern), pattern


def test_layout_ids_unique_and_panels_do_not_overlap():
    panels = load()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]  # Grafana's grid is 24 columns wide
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, p["title"]
        cells |= mine
