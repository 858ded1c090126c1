"""The Helm chart deploy/helm/servelm, checked offline with the real tools: `helm lint --strict`,
`helm template` at the lowest and highest supported Kubernetes versions (default values and the
GPU + autoscaling + canary example), `kubernetes-validate --strict` on every rendered document,
the KEDA / Prometheus Operator objects against their CRD models and the dashboard against
Grafana's, values.schema.json refusing bad values, and the references between objects.

No API server runs here, so nothing is applied; everything short of that is checked.
"""

from __future__ import annotations

import functools
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "servelm"
EXAMPLE = CHART / "examples" / "gpu-autoscale-canary.yaml"
HELM = ROOT / ".tools" / "bin" / "helm"
KUBE_VERSIONS = ("1.29.0", "1.37.0")  # Chart.yaml kubeVersion >=1.29; 1.37 is the newest schema
CRD_APIS = ("keda.sh/v1alpha1", "monitoring.coreos.com/v1")
VALUES = {"default": None, "gpu-autoscale-canary": EXAMPLE}
# servelm serve, start to first /health 200, default model, 2-core CPU machine (docs/deploy.md)
MEASURED_COLD_START_S = 12.3
RENDERS = [(k, v) for k in KUBE_VERSIONS for v in VALUES]


@functools.cache
def helm() -> str:
    # `make test` installs it; this keeps `pytest tests/deploy` working on its own (idempotent)
    subprocess.run(["bash", str(ROOT / "deploy/tools/install-helm.sh")], check=True)
    return str(HELM)


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm(), *args], capture_output=True, text=True, timeout=120)


@functools.cache
def render(kube: str, values: str | None, apis: tuple[str, ...] = CRD_APIS, *sets: str) -> str:
    args = ["template", "r", str(CHART), "--namespace", "llm", "--kube-version", kube]
    for api in apis:
        args += ["--api-versions", api]
    if values:
        args += ["-f", str(values)]
    for s in sets:
        args += ["--set", s]
    out = run_helm(*args)
    assert out.returncode == 0, out.stderr
    return out.stdout


