"""Every file in deploy/ is parsed and checked against what reads it: thinkserve configs against the
config model, the Ray cluster launcher YAML against Ray's own schema, the KubeRay manifests'
structure and their cross-references, the Grafana dashboard against the metric names the frontend
exports, the Dockerfile against the repository. A file of a kind no test knows fails."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from thinkserve.cluster.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KINDS = {"local.yaml": "thinkserve", "gpu-cluster.yaml": "thinkserve", "ray-cluster.yaml": "ray-launcher",
         "kuberay.yaml": "kubernetes", "prometheus.yml": "prometheus", "grafana-dashboard.json": "grafana",
         "Dockerfile": "docker"}


def test_every_deploy_file_is_known_and_parses():
    files = sorted(p.name for p in DEPLOY.iterdir() if p.is_file())
    assert files == sorted(KINDS), "a new file in deploy/ needs a check here"
    for name in files:
        text = (DEPLOY / name).read_text()
        if name.endswith((".yaml", ".yml")):
            assert all(d is not None for d in yaml.safe_load_all(text)), name
        elif name.endswith(".json"):
            json.loads(text)


@pytest.mark.parametrize("name", [n for n, k in KINDS.items() if k == "thinkserve"])
def test_thinkserve_configs_validate(name):
    cfg = parse_config(yaml.safe_load((DEPLOY / name).read_text()))
    assert cfg.frontend.http_port is not None


def _kube_docs():
    return list(yaml.safe_load_all((DEPLOY / "kuberay.yaml").read_text()))


def test_kuberay_configmap_is_a_valid_config():
    cm = next(d for d in _kube_docs() if d["kind"] == "ConfigMap")
    cfg = parse_config(yaml.safe_load(cm["data"]["cluster.yaml"]))
    assert cfg.frontend.host == "0.0.0.0" and cfg.frontend.resources == {"frontend": 1.0}


def test_ray_launcher_yaml_matches_rays_schema():
    import jsonschema
    import ray
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    doc = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    jsonschema.validate(doc, schema)
    assert doc["head_node_type"] in doc["available_node_types"]
    assert doc["available_node_types"][doc["head_node_type"]]["resources"].get("frontend") == 1
    for src in doc["file_mounts"].values():          # mounted from the repository root
        assert (ROOT / src).is_file(), src
    assert parse_config(yaml.safe_load((ROOT / doc["file_mounts"]["~/thinkserve.yaml"]).read_text()))
    # the head advertises the resource the frontend is pinned to
    assert any("frontend" in c for c in doc["head_start_ray_commands"])


def _containers(template):
    cs = template["spec"]["containers"]
    assert cs and all(c.get("name") and c.get("image") for c in cs)
    return cs


def test_kuberay_manifests_structure():
    import ray
    docs = _kube_docs()
    for d in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(d) and d["metadata"].get("name"), d
    by_kind = {d["kind"]: d for d in docs}
    assert set(by_kind) == {"ConfigMap", "RayCluster", "RayJob", "Service", "ServiceMonitor"}

    rc = by_kind["RayCluster"]
    assert rc["apiVersion"] == "ray.io/v1"
    spec = rc["spec"]
    want = tuple(int(x) for x in ray.__version__.split(".")[:2])
    assert tuple(int(x) for x in spec["rayVersion"].split(".")[:2]) == want, "image's Ray != this Ray"
    head = spec["headGroupSpec"]
    assert all(isinstance(v, str) for v in head["rayStartParams"].values()), "rayStartParams values are strings"
    assert json.loads(json.loads(head["rayStartParams"]["resources"])) == {"frontend": 1}
    head_containers = _containers(head["template"])
    ports = {p["containerPort"] for c in head_containers for p in c.get("ports", ())}
    for g in spec["workerGroupSpecs"]:
        assert g["groupName"] and g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert isinstance(g["rayStartParams"], dict)
        _containers(g["template"])
    # volumes referenced by mounts exist in the same pod
    for t in [head["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]:
        vols = {v["name"] for v in t["spec"].get("volumes", ())}
        assert {m["name"] for c in t["spec"]["containers"] for m in c.get("volumeMounts", ())} <= vols

    # the RayJob runs `thinkserve up` on that cluster with the ConfigMap's config
    job = by_kind["RayJob"]
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == rc["metadata"]["name"]
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["thinkserve", "up"] and "--detach" not in argv
    config_path = Path(argv[argv.index("--config") + 1])
    mount = next(m for c in head_containers for m in c["volumeMounts"] if m["mountPath"] == str(config_path.parent))
    vol = next(v for v in head["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    cm = by_kind["ConfigMap"]
    assert vol["configMap"]["name"] == cm["metadata"]["name"] and config_path.name in cm["data"]

    # the Service reaches the head's gRPC and HTTP ports, which are the config's
    cfg = parse_config(yaml.safe_load(cm["data"]["cluster.yaml"]))
    svc = by_kind["Service"]
    assert svc["spec"]["selector"].items() <= head["template"]["metadata"]["labels"].items()
    targets = {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]}
    assert targets == {"grpc": cfg.frontend.port, "http": cfg.frontend.http_port} and set(targets.values()) <= ports
    # the token comes from a Secret into the environment `thinkserve up` reads
    env = {e["name"]: e for c in head_containers for e in c.get("env", ())}
    assert env["THINKSERVE_API_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "thinkserve-token"

    sm = by_kind["ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["http"] and sm["spec"]["endpoints"][0]["path"] == "/metrics"


def exported_series() -> set[str]:
    """Every series name the frontend's /metrics can expose (from its real registry)."""
    from types import SimpleNamespace

    from thinkserve.cluster.loop_lag import LoopLag
    from thinkserve.cluster.metrics import FrontendMetrics
    from thinkserve.cluster.orchestrator import Orchestrator
    from thinkserve.router import LeastLoadedPolicy
    # the frontend's attributes the collectors read: its orchestrator, loop-lag gauge and store stats
    m = FrontendMetrics(SimpleNamespace(orch=Orchestrator(LeastLoadedPolicy(1024, 64)), loop_lag=LoopLag(),
                                        store_stats={}))
    names = set()
    for fam in m.registry.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}[fam.type]
        names |= {fam.name + s for s in suffixes}
    return names


