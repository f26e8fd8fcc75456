"""``ctxstore serve`` as an operator runs it: generated credentials on loopback, refusals, flag errors,
graceful SIGTERM, health endpoints, the tenants file, and the generated configuration reference."""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from support import REPO_ROOT
from support.nodes import ACCESS_KEY, SECRET_KEY, Node, free_port, make_client, start_node, wait_ready
from support.cli import run_in_process
from support.raw import RawConn, sign

BIN = Path(sys.executable).parent
ROOT = REPO_ROOT


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any CTXSTORE_* setting (so nothing configured on this machine leaks in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTXSTORE_")}
    env.update(extra)
    return env


def ctxstore(*args: str, env: dict[str, str] | None = None,
             timeout: float = 20) -> subprocess.CompletedProcess[str]:
    """Run the ``ctxstore`` command to completion (for invocations that must refuse to start)."""
    return subprocess.run([str(BIN / "ctxstore"), *args], env=env if env is not None else clean_env(),
                          capture_output=True, text=True, timeout=timeout)


def refused(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``ctxstore ARGS`` in this process with no other CTXSTORE_* setting, for invocations refused before the node
    binds or starts anything (flags, environment, the tenants file). ``test_the_command_refuses_as_the_in_process_
    runs_do`` runs the command itself for such refusals."""
    return run_in_process(args, drop=[name for name in os.environ if name.startswith("CTXSTORE_")], env=env)


def spawn(tmp: Path, *args: str, env: dict[str, str]) -> Node:
    """``ctxstore serve`` on a free loopback port, output to a log file."""
    port = free_port()
    log = tmp / f"serve-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(BIN / "ctxstore"), "serve", "--port", str(port), *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    node = Node(port=port, proc=proc, log=log, env=env)
    try:
        wait_ready(node)
    except BaseException:
        node.stop()
        raise
    return node


@pytest.fixture
def nodes() -> Iterator[list[Node]]:
    started: list[Node] = []
    yield started
    for node in started:
        node.stop()


def get(url: str, method: str = "GET") -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


# -------------------- credentials


def test_generated_credentials_on_loopback(tmp_path: Path, nodes: list[Node]) -> None:
    node = spawn(tmp_path, env=clean_env())
    nodes.append(node)
    out = node.log.read_text()  # type: ignore[union-attr]
    access = re.search(r"AWS_ACCESS_KEY_ID=(\S+)", out)
    secret = re.search(r"AWS_SECRET_ACCESS_KEY=(\S+)", out)
    assert access and secret, out
    assert "generated" in out.lower()
    # The status page link carries the admin token generated with them, not a placeholder.
    token = re.search(r"CTXSTORE_ADMIN_TOKEN=(\S+)", out)
    assert token and f"/_ctx/v1/admin/status#token={token.group(1)}" in out, out
    client = make_client(node.endpoint, access.group(1), secret.group(1))
    client.create_bucket(Bucket="gen-creds")
    client.put_object(Bucket="gen-creds", Key="k", Body=b"v")
    assert client.get_object(Bucket="gen-creds", Key="k")["Body"].read() == b"v"
    # The key pair is this run's own: the test suite's keys are not valid here.
    with pytest.raises(ClientError) as info:
        make_client(node.endpoint).list_buckets()
    assert info.value.response["Error"]["Code"] == "InvalidAccessKeyId"
    # A second run generates a different pair.
    other = spawn(tmp_path, env=clean_env())
    nodes.append(other)
    assert access.group(1) not in other.log.read_text()  # type: ignore[union-attr]


def test_configured_credentials_are_not_printed_or_logged(tmp_path: Path, nodes: list[Node]) -> None:
    node = spawn(tmp_path, "--log-level", "debug",
                 env=clean_env(CTXSTORE_ACCESS_KEY=ACCESS_KEY, CTXSTORE_SECRET_KEY=SECRET_KEY))
    nodes.append(node)
    client = make_client(node.endpoint)
    client.create_bucket(Bucket="logged")
    client.put_object(Bucket="logged", Key="k", Body=b"v")
    with pytest.raises(ClientError):
        make_client(node.endpoint, ACCESS_KEY, SECRET_KEY + "x").get_object(Bucket="logged", Key="k")
    node.stop()
    out = node.log.read_text()  # type: ignore[union-attr]
    assert "AWS_SECRET_ACCESS_KEY" not in out
    assert SECRET_KEY not in out


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_public_bind_without_credentials_is_refused(host: str) -> None:
    # build_tenants refuses before anything is bound, so this never listens on a public address.
    proc = refused("serve", "--host", host, "--port", str(free_port()), env={})
    assert proc.returncode != 0
    message = proc.stdout + proc.stderr
    assert "refusing" in message and host in message and "CTXSTORE_ACCESS_KEY" in message, message
    assert "Traceback" not in message


def test_half_configured_credentials_are_refused() -> None:
    proc = refused("serve", "--port", str(free_port()), env={"CTXSTORE_ACCESS_KEY": ACCESS_KEY})
    assert proc.returncode != 0
    assert "CTXSTORE_SECRET_KEY" in proc.stdout + proc.stderr


@pytest.mark.parametrize("args, needle", [
    (["--memory", "lots"], "--memory"),
    (["--default-ttl", "forever"], "--default-ttl"),
    (["--body-timeout", "-1"], "--body-timeout"),
    (["--tls-cert", "/nonexistent.pem"], "--tls-key"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--memry", "2G"], "did you mean --memory?"),
    (["--port", "99999"], "--port: not a TCP port (1-65535): '99999'"),  # it bound 99999 mod 65536 before
    (["--port", "0"], "--port"),
    (["--max-ttl", "30m"], "default_ttl 1h exceeds --max-ttl 30m"),  # objects silently got 30 min before
    (["--default-ttl", "8d"], "--default-ttl 8d exceeds max_ttl 7d"),
])
def test_bad_flags_give_clear_errors(args: list[str], needle: str) -> None:
    proc = refused("serve", "--port", str(free_port()), *args,
                   env={"CTXSTORE_ACCESS_KEY": ACCESS_KEY, "CTXSTORE_SECRET_KEY": SECRET_KEY})
    assert_flag_error(proc, needle)


def assert_flag_error(proc: subprocess.CompletedProcess[str], needle: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    # The mistake first, in a line of its own, then where the flags are listed: not the usage block.
    assert proc.stderr.startswith("ctxstore serve: error: ") and len(proc.stderr.splitlines()) <= 3, proc.stderr


@pytest.mark.parametrize("args, needle", [
    (["--memry", "2G"], "did you mean --memory?"),
    # Refused only once the node has bound its port and builds its flash tier: never in this process.
    (["--disk", "/nonexistent/ctxstore-flash", "--disk-size", "64MiB"],
     "--disk-size 64 MiB is too small for --disk-segment-size 64 MiB: the flash tier needs at least 3 segments"),
])
def test_the_command_refuses_as_the_in_process_runs_do(args: list[str], needle: str) -> None:
    proc = ctxstore("serve", "--port", str(free_port()), *args,
                    env=clean_env(CTXSTORE_ACCESS_KEY=ACCESS_KEY, CTXSTORE_SECRET_KEY=SECRET_KEY))
    assert_flag_error(proc, needle)


def test_a_failed_start_prints_no_banner_and_no_keys(tmp_path: Path, nodes: list[Node]) -> None:
    # Generated keys printed before a start that fails would send the user to whatever holds the port.
    flash = tmp_path / "flash"
    disk = ["--disk", str(flash), "--disk-size", "64MiB", "--disk-segment-size", "4MiB"]
    first = spawn(tmp_path, *disk, env=clean_env())
    nodes.append(first)
    in_use = ctxstore("serve", "--port", str(first.port), env=clean_env())
    other = ctxstore("serve", "--port", str(free_port()), *disk, env=clean_env())
    for proc, reason in ((in_use, f"cannot listen on 127.0.0.1:{first.port}: Address already in use"),
                         (other, f"flash tier: {flash} is in use by another flash store")):
        out = proc.stdout + proc.stderr
        assert proc.returncode not in (0, None), out
        assert reason in out and "Traceback" not in out, out
        assert [line for line in out.splitlines() if "error" in line.lower() or reason in line] == \
            [line for line in out.splitlines() if reason in line], out  # one line says why
        assert "serving" not in out and "AWS_ACCESS_KEY_ID" not in out and "CTXSTORE_ADMIN_TOKEN" not in out, out


def test_the_banner_gives_the_budget_as_written_and_in_binary_units(tmp_path: Path, nodes: list[Node]) -> None:
    node = spawn(tmp_path, "--memory", "2G", "--max-ttl", "30m", "--default-ttl", "30m", env=clean_env())
    nodes.append(node)
    out = node.log.read_text()  # type: ignore[union-attr]
    assert "(budget 2 GB (1.86 GiB), default TTL 30m)" in out, out  # it said "1.86265 GiB" and "1800 s"


def test_bad_environment_value_names_the_variable() -> None:
    proc = refused("serve", "--port", str(free_port()), env={
        "CTXSTORE_ACCESS_KEY": ACCESS_KEY, "CTXSTORE_SECRET_KEY": SECRET_KEY, "CTXSTORE_MEMORY": "lots"})
    assert proc.returncode == 2
    assert "CTXSTORE_MEMORY" in proc.stderr and "Traceback" not in proc.stderr


# -------------------- lifecycle


def test_health_endpoints(server: Node) -> None:
    for path in ("/_ctx/health/live", "/_ctx/health/ready"):
        status, body = get(server.endpoint + path)
        assert status == 200 and json.loads(body) == {"status": "ok"}
        assert get(server.endpoint + path, "HEAD") == (200, b"")
    assert get(server.endpoint + "/_ctx/health/nope")[0] == 404


def test_sigterm_lets_an_inflight_upload_finish(tmp_path: Path) -> None:
    node = start_node(tmp_path, "--drain-timeout", "10")
    try:
        client = make_client(node.endpoint)
        client.create_bucket(Bucket="drain")
        body = os.urandom(400_000)
        signed = sign(node, "PUT", "/drain/k", headers={"Content-Length": str(len(body))})
        with RawConn(node, timeout=10) as conn:
            conn.send_head("PUT", "/drain/k", signed.headers)
            conn.send(body[:200_000])
            time.sleep(0.2)
            node.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)  # draining now: the process is still there, finishing this request
            assert node.proc.poll() is None
            conn.send(body[200_000:])
            resp = conn.read_response()
            assert resp.status == 200, resp
            assert resp.headers["etag"] == f'"{hashlib.md5(body).hexdigest()}"'
        assert node.proc.wait(10) == 0
    finally:
        node.stop()


def test_sigterm_drain_timeout_bounds_a_stalled_upload(tmp_path: Path) -> None:
    node = start_node(tmp_path, "--drain-timeout", "1", "--body-timeout", "60")
    try:
        make_client(node.endpoint).create_bucket(Bucket="stall")
        signed = sign(node, "PUT", "/stall/k", headers={"Content-Length": "100000"})
        with RawConn(node, timeout=10) as conn:
            conn.send_head("PUT", "/stall/k", signed.headers)
            conn.send(b"x" * 1000)  # ... and never the rest
            time.sleep(0.2)
            started = time.monotonic()
            node.proc.send_signal(signal.SIGTERM)
            code = node.proc.wait(10)
            assert time.monotonic() - started < 5
        assert code == 0
    finally:
        node.stop()


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_sigterm_with_idle_keepalive_clients_exits_promptly(tmp_path: Path, scheme: str) -> None:
    """Pooled client connections sit idle between requests; a drain must not wait for them (over TLS a
    close waits for the client's close_notify, which an idle client never sends)."""
    import boto3
    from botocore.config import Config

    from support.tls import make_self_signed

    args: list[str] = []
    if scheme == "https":
        cert, key = make_self_signed(tmp_path)
        args = ["--tls-cert", str(cert), "--tls-key", str(key)]
    node = start_node(tmp_path, *args, scheme=scheme)  # default drain timeout: 30 s
    try:
        client = boto3.client("s3", endpoint_url=node.endpoint, region_name="us-east-1",
                              aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                              verify=str(tmp_path / "cert.pem") if scheme == "https" else None,
                              config=Config(retries={"max_attempts": 1}, max_pool_connections=4))
        client.create_bucket(Bucket="idle")
        client.put_object(Bucket="idle", Key="k", Body=b"v")  # the pool now holds an idle connection
        started = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(10) == 0
        assert time.monotonic() - started < 5
        client.close()
    finally:
        node.stop()


def test_sigterm_idle_exits_zero(tmp_path: Path) -> None:
    node = start_node(tmp_path)
    started = time.monotonic()
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(10) == 0
    assert time.monotonic() - started < 3


# -------------------- tenants


def test_tenants_file(tmp_path: Path, nodes: list[Node]) -> None:
    keys = {name: ("CTX" + name.upper() + secrets.token_hex(6).upper(), secrets.token_urlsafe(24))
            for name in ("alpha", "beta")}
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps([{"tenant": n, "access_key": a, "secret_key": s}
                                   for n, (a, s) in keys.items()]))
    node = spawn(tmp_path, env=clean_env(CTXSTORE_TENANTS_FILE=str(tenants)))
    nodes.append(node)
    # Nothing generated: the file configured the keys.
    assert "AWS_SECRET_ACCESS_KEY" not in node.log.read_text()  # type: ignore[union-attr]
    alpha = make_client(node.endpoint, *keys["alpha"])
    beta = make_client(node.endpoint, *keys["beta"])
    alpha.create_bucket(Bucket="alpha-bucket")
    alpha.put_object(Bucket="alpha-bucket", Key="k", Body=b"alpha's")
    beta.create_bucket(Bucket="beta-bucket")
    assert [b["Name"] for b in alpha.list_buckets()["Buckets"]] == ["alpha-bucket"]
    assert [b["Name"] for b in beta.list_buckets()["Buckets"]] == ["beta-bucket"]
    for call in (lambda: beta.get_object(Bucket="alpha-bucket", Key="k"),
                 lambda: beta.put_object(Bucket="alpha-bucket", Key="k", Body=b"beta's"),
                 lambda: beta.delete_object(Bucket="alpha-bucket", Key="k"),
                 lambda: beta.list_objects_v2(Bucket="alpha-bucket")):
        with pytest.raises(ClientError) as info:
            call()
        assert info.value.response["Error"]["Code"] in ("AccessDenied", "NoSuchBucket")
    assert alpha.get_object(Bucket="alpha-bucket", Key="k")["Body"].read() == b"alpha's"


@pytest.mark.parametrize("content", ["not json", '[{"tenant": "a", "access_key": "A"}]',
                                     '[{"tenant": "a", "access_key": "AKEY1", "secret_key": "short"}]', None],
                         ids=["not-json", "no-secret", "short-secret", "missing-file"])
def test_bad_tenants_file(tmp_path: Path, content: str | None) -> None:
    tenants = tmp_path / "tenants.json"
    if content is not None:
        tenants.write_text(content)
    proc = refused("serve", "--port", str(free_port()), env={"CTXSTORE_TENANTS_FILE": str(tenants)})
    assert proc.returncode != 0
    assert str(tenants) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# -------------------- docs


def test_configuration_reference_is_generated() -> None:
    doc = ROOT / "docs" / "configuration.md"
    if not doc.exists():
        pytest.skip("docs/configuration.md does not exist yet")
    generated = subprocess.run([sys.executable, "-m", "ctxstore_server.settings"], capture_output=True,
                               text=True, check=True, timeout=30, env=clean_env()).stdout
    assert generated == doc.read_text(), \
        "regenerate: python -m ctxstore_server.settings > docs/configuration.md"


def test_help_lists_every_flag() -> None:
    from ctxstore_server.settings import SETTINGS

    proc = refused("serve", "--help", env={})
    assert proc.returncode == 0
    for setting in SETTINGS:
        flag = "--" + setting.name.replace("_", "-")
        assert (flag in proc.stdout) == setting.flag, flag


def test_a_node_a_failed_test_left_running_is_stopped_when_the_test_ends(tmp_path: Path,
                                                                       pytestconfig: pytest.Config) -> None:
    """The suite's own cleanup (tests/conftest.py), driven as pytest drives it around a test's call."""
    # By its path: "import conftest" finds whichever conftest.py was loaded last (tests/s3 and others have one).
    conftest = pytestconfig.pluginmanager.get_plugin(str(REPO_ROOT / "tests" / "conftest.py"))
    assert conftest is not None

    around_call = conftest.pytest_runtest_call(item=None)
    next(around_call)
    left = start_node(tmp_path)  # the "test" fails here, before its own node.stop()
    view = Node(port=left.port, proc=left.proc)  # another handle on the same process (a shard's, a restart's)
    with pytest.raises(StopIteration):
        next(around_call)
    assert left.proc.poll() is not None and view.proc is left.proc

    kept = start_node(tmp_path)  # a fixture's node, started before the call: the test may make views of it
    around_call = conftest.pytest_runtest_call(item=None)
    next(around_call)
    Node(port=kept.port, proc=kept.proc)
    with pytest.raises(StopIteration):
        next(around_call)
    try:
        assert kept.proc.poll() is None
    finally:
        kept.stop()
