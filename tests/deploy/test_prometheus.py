"""A real Prometheus (Debian's 2.42, unpacked by deploy/tools/install-prometheus.sh) scrapes a
real `servelm serve` on the default model and a `servelm route` in front of it, under a little
load; every PromQL expression the chart ships must return data from it (issue #31):

- every target of files/grafana-dashboard.json, Grafana's variables filled in;
- every alert of the chart's rendered PrometheusRule (`promtool check rules` on it too), with the
  thresholds set to 0 so each condition holds under the load; the engine-down alert is empty
  while the engine is up and fires once it is stopped;
- every trigger query of the chart's rendered KEDA ScaledObject.

Each scrape job is labelled as the Prometheus Operator labels a ServiceMonitor's targets
(job and service = the Service's name, namespace, pod), so the chart's selectors are checked as
written. A misspelt metric returns nothing, and `assert_data` is shown to refuse it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from servelm.bench.ready import wait_healthy
from tests.live_server import LiveServer, free_port

# In the fast suite, as issue #31 wants it in `make test`: about 30 s on a 2-core machine.

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/helm/servelm"
HELM = ROOT / ".tools/bin/helm"
PROMETHEUS = ROOT / ".tools/prometheus/usr/bin/prometheus"
PROMTOOL = ROOT / ".tools/prometheus/usr/bin/promtool"
RELEASE, NAMESPACE = "rel", "servelm-test"
# Scrapes every 2 s (a scrape times out at its interval, and /metrics of a busy engine on a
# small shared machine can take over 1 s); rate() windows hold 15 of them, as Grafana's
# $__rate_interval (at least 4 scrape intervals) would on a dashboard zoomed in.
SCRAPE_INTERVAL, RATE_INTERVAL = "2s", "30s"
OPERATOR_APIS = ["--api-versions", "monitoring.coreos.com/v1", "--api-versions", "keda.sh/v1alpha1"]


def helm_template(*args: str) -> list[dict]:
    assert HELM.exists(), f"{HELM} missing: `make test` installs it"
    out = subprocess.run(
        [str(HELM), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def one(docs: list[dict], kind: str, component: str | None = None) -> dict:
    found = [
        d
        for d in docs
        if d["kind"] == kind
        and (
            component is None
            or d["metadata"]["labels"].get("app.kubernetes.io/component") == component
        )
        and d["metadata"]["labels"].get("servelm.dev/track", "stable") == "stable"
    ]
    assert len(found) == 1, (kind, component, [d["metadata"]["name"] for d in found])
    return found[0]


def dashboard_exprs(model_name: str) -> list[str]:
    dashboard = json.loads((CHART / "files/grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20, exprs
    return [
        e.replace("$model_name", model_name).replace("$__rate_interval", RATE_INTERVAL)
        for e in exprs
    ]


class Prometheus:
    def __init__(self, tmp: Path, jobs: dict[str, str]) -> None:
        """`jobs`: Service name -> host:port, one scrape job each, labelled as the Prometheus
        Operator labels a ServiceMonitor's targets."""
        assert PROMETHEUS.exists(), f"{PROMETHEUS} missing: `make test` installs it"
        config = {
            "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": "1s"},
            "scrape_configs": [
                {
                    "job_name": service,
                    "static_configs": [
                        {
                            "targets": [address],
                            "labels": {
                                "namespace": NAMESPACE,
                                "service": service,
                                "pod": f"{service}-0",
                                "endpoint": "http",
                            },
                        }
                    ],
                }
                for service, address in jobs.items()
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(tmp / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [
                str(PROMETHEUS),
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
                "--web.console.templates=/nonexistent",  # (the package's defaults are not here)
                "--web.console.libraries=/nonexistent",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_healthy(self.url + "/-/ready", self.proc, 30, 0.2, lambda: self.log_text())
        self.client = httpx.Client(base_url=self.url, timeout=10)

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def query(self, expr: str) -> list[dict]:
        r = self.client.get("/api/v1/query", params={"query": expr})
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def assert_data(self, expr: str) -> list[dict]:
        result = self.query(expr)
        assert result, f"no data for {expr}; targets: {self.targets()}"
        return result

    def targets(self) -> list[tuple]:
        """Each target's job, health and last scrape error: what a failure message wants."""
        active = self.client.get("/api/v1/targets").json()["data"]["activeTargets"]
        return [(t["labels"]["job"], t["health"], t["lastError"]) for t in active]

    def value(self, expr: str) -> float:
        (sample,) = self.assert_data(expr)
        return float(sample["value"][1])

    def wait_for(self, expr: str, timeout: float = 20) -> list[dict]:
        deadline = time.monotonic() + timeout
        while not (result := self.query(expr)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert result, f"no data for {expr} within {timeout} s; targets: {self.targets()}"
        return result

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


class Load:
    """Steady traffic while the tests query: streaming and plain completions sharing a long
    prefix (prefix-cache hits) from more clients than the engine admits (waiting requests, 503s
    for the rest), bad requests (400, 404), and a rate-limited key through the router (429)."""

    def __init__(self, engine: LiveServer, router_url: str, model: str) -> None:
        self.stop_event = threading.Event()
        self.errors: list[BaseException] = []
        self.engine = openai.OpenAI(
            base_url=engine.base_url, api_key="x", max_retries=0, timeout=60
        )
        self.model, self.engine_url, self.router_url = model, engine.base_url, router_url
        self.threads = [
            threading.Thread(target=self._guard, args=(self._stream, i)) for i in range(6)
        ]
        self.threads.append(threading.Thread(target=self._guard, args=(self._misc, 0)))
        for t in self.threads:
            t.start()

    def _guard(self, fn, i: int) -> None:
        try:
            fn(i)
        except BaseException as exc:  # surfaced by stop()
            self.errors.append(exc)

    def _stream(self, i: int) -> None:
        system = "You are a terse assistant for a monitoring test. " * 12  # shared prefix
        n = 0
        while not self.stop_event.is_set():
            n += 1
            try:
                if (i + n) % 2:
                    stream = self.engine.chat.completions.create(
                        model=self.model,
                        messages=[
                            {"role": "system", "content": system},
                            {"role": "user", "content": f"Count to {n + i}."},
                        ],
                        max_tokens=12,
                        stream=True,
                    )
                    for _ in stream:
                        pass
                else:
                    self.engine.completions.create(
                        model=self.model, prompt=system + f"Item {n}:", max_tokens=8
                    )
            except openai.APIStatusError as exc:  # the queue is full: back off a little
                assert exc.status_code == 503, exc
                time.sleep(0.3)

    def _misc(self, _: int) -> None:
        with httpx.Client(timeout=60) as c:
            while not self.stop_event.is_set():
                bad = c.post(
                    self.engine_url + "/completions", json={"model": self.model, "prompt": 5}
                )
                missing = c.post(
                    self.engine_url + "/completions", json={"model": "nope", "prompt": "x"}
                )
                assert (bad.status_code, missing.status_code) == (400, 404)
                limited = c.post(
                    self.router_url + "/v1/completions",
                    json={"model": self.model, "prompt": "Hi", "max_tokens": 2},
                    headers={"Authorization": "Bearer sk-limited"},
                )
                assert limited.status_code in (200, 429, 503), limited.text
                self.stop_event.wait(0.5)

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(120)
        assert not self.errors, self.errors


@pytest.fixture(scope="module")
def stack(default_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prometheus")
    docs = helm_template(*OPERATOR_APIS)
    engine_service = one(docs, "Service", "engine")["metadata"]["name"]
    router_service = one(docs, "Service", "router")["metadata"]["name"]
    model = default_model_dir.name  # the chart's default served model name, too
    # 2 in the batch, 2 more admitted to wait, the rest 503: waiting and 503s at a small load
    engine = LiveServer(
        default_model_dir, "--max-num-seqs", "2", "--max-queued-requests", "2", startup_timeout=180
    )
    keys = tmp / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "sk-limited", "name": "limited", "rpm": 2}]}))
    router_port = free_port()
    router_log = open(tmp / "router.log", "wb")
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "servelm.cli",
            "route",
            "--replica",
            engine.url,
            "--port",
            str(router_port),
            "--api-keys-file",
            str(keys),
        ],
        stdout=router_log,
        stderr=subprocess.STDOUT,
    )
    router_url = f"http://127.0.0.1:{router_port}"
    prometheus = load = None
    try:
        wait_healthy(router_url + "/health", router, 30)
        prometheus = Prometheus(
            tmp,
            {
                engine_service: f"127.0.0.1:{engine.port}",
                router_service: f"127.0.0.1:{router_port}",
            },
        )
        load = Load(engine, router_url, model)
        # rate() over RATE_INTERVAL wants several scrapes of the load, error series included
        prometheus.wait_for('servelm:http_requests_total{status="503"}')
        prometheus.wait_for("servelm_router:rate_limit_rejections_total")
        time.sleep(6)
        yield {
            "prometheus": prometheus,
            "engine": engine,
            "engine_url": engine.url,
            "model": model,
            "load": load,
            "tmp": tmp,
        }
    finally:
        if load is not None:
            load.stop_event.set()
        if prometheus is not None:
            prometheus.stop()
        router.terminate()
        router.wait(30)
        router_log.close()
        engine.stop()


