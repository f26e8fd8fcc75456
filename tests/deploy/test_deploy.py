"""The deployment files under deploy/ (Dockerfile, Compose, Kubernetes, systemd) and docs/deployment.md.

Docker cannot run here, so the image is checked by what can be run without an engine: the Dockerfile's own
entrypoint and HEALTHCHECK commands are executed against a local node, the build context (.dockerignore)
and the package list the image installs are checked, and the manifests are parsed, cross-checked and, where
kubectl and systemd-analyze are installed, rendered (kustomize) and verified.
"""

from __future__ import annotations

import base64
import configparser
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import REPO_ROOT
from support.nodes import free_port

from ctxstore.lanes import THREADS_ENV
from ctxstore.tls import TLS_CA_ENV
from ctxstore_server.engine import OBJECT_OVERHEAD
from ctxstore_server.settings import SETTINGS, parse_duration, parse_size

ROOT = REPO_ROOT
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
SYSTEMD = DEPLOY / "systemd"
DOC = ROOT / "docs" / "deployment.md"
BIN = Path(sys.executable).parent

SETTING_BY_ENV = {s.env: s for s in SETTINGS}
# Read by the client (ctxstore.ContextStore, ctxstore admin), not the node.
CLIENT_VARIABLES = {"CTXSTORE_NODES", TLS_CA_ENV, THREADS_ENV}
SECRET_VARIABLES = {"CTXSTORE_ACCESS_KEY", "CTXSTORE_SECRET_KEY", "CTXSTORE_ADMIN_TOKEN"}
PLACEHOLDER = re.compile(r"^<REPLACE-ME[^>]*>$")
ACCESS_KEY_RE = re.compile(r"^[A-Za-z0-9._\-]{3,128}$")  # server/tenants.py
MiB = 1 << 20

ACCESS_KEY = "CTXDEPLOYTESTKEY0001"
SECRET_KEY = "deploy-test-secret-key-0001"
ADMIN_TOKEN = "deploy-test-admin-token-0001"


def headroom_ok(limit: int, budget: int) -> bool:
    """The sizing rule of docs/deployment.md: a memory limit of at least budget x 1.1 + 256 MiB."""
    return limit >= budget * 1.1 + 256 * MiB


def default(name: str) -> Any:
    return next(s.default for s in SETTINGS if s.name == name)


# -------------------------------------------------------------------- parsing helpers


