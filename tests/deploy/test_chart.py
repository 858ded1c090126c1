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
# servelm serve, start to first /health 200, default model, 2-core CPU machine (docs/deploy.md),
# with the C kernels already built
MEASURED_COLD_START_S = 12.3
# a pod's first start, which also compiles the C kernels (152.6 s of it), on that machine while
# other work shared its cores (docs/deploy.md)
MEASURED_FIRST_START_S = 173
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
        # one engine pod on a ReadWriteOnce claim: it fetches the weights itself, no Job
        "default": [
            "ConfigMap",
            "Deployment",
            "Deployment",
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


def engines(objs: list[dict]) -> list[dict]:
    return [
        d
        for d in by_kind(objs, "Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"
    ]


def fetched_folder(c: dict) -> Path:
    """The folder a `servelm fetch` container writes, through servelm's own parser and layout."""
    from servelm.cli import build_parser
    from servelm.store.hub import snapshot_folder

    assert c["command"] == ["servelm", "fetch"]
    args = build_parser(["fetch", *c["args"]]).parse_args(["fetch", *c["args"]])
    assert re.fullmatch(r"[0-9a-f]{40}", args.revision) and args.store == Path(
        f"/models/{args.revision}"
    )
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_HUB_OFFLINE"]["value"] == "0"
    if "HF_TOKEN" in env:
        assert "secretKeyRef" in env["HF_TOKEN"]["valueFrom"]
    assert {"name": "models", "mountPath": "/models"} in c["volumeMounts"]  # read-write
    return snapshot_folder(args.store, args.model)


SHAPES = [
    (),  # one engine pod, ReadWriteOnce: it fetches in an init container
    ("storage.accessMode=ReadWriteOncePod",),
    ("storage.existingClaim=mine",),
    ("storage.accessMode=ReadWriteMany",),  # one pod, but a Job fetches
    ("engine.replicas=3",),
    ("canary.enabled=true", f"canary.model.revision={'b' * 40}"),
]


@pytest.mark.parametrize(("kube", "name"), RENDERS)
def test_fetch_and_engines_share_the_claim_and_model_folder(kube: str, name: str) -> None:
    check_fetch_and_engines(docs(kube, VALUES[name]))


@pytest.mark.parametrize("sets", SHAPES)
def test_fetch_and_engines_share_the_claim_in_every_shape(sets: tuple[str, ...]) -> None:
    check_fetch_and_engines(docs(KUBE_VERSIONS[-1], None, CRD_APIS, *sets))


def check_fetch_and_engines(objs: list[dict]) -> None:
    pvcs = by_kind(objs, "PersistentVolumeClaim")
    claim = pvcs[0]["metadata"]["name"] if pvcs else "mine"
    fetched = set()
    for job in by_kind(objs, "Job"):
        spec = pod_spec(job)
        assert {
            v["persistentVolumeClaim"]["claimName"]
            for v in spec["volumes"]
            if "persistentVolumeClaim" in v
        } == {claim}
        fetched.add(fetched_folder(spec["containers"][0]))
    served = set()
    for d in engines(objs):
        spec = pod_spec(d)
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["models"]["persistentVolumeClaim"]["claimName"] == claim
        init = spec["initContainers"][0]
        if by_kind(objs, "Job"):  # waits for the Job: complete once it matches its manifest
            model_dir = Path({e["name"]: e["value"] for e in init["env"]}["MODEL_DIR"])
            assert 'servelm fetch --verify "$MODEL_DIR"' in init["command"][-1]
            assert vols["models"]["persistentVolumeClaim"]["readOnly"] is True
        else:  # the claim's one pod fetches itself
            model_dir = fetched_folder(init)
            fetched.add(model_dir)
            assert vols["models"]["persistentVolumeClaim"]["readOnly"] is False
        engine = spec["containers"][0]
        assert engine["args"][0] == str(model_dir)  # serves the folder fetched and verified
        mount = next(m for m in engine["volumeMounts"] if m["name"] == "models")
        assert mount["readOnly"] is True  # the server only reads
        served.add(model_dir)
    assert served == fetched


def claim_access_mode(objs: list[dict], sets: tuple[str, ...]) -> str:
    pvcs = by_kind(objs, "PersistentVolumeClaim")
    if pvcs:
        return pvcs[0]["spec"]["accessModes"][0]
    given = dict(s.split("=", 1) for s in sets).get("storage.accessMode")
    return given or "ReadWriteOnce"


@pytest.mark.parametrize("sets", SHAPES)
def test_a_read_write_once_claim_has_one_pod(sets: tuple[str, ...]) -> None:
    """A ReadWriteOnce(Pod) claim attaches to one node (one pod): a fetch Job's pod and the
    engine pod, which nothing puts on one node, would wait on each other (Multi-Attach) while
    the engine's init container waited for the Job. Only one pod template may mount it, and
    updates replace its pod rather than surge a second."""
    objs = docs(KUBE_VERSIONS[-1], None, CRD_APIS, *sets)
    mode = claim_access_mode(objs, sets)
    mounting = [
        o
        for o in by_kind(objs, "Job") + by_kind(objs, "Deployment")
        if any("persistentVolumeClaim" in v for v in pod_spec(o).get("volumes", []))
    ]
    if mode == "ReadWriteMany":
        assert by_kind(objs, "Job")  # one fetch for many readers
        return
    assert [o["kind"] for o in mounting] == ["Deployment"]
    assert mounting[0]["spec"]["replicas"] == 1
    assert mounting[0]["spec"]["strategy"]["type"] == "Recreate"


@pytest.mark.parametrize(("kube", "name"), RENDERS)
def test_claim_is_read_write_many_whenever_several_pods_can_run(kube: str, name: str) -> None:
    objs = docs(kube, VALUES[name])
    pvc = by_kind(objs, "PersistentVolumeClaim")[0]
    v = values_of(VALUES[name])
    most = sum(
        d["spec"].get("replicas", v["autoscaling"]["maxReplicas"]) for d in engines(objs)
    )  # no replicas field: the autoscaler owns it, up to maxReplicas
    many = most > 1
    assert pvc["spec"]["accessModes"] == (["ReadWriteMany"] if many else ["ReadWriteOnce"])
    if not many:  # a surge pod could not mount a ReadWriteOnce volume on another node
        assert all(d["spec"]["strategy"]["type"] == "Recreate" for d in engines(objs))


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
    # the C kernels are CPU-only: a GPU engine compiles nothing
    kernel_build = v["engine"]["kernelBuildSeconds"] if v["engine"]["gpus"] == 0 else 0
    for d in engines(objs):
        c = engine_container(d)
        canary = d["metadata"]["labels"]["servelm.dev/track"] == "canary"
        budget = (v["canary"]["model"]["loadTimeBudgetSeconds"] if canary else 0) or v["model"][
            "loadTimeBudgetSeconds"
        ]
        s, live = c["startupProbe"], c["livenessProbe"]
        assert s["httpGet"]["path"] == "/health"
        window = 2 * budget + kernel_build
        assert s["failureThreshold"] * s["periodSeconds"] >= window
        assert (
            s["failureThreshold"] * s["periodSeconds"] < window + s["periodSeconds"]
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


@pytest.mark.parametrize(
    ("gpus", "kernel_build"), [("0", None), ("0", "0"), ("0", "121"), ("1", None), ("1", "121")]
)
def test_startup_window_follows_the_budget(gpus: str, kernel_build: str | None) -> None:
    sets = [f"engine.gpus={gpus}"] + (
        [f"engine.kernelBuildSeconds={kernel_build}"] * bool(kernel_build)
    )
    # on the CPU the kernel build's allowance comes on top; a GPU engine builds no C kernel
    extra = (
        0 if gpus != "0" else int(kernel_build or values_of(None)["engine"]["kernelBuildSeconds"])
    )
    for budget in (30, 31, 600):
        d = one(
            docs(KUBE_VERSIONS[-1], None, CRD_APIS, f"model.loadTimeBudgetSeconds={budget}", *sets),
            "Deployment",
            "r-servelm-engine",
        )
        s = engine_container(d)["startupProbe"]
        assert (s["failureThreshold"], s["periodSeconds"]) == (
            math.ceil((2 * budget + extra) / 5),
            5,
        )


# --- upgrades --------------------------------------------------------------------------------

RWX = "storage.accessMode=ReadWriteMany"  # the shape with a fetch Job
# Values an upgrade may change that land in the fetch Job's pod template
JOB_CHANGES = [
    "image.tag=0.1.1",
    "model.hfEndpoint=https://hf-mirror.example",
    "model.hfToken.secretName=hf-token",
    "imagePullSecrets[0].name=regcred",
    "fetch.resources.limits.memory=3Gi",
    "engine.podSecurityContext.runAsUser=10002",
    "engine.securityContext.readOnlyRootFilesystem=true",
    f"model.revision={'c' * 40}",
]


def fetch_job(*sets: str) -> dict:
    jobs = by_kind(docs(KUBE_VERSIONS[-1], None, CRD_APIS, *sets), "Job")
    assert len(jobs) == 1
    return jobs[0]


@pytest.mark.parametrize("change", JOB_CHANGES)
def test_an_upgrade_that_changes_the_fetch_job_renames_it(change: str) -> None:
    """A Job's spec.template is immutable: `helm upgrade` patching a Job of the same name with
    another template fails ("field is immutable", helm/helm#7725). A new name is a new Job,
    which helm creates, deleting the old one."""
    before, after = fetch_job(RWX), fetch_job(RWX, change)
    assert before["spec"]["template"] != after["spec"]["template"]
    assert before["metadata"]["name"] != after["metadata"]["name"]


@pytest.mark.parametrize(
    "change",
    [
        "engine.replicas=3",
        "router.replicas=4",
        "engine.kernelBuildSeconds=10",
        "apiKey.create=false",
    ],
)
def test_an_upgrade_elsewhere_keeps_the_fetch_job(change: str) -> None:
    before, after = fetch_job(RWX), fetch_job(RWX, change)
    assert before["metadata"]["name"] == after["metadata"]["name"]
    assert before["spec"] == after["spec"]


# --- the C kernels on the CPU ----------------------------------------------------------------


def test_kernel_cache_outlives_a_container_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod's first start on the CPU compiles servelm's C kernels, minutes on a busy node. They
    go to a pod-lifetime emptyDir, so a container the startup probe restarts does not start the
    compile over (a crash loop), and the startup window allows for that first compile."""
    from servelm.kernels.build import cache_dir

    d = one(docs(KUBE_VERSIONS[-1], None), "Deployment", "r-servelm-engine")
    c = engine_container(d)
    env = {e["name"]: e.get("value") for e in c["env"]}
    monkeypatch.setenv("XDG_CACHE_HOME", env["XDG_CACHE_HOME"])
    kernels = cache_dir()  # where servelm puts them in that container
    mounts = [m for m in c["volumeMounts"] if kernels.is_relative_to(m["mountPath"])]
    assert mounts, f"{kernels} is on the container's own layer, lost with it"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    volume = next(v for v in pod_spec(d)["volumes"] if v["name"] == mount["name"])
    assert volume["emptyDir"].get("medium") != "Memory" and not mount.get("readOnly")
    s = c["startupProbe"]
    assert s["failureThreshold"] * s["periodSeconds"] >= 2 * MEASURED_FIRST_START_S


# --- autoscaling and GPUs ----------------------------------------------------------------------


@pytest.mark.parametrize(("cooldown", "window"), [(300, 300), (3600, 3600), (7200, 3600)])
def test_hpa_window_within_the_api_servers_limit(cooldown: int, window: int) -> None:
    """The HPA takes cooldownPeriod as its scale-down stabilization window, which the API server
    refuses above 3600 s (MaxStabilizationWindowSeconds); KEDA's cooldown has no such limit."""
    sets = ("autoscaling.enabled=true", f"autoscaling.keda.cooldownPeriod={cooldown}")
    hpa = by_kind(docs(KUBE_VERSIONS[0], None, (), *sets), "HorizontalPodAutoscaler")[0]
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == window
    so = by_kind(docs(KUBE_VERSIONS[0], None, CRD_APIS, *sets), "ScaledObject")[0]
    assert so["spec"]["cooldownPeriod"] == cooldown


@pytest.mark.parametrize(
    ("gpus", "extra", "ranks"),
    [
        (0, [], 1),
        (1, [], 1),
        (2, [], 2),
        (8, [], 8),
        (4, ["-tp", "2"], 2),  # the user's split wins, given once
        (2, ["--tensor-parallel-size=2"], 2),
        (2, ["--max-model-len", "4096"], 2),
    ],
)
def test_every_gpu_gets_a_tensor_parallel_rank(
    gpus: int, extra: list[str], ranks: int, tmp_path: Path
) -> None:
    """The pod holds engine.gpus GPUs; servelm serve uses one per tensor-parallel rank. The
    rendered arguments go through servelm's own parser."""
    from servelm.cli import build_parser

    f = tmp_path / "gpus.yaml"
    f.write_text(yaml.safe_dump({"engine": {"gpus": gpus, "extraArgs": extra}}))
    d = one(docs(KUBE_VERSIONS[-1], str(f)), "Deployment", "r-servelm-engine")
    c = engine_container(d)
    argv = ["serve", *c["args"]]
    args = build_parser(argv).parse_args(argv)
    assert args.tensor_parallel_size == ranks
    assert args.device == ("cuda" if gpus else "auto")
    assert c["resources"].get("limits", {}).get("nvidia.com/gpu", 0) == gpus
    assert sum(a.startswith(("-tp", "--tensor-parallel")) for a in c["args"]) <= 1