def test_dashboard_queries_return_data(stack):
    prometheus = stack["prometheus"]
    empty = [expr for expr in dashboard_exprs(stack["model"]) if not prometheus.query(expr)]
    assert not empty, (empty, prometheus.targets())
    # the load did what the panels are meant to show, not only series at zero
    model = stack["model"]
    for status in ("400", "404", "503"):
        assert prometheus.value(f'sum(servelm:http_requests_total{{status="{status}"}})') > 0
    assert prometheus.value("sum(servelm_router:rate_limit_rejections_total)") > 0
    assert prometheus.value(f'sum(servelm:prefix_cache_hits_total{{model_name="{model}"}})') > 0
    assert prometheus.value("sum(servelm:request_time_per_output_token_seconds_count)") > 0


def test_a_misspelt_metric_returns_nothing(stack):
    prometheus = stack["prometheus"]
    expr = next(e for e in dashboard_exprs(stack["model"]) if "servelm:num_requests_waiting" in e)
    misspelt = expr.replace("servelm:num_requests_waiting", "servelm:num_request_waiting")
    assert prometheus.query(misspelt) == []
    with pytest.raises(AssertionError, match="no data"):
        prometheus.assert_data(misspelt)
    # and a wrong label value is as empty as a wrong name
    assert prometheus.query(expr.replace(stack["model"], "no-such-model")) == []