def load_yaml(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def k8s_objects() -> dict[str, dict[str, Any]]:
    """``Kind/name`` → object, for every manifest listed by the kustomization."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    objects: dict[str, dict[str, Any]] = {}
    for resource in kustomization["resources"]:
        for doc in load_yaml(K8S / resource):
            objects[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return objects


def one(kind: str) -> dict[str, Any]:
    found = [o for key, o in k8s_objects().items() if key.startswith(kind + "/")]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def k8s_quantity(text: str | int) -> int:
    """Kubernetes memory quantities: 5Gi, 512Mi, 4G, plain bytes."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(text))
    assert match, f"not a quantity: {text!r}"
    scale = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[match.group(2)]
    return int(float(match.group(1)) * scale)


def compose_memory(text: str) -> int:
    """Compose/Docker byte values: 896m, 1g, 512k (powers of 2)."""
    match = re.fullmatch(r"(\d+)([bkmg]?)", str(text).lower())
    assert match, f"not a size: {text!r}"
    return int(match.group(1)) * {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[match.group(2)]


def systemd_bytes(text: str) -> int:
    """systemd sizes: K, M, G, T are powers of 1024."""
    match = re.fullmatch(r"(\d+)([KMGT]?)", text.strip())
    assert match, f"not a systemd size: {text!r}"
    return int(match.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[match.group(2)]


def env_file(path: Path) -> dict[str, str]:
    """KEY=value lines (comments and blanks skipped), as Compose and systemd read them."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


@dataclass
class Dockerfile:
    """The instructions of deploy/Dockerfile, continuation lines joined."""

    instructions: list[tuple[str, str]]

    @classmethod
    def read(cls) -> Dockerfile:
        text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
        instructions = []
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                word, _, rest = line.partition(" ")
                instructions.append((word.upper(), rest.strip()))
        return cls(instructions)

    def all(self, word: str) -> list[str]:
        return [rest for w, rest in self.instructions if w == word]

    def last(self, word: str) -> str:
        found = self.all(word)
        assert found, f"no {word} in deploy/Dockerfile"
        return found[-1]

    def index(self, word: str, contains: str = "") -> int:
        return next(i for i, (w, rest) in enumerate(self.instructions) if w == word and contains in rest)

    @property
    def entrypoint(self) -> list[str]:
        return json.loads(self.last("ENTRYPOINT"))

    @property
    def healthcheck(self) -> list[str]:
        """The HEALTHCHECK's command in exec form (without the CMD word and the options)."""
        rest = self.last("HEALTHCHECK")
        assert " CMD " in f" {rest} ", rest
        return json.loads(rest.split("CMD", 1)[1])

    @property
    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for rest in self.all("ENV"):
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                out[key] = value
        return out


# -------------------------------------------------------------------- every file


def deploy_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def test_every_yaml_file_parses() -> None:
    files = [p for p in deploy_files() if p.suffix in (".yaml", ".yml")]
    assert len(files) >= 9, files
    for path in files:
        docs = load_yaml(path)
        assert docs, f"{path} is empty"
        assert all(isinstance(d, dict) for d in docs), path


def test_every_ctxstore_variable_is_a_setting_or_the_clients() -> None:
    """A misspelt CTXSTORE_* variable is silently ignored by the node: every one named under deploy/ (and in
    docs/deployment.md) must be a row of the settings table, or CTXSTORE_NODES (the client's)."""
    known = set(SETTING_BY_ENV) | CLIENT_VARIABLES
    used: dict[str, set[str]] = {}
    for path in [*deploy_files(), DOC]:
        for name in re.findall(r"CTXSTORE_[A-Z0-9_]*[A-Z0-9]", path.read_text()):
            used.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    unknown = {name: sorted(where) for name, where in used.items() if name not in known}
    assert not unknown, f"not settings: {unknown}"
    assert {"CTXSTORE_MEMORY", "CTXSTORE_NODE_ID", "CTXSTORE_NODES", *SECRET_VARIABLES} <= set(used)


def test_no_real_secret_is_shipped() -> None:
    """Env examples and the Secret hold placeholders only, and those are invalid access keys, so a node
    started from them refuses to run (see test_placeholder_credentials_refuse_to_start)."""
    examples = [DEPLOY / "ctxstore.env.example", SYSTEMD / "ctxstore.env.example"]
    for path in examples:
        values = env_file(path)
        assert SECRET_VARIABLES <= set(values), path
        for name in SECRET_VARIABLES:
            assert PLACEHOLDER.match(values[name]), f"{path}: {name}={values[name]}"
    secret = one("Secret")
    assert set(secret["stringData"]) == SECRET_VARIABLES
    assert all(PLACEHOLDER.match(v) for v in secret["stringData"].values())
    assert "data" not in secret
    assert not ACCESS_KEY_RE.match(secret["stringData"]["CTXSTORE_ACCESS_KEY"])


def test_capacity_table_in_docs_is_the_scripts_output() -> None:
    capacity = import_path(DEPLOY / "kv_capacity.py")
    # Double-check the arithmetic by hand for the shapes the docs quote.
    assert capacity.Shape(32, 8, 128, 2).bytes_per_token == 2 * 32 * 8 * 128 * 2 == 128 * 1024  # Llama-3-8B
    assert capacity.Shape(80, 8, 128, 2).bytes_per_token == 320 * 1024  # Llama-3-70B
    assert capacity.Shape(28, 4, 128, 2).bytes_per_token == 56 * 1024  # Qwen2.5-7B
    assert capacity.Shape(32, 8, 128, 1).bytes_per_token == 64 * 1024  # fp8 halves bf16
    assert capacity.block_bytes(capacity.Shape(32, 8, 128, 2)) == 2 * MiB
    assert capacity.OBJECT_OVERHEAD == OBJECT_OVERHEAD  # the server's per-object charge
    assert capacity.charged_per_block(capacity.Shape(32, 8, 128, 2)) == 2 * MiB + 32 + OBJECT_OVERHEAD
    assert capacity.blocks_in(1 << 30, capacity.Shape(32, 8, 128, 2)) == 511  # 512 would need 374 KiB more
    out = subprocess.run([sys.executable, str(DEPLOY / "kv_capacity.py")], capture_output=True, text=True,
                         check=True).stdout
    doc = DOC.read_text()
    for table in out.strip().split("\n\n"):
        assert table in doc, f"docs/deployment.md is missing (python3 deploy/kv_capacity.py):\n{table}"


def import_path(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


# -------------------------------------------------------------------- Dockerfile


def test_dockerfile() -> None:
    df = Dockerfile.read()
    assert df.all("FROM") == ["python:3.11-slim"]
    install = df.index("RUN", "pip install")
    assert "--no-cache-dir '.[server]'" in df.instructions[install][1]
    user = df.last("USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER must be a numeric non-root uid (runAsNonRoot), got {user}"
    assert df.index("USER") > install, "USER must come after the install"
    assert df.all("EXPOSE") == ["9000"]
    assert df.all("STOPSIGNAL") == ["SIGTERM"]
    assert df.entrypoint == ["ctxstore", "serve", "--host", "0.0.0.0"]
    health = df.healthcheck
    assert health[:2] == ["python", "-c"] and "/_ctx/health/ready" in health[2]
    assert "--start-period" in df.last("HEALTHCHECK") and "--timeout" in df.last("HEALTHCHECK")
    assert df.env.get("CTXSTORE_PORT") == "9000"  # what the health check reads
    for name in df.env:
        assert not name.startswith("CTXSTORE_") or name not in SECRET_VARIABLES


def test_build_context_holds_only_the_package_sources() -> None:
    """The top-level .dockerignore is an allowlist matching the Dockerfile's COPY sources exactly, so no
    virtualenv, .git or env file with credentials (deploy/ctxstore.env) is sent to the builder."""
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    copied = set()
    for rest in Dockerfile.read().all("COPY"):
        copied.update(rest.split()[:-1])
    assert copied == allowed == {"pyproject.toml", "README.md", "ctxstore", "server"}
    for path in copied:
        assert (ROOT / path).exists(), path


# -------------------------------------------------------------------- a node started as the image starts it


def node_env(port: int, **extra: str) -> dict[str, str]:
    """The environment of the container: the image's ENV, the env file's credentials, nothing from this
    machine's CTXSTORE_* variables; the image's port variable points at a free port."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTXSTORE_")}
    env.update(Dockerfile.read().env)
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", CTXSTORE_PORT=str(port),
               CTXSTORE_ACCESS_KEY=ACCESS_KEY, CTXSTORE_SECRET_KEY=SECRET_KEY, CTXSTORE_ADMIN_TOKEN=ADMIN_TOKEN)
    env.update(extra)
    return env


def entrypoint_argv(port: int) -> list[str]:
    """The Dockerfile's ENTRYPOINT with the bind address made loopback (the test must not listen on every
    interface) and the port given as a flag, as ``docker run IMAGE --port N`` appends it."""
    argv = Dockerfile.read().entrypoint
    i = argv.index("--host")
    argv[i + 1] = "127.0.0.1"
    return [*argv, "--port", str(port)]


@dataclass
class Node:
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    env: dict[str, str]

    def ready(self) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/_ctx/health/ready", timeout=1) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            exc.close()
            return exc.code

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_entrypoint(tmp: Path) -> Node:
    port = free_port()
    env = node_env(port)
    log = tmp / f"entrypoint-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(entrypoint_argv(port), env=env, stdout=out, stderr=subprocess.STDOUT)
    node = Node(port, proc, log, env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the entrypoint exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if node.ready() == 200:
                return node
        except OSError:
            pass
        time.sleep(0.05)
    node.stop()
    raise AssertionError(f"the entrypoint never became ready:\n{log.read_text()}")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    started = start_entrypoint(tmp_path_factory.mktemp("deploy"))
    yield started
    started.stop()


def admin_get(node: Node, path: str) -> Any:
    request = urllib.request.Request(f"http://127.0.0.1:{node.port}/_ctx/v1/admin/{path}",
                                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.load(resp)


def test_healthcheck_command_passes_on_a_ready_node_and_fails_without_one(node: Node) -> None:
    command = Dockerfile.read().healthcheck
    command[0] = sys.executable  # "python" in the image
    ok = subprocess.run(command, env=node.env, capture_output=True, timeout=10, check=False)
    assert ok.returncode == 0, ok.stderr
    closed = subprocess.run(command, env={**node.env, "CTXSTORE_PORT": str(free_port())}, capture_output=True,
                            timeout=10, check=False)
    assert closed.returncode != 0


def test_demo_worker_restores_from_a_node(node: Node) -> None:
    env = {**node.env, "CTXSTORE_NODES": f"127.0.0.1:{node.port}"}
    env.pop("CTXSTORE_ADMIN_TOKEN")
    run = subprocess.run([sys.executable, str(DEPLOY / "demo_worker.py"), "--blocks", "12", "--wait", "10"],
                         env=env, capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "restore OK" in run.stdout
    assert "restore: 12 blocks (192 tokens), 12 byte-identical" in run.stdout
    assert "follow-up prompt sharing 6 blocks: 6 cached" in run.stdout


def test_charged_bytes_per_block_match_the_capacity_model(node: Node) -> None:
    """What the node really charges per stored block is what docs/deployment.md's tables assume."""
    capacity = import_path(DEPLOY / "kv_capacity.py")
    worker = import_path(DEPLOY / "demo_worker.py")
    env = {**node.env, "CTXSTORE_NODES": f"127.0.0.1:{node.port}"}
    run = subprocess.run([sys.executable, str(DEPLOY / "demo_worker.py"), "--blocks", "4", "--bucket",
                          "capacity-check"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    stats = admin_get(node, "stats")["buckets"]["capacity-check"]
    assert stats["objects"] == 4
    assert stats["charged"] == 4 * (worker.BLOCK_BYTES + capacity.KEY_BYTES + capacity.OBJECT_OVERHEAD)


def test_placeholder_credentials_refuse_to_start() -> None:
    """A node started with the shipped placeholders exits at once instead of serving with known keys."""
    placeholders = env_file(DEPLOY / "ctxstore.env.example")
    port = free_port()
    env = node_env(port, **placeholders)
    run = subprocess.run(entrypoint_argv(port), env=env, capture_output=True, text=True, timeout=30, check=False)
    assert run.returncode != 0
    assert "access keys are" in run.stderr


def test_entrypoint_drains_on_sigterm_and_exits_zero(tmp_path: Path) -> None:
    started = start_entrypoint(tmp_path)
    try:
        started.proc.send_signal(signal.SIGTERM)
        assert started.proc.wait(15) == 0, started.log.read_text()
    finally:
        started.stop()


# -------------------------------------------------------------------- make_env.py


def test_make_env_writes_fresh_valid_credentials(tmp_path: Path) -> None:
    dest = tmp_path / "ctxstore.env"
    script = [sys.executable, str(DEPLOY / "make_env.py"), str(dest)]
    subprocess.run(script, check=True, capture_output=True)
    assert dest.stat().st_mode & 0o777 == 0o600
    values = env_file(dest)
    assert set(values) == set(env_file(DEPLOY / "ctxstore.env.example"))
    assert ACCESS_KEY_RE.match(values["CTXSTORE_ACCESS_KEY"])
    assert len(values["CTXSTORE_SECRET_KEY"]) >= 40 and len(values["CTXSTORE_ADMIN_TOKEN"]) >= 40
    assert not any("REPLACE" in v for v in values.values())
    again = subprocess.run(script, capture_output=True, text=True, check=False)
    assert again.returncode != 0 and "exists" in again.stderr
    assert env_file(dest) == values
    subprocess.run([*script, "--force"], check=True, capture_output=True)
    assert env_file(dest)["CTXSTORE_SECRET_KEY"] != values["CTXSTORE_SECRET_KEY"]


# -------------------------------------------------------------------- Compose


def test_compose_pod() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    nodes = {name: svc for name, svc in services.items() if name.startswith("ctxstore-")}
    assert sorted(nodes) == ["ctxstore-0", "ctxstore-1", "ctxstore-2"]
    health = ["CMD", *Dockerfile.read().healthcheck]
    for name, svc in nodes.items():
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
        assert svc["env_file"] == "ctxstore.env"
        assert svc["healthcheck"]["test"] == health, f"{name}: the same check as the image's HEALTHCHECK"
        env = svc["environment"]
        assert env["CTXSTORE_NODE_ID"] == name
        assert headroom_ok(compose_memory(svc["mem_limit"]), parse_size(env["CTXSTORE_MEMORY"]))
        drain = parse_duration(env.get("CTXSTORE_DRAIN_TIMEOUT", str(default("drain_timeout"))))
        assert parse_duration(svc["stop_grace_period"]) > drain
        assert svc["stop_signal"] == "SIGTERM"
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        assert svc["read_only"] is True
    worker = services["demo-worker"]
    assert worker["depends_on"] == {name: {"condition": "service_healthy"} for name in nodes}
    assert worker["env_file"] == "ctxstore.env"
    listed = worker["environment"]["CTXSTORE_NODES"].split(",")
    assert listed == [f"{name}:9000" for name in sorted(nodes)]
    source, target = worker["volumes"][0].split(":")[:2]
    assert (DEPLOY / source).resolve() == DEPLOY / "demo_worker.py"
    assert worker["entrypoint"] == ["python", target]
    assert {k for k in env_file(DEPLOY / "ctxstore.env.example")} == SECRET_VARIABLES


# -------------------------------------------------------------------- Kubernetes


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests
    kinds = sorted(key.split("/")[0] for key in k8s_objects())
    assert kinds == sorted(["ConfigMap", "Secret", "Service", "Service", "StatefulSet", "PodDisruptionBudget",
                            "ServiceMonitor"])
    for obj in k8s_objects().values():
        assert "namespace" not in obj["metadata"], "manifests must stay namespace-agnostic"


def test_statefulset() -> None:
    sts = one("StatefulSet")
    spec, pod = sts["spec"], sts["spec"]["template"]["spec"]
    assert spec["replicas"] == 3
    assert spec["podManagementPolicy"] == "Parallel"
    selector = spec["selector"]["matchLabels"]
    assert selector.items() <= spec["template"]["metadata"]["labels"].items()
    headless = k8s_objects()[f"Service/{spec['serviceName']}"]
    assert headless["spec"]["clusterIP"] == "None"
    assert pod["enableServiceLinks"] is False  # else a Service "ctxstore" injects CTXSTORE_PORT=tcp://...
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"s3": 9000}
    assert container["livenessProbe"]["httpGet"] == {"path": "/_ctx/health/live", "port": "s3"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/_ctx/health/ready", "port": "s3"}
    ctx = container["securityContext"]
    assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == mounts["/tmp"])
    # Resources: set, Guaranteed (requests == limits), the limit above budget + headroom.
    resources = container["resources"]
    assert resources["requests"] == resources["limits"]
    assert {"cpu", "memory"} <= set(resources["limits"])
    config = one("ConfigMap")
    budget = parse_size(config["data"]["CTXSTORE_MEMORY"])
    assert headroom_ok(k8s_quantity(resources["limits"]["memory"]), budget)
    drain = parse_duration(config["data"].get("CTXSTORE_DRAIN_TIMEOUT", str(default("drain_timeout"))))
    assert pod["terminationGracePeriodSeconds"] > drain
    # Configuration and secrets come from the ConfigMap and the Secret; the node id is the pod name.
    refs = {next(iter(ref)): ref[next(iter(ref))]["name"] for ref in container["envFrom"]}
    assert refs == {"configMapRef": config["metadata"]["name"], "secretRef": one("Secret")["metadata"]["name"]}
    env = {e["name"]: e for e in container["env"]}
    assert env["CTXSTORE_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_configmap_holds_valid_non_secret_settings() -> None:
    data = one("ConfigMap")["data"]
    for name, value in data.items():
        assert name in SETTING_BY_ENV, name
        assert name not in SECRET_VARIABLES, f"{name} belongs in the Secret"
        assert name not in ("CTXSTORE_HOST", "CTXSTORE_PORT"), "the StatefulSet's probes and Services fix these"
        SETTING_BY_ENV[name].type.parse(value)


def test_services_select_the_statefulset_pods() -> None:
    selector = one("StatefulSet")["spec"]["selector"]["matchLabels"]
    services = [o for key, o in k8s_objects().items() if key.startswith("Service/")]
    assert len(services) == 2
    headless = [s for s in services if s["spec"].get("clusterIP") == "None"]
    regular = [s for s in services if s["spec"].get("clusterIP") != "None"]
    assert len(headless) == len(regular) == 1
    assert headless[0]["spec"]["publishNotReadyAddresses"] is False
    for svc in services:
        assert svc["spec"]["selector"] == selector
        (port,) = svc["spec"]["ports"]
        assert port["port"] == 9000 and port["targetPort"] == "s3" and port["name"] == "s3"


def test_pod_disruption_budget() -> None:
    pdb = one("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == one("StatefulSet")["spec"]["selector"]["matchLabels"]


def test_service_monitor_scrapes_each_pod_once_with_the_admin_token() -> None:
    monitor = one("ServiceMonitor")
    wanted = monitor["spec"]["selector"]["matchLabels"]
    services = [o for key, o in k8s_objects().items() if key.startswith("Service/")]
    matched = [s for s in services if wanted.items() <= s["metadata"]["labels"].items()]
    assert [s["spec"]["clusterIP"] for s in matched] == ["None"], "exactly the headless Service"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in matched[0]["spec"]["ports"]}
    secret = one("Secret")
    assert endpoint["bearerTokenSecret"] == {"name": secret["metadata"]["name"], "key": "CTXSTORE_ADMIN_TOKEN"}
    assert endpoint["bearerTokenSecret"]["key"] in secret["stringData"]


needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")


def kustomize(path: Path) -> list[dict[str, Any]]:
    run = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    return [d for d in yaml.safe_load_all(run.stdout) if d]


@needs_kubectl
def test_kustomize_renders_the_base() -> None:
    rendered = kustomize(K8S)
    assert sorted(d["kind"] for d in rendered) == sorted(key.split("/")[0] for key in k8s_objects())
    sts = next(d for d in rendered if d["kind"] == "StatefulSet")
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == "ctxstore:0.1.0"


@needs_kubectl
def test_documented_overlay_replaces_the_placeholder_secret(tmp_path: Path) -> None:
    """The overlay of docs/deployment.md, as written there, run against a copy of deploy/kubernetes."""
    block = re.search(r"<!-- overlay -->\s*```yaml\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert block, "docs/deployment.md: the overlay block (marked <!-- overlay -->) is missing"
    shutil.copytree(K8S, tmp_path / "deploy" / "kubernetes")
    overlay = tmp_path / "kv-pod"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(block.group(1))
    subprocess.run([sys.executable, str(DEPLOY / "make_env.py"), str(overlay / "ctxstore.env")], check=True,
                   capture_output=True)
    rendered = kustomize(overlay)
    kinds = sorted(d["kind"] for d in rendered)
    assert "ServiceMonitor" not in kinds and "StatefulSet" in kinds
    (secret,) = [d for d in rendered if d["kind"] == "Secret"]
    assert "stringData" not in secret, "the placeholders would win over data"
    values = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(values) == SECRET_VARIABLES and values == env_file(overlay / "ctxstore.env")
    assert ACCESS_KEY_RE.match(values["CTXSTORE_ACCESS_KEY"])
    assert secret["metadata"]["name"] == "ctxstore"  # no hash suffix: the StatefulSet refers to it by name
    assert {d["metadata"].get("namespace") for d in rendered} == {"kv-cache"}


# -------------------------------------------------------------------- systemd


def unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string(path.read_text())
    return parser


@pytest.mark.parametrize("name", ["ctxstore.service", "ctxstore@.service"])
def test_systemd_unit(name: str) -> None:
    parsed = unit(SYSTEMD / name)
    assert {"Unit", "Service", "Install"} <= set(parsed.sections())
    service = parsed["Service"]
    assert service["EnvironmentFile"] == "/etc/ctxstore/ctxstore.env"
    assert "ctxstore serve" in service["ExecStart"]
    assert service.get("DynamicUser") == "yes" or service.get("User") not in (None, "root")
    assert service["Restart"] == "on-failure"
    assert service["NoNewPrivileges"] == "yes"
    assert service["ProtectSystem"] == "strict"
    assert service["PrivateTmp"] == "yes"
    assert service["KillSignal"] == "SIGTERM"
    settings = env_file(SYSTEMD / "ctxstore.env.example")
    drain = parse_duration(settings.get("CTXSTORE_DRAIN_TIMEOUT", str(default("drain_timeout"))))
    assert parse_duration(service["TimeoutStopSec"]) > drain
    assert headroom_ok(systemd_bytes(service["MemoryMax"]), parse_size(settings["CTXSTORE_MEMORY"]))
    assert parsed["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("name,instance", [("ctxstore.service", "ctxstore.service"),
                                           ("ctxstore@.service", "ctxstore@9000.service")])
def test_systemd_analyze_verify(tmp_path: Path, name: str, instance: str) -> None:
    """systemd itself accepts every directive (the binary path pointed at this checkout's ctxstore)."""
    text = (SYSTEMD / name).read_text().replace("/opt/ctxstore/bin/ctxstore", str(BIN / "ctxstore"))
    (tmp_path / name).write_text(text)
    run = subprocess.run(["systemd-analyze", "verify", str(tmp_path / instance)], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path, check=False)
    assert run.returncode == 0 and not run.stdout.strip() and not run.stderr.strip(), run.stdout + run.stderr


# -------------------------------------------------------------------- docs/deployment.md


def test_deployment_doc_covers_every_form() -> None:
    doc = DOC.read_text()
    for needle in ("docker build -f deploy/Dockerfile", "docker compose -f deploy/compose.yaml up",
                   "kubectl apply", "-k deploy/kubernetes", "systemctl enable --now ctxstore",
                   "ctxstore-headless.<namespace>.svc.cluster.local:9000", "--tls-cert", "--tls-key",
                   "PodDisruptionBudget", "python3 deploy/make_env.py"):
        assert needle in doc, needle


def test_measure_memory_script_runs() -> None:
    run = subprocess.run([sys.executable, str(DEPLOY / "measure_memory.py"), "--budget", "32MiB", "--overfill", "2"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "MiB above the budget" in run.stdout and "(covers this peak)" in run.stdout