def docs(kube: str, values: str | None, apis: tuple[str, ...] = CRD_APIS, *sets: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(render(kube, values, apis, *sets)) if d]


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in by_kind(objs, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def values_of(values: str | None) -> dict:
    base = yaml.safe_load((CHART / "values.yaml").read_text())
    if values:
        merge(base, yaml.safe_load(Path(values).read_text()))
    return base


def merge(into: dict, over: dict) -> None:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            merge(into[k], v)
        else:
            into[k] = v


# --- helm lint and template ------------------------------------------------------------------


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("name", list(VALUES))
def test_helm_lint_strict(kube: str, name: str) -> None:
    args = ["lint", "--strict", str(CHART), "--kube-version", kube]
    if VALUES[name]:
        args += ["-f", str(VALUES[name])]
    out = run_helm(*args)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout


@pytest.mark.parametrize(("kube", "name"), RENDERS)
def test_renders_every_object(kube: str, name: str) -> None:
    kinds = sorted(o["kind"] for o in docs(kube, VALUES[name]))
    expected = {
        "default": [
            "ConfigMap",
            "Deployment",
            "Deployment",
            "Job",
            "PersistentVolumeClaim",
            "PodDisruptionBudget",
            "PodDisruptionBudget",
            "PrometheusRule",
            "Secret",
            "Service",
            "Service",
            "ServiceMonitor",
        ],
        # a second engine Deployment, Service and fetch Job for the canary; the ScaledObject
        "gpu-autoscale-canary": [
            "ConfigMap",
            "Deployment",
            "Deployment",
            "Deployment",
            "Job",
            "Job",
            "PersistentVolumeClaim",
            "PodDisruptionBudget",
            "PodDisruptionBudget",
            "PrometheusRule",
            "ScaledObject",
            "Secret",
            "Service",
            "Service",
            "Service",
            "ServiceMonitor",
        ],
    }[name]
    assert kinds == expected


def test_kube_version_below_the_supported_range_is_refused() -> None:
    out = run_helm("template", "r", str(CHART), "--kube-version", "1.28.0")
    assert out.returncode != 0 and "kubeVersion" in out.stderr, out.stderr


# --- schemas -----------------------------------------------------------------------------------

CRD_KINDS = {"ScaledObject", "ServiceMonitor", "PrometheusRule"}


@pytest.mark.parametrize(("kube", "name"), RENDERS)
def test_kubernetes_validate_strict(kube: str, name: str, tmp_path: Path) -> None:
    """Every document through the kubernetes-validate CLI; it only warns (exit 0) for a kind
    it has no schema for, so any warning fails unless it is one of the CRD kinds that
    test_crd_objects_against_their_models validates."""
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(render(kube, VALUES[name]))
    out = subprocess.run(
        [
            str(Path(sys.executable).parent / "kubernetes-validate"),
            "--strict",
            "-k",
            kube,
            str(rendered),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = (out.stdout + out.stderr).splitlines()
    passed = [ln for ln in lines if ln.startswith("INFO") and " passed " in ln]
    others = [ln for ln in lines if ln.strip() and ln not in passed]
    no_schema = re.compile(r"^WARN .* Couldn't find schema for kind (\w+) with api version \S+ ")
    unexplained = [ln for ln in others if not (m := no_schema.match(ln)) or m[1] not in CRD_KINDS]
    assert not unexplained, "\n".join(unexplained)
    core = [o for o in docs(kube, VALUES[name]) if o["kind"] not in CRD_KINDS]
    assert len(passed) == len(core)


def dropped_keys(given: Any, kept: Any, path: str = "") -> list[str]:
    """Keys of `given` that a model round trip lost: fields the model does not know."""
    if isinstance(given, dict) and isinstance(kept, dict):
        out = []
        for k, v in given.items():
            out += [f"{path}/{k}"] if k not in kept else dropped_keys(v, kept[k], f"{path}/{k}")
        return out
    if isinstance(given, list) and isinstance(kept, list):
        if len(given) != len(kept):
            return [f"{path} (items lost)"]
        pairs = enumerate(zip(given, kept, strict=True))
        return [p for i, (a, b) in pairs for p in dropped_keys(a, b, f"{path}[{i}]")]
    return []


def crd_model(doc: dict):
    from cloudcoil.models.keda.v1alpha1 import ScaledObject
    from cloudcoil.models.prometheus_operator.v1 import PrometheusRule, ServiceMonitor

    models = {
        ("keda.sh/v1alpha1", "ScaledObject"): ScaledObject,
        ("monitoring.coreos.com/v1", "ServiceMonitor"): ServiceMonitor,
        ("monitoring.coreos.com/v1", "PrometheusRule"): PrometheusRule,
    }
    return models[(doc["apiVersion"], doc["kind"])]


def check_crd(doc: dict) -> None:
    """The cloudcoil pydantic models ignore unknown fields, so a round trip that loses a key
    is the refusal: the model validates types and required fields, the diff unknown ones."""
    model = crd_model(doc)
    obj = model.model_validate(doc)
    kept = obj.model_dump(by_alias=True, exclude_unset=True, mode="json")
    lost = dropped_keys(doc, kept)
    assert not lost, f"{doc['kind']}: fields unknown to its CRD: {lost}"


@pytest.mark.parametrize(("kube", "name"), RENDERS)
def test_crd_objects_against_their_models(kube: str, name: str) -> None:
    crds = [o for o in docs(kube, VALUES[name]) if o["kind"] in CRD_KINDS]
    assert {o["kind"] for o in crds} == (
        CRD_KINDS if name != "default" else CRD_KINDS - {"ScaledObject"}
    )
    for doc in crds:
        check_crd(doc)


def test_crd_check_refuses_unknown_fields_and_bad_types() -> None:
    so = by_kind(docs(KUBE_VERSIONS[0], str(EXAMPLE)), "ScaledObject")[0]
    check_crd(so)
    misspelt = json.loads(json.dumps(so))
    misspelt["spec"]["cooldownPeriods"] = misspelt["spec"].pop("cooldownPeriod")
    with pytest.raises(AssertionError, match="cooldownPeriods"):
        check_crd(misspelt)
    bad_type = json.loads(json.dumps(so))
    bad_type["spec"]["maxReplicaCount"] = "many"
    with pytest.raises(Exception, match="maxReplicaCount"):
        check_crd(bad_type)


# The SDK's v10 dashboard model lacks `definition`, the query text Grafana's UI keeps on a
# query variable next to `query`; every other key it does not know fails.
GRAFANA_KNOWN_EXTRA = re.compile(r"^/templating/list\[\d+\]/definition$")


def test_dashboard_configmap_holds_a_grafana_dashboard() -> None:
    from grafana_foundation_sdk.cog import plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    plugins.register_default_plugins()
    cm = one(docs(KUBE_VERSIONS[-1], None), "ConfigMap", "r-servelm-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's label
    raw = json.loads(cm["data"]["servelm.json"])
    assert raw == json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    kept = json.loads(json.dumps(Dashboard.from_json(raw).to_json(), default=lambda o: o.to_json()))
    lost = [p for p in dropped_keys(raw, kept) if not GRAFANA_KNOWN_EXTRA.match(p)]
    assert not lost, f"dashboard fields unknown to Grafana's model: {lost}"
    assert raw["panels"], "no panels"


BAD_VALUES = [
    ({"model": {"revision": "main"}}, "does not match pattern"),  # a branch, not a commit
    ({"engine": {"replicas": -1}}, "minimum"),
    ({"engine": {"replica": 2}}, "additional properties 'replica' not allowed"),
    ({"canary": {"enabled": True}}, "revision"),  # a canary needs its own commit
    (
        {"canary": {"enabled": True, "weightPercent": 100, "model": {"revision": "a" * 40}}},
        "maximum",
    ),
    ({"alerts": {"kvUsageThreshold": 95}}, "maximum"),  # a fraction, not a percentage
    ({"engine": {"terminationGraceExtraSeconds": 0}}, "minimum"),
    ({"model": {"loadTimeBudgetSeconds": 0}}, "minimum"),
    ({"router": {"policy": "random"}}, "must be one of"),
    # more than one pod on a ReadWriteOnce volume
    ({"engine": {"replicas": 3}, "storage": {"accessMode": "ReadWriteOnce"}}, "/engine/replicas"),
    (
        {
            "canary": {"enabled": True, "model": {"revision": "a" * 40}},
            "storage": {"accessMode": "ReadWriteOnce"},
        },
        "/canary/enabled",
    ),
    (
        {"autoscaling": {"enabled": True}, "storage": {"accessMode": "ReadWriteOnce"}},
        "/autoscaling",
    ),
    # scale to zero without the router that would see the demand
    (
        {"autoscaling": {"enabled": True, "minReplicas": 0}, "router": {"enabled": False}},
        "/router/enabled",
    ),
]


@pytest.mark.parametrize(("bad", "message"), BAD_VALUES)
def test_bad_values_are_refused(bad: dict, message: str, tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(bad))
    for cmd in ("lint", "template"):
        args = [cmd, str(CHART), "-f", str(f)]
        if cmd == "lint":
            args.insert(1, "--strict")
        else:
            args += ["--api-versions", CRD_APIS[0]]
        out = run_helm(*args)
        assert out.returncode != 0, f"helm {cmd} accepted {bad}"
        assert message in out.stdout + out.stderr, out.stdout + out.stderr


# --- references between objects --------------------------------------------------------------


def pod_spec(o: dict) -> dict:
    return o["spec"]["template"]["spec"]


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize(("kube", "name"), RENDERS)
def test_services_select_pods_with_the_named_port(kube: str, name: str) -> None:
    objs = docs(kube, VALUES[name])
    workloads = by_kind(objs, "Deployment")
    for svc in by_kind(objs, "Service"):
        sel = svc["spec"]["selector"]
        hits = [d for d in workloads if matches(sel, d["spec"]["template"]["metadata"]["labels"])]
        assert len(hits) == 1, f"Service {svc['metadata']['name']} selects {len(hits)} Deployments"
        ports = {
            p["name"]: p["containerPort"]
            for c in pod_spec(hits[0])["containers"]
            for p in c["ports"]
        }
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports and ports[p["targetPort"]] == p["port"]
    for d in workloads:  # a Deployment's own selector picks its own pods
        assert matches(
            d["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"]
        )
        for c in pod_spec(d)["containers"]:
            named = {p["name"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:
                    assert c[probe]["httpGet"]["port"] in named
    for pdb in by_kind(objs, "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert any(matches(sel, d["spec"]["template"]["metadata"]["labels"]) for d in workloads)
    for sm in by_kind(objs, "ServiceMonitor"):  # scrapes the engine and router Services
        sel = sm["spec"]["selector"]["matchLabels"]
        scraped = {
            s["metadata"]["name"]
            for s in by_kind(objs, "Service")
            if matches(sel, s["metadata"]["labels"])
        }
        assert scraped == {s["metadata"]["name"] for s in by_kind(objs, "Service")}
        assert {e["port"] for e in sm["spec"]["endpoints"]} == {"http"}


@pytest.mark.parametrize(("kube", "name"), RENDERS)
def test_router_sends_to_every_engine_service(kube: str, name: str) -> None:
    objs = docs(kube, VALUES[name])
    router = one(objs, "Deployment", "r-servelm-router")
    args = pod_spec(router)["containers"][0]["args"]
    engines = [
        s
        for s in by_kind(objs, "Service")
        if s["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"
    ]
    urls = {f"http://{s['metadata']['name']}:{s['spec']['ports'][0]['port']}" for s in engines}
    assert {a.split("=", 1)[1] for a in args if a.startswith("--replica=")} == urls
    weights = {
        a.split("=", 1)[1].rsplit("=", 1)[0]: float(a.rsplit("=", 1)[1])
        for a in args
        if a.startswith("--weight=")
    }
    v = values_of(VALUES[name])
    if v["canary"]["enabled"]:
        assert weights == {
            "http://r-servelm-engine:8000": 100 - v["canary"]["weightPercent"],
            "http://r-servelm-engine-canary:8000": v["canary"]["weightPercent"],
        }
    else:
        assert weights == {}


@pytest.mark.parametrize(("kube", "name"), RENDERS)
def test_fetch_job_and_engines_share_the_claim_and_model_folder(kube: str, name: str) -> None:
    objs = docs(kube, VALUES[name])
    claim = by_kind(objs, "PersistentVolumeClaim")[0]["metadata"]["name"]
    fetched = set()
    for job in by_kind(objs, "Job"):
        spec = pod_spec(job)
        assert {
            v["persistentVolumeClaim"]["claimName"]
            for v in spec["volumes"]
            if "persistentVolumeClaim" in v
        } == {claim}
        c = spec["containers"][0]
        assert c["command"] == ["servelm", "fetch"]
        repo, rev, store = c["args"][0], c["args"][1].split("=")[1], c["args"][2].split("=")[1]
        assert re.fullmatch(r"[0-9a-f]{40}", rev) and store == f"/models/{rev}"
        fetched.add(f"{store}/{repo.replace('/', '--')}")
        env = {e["name"]: e for e in c["env"]}
        assert env["HF_HUB_OFFLINE"]["value"] == "0"
        if "HF_TOKEN" in env:
            assert "secretKeyRef" in env["HF_TOKEN"]["valueFrom"]
    served = set()
    for d in by_kind(objs, "Deployment"):
        if d["metadata"]["labels"]["app.kubernetes.io/component"] != "engine":
            continue
        spec = pod_spec(d)
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["models"]["persistentVolumeClaim"]["claimName"] == claim
        init = spec["initContainers"][0]
        model_dir = {e["name"]: e["value"] for e in init["env"]}["MODEL_DIR"]
        assert 'servelm fetch --verify "$MODEL_DIR"' in init["command"][-1]
        engine = spec["containers"][0]
        assert engine["args"][0] == model_dir  # serves the folder the init container verified
        served.add(model_dir)
    assert served == fetched


@pytest.mark.parametrize(("kube", "name"), RENDERS)
def test_claim_is_read_write_many_whenever_several_pods_can_run(kube: str, name: str) -> None:
    objs = docs(kube, VALUES[name])
    pvc = by_kind(objs, "PersistentVolumeClaim")[0]
    v = values_of(VALUES[name])
    engines = [
        d
        for d in by_kind(objs, "Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"
    ]
    most = sum(
        d["spec"].get("replicas", v["autoscaling"]["maxReplicas"]) for d in engines
    )  # no replicas field: the autoscaler owns it, up to maxReplicas
    many = most > 1
    assert pvc["spec"]["accessModes"] == (["ReadWriteMany"] if many else ["ReadWriteOnce"])
    if not many:  # a surge pod could not mount a ReadWriteOnce volume on another node
        assert all(d["spec"]["strategy"]["type"] == "Recreate" for d in engines)


@pytest.mark.parametrize(
    "sets",
    [
        ("engine.replicas=2",),
        ("autoscaling.enabled=true",),
        ("canary.enabled=true", f"canary.model.revision={'b' * 40}"),
    ],
)
def test_claim_turns_read_write_many_for_more_pods(sets: tuple[str, ...]) -> None:
    objs = docs(KUBE_VERSIONS[-1], None, CRD_APIS, *sets)
    assert by_kind(objs, "PersistentVolumeClaim")[0]["spec"]["accessModes"] == ["ReadWriteMany"]


def engine_container(d: dict) -> dict:
    return next(c for c in pod_spec(d)["containers"] if c["name"] == "engine")


@pytest.mark.parametrize(("kube", "name"), RENDERS)
def test_probe_windows_and_shutdown(kube: str, name: str) -> None:
    objs = docs(kube, VALUES[name])
    v = values_of(VALUES[name])
    assert v["model"]["loadTimeBudgetSeconds"] >= 2 * MEASURED_COLD_START_S
    for d in by_kind(objs, "Deployment"):
        if d["metadata"]["labels"]["app.kubernetes.io/component"] != "engine":
            continue
        c = engine_container(d)
        canary = d["metadata"]["labels"]["servelm.dev/track"] == "canary"
        budget = (v["canary"]["model"]["loadTimeBudgetSeconds"] if canary else 0) or v["model"][
            "loadTimeBudgetSeconds"
        ]
        s, live = c["startupProbe"], c["livenessProbe"]
        assert s["httpGet"]["path"] == "/health"
        assert s["failureThreshold"] * s["periodSeconds"] >= 2 * budget
        assert (
            s["failureThreshold"] * s["periodSeconds"] < 2 * budget + s["periodSeconds"]
        )  # derived, not padded
        assert live["failureThreshold"] * live["periodSeconds"] >= 30
        assert live.get("initialDelaySeconds", 0) <= 10  # the startup probe covers the load
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        shutdown = [a for a in c["args"] if a.startswith("--shutdown-timeout=")]
        assert len(shutdown) == 1
        assert pod_spec(d)["terminationGracePeriodSeconds"] > float(shutdown[0].split("=")[1])
        shm = next(x for x in pod_spec(d)["volumes"] if x["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        # the API key comes from a Secret the chart renders or the user names
        env = {e["name"]: e for e in c["env"]}
        ref = env["SERVELM_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] in {s["metadata"]["name"] for s in by_kind(objs, "Secret")} | {
            v["apiKey"]["existingSecret"]
        }
        assert ref["key"] == v["apiKey"]["secretKey"]
        assert env["HF_HUB_OFFLINE"]["value"] == "1"
    router = one(objs, "Deployment", "r-servelm-router")
    env = {e["name"]: e for e in pod_spec(router)["containers"][0]["env"]}
    assert env["SERVELM_UPSTREAM_API_KEY"]["valueFrom"]["secretKeyRef"] == ref
    assert router["spec"]["replicas"] >= 1


def test_gpu_values_request_gpus_on_gpu_nodes() -> None:
    objs = docs(KUBE_VERSIONS[-1], str(EXAMPLE))
    v = values_of(str(EXAMPLE))
    for name in ("r-servelm-engine", "r-servelm-engine-canary"):
        d = one(objs, "Deployment", name)
        c = engine_container(d)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == v["engine"]["gpus"] >= 1
        assert "--device=cuda" in c["args"]
        spec = pod_spec(d)
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
        assert spec["nodeSelector"] == v["engine"]["nodeSelector"] != {}
    # the default values ask for no GPU
    default = engine_container(one(docs(KUBE_VERSIONS[-1], None), "Deployment", "r-servelm-engine"))
    assert "nvidia.com/gpu" not in default["resources"].get("limits", {})


def test_scaled_object_targets_the_engine_with_servelm_metrics() -> None:
    objs = docs(KUBE_VERSIONS[-1], str(EXAMPLE))
    so = by_kind(objs, "ScaledObject")[0]
    target = so["spec"]["scaleTargetRef"]
    d = one(objs, target["kind"], target["name"])
    assert d["metadata"]["labels"]["servelm.dev/track"] == "stable"
    assert "replicas" not in d["spec"]  # the autoscaler owns it
    v = values_of(str(EXAMPLE))["autoscaling"]
    assert so["spec"]["minReplicaCount"] == v["minReplicas"] == 0
    assert so["spec"]["cooldownPeriod"] == v["keda"]["cooldownPeriod"]
    assert so["spec"]["pollingInterval"] == v["keda"]["pollingInterval"]
    queries = {t["name"]: t["metadata"] for t in so["spec"]["triggers"]}
    engine_svc = one(objs, "Service", target["name"])["metadata"]["name"]
    assert (
        queries["engine-queue"]["query"]
        == f'sum(servelm:num_requests_waiting{{namespace="llm",job="{engine_svc}"}})'
    )
    assert queries["engine-queue"]["threshold"] == str(v["keda"]["waitingThreshold"])
    # at zero engine pods only the router sees demand: its open requests and its refusals
    q = queries["router-demand"]["query"]
    assert (
        'servelm_router:replica_in_flight{namespace="llm",job="r-servelm-router",replica="http://r-servelm-engine:8000"}'
        in q
    )
    assert (
        'servelm_router:requests_total{namespace="llm",job="r-servelm-router",replica="none"}' in q
    )
    from servelm.router.metrics import RouterMetrics
    from servelm.server.metrics import ServerMetrics

    router_text = RouterMetrics().render([]).decode()
    assert (
        "servelm_router:requests_total{" in router_text
        and "# TYPE servelm_router:replica_in_flight gauge" in router_text
    )
    engine_text = ServerMetrics("m", 16, 8).render().decode()
    assert "servelm:num_requests_waiting{" in engine_text


def test_hpa_where_keda_is_absent() -> None:
    objs = docs(KUBE_VERSIONS[0], str(EXAMPLE), ("monitoring.coreos.com/v1",))
    assert not by_kind(objs, "ScaledObject")
    hpa = by_kind(objs, "HorizontalPodAutoscaler")[0]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert one(objs, "Deployment", hpa["spec"]["scaleTargetRef"]["name"])
    assert hpa["spec"]["minReplicas"] == 1  # an HPA cannot scale to zero
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "servelm_num_requests_waiting"


def test_without_prometheus_operator_no_monitoring_objects() -> None:
    objs = docs(KUBE_VERSIONS[0], None, ())
    assert not {"ServiceMonitor", "PrometheusRule", "ScaledObject"} & {o["kind"] for o in objs}


def test_startup_window_follows_the_budget() -> None:
    for budget, expect in ((30, 12), (31, 13), (600, 240)):
        d = one(
            docs(KUBE_VERSIONS[-1], None, CRD_APIS, f"model.loadTimeBudgetSeconds={budget}"),
            "Deployment",
            "r-servelm-engine",
        )
        s = engine_container(d)["startupProbe"]
        assert (s["failureThreshold"], s["periodSeconds"]) == (expect, 5)
        assert math.ceil(2 * budget / 5) == expect
