"""The admin API (``/_ctx/v1/admin``) against the node's application in-process (a real node where its log
or its start is what is tested): the bearer token guards every route (and opens
nothing else), each call leaves one audit line without secrets, and the verbs (info, stats, buckets and
their policies, tenants and keys, flush / expire-now, runtime settings) have the effect they promise, as
seen through S3.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError
from ctxstore import wire
from fastapi.routing import APIRoute

from support.inprocess import InProcessNode
from support.nodes import ACCESS_KEY, OTHER_ACCESS_KEY, OTHER_SECRET_KEY, SECRET_KEY, Node, make_client, start_node
from ctxstore_server.admin.api import DOCS_PATHS, PREFIX
from ctxstore_server.app import App
from ctxstore_server.serve import ensure_admin_token
from ctxstore_server.settings import Settings
from ctxstore_server.tenants import TenantRegistry
from support.raw import raw_request, sign

TOKEN = "ctx-admin-" + secrets.token_hex(16)
# The only admin paths served without the token: the API docs and the status page (a page with no data in it,
# whose own calls carry the token). Adding one is a decision, so it means editing this line.
PUBLIC = {f"{PREFIX}/docs", f"{PREFIX}/openapi.json", f"{PREFIX}/status"}
MiB = 1 << 20


# ---------------------------------------------------------------------------- helpers


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)


def request(node: Node | InProcessNode, method: str, path: str, body: Any = None, *,
            token: str | None = TOKEN, headers: dict[str, str] | None = None, raw: bytes | None = None) -> Reply:
    """One HTTP request to ``node`` (``path`` is absolute); ``token`` goes in as ``Authorization: Bearer``."""
    hdrs = dict(headers or {})
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    if data is not None:
        hdrs.setdefault("Content-Type", "application/json")
    if data is not None or method in ("POST", "PUT", "PATCH"):
        hdrs.setdefault("Content-Length", str(len(data or b"")))
    reply = raw_request(node, method, path, hdrs, data or b"")
    return Reply(reply.status, reply.headers, reply.body)


def client_of(node: Node | InProcessNode, access: str = ACCESS_KEY, secret: str = SECRET_KEY) -> Any:
    return node.client(access, secret) if isinstance(node, InProcessNode) else make_client(node.endpoint, access,
                                                                                              secret)


class Admin:
    """Calls to one node's admin API with the right token unless told otherwise."""

    def __init__(self, node: Node | InProcessNode) -> None:
        self.node = node

    def call(self, method: str, path: str, body: Any = None, **kw: Any) -> Reply:
        return request(self.node, method, PREFIX + path, body, **kw)

    def ok(self, method: str, path: str, body: Any = None, status: int = 200) -> Any:
        reply = self.call(method, path, body)
        assert reply.status == status, (method, path, reply.status, reply.body)
        return reply.json

    def stats(self) -> dict[str, Any]:
        return self.ok("GET", "/stats")

    def settings(self) -> dict[str, Any]:
        return self.ok("GET", "/settings")["settings"]


def error_code(exc: pytest.ExceptionInfo[ClientError]) -> str:
    return exc.value.response["Error"]["Code"]


def keys_of(client: Any, bucket: str) -> list[str]:
    return [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]


def expires_at(response: dict[str, Any]) -> float:
    return float(response["ResponseMetadata"]["HTTPHeaders"]["x-ctx-expires-at"])


def bulk_pin(node: Node | InProcessNode, bucket: str, keys: list[str], seconds: float = 300, *,
             access: str = ACCESS_KEY, secret: str = SECRET_KEY) -> int:
    """Pin ``keys`` through the bulk API (SigV4, like S3)."""
    body = wire.encode_keys_request("pin", wire.KeysRequest(keys=keys, seconds=seconds))
    path = wire.path(bucket, "pin")
    signed = sign(node, "POST", path, access=access, secret=secret)
    reply = request(node, "POST", path, token=None, raw=body, headers=signed.headers)
    assert reply.status == 200, reply.body
    head, _ = wire.unpack_head(reply.body, wire.ANY_HEAD)
    return int(head["count"])


def audit_lines(node: Node) -> list[str]:
    assert node.log is not None
    return [line for line in node.log.read_text().splitlines() if "ctxstore.audit" in line]


def admin_routes(*, public: bool = False) -> list[tuple[str, str]]:
    """(method, path) of every API route of the admin application, taken from the application itself, so a
    route added later is covered without touching this file. ``public``: include the PUBLIC ones."""
    app = App(Settings(admin_token="in-process"), TenantRegistry())
    out = []
    for route in app.admin.routes:
        if isinstance(route, APIRoute):
            if public or route.path not in PUBLIC:
                out += [(method, route.path) for method in sorted(route.methods)]
        else:  # only the interactive docs are not API routes; anything else must be looked at
            assert route.path in PUBLIC, route.path
    assert out
    return out


def concrete(path: str) -> str:
    """A path template with its parameters filled in."""
    return re.sub(r"\{[^}]+\}", "no-such-thing", path)


def asgi_call(app: Any, method: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """Drive an ASGI app in-process with one request (no server)."""
    async def run() -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
            "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 9000),
        }

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await app(scope, receive, send)
        return sent

    sent = asyncio.run(run())
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def node() -> Iterator[InProcessNode]:
    """The application with a 64 MiB budget, the token and the tenants ``default`` and ``other``."""
    started = InProcessNode(memory=64 * MiB, admin_token=TOKEN, keep_time=True)
    yield started
    started.close()