def test_grafana_dashboard_uses_exported_metrics():
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    series = exported_series()
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"thinkserve_[a-z0-9_]+", e)}
    assert used and used <= series, sorted(used - series)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for want in ("ttft", "tpot", "e2e", "kv_usage", "kv_transfer", "preemptions", "store_hits", "handoffs",
                 "migrations", "promotions", "bestofn"):
        assert any(want in n for n in used), want


def test_metric_names_are_documented():
    doc = (ROOT / "docs" / "interfaces.md").read_text()
    missing = sorted(n for n in exported_series() if not n.endswith(("_bucket", "_count", "_sum"))
                     and n not in doc and n.removesuffix("_total") not in doc)
    assert not missing, missing


def test_prometheus_config_scrapes_metrics():
    doc = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    job = doc["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    port = int(job["static_configs"][0]["targets"][0].rsplit(":", 1)[1])
    assert port == parse_config(yaml.safe_load((DEPLOY / "local.yaml").read_text())).frontend.http_port


def test_dockerfile_copies_what_exists_and_runs_a_valid_config():
    lines = [ln.strip() for ln in (DEPLOY / "Dockerfile").read_text().splitlines()]
    for ln in lines:
        if ln.startswith("COPY "):
            for src in ln.split()[1:-1]:
                assert (ROOT / src).exists(), src
    expose = {int(p) for ln in lines if ln.startswith("EXPOSE ") for p in ln.split()[1:]}
    cfg = parse_config(yaml.safe_load((DEPLOY / "local.yaml").read_text()))
    assert {cfg.frontend.port, cfg.frontend.http_port} <= expose
    cmd = json.loads(next(ln for ln in lines if ln.startswith("CMD "))[4:])
    assert cmd[:2] == ["thinkserve", "up"] and cmd[cmd.index("--config") + 1].startswith("/opt/thinkserve/deploy/")
    assert (DEPLOY / Path(cmd[cmd.index("--config") + 1]).name).is_file()
