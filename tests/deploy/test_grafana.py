"""The Grafana dashboard (deploy/grafana/): generated from deploy/grafana/dashboard.py, well formed, provisioned
by the compose pod, and every metric its queries name exists on a live node's /metrics. Where Debian's
prometheus package is installed (``.ci/run`` installs it), a real Prometheus scrapes a live node under load
and evaluates every query of the dashboard: none may fail, and the core panels must return data."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ctxstore import ContextStore
from support import REPO_ROOT
from support.nodes import ACCESS_KEY, SECRET_KEY, Node, free_port, make_client, start_node

GRAFANA = REPO_ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "ctxstore.json"
COMPOSE = REPO_ROOT / "deploy" / "compose.yaml"
TOKEN = "grafana-test-admin-token-0001"
METRIC = re.compile(r"\b((?:ctxstore|process)_[a-z0-9_]+)\b")
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ctxstore_dashboard", GRAFANA / "dashboard.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def expressions() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]]


def concrete(expr: str, interval: str = "1m") -> str:
    """A dashboard query with Grafana's variables filled in as the dashboard's defaults would."""
    return expr.replace("$__rate_interval", interval).replace("$job", "ctxstore").replace("$instance", ".*")


# -------------------------------------------------------------------- the file


def test_the_json_is_generated_from_dashboard_py() -> None:
    assert DASHBOARD.read_text() == generator().render(), "regenerate: python3 deploy/grafana/dashboard.py"


def test_the_dashboard_is_well_formed() -> None:
    d = dashboard()
    assert d["uid"] == "ctxstore-pod" and d["title"] and d["schemaVersion"] >= 36
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    # The grid: 24 columns, no two panels overlap.
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
    for p in panels():
        assert p["type"] in ("stat", "timeseries") and p["title"] and p["description"], p
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip()
            used = set(re.findall(r"\$(\w+)", t["expr"])) - {"__rate_interval"}
            assert used <= set(variables), f"{p['title']}: undefined variables {used - set(variables)}"
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            if METRIC.search(t["expr"]):  # every ctxstore series is narrowed to the chosen job and nodes
                assert 'job=~"$job", instance=~"$instance"' in t["expr"], t["expr"]
    # What the issue asks the dashboard to show.
    text = " ".join(expressions())
    for needle in ("ctxstore_used_bytes", "ctxstore_disk_used_bytes", "ctxstore_bucket_hits_total",
                   'operation="get"', "histogram_quantile(0.99", "ctxstore_bucket_evictions_total",
                   "ctxstore_bucket_expirations_total", 'status=~"5..'):
        assert needle in text, needle


# -------------------------------------------------------------------- against a live node


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = start_node(tmp_path_factory.mktemp("grafana-node"), "--memory", "4MiB", "--node-id", "grafana-node",
                   env={"CTXSTORE_ADMIN_TOKEN": TOKEN})
    yield n
    n.stop()


def traffic(node: Node, rounds: int = 1) -> None:
    """Every kind of request the dashboard's panels count: bulk save/lookup/restore, S3 put/get/head and misses,
    evictions (a 4 MiB budget) and expirations."""
    s3 = make_client(node.endpoint)
    block = b"\x5a" * (64 << 10)
    with ContextStore(node.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY) as store:
        ns = store.namespace("kv-grafana", model="grafana-test")
        for r in range(rounds):
            for p in range(12):  # 12 x 8 x 64 KiB = 6 MiB: evictions
                tokens = list(range((r * 100 + p) * 1000, (r * 100 + p) * 1000 + 8 * ns.block_size))
                ns.save(tokens, [block] * 8)
                ns.lookup(tokens)
                ns.restore(tokens)
            s3.put_object(Bucket="kv-grafana", Key=f"s3/{r}", Body=block)
            s3.get_object(Bucket="kv-grafana", Key=f"s3/{r}")
            s3.head_object(Bucket="kv-grafana", Key=f"s3/{r}")
            s3.put_object(Bucket="kv-grafana", Key=f"ttl/{r}", Body=b"t", Metadata={"ctx-ttl": "1"})
            try:
                s3.get_object(Bucket="kv-grafana", Key="absent")
            except s3.exceptions.NoSuchKey:
                pass


def scrape(node: Node) -> str:
    request = urllib.request.Request(node.endpoint + "/_ctx/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return resp.read().decode()


def test_every_metric_the_dashboard_queries_exists_on_a_live_node(node: Node) -> None:
    traffic(node)
    exposed = {sample.name for family in text_string_to_metric_families(scrape(node)) for sample in family.samples}
    queried = {name for expr in expressions() for name in METRIC.findall(expr)}
    assert len(queried) > 30  # the parse found the queries' metrics
    missing = sorted(queried - exposed)
    assert not missing, f"the dashboard queries metrics no node exposes: {missing}"
    # Histogram quantiles read the buckets of a histogram, rates read counters.
    assert "ctxstore_request_duration_seconds_bucket" in queried
    for expr in expressions():
        for name in re.findall(r"rate\((\w+)\{", expr):
            assert name.endswith(("_total", "_bucket")), f"rate() of {name}, which is not a counter"


# -------------------------------------------------------------------- compose and provisioning


def test_compose_provisions_prometheus_and_grafana_with_the_dashboard() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    nodes = sorted(name for name in services if name.startswith("ctxstore-"))
    prom, grafana = services["prometheus"], services["grafana"]
    for svc in (prom, grafana):
        assert all(str(p).startswith("127.0.0.1:") for p in svc["ports"]), "published beyond loopback"
        assert svc["env_file"] == "ctxstore.env"
    # Every node knows its peers (the status page's pod view).
    for name in nodes:
        assert services[name]["environment"]["CTXSTORE_PEERS"].split(",") == [f"{n}:9000" for n in nodes]

    def mounts(svc: dict[str, Any]) -> dict[str, Path]:
        out = {}
        for volume in svc["volumes"]:
            source, target = volume.split(":")[:2]
            out[target] = (COMPOSE.parent / source).resolve()
        return out

    prom_mounts, grafana_mounts = mounts(prom), mounts(grafana)
    script = prom["entrypoint"][2]
    config_path = re.search(r"--config\.file=(\S+)", script)
    assert config_path and prom_mounts[config_path.group(1)] == GRAFANA / "prometheus.yml"
    config = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    job = config["scrape_configs"][0]
    assert job["job_name"] == "ctxstore" and job["metrics_path"] == "/_ctx/metrics"
    assert job["static_configs"][0]["targets"] == [f"{n}:9000" for n in nodes]
    token_file = job["authorization"]["credentials_file"]
    assert f"> {token_file}" in script and "$$CTXSTORE_ADMIN_TOKEN" in script  # written from the env file
    assert grafana_mounts["/etc/grafana/provisioning"] == GRAFANA / "provisioning"
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    url = urllib.parse.urlsplit(datasource["datasources"][0]["url"])
    assert url.hostname == "prometheus" and f"--web.listen-address=:{url.port}" in script
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "ctxstore.yaml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert grafana_mounts[path] == DASHBOARD.parent
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert grafana_mounts[str(Path(home).parent)] / Path(home).name == DASHBOARD
    assert "GF_SECURITY_ADMIN_PASSWORD" in grafana["entrypoint"][2]  # no default admin/admin
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def test_the_kubernetes_docs_point_at_the_dashboard() -> None:
    text = (REPO_ROOT / "docs" / "deployment.md").read_text()
    assert "deploy/grafana/dashboards/ctxstore.json" in text
    assert "deploy/grafana/dashboards/ctxstore.json" in (REPO_ROOT / "docs" / "operations.md").read_text()


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package prometheus; .ci/run installs it)")
def test_promtool_accepts_the_prometheus_config(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    config = (GRAFANA / "prometheus.yml").read_text().replace("/tmp/ctxstore-admin-token", str(token))
    (tmp_path / "prometheus.yml").write_text(config)
    out = subprocess.run([str(PROMTOOL), "check", "config", str(tmp_path / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


# -------------------------------------------------------------------- a real Prometheus evaluating every query


def prom_query(port: int, expr: str) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            answer: dict[str, Any] = json.load(resp)
    except urllib.error.HTTPError as exc:  # 400 bad_data: the expression does not parse or evaluate
        if exc.code == 503:  # plain "Service Unavailable" until its storage is ready: the caller waits
            raise
        answer = json.loads(exc.read() or b"{}")
        exc.close()
    return answer


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (Debian package; .ci/run installs it)")
def test_a_real_prometheus_evaluates_every_query(node: Node, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    config = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    job = config["scrape_configs"][0]
    job.update(scrape_interval="1s", scrape_timeout="1s")
    job["authorization"]["credentials_file"] = str(token)
    job["static_configs"] = [{"targets": [f"127.0.0.1:{node.port}"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen([str(PROMETHEUS), f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        # Load between scrapes, until rates over 1m windows have several samples.
        while True:
            traffic(node)
            try:  # Prometheus takes a moment to open its port (refused) and its storage (503)
                answer = prom_query(port, 'count_over_time(ctxstore_up{job="ctxstore"}[1m])') \
                    if proc.poll() is None else {}
            except urllib.error.URLError:
                answer = {}
            samples = answer.get("data", {}).get("result", [])
            if samples and float(samples[0]["value"][1]) >= 6:
                break
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "Prometheus did not scrape the node"
            time.sleep(0.5)
        empty = []
        for expr in expressions():
            answer = prom_query(port, concrete(expr))
            assert answer.get("status") == "success", f"{expr}\n-> {answer}"
            if not answer["data"]["result"]:
                empty.append(expr)
        # Without a flash tier its ratios have no value; everything a RAM-only node does must show.
        core = [e for e in expressions() if "disk" not in e and "demotions" not in e and "promotions" not in e
                and "prefetches" not in e and 'status=~"5..|499"' not in e and "draining" not in e]
        assert not [e for e in empty if e in core], "core panels without data: " + "\n".join(
            e for e in empty if e in core)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_kubernetes_nodes_know_every_replica_as_a_peer() -> None:
    """The status page's pod view in Kubernetes: each pod's stable name under the headless Service."""
    docs = {f"{d['kind']}/{d['metadata']['name']}": d for path in (REPO_ROOT / "deploy" / "kubernetes").glob("*.yaml")
            if path.name != "kustomization.yaml" for d in yaml.safe_load_all(path.read_text()) if d}
    statefulset = docs["StatefulSet/ctxstore"]
    headless = statefulset["spec"]["serviceName"]
    peers = docs["ConfigMap/ctxstore-config"]["data"]["CTXSTORE_PEERS"].split(",")
    assert peers == [f"ctxstore-{i}.{headless}:9000" for i in range(statefulset["spec"]["replicas"])]