@pytest.fixture(scope="module")
def logged_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A real node, for what is read in its log."""
    tmp = tmp_path_factory.mktemp("admin")
    tenants = tmp / "tenants.json"
    tenants.write_text(json.dumps([{"tenant": "other", "access_key": OTHER_ACCESS_KEY,
                                    "secret_key": OTHER_SECRET_KEY}]))
    started = start_node(tmp, "--memory", "64MiB", env={"CTXSTORE_ADMIN_TOKEN": TOKEN,
                                                      "CTXSTORE_TENANTS_FILE": str(tenants)})
    yield started
    started.stop()


@pytest.fixture(scope="module")
def admin(node: InProcessNode) -> Admin:
    return Admin(node)


@pytest.fixture(scope="module")
def client(node: InProcessNode) -> Any:
    return node.client()


@pytest.fixture
def bucket(client: Any, admin: Admin) -> Iterator[str]:
    name = "adm-" + secrets.token_hex(5)
    client.create_bucket(Bucket=name)
    yield name
    admin.ok("POST", "/flush", {"bucket": name})
    client.delete_bucket(Bucket=name)


# ---------------------------------------------------------------------------- the token


BAD_AUTH = {
    "none": {},
    "wrong token": {"Authorization": "Bearer not-the-token"},
    "token with a suffix": {"Authorization": f"Bearer {TOKEN}x"},
    "token prefix": {"Authorization": f"Bearer {TOKEN[:-1]}"},
    "token without scheme": {"Authorization": TOKEN},
    "token as Basic": {"Authorization": "Basic " + base64.b64encode(f"admin:{TOKEN}".encode()).decode()},
    "S3 key pair as Basic": {
        "Authorization": "Basic " + base64.b64encode(f"{ACCESS_KEY}:{SECRET_KEY}".encode()).decode()},
    "S3 secret as Bearer": {"Authorization": f"Bearer {SECRET_KEY}"},
    "S3 access key as Bearer": {"Authorization": f"Bearer {ACCESS_KEY}"},
    "empty Bearer": {"Authorization": "Bearer "},
}


def test_only_the_docs_and_the_status_page_are_public() -> None:
    assert set(DOCS_PATHS) == PUBLIC


def test_every_admin_route_requires_the_token(node: InProcessNode, client: Any) -> None:
    routes = admin_routes()
    # The OpenAPI document lists the same routes (nothing served that the application does not declare).
    doc = request(node, "GET", f"{PREFIX}/openapi.json", token=None).json
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert documented <= set(routes)
    assert len(routes) >= 11
    for method, template in routes:
        path = concrete(template)
        for label, headers in BAD_AUTH.items():
            body = b"{}" if method != "GET" else None
            reply = request(node, method, path, token=None, headers=headers, raw=body)
            assert reply.status == 401, (method, path, label, reply.status, reply.body)
            assert reply.headers.get("www-authenticate") == "Bearer", (method, path, label)
        # A request SigV4-signed with a tenant's S3 keys is not an admin request either.
        signed = sign(node, method, path)
        reply = request(node, method, path, token=None, headers=signed.headers)
        assert reply.status == 401, (method, path, "sigv4", reply.body)
        # A malformed body is not looked at before the token is checked.
        if method != "GET":
            reply = request(node, method, path, token=None, raw=b"{not json")
            assert reply.status == 401, (method, path, "malformed body", reply.status, reply.body)


def test_unauthenticated_calls_change_nothing(node: InProcessNode, admin: Admin, client: Any, bucket: str) -> None:
    client.put_object(Bucket=bucket, Key="keep", Body=b"v")
    before, tenants_before = admin.settings(), admin.ok("GET", "/tenants")
    for token in (None, "wrong"):
        assert admin.call("POST", "/flush", {"bucket": bucket}, token=token).status == 401
        assert admin.call("PUT", "/settings", {"memory": "1MiB"}, token=token).status == 401
        assert admin.call("POST", "/tenants", {"tenant": "intruder"}, token=token).status == 401
        assert admin.call("PATCH", f"/tenants/{ACCESS_KEY}", {"enabled": False}, token=token).status == 401
        assert admin.call("DELETE", f"/tenants/{OTHER_ACCESS_KEY}", token=token).status == 401
        # Unknown routes and wrong methods answer 401 too: nothing is learnt without the token.
        assert admin.call("GET", "/no-such-route", token=token).status == 401
        assert admin.call("DELETE", "/info", token=token).status == 401
    assert keys_of(client, bucket) == ["keep"]
    assert admin.settings() == before
    assert admin.ok("GET", "/tenants") == tenants_before
    assert {ACCESS_KEY, OTHER_ACCESS_KEY} <= {t["access_key"] for t in tenants_before}


def test_the_admin_token_never_opens_s3(node: InProcessNode, client: Any, bucket: str) -> None:
    client.put_object(Bucket=bucket, Key="secret-block", Body=b"payload-xyz")
    for path in ("/", f"/{bucket}", f"/{bucket}/secret-block"):
        reply = request(node, "GET", path)  # Authorization: Bearer <admin token>
        assert reply.status in (400, 403), (path, reply.status)
        code = re.search(rb"<Code>([^<]+)</Code>", reply.body)
        assert code and code.group(1) in (b"AccessDenied", b"InvalidArgument"), reply.body
        assert b"payload-xyz" not in reply.body
    # Nor as an S3 key pair.
    for access, secret in (("admin", TOKEN), (TOKEN, TOKEN)):
        with pytest.raises(ClientError) as info:
            client_of(node, access, secret).list_buckets()
        assert error_code(info) == "InvalidAccessKeyId"


def test_docs_and_openapi_are_served(node: InProcessNode) -> None:
    docs = request(node, "GET", f"{PREFIX}/docs", token=None)
    assert docs.status == 200 and docs.headers["content-type"].startswith("text/html")
    assert b"openapi.json" in docs.body
    doc = request(node, "GET", f"{PREFIX}/openapi.json", token=None)
    assert doc.status == 200
    paths = doc.json["paths"]
    for method, path in admin_routes():
        assert method.lower() in paths[path], (method, path)
    assert TOKEN.encode() not in docs.body + doc.body


def test_the_status_page_loads_without_the_token_and_holds_no_data(node: InProcessNode, client: Any,
                                                                    bucket: str) -> None:
    client.put_object(Bucket=bucket, Key="visible-only-with-token", Body=b"v")
    page = request(node, "GET", f"{PREFIX}/status", token=None)
    assert page.status == 200 and page.headers["content-type"].startswith("text/html")
    for secret_text in (TOKEN, SECRET_KEY, OTHER_SECRET_KEY, bucket, "visible-only-with-token"):
        assert secret_text.encode() not in page.body


@pytest.mark.parametrize("path", ["/_ctx/health/live", "/_ctx/health/ready"])
def test_health_needs_no_token(node: InProcessNode, path: str) -> None:
    get = request(node, "GET", path, token=None)
    assert get.status == 200 and get.json == {"status": "ok"}
    head = request(node, "HEAD", path, token=None)
    assert head.status == 200 and head.body == b""


def test_ensure_admin_token_on_loopback_generates_and_prints() -> None:
    for host in ("127.0.0.1", "localhost", "::1"):
        settings, out = Settings(host=host), io.StringIO()
        ensure_admin_token(settings, out)
        assert len(settings.admin_token) >= 24
        assert f"CTXSTORE_ADMIN_TOKEN={settings.admin_token}" in out.getvalue()
    # A configured token is kept and never printed.
    settings, out = Settings(host="127.0.0.1", admin_token="configured-token"), io.StringIO()
    ensure_admin_token(settings, out)
    assert settings.admin_token == "configured-token" and out.getvalue() == ""
    # Two starts, two tokens.
    a, b = Settings(), Settings()
    ensure_admin_token(a, io.StringIO())
    ensure_admin_token(b, io.StringIO())
    assert a.admin_token != b.admin_token


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "ctx-0.ctx.svc.cluster.local"])
def test_without_a_token_off_loopback_the_admin_api_is_disabled(host: str) -> None:
    settings, out = Settings(host=host), io.StringIO()
    ensure_admin_token(settings, out)
    assert settings.admin_token == ""
    assert "CTXSTORE_ADMIN_TOKEN" in out.getvalue() and "disabled" in out.getvalue()
    app = App(settings, TenantRegistry())
    for method, path in admin_routes(public=True):
        for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer ***"}):
            status, body = asgi_call(app, method, concrete(path), headers)
            assert status == 403, (method, path, status)
            assert b"admin API disabled" in body and b"CTXSTORE_ADMIN_TOKEN" in body
    for path in (f"{PREFIX}/docs", f"{PREFIX}/openapi.json"):
        assert asgi_call(app, "GET", path)[0] == 403
    assert asgi_call(app, "GET", "/_ctx/health/live") == (200, b'{"status":"ok"}')


def test_a_loopback_node_without_a_token_prints_one_that_works(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CTXSTORE_ADMIN_TOKEN", raising=False)
    node = start_node(tmp_path)
    try:
        assert node.log is not None
        found = re.search(r"CTXSTORE_ADMIN_TOKEN=(\S+)", node.log.read_text())
        assert found, node.log.read_text()
        token = found.group(1)
        assert request(node, "GET", f"{PREFIX}/info", token=token).status == 200
        assert request(node, "GET", f"{PREFIX}/info", token=token + "x").status == 401
        assert request(node, "GET", f"{PREFIX}/info", token=TOKEN).status == 401
    finally:
        node.stop()


# ---------------------------------------------------------------------------- audit


def test_every_call_leaves_one_audit_line_without_secrets(logged_node: Node) -> None:
    node, admin = logged_node, Admin(logged_node)
    bucket = "adm-" + secrets.token_hex(5)
    make_client(node.endpoint).create_bucket(Bucket=bucket)
    created = admin.ok("POST", "/tenants", {"tenant": "audited"}, status=201)
    access, secret = created["access_key"], created["secret_key"]
    calls: list[tuple[str, str, Any, str | None, int]] = [
        ("GET", "/info", None, TOKEN, 200),
        ("GET", "/stats", None, TOKEN, 200),
        ("GET", "/buckets", None, TOKEN, 200),
        ("PUT", f"/buckets/{bucket}/policy", {"sliding_ttl": False}, TOKEN, 200),
        ("PUT", f"/buckets/{bucket}/policy", {"default_ttl": -1}, TOKEN, 422),
        ("GET", "/tenants", None, TOKEN, 200),
        ("POST", "/tenants",
         {"tenant": "audited", "access_key": "AUDITKEY00001", "secret_key": "audit-" + secret}, TOKEN, 201),
        ("PATCH", f"/tenants/{access}", {"enabled": False}, TOKEN, 200),
        ("DELETE", f"/tenants/{access}", None, TOKEN, 200),
        ("DELETE", f"/tenants/{access}", None, TOKEN, 404),
        ("POST", "/flush", {"bucket": bucket, "prefix": "x/"}, TOKEN, 200),
        ("POST", "/flush", {"bucket": "no-such-bucket-zz"}, TOKEN, 404),
        ("GET", "/settings", None, TOKEN, 200),
        ("PUT", "/settings", {"memory": "-1"}, TOKEN, 422),
        ("GET", "/info", None, None, 401),
        ("GET", "/info", None, "wrong-token", 401),
        ("POST", "/tenants", {"tenant": "x"}, SECRET_KEY, 401),
    ]
    for method, path, body, token, status in calls:
        before = len(audit_lines(node))
        reply = admin.call(method, path, body, token=token)
        assert reply.status == status, (method, path, reply.body)
        deadline = time.monotonic() + 3
        while len(audit_lines(node)) == before and time.monotonic() < deadline:
            time.sleep(0.01)
        new = audit_lines(node)[before:]
        assert len(new) == 1, (method, path, new)
        line = new[0]
        who = "admin" if status not in (401, 403) else "anonymous"
        assert f"who={who} " in line, line
        assert f"what={method} {PREFIX}{path} " in line, line
        assert f"result={status}" in line, line
    # Docs and health are not audited calls.
    before = len(audit_lines(node))
    request(node, "GET", f"{PREFIX}/openapi.json", token=None)
    request(node, "GET", f"{PREFIX}/docs", token=None)
    request(node, "GET", "/_ctx/health/live", token=None)
    time.sleep(0.1)
    assert len(audit_lines(node)) == before
    assert node.log is not None
    log = node.log.read_text()
    for secret_text in (TOKEN, secret, "audit-" + secret, SECRET_KEY, OTHER_SECRET_KEY):
        assert secret_text not in log
    admin.ok("DELETE", "/tenants/AUDITKEY00001")


# ---------------------------------------------------------------------------- info and stats


def test_info(admin: Admin) -> None:
    from ctxstore import __version__

    first = admin.ok("GET", "/info")
    assert first["version"] == __version__
    assert first["node_id"] and first["uptime"] > 0
    assert first["budget"] == 64 * MiB and 0 <= first["used"] <= first["budget"]
    settings = first["settings"]
    assert settings["admin_token"] == "***" and settings["secret_key"] == "***"
    assert settings["memory"] == 64 * MiB
    reply = admin.call("GET", "/info")
    assert TOKEN.encode() not in reply.body and SECRET_KEY.encode() not in reply.body
    assert OTHER_SECRET_KEY.encode() not in reply.body
    time.sleep(0.02)
    assert admin.ok("GET", "/info")["uptime"] > first["uptime"]


COUNTERS = ("hits", "misses", "puts", "deletes", "evictions", "expirations", "bytes_in", "bytes_out")


def test_stats_follow_s3_traffic_and_reset_keeps_levels(node: InProcessNode, admin: Admin, client: Any,
                                                        bucket: str) -> None:
    g0 = admin.stats()
    assert bucket in g0["buckets"] and g0["buckets"][bucket]["objects"] == 0
    for key, size in (("k1", 100), ("k2", 200), ("k3", 300)):
        client.put_object(Bucket=bucket, Key=key, Body=b"x" * size)
    assert client.get_object(Bucket=bucket, Key="k1")["Body"].read() == b"x" * 100
    client.get_object(Bucket=bucket, Key="k1")["Body"].read()
    with pytest.raises(ClientError):
        client.get_object(Bucket=bucket, Key="absent")
    client.head_object(Bucket=bucket, Key="k2")  # HEAD is not a read of the block
    assert bulk_pin(node, bucket, ["k2"]) == 1
    assert admin.ok("POST", "/flush", {"bucket": bucket, "prefix": "k3", "mode": "expire"}) == {"expired": 1}
    client.delete_object(Bucket=bucket, Key="k1")

    s = admin.stats()
    b = s["buckets"][bucket]
    assert b["objects"] == 1 and b["bytes"] == 200
    assert (b["puts"], b["hits"], b["misses"], b["deletes"], b["expirations"]) == (3, 2, 1, 1, 1)
    assert b["hit_ratio"] == pytest.approx(2 / 3)
    assert b["bytes_in"] == 600 and b["bytes_out"] == 200
    assert b["pinned_bytes"] >= 200 and b["evictions"] == 0
    # The global figures moved by the same amounts.
    for name in COUNTERS + ("objects", "bytes", "pinned_bytes"):
        assert s[name] - g0[name] == b[name], name
    assert s["used"] >= 200 and s["budget"] == 64 * MiB
    # /buckets has the same counters plus owner and policy.
    summary = next(x for x in admin.ok("GET", "/buckets") if x["name"] == bucket)
    assert summary["owner"] == "default"
    assert summary["policy"] == {"default_ttl": None, "sliding_ttl": False, "quota": 0}
    for name in COUNTERS + ("objects", "bytes", "pinned_bytes", "hit_ratio"):
        assert summary[name] == b[name], name

    # reset=true answers the figures before the reset, then counters restart from zero; levels stay.
    r = admin.ok("GET", "/stats?reset=true")
    assert r["buckets"][bucket]["hits"] == 2
    after = admin.stats()
    a = after["buckets"][bucket]
    assert all(a[name] == 0 for name in COUNTERS), a
    assert all(after[name] == 0 for name in COUNTERS), after
    assert a["hit_ratio"] is None and after["hit_ratio"] is None
    assert (a["objects"], a["bytes"], a["pinned_bytes"]) == (1, 200, b["pinned_bytes"])
    assert after["used"] == s["used"] and after["objects"] == s["objects"] and after["bytes"] == s["bytes"]
    # And they move again.
    client.get_object(Bucket=bucket, Key="k2")["Body"].read()
    assert admin.stats()["buckets"][bucket]["hits"] == 1


# ---------------------------------------------------------------------------- buckets and policies


def test_default_ttl_policy_applies_to_later_puts(admin: Admin, client: Any, bucket: str) -> None:
    client.put_object(Bucket=bucket, Key="before", Body=b"v")
    assert admin.ok("PUT", f"/buckets/{bucket}/policy", {"default_ttl": 120}) == {
        "name": bucket, "policy": {"default_ttl": 120, "sliding_ttl": False, "quota": 0}}
    now = time.time()
    put = client.put_object(Bucket=bucket, Key="after", Body=b"v")
    assert expires_at(put) == pytest.approx(now + 120, abs=5)
    assert expires_at(client.head_object(Bucket=bucket, Key="after")) == pytest.approx(now + 120, abs=5)
    # A TTL on the request still wins over the bucket's default.
    explicit = client.put_object(Bucket=bucket, Key="own", Body=b"v", Metadata={"ctx-ttl": "30"})
    assert expires_at(explicit) == pytest.approx(now + 30, abs=5)
    # The object written before keeps the server default (1 h).
    assert expires_at(client.head_object(Bucket=bucket, Key="before")) == pytest.approx(now + 3600, abs=10)
    # The default is capped by the server's max_ttl.
    capped = admin.ok("PUT", f"/buckets/{bucket}/policy", {"default_ttl": 10**9})
    assert capped["policy"]["default_ttl"] == admin.settings()["max_ttl"]
    # The policy is listed with the bucket.
    listed = next(x for x in admin.ok("GET", "/buckets") if x["name"] == bucket)
    assert listed["policy"]["default_ttl"] == capped["policy"]["default_ttl"]


def test_sliding_ttl_policy_extends_expiry_on_read() -> None:
    node = InProcessNode()  # on a fake clock: time passes when the test says so
    client = node.client()
    for name in ("adm-slide", "adm-fixed"):
        client.create_bucket(Bucket=name)
    assert node.admin("PUT", "/buckets/adm-slide/policy", {"default_ttl": 2, "sliding_ttl": True})[0] == 200
    assert node.admin("PUT", "/buckets/adm-fixed/policy", {"default_ttl": 2})[0] == 200
    e_slide = expires_at(client.put_object(Bucket="adm-slide", Key="k", Body=b"s"))
    e_fixed = expires_at(client.put_object(Bucket="adm-fixed", Key="k", Body=b"f"))
    node.advance(1.2)
    read = client.get_object(Bucket="adm-slide", Key="k")
    assert read["Body"].read() == b"s"
    assert expires_at(read) >= e_slide + 1.0
    read = client.get_object(Bucket="adm-fixed", Key="k")
    assert read["Body"].read() == b"f"
    assert expires_at(read) == pytest.approx(e_fixed, abs=0.01)
    node.advance(1.0)  # past both original expiries
    assert client.get_object(Bucket="adm-slide", Key="k")["Body"].read() == b"s"
    with pytest.raises(ClientError) as info:
        client.get_object(Bucket="adm-fixed", Key="k")
    assert error_code(info) == "NoSuchKey"
    node.close()


def test_bucket_quota_policy_evicts_the_buckets_own_lru(admin: Admin, client: Any, bucket: str) -> None:
    neighbour = "adm-nb-" + secrets.token_hex(4)
    client.create_bucket(Bucket=neighbour)
    try:
        client.put_object(Bucket=neighbour, Key="old", Body=b"n" * 1000)  # the oldest object of the node
        for i in range(6):
            client.put_object(Bucket=bucket, Key=f"k{i}", Body=b"b" * 1000)
        client.get_object(Bucket=bucket, Key="k0")["Body"].read()  # k0 becomes the most recently used
        charge = admin.stats()["buckets"][bucket]["charged"] // 6
        quota = int(3.5 * charge)
        reply = admin.ok("PUT", f"/buckets/{bucket}/policy", {"quota": quota})
        assert reply["policy"]["quota"] == quota
        assert keys_of(client, bucket) == ["k0", "k4", "k5"]
        # A later write evicts the bucket's own least recently used object, not the neighbour's older one.
        client.put_object(Bucket=bucket, Key="k6", Body=b"b" * 1000)
        assert keys_of(client, bucket) == ["k0", "k5", "k6"]
        assert keys_of(client, neighbour) == ["old"]
        stats = admin.stats()["buckets"]
        assert stats[bucket]["charged"] <= quota and stats[bucket]["evictions"] == 4
        assert stats[neighbour]["evictions"] == 0
        # quota 0 lifts it.
        admin.ok("PUT", f"/buckets/{bucket}/policy", {"quota": 0})
        client.put_object(Bucket=bucket, Key="k7", Body=b"b" * 1000)
        assert len(keys_of(client, bucket)) == 4
    finally:
        admin.ok("POST", "/flush", {"bucket": neighbour})
        client.delete_bucket(Bucket=neighbour)


@pytest.mark.parametrize("body", [
    {"default_ttl": -1}, {"default_ttl": 0}, {"default_ttl": "soon"}, {"quota": -5}, {"quota": "lots"},
    {"quota": 1.5}, {"sliding_ttl": "maybe"}, {"default-ttl": 60}, {"ttl": 60}, [], "quota",
])
def test_invalid_policy_bodies_are_rejected(admin: Admin, bucket: str, body: Any) -> None:
    before = next(x for x in admin.ok("GET", "/buckets") if x["name"] == bucket)["policy"]
    reply = admin.call("PUT", f"/buckets/{bucket}/policy", body)
    assert reply.status == 422, (body, reply.status, reply.body)
    assert next(x for x in admin.ok("GET", "/buckets") if x["name"] == bucket)["policy"] == before


def test_policy_malformed_json_and_unknown_bucket(admin: Admin, bucket: str) -> None:
    assert admin.call("PUT", f"/buckets/{bucket}/policy", raw=b"{nope").status == 422
    # JSON extensions Python's parser accepts: refused with 422 (not a 500 while echoing them back).
    for raw in (b'{"default_ttl": NaN}', b'{"default_ttl": Infinity}', b'{"quota": 1e400}',
                b'{"quota": NaN}'):
        reply = admin.call("PUT", f"/buckets/{bucket}/policy", raw=raw)
        assert reply.status == 422, (raw, reply.status, reply.body)
        assert reply.json["detail"][0]["loc"][-1] in ("default_ttl", "quota")
    reply = admin.call("PUT", "/buckets/no-such-bucket-qq/policy", {"default_ttl": 5})
    assert reply.status == 404 and reply.json["error"] == "NoSuchBucket"


# ---------------------------------------------------------------------------- tenants


def test_tenant_lifecycle(node: InProcessNode, admin: Admin, client: Any, bucket: str) -> None:
    client.put_object(Bucket=bucket, Key="mine", Body=b"default tenant data")
    created = admin.ok("POST", "/tenants", {"tenant": "team-a"}, status=201)
    access, secret = created["access_key"], created["secret_key"]
    assert created["tenant"] == "team-a" and created["quota"] == 0 and len(secret) >= 30
    # The secret is shown once: never in the list.
    listing = admin.call("GET", "/tenants")
    assert secret.encode() not in listing.body and SECRET_KEY.encode() not in listing.body
    entry = next(t for t in listing.json if t["access_key"] == access)
    assert entry == {"tenant": "team-a", "access_key": access, "enabled": True, "quota": 0, "charged": 0}
    assert all("secret" not in name for t in listing.json for name in t)

    # The new key works at once and sees nothing of the other tenants.
    team = client_of(node, access, secret)
    assert team.list_buckets()["Buckets"] == []
    with pytest.raises(ClientError) as info:
        team.get_object(Bucket=bucket, Key="mine")
    assert error_code(info) in ("AccessDenied", "NoSuchBucket")
    with pytest.raises(ClientError) as info:
        team.list_objects_v2(Bucket=bucket)
    assert error_code(info) in ("AccessDenied", "NoSuchBucket")
    own = "team-a-" + secrets.token_hex(4)
    team.create_bucket(Bucket=own)
    team.put_object(Bucket=own, Key="k", Body=b"team data")
    assert [b["Name"] for b in team.list_buckets()["Buckets"]] == [own]
    assert own not in [b["Name"] for b in client.list_buckets()["Buckets"]]
    with pytest.raises(ClientError) as info:
        client.get_object(Bucket=own, Key="k")
    assert error_code(info) == "AccessDenied"
    charged = next(t for t in admin.ok("GET", "/tenants") if t["access_key"] == access)["charged"]
    assert charged > len(b"team data")

    # Disable: refused on S3 as an unknown key; enable again: works.
    disabled = admin.ok("PATCH", f"/tenants/{access}", {"enabled": False})
    assert disabled["enabled"] is False
    with pytest.raises(ClientError) as info:
        team.list_buckets()
    assert error_code(info) == "InvalidAccessKeyId"
    assert next(t for t in admin.ok("GET", "/tenants") if t["access_key"] == access)["enabled"] is False
    assert admin.ok("PATCH", f"/tenants/{access}", {"enabled": True})["enabled"] is True
    assert team.get_object(Bucket=own, Key="k")["Body"].read() == b"team data"
    # A quota through PATCH.
    assert admin.ok("PATCH", f"/tenants/{access}", {"quota": 10 * MiB})["quota"] == 10 * MiB
    assert next(t for t in admin.ok("GET", "/tenants") if t["access_key"] == access)["quota"] == 10 * MiB

    # A second key for the same tenant reaches the same buckets; deleting the first leaves the second working.
    second = admin.ok("POST", "/tenants", {"tenant": "team-a"}, status=201)
    team2 = client_of(node, second["access_key"], second["secret_key"])
    assert team2.get_object(Bucket=own, Key="k")["Body"].read() == b"team data"
    deleted = admin.ok("DELETE", f"/tenants/{access}")
    assert deleted == {"tenant": "team-a", "access_key": access, "deleted": True}
    with pytest.raises(ClientError) as info:
        team.list_buckets()
    assert error_code(info) == "InvalidAccessKeyId"
    assert access not in [t["access_key"] for t in admin.ok("GET", "/tenants")]
    assert [b["Name"] for b in team2.list_buckets()["Buckets"]] == [own]
    team2.delete_object(Bucket=own, Key="k")
    team2.delete_bucket(Bucket=own)
    admin.ok("DELETE", f"/tenants/{second['access_key']}")
    # The default tenant was never touched.
    assert client.get_object(Bucket=bucket, Key="mine")["Body"].read() == b"default tenant data"


def test_unknown_access_keys_answer_404(admin: Admin) -> None:
    for method, body in (("PATCH", {"enabled": False}), ("PATCH", {"quota": 5}), ("PATCH", {}),
                         ("DELETE", None)):
        reply = admin.call(method, "/tenants/NOSUCHKEY0000", body)
        assert reply.status == 404, (method, body, reply.body)


def test_create_with_a_given_key_pair(node: InProcessNode, admin: Admin) -> None:
    pair = {"tenant": "podwide", "access_key": "PODWIDEKEY000001", "secret_key": "podwide-secret-000001"}
    created = admin.ok("POST", "/tenants", pair, status=201)
    try:
        assert (created["access_key"], created["secret_key"]) == (pair["access_key"], pair["secret_key"])
        pod = client_of(node, pair["access_key"], pair["secret_key"])
        assert pod.list_buckets()["Buckets"] == []
        # The CLI may repeat the same creation on a node that already has it (a retry): same answer.
        assert admin.ok("POST", "/tenants", pair, status=201)["access_key"] == pair["access_key"]
        # The same access key with another secret, or for another tenant, is a conflict and changes nothing.
        assert admin.call("POST", "/tenants", {**pair, "secret_key": "another-secret-01"}).status == 409
        assert admin.call("POST", "/tenants", {**pair, "tenant": "someone-else"}).status == 409
        assert admin.call("POST", "/tenants", {"tenant": "podwide", "access_key": ACCESS_KEY,
                                               "secret_key": "hijack-secret-01"}).status == 409
        assert pod.list_buckets()["Buckets"] == []
        assert client_of(node).list_buckets() is not None  # the default tenant's key still works
        keys = [t for t in admin.ok("GET", "/tenants") if t["access_key"] == pair["access_key"]]
        assert len(keys) == 1 and keys[0]["tenant"] == "podwide"
    finally:
        admin.ok("DELETE", f"/tenants/{pair['access_key']}")


@pytest.mark.parametrize("body", [
    {}, {"tenant": ""}, {"tenant": "has space"}, {"tenant": "x" * 65}, {"tenant": "t", "quota": -1},
    {"tenant": "t", "access_key": "SHORTSECRET01", "secret_key": "s3cr3t7"},
    {"tenant": "t", "access_key": "ONLYACCESSKEY01"},
    {"tenant": "t", "secret_key": "only-the-secret-1"},
    {"tenant": "t", "access_key": "bad key!", "secret_key": "long-enough-secret"},
    {"tenant": "t", "access_key": "ab", "secret_key": "long-enough-secret"},
    {"tenant": "t", "enabled": False},
])
def test_invalid_tenant_creation_is_rejected(admin: Admin, body: dict[str, Any]) -> None:
    before = admin.ok("GET", "/tenants")
    reply = admin.call("POST", "/tenants", body)
    assert reply.status == 422, (body, reply.status, reply.body)
    for value in body.values():  # the error says where and why, without echoing the input (a secret, maybe)
        if isinstance(value, str) and len(value) >= 5:
            assert value.encode() not in reply.body, (value, reply.body)
    assert admin.ok("GET", "/tenants") == before


@pytest.mark.parametrize("body", [{"enabled": "perhaps"}, {"quota": -1}, {"quota": "big"}, {"enable": False}])
def test_invalid_tenant_updates_are_rejected(admin: Admin, body: dict[str, Any]) -> None:
    reply = admin.call("PATCH", f"/tenants/{OTHER_ACCESS_KEY}", body)
    assert reply.status == 422, (body, reply.status, reply.body)
    entry = next(t for t in admin.ok("GET", "/tenants") if t["access_key"] == OTHER_ACCESS_KEY)
    assert entry["enabled"] is True and entry["quota"] == 0


# ---------------------------------------------------------------------------- flush and expire-now


def test_flush_a_prefix_then_the_bucket(admin: Admin, client: Any, bucket: str) -> None:
    for key in ("a/1", "a/2", "ab", "b/1", "c"):
        client.put_object(Bucket=bucket, Key=key, Body=b"v")
    assert admin.ok("POST", "/flush", {"bucket": bucket, "prefix": "a/"}) == {"flushed": 2}
    assert keys_of(client, bucket) == ["ab", "b/1", "c"]
    assert admin.ok("POST", "/flush", {"bucket": bucket, "prefix": "zz"}) == {"flushed": 0}
    assert admin.ok("POST", "/flush", {"bucket": bucket}) == {"flushed": 3}
    assert keys_of(client, bucket) == []
    with pytest.raises(ClientError) as info:
        client.get_object(Bucket=bucket, Key="c")
    assert error_code(info) == "NoSuchKey"
    assert admin.stats()["buckets"][bucket]["objects"] == 0


def test_flush_reaches_every_tenant_and_pinned_blocks(node: InProcessNode, admin: Admin, client: Any,
                                                      bucket: str) -> None:
    other = client_of(node, OTHER_ACCESS_KEY, OTHER_SECRET_KEY)
    name = "adm-other-" + secrets.token_hex(4)
    other.create_bucket(Bucket=name)
    try:
        other.put_object(Bucket=name, Key="p", Body=b"v")
        client.put_object(Bucket=bucket, Key="p", Body=b"v")
        assert bulk_pin(node, bucket, ["p"]) == 1
        assert admin.ok("POST", "/flush", {"bucket": name}) == {"flushed": 1}
        assert admin.ok("POST", "/flush", {"bucket": bucket}) == {"flushed": 1}
        assert keys_of(other, name) == [] and keys_of(client, bucket) == []
        assert admin.stats()["buckets"][bucket]["pinned_bytes"] == 0
    finally:
        other.delete_bucket(Bucket=name)


def test_expire_now(admin: Admin, client: Any, bucket: str) -> None:
    for key in ("x/1", "x/2", "y"):
        client.put_object(Bucket=bucket, Key=key, Body=b"v")
    before = admin.stats()["buckets"][bucket]["expirations"]
    assert admin.ok("POST", "/flush", {"bucket": bucket, "prefix": "x/", "mode": "expire"}) == {"expired": 2}
    assert keys_of(client, bucket) == ["y"]
    with pytest.raises(ClientError):
        client.head_object(Bucket=bucket, Key="x/1")
    assert admin.stats()["buckets"][bucket]["expirations"] == before + 2
    assert admin.ok("POST", "/flush", {"bucket": bucket, "mode": "expire"}) == {"expired": 1}
    assert keys_of(client, bucket) == []


@pytest.mark.parametrize("body,status", [
    ({"bucket": "no-such-bucket-ff"}, 404), ({"bucket": "no-such-bucket-ff", "mode": "expire"}, 404),
    ({}, 422), ({"prefix": "a"}, 422), ({"bucket": "b", "mode": "delete"}, 422), ({"bucket": 5}, 422),
])
def test_invalid_flush_requests(admin: Admin, body: dict[str, Any], status: int) -> None:
    reply = admin.call("POST", "/flush", body)
    assert reply.status == status, (body, reply.body)


# ---------------------------------------------------------------------------- settings


@pytest.fixture(scope="module")
def small_node_started() -> Iterator[InProcessNode]:
    started = InProcessNode(memory=8 * MiB, admin_token=TOKEN, keep_time=True)
    yield started
    started.close()


@pytest.fixture
def small_node(small_node_started: InProcessNode) -> InProcessNode:
    """A node with an 8 MiB budget, emptied and back to its start settings for each test."""
    admin = Admin(small_node_started)
    for summary in admin.ok("GET", "/buckets"):
        admin.ok("POST", "/flush", {"bucket": summary["name"]})
    admin.ok("PUT", "/settings", {"memory": "8MiB", "default_ttl": "1h", "max_ttl": "7d"})
    return small_node_started


def test_get_settings(admin: Admin) -> None:
    reply = admin.ok("GET", "/settings")
    assert set(reply["mutable"]) == {"memory", "default_ttl", "max_ttl"}
    settings = reply["settings"]
    assert settings["memory"] == 64 * MiB and settings["default_ttl"] == 3600
    assert settings["admin_token"] == "***" and settings["secret_key"] == "***"
    assert TOKEN not in json.dumps(reply)


def test_set_ttl_settings(small_node: InProcessNode) -> None:
    admin = Admin(small_node)
    client = small_node.client()
    client.create_bucket(Bucket="ttl")
    assert admin.stats()["objects"] == 0
    reply = admin.ok("PUT", "/settings", {"default_ttl": "2m", "max_ttl": "10m"})
    assert reply["settings"]["default_ttl"] == 120 and reply["settings"]["max_ttl"] == 600
    assert admin.settings()["default_ttl"] == 120
    now = time.time()
    assert expires_at(client.put_object(Bucket="ttl", Key="a", Body=b"v")) == pytest.approx(now + 120, abs=5)
    capped = client.put_object(Bucket="ttl", Key="b", Body=b"v", Metadata={"ctx-ttl": "3600"})
    assert expires_at(capped) == pytest.approx(now + 600, abs=5)
    # Numbers are seconds.
    assert admin.ok("PUT", "/settings", {"default_ttl": 90})["settings"]["default_ttl"] == 90


@pytest.mark.parametrize("body", [
    {"memory": "-1"}, {"memory": -5}, {"memory": 0}, {"memory": "lots"}, {"memory": "4 parsecs"},
    {"default_ttl": "-5"}, {"default_ttl": 0}, {"default_ttl": "soon"}, {"max_ttl": "0s"}, {"max_ttl": -1},
    {"default_ttl": "2h", "max_ttl": "1h"}, {"default_ttl": "8d"}, {"max_ttl": "30m"},
    {"memory": "1MiB", "default_ttl": "2h", "max_ttl": "1h"}, {"memory": "1MiB", "default_ttl": "garbage"},
    {"budget": "1MiB"}, {"memory": [1]}, {"memory": None, "mem": 5}, b'{"memory": NaN}', b'{"memory": 1e400}',
    b'{"default_ttl": Infinity}', b'{"max_ttl": NaN}', b"[]", b"{",
])
def test_invalid_settings_change_nothing(admin: Admin, body: dict[str, Any] | bytes) -> None:
    before, stats_before = admin.settings(), admin.stats()
    if isinstance(body, bytes):
        reply = admin.call("PUT", "/settings", raw=body)
    else:
        reply = admin.call("PUT", "/settings", body)
    assert reply.status in (400, 422), (body, reply.status, reply.body)
    assert "detail" in reply.json
    assert admin.settings() == before
    after = admin.stats()
    assert after["budget"] == stats_before["budget"] and after["evictions"] == stats_before["evictions"]


def test_a_memory_cut_evicts_down_to_the_new_budget(small_node: InProcessNode) -> None:
    admin = Admin(small_node)
    client = small_node.client()
    client.create_bucket(Bucket="fill")
    block = os.urandom(100 * 1024)
    for i in range(40):
        client.put_object(Bucket="fill", Key=f"k{i:02d}", Body=block)
    before = admin.stats()
    assert before["objects"] == 40 and before["used"] > 4_000_000
    reply = admin.ok("PUT", "/settings", {"memory": "1MiB"})
    assert reply["settings"]["memory"] == MiB and reply["over_budget"] == 0 and reply["evicted"] > 0
    after = admin.stats()
    assert after["budget"] == MiB and after["used"] <= after["budget"]
    assert after["evictions"] - before["evictions"] == reply["evicted"]
    assert after["objects"] == 40 - reply["evicted"] and after["objects"] <= 10
    left = keys_of(client, "fill")
    assert len(left) == after["objects"]
    assert left == [f"k{i:02d}" for i in range(40 - len(left), 40)]  # the most recently written stayed
    assert admin.ok("GET", "/info")["budget"] == MiB
    # Writes go on under the new budget, evicting as they need.
    client.put_object(Bucket="fill", Key="new", Body=block)
    assert admin.stats()["used"] <= MiB
    assert client.get_object(Bucket="fill", Key="new")["Body"].read() == block
    # A budget raise is immediate too.
    admin.ok("PUT", "/settings", {"memory": "8MiB"})
    for i in range(20):
        client.put_object(Bucket="fill", Key=f"m{i:02d}", Body=block)
    assert admin.stats()["objects"] >= 21


def test_a_cut_below_pinned_bytes_reports_the_excess(small_node: InProcessNode) -> None:
    admin = Admin(small_node)
    client = small_node.client()
    client.create_bucket(Bucket="pinned")
    block = os.urandom(200 * 1024)
    keys = [f"p{i}" for i in range(10)]
    for key in keys:
        client.put_object(Bucket="pinned", Key=key, Body=block)
    assert bulk_pin(small_node, "pinned", keys[:5]) == 5
    reply = admin.ok("PUT", "/settings", {"memory": "512KiB"})
    assert reply["evicted"] == 5 and reply["over_budget"] > 0
    assert sorted(keys_of(client, "pinned")) == keys[:5]
    stats = admin.stats()
    assert stats["used"] - stats["budget"] == reply["over_budget"]