def rules(*args: str) -> dict:
    rule = one(
        helm_template(*OPERATOR_APIS, "--show-only", "templates/prometheusrule.yaml", *args),
        "PrometheusRule",
    )
    return {"groups": rule["spec"]["groups"]}


def test_promtool_checks_the_rendered_rules(tmp_path):
    for name, args in {
        "default": (),
        "scale-to-zero": (
            "--set",
            "autoscaling.enabled=true",
            "--set",
            "autoscaling.minReplicas=0",
        ),
    }.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(rules(*args)))
        out = subprocess.run(
            [str(PROMTOOL), "check", "rules", str(path)], capture_output=True, text=True
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "SUCCESS: 4 rules found" in out.stdout, out.stdout


def test_scaled_object_queries_return_data(stack):
    docs = helm_template(
        *OPERATOR_APIS,
        "--set",
        "autoscaling.enabled=true",
        "--show-only",
        "templates/autoscaling.yaml",
    )
    scaled = one(docs, "ScaledObject")
    queries = [t["metadata"]["query"] for t in scaled["spec"]["triggers"]]
    assert len(queries) == 2, queries  # the engine's queue and the router's demand
    engine_service = one(helm_template(), "Service", "engine")["metadata"]["name"]
    for query in queries:
        # The router labels a replica with the URL it was given: in the cluster the engine
        # Service's, here the loopback address the test router was pointed at.
        chart_url = f"http://{engine_service}:8000"
        if chart_url in query:
            assert query.count(chart_url) == 1, query
            query = query.replace(chart_url, stack["engine_url"])
        stack["prometheus"].assert_data(query)


def test_alert_rules_fire_under_load_and_engine_down_when_stopped(stack):
    prometheus = stack["prometheus"]
    zero = (
        "--set-json",  # (--set would pass 1e-9 as a string, which the schema refuses)
        "alerts.ttftP95SloSeconds=1e-9",
        "--set-json",
        "alerts.kvUsageThreshold=1e-9",
        "--set",
        "alerts.waitingThreshold=0",
    )
    alerts = {r["alert"]: r["expr"] for g in rules(*zero)["groups"] for r in g["rules"]}
    assert set(alerts) == {
        "ServelmEngineDown",
        "ServelmKVCacheFull",
        "ServelmTTFTOverSLO",
        "ServelmRequestsWaiting",
    }
    for name, expr in alerts.items():
        if name != "ServelmEngineDown":  # gauges under load: wait for a scrape that caught it
            prometheus.wait_for(expr, timeout=15)
    down = alerts["ServelmEngineDown"]
    assert prometheus.query(down) == [], "the engine is up"
    stack["load"].stop()
    stack["engine"].stop()
    (sample,) = prometheus.wait_for(down, timeout=15)
    assert sample["metric"]["job"] == one(helm_template(), "Service", "engine")["metadata"]["name"]
