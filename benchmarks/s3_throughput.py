"""GET and PUT throughput of 1 MiB (and 64 KiB) objects over S3, ctxstore side by side with a peer.

Command (results go in docs/benchmarks.md):

    apt-get install -y wrk            # the load generator (native, so the client is not the bottleneck)
    .venv/bin/pip install -e '.[bench]'   # the peer: moto's S3 server (Python), among others
    .venv/bin/python benchmarks/s3_throughput.py --rounds 3 --seconds 5

Method: each server runs alone on core 0 (taskset), wrk on core 1 with 8 connections. Requests are signed
once with SigV4 and replayed (S3 accepts a signature until the clock-skew limit, so the load generator does
no hashing). PUT is measured twice: with UNSIGNED-PAYLOAD (what boto3 sends over HTTPS), and with the body's
SHA-256 as x-amz-content-sha256 (what boto3 sends over plain HTTP), which the server must verify. Each round reports requests/s, MB/s and wrk's latency percentiles; the
table gives the median over rounds (p50/p99 latency are medians of the rounds' values).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from ctxstore.sigv4 import Signer

ACCESS, SECRET = "BENCHACCESSKEY000001", "bench-secret-key-000001"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except urllib.error.HTTPError:
            return  # any HTTP answer means it is up
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def signed_headers(method: str, url: str, body: bytes = b"", *, sign_payload: bool = False) -> dict[str, str]:
    """SigV4 headers. ``sign_payload``: x-amz-content-sha256 is the body's SHA-256 (botocore's choice over plain
    HTTP), which the server must verify; otherwise UNSIGNED-PAYLOAD (botocore's choice over HTTPS)."""
    if sign_payload:
        req = AWSRequest(method=method, url=url, data=body)
        S3SigV4Auth(Credentials(ACCESS, SECRET), "s3", "us-east-1").add_auth(req)
        return dict(req.headers.items())
    parts = urllib.parse.urlsplit(url)
    return dict(Signer(ACCESS, SECRET).headers(method, parts.netloc, parts.path))


def s3_request(method: str, url: str, body: bytes = b"") -> None:
    headers = signed_headers(method, url, body)
    urllib.request.urlopen(urllib.request.Request(url, data=body or None, method=method, headers=headers))


LUA = """
wrk.method = "{method}"
{headers}
{body}
"""


def run_wrk(url: str, method: str, headers: dict[str, str], body_file: str | None, seconds: int) -> dict[str, float]:
    lines = [f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items() if k.lower() != "host"]
    body = ""
    if body_file:
        body = f'local f = io.open("{body_file}", "rb"); wrk.body = f:read("*all"); f:close()'
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(LUA.format(method=method, headers="\n".join(lines), body=body))
    out = subprocess.run(
        ["taskset", "-c", "1", "wrk", "-t1", "-c8", f"-d{seconds}s", "--latency", "-s", script.name, url],
        capture_output=True, text=True, check=True,
    ).stdout
    os.unlink(script.name)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))

    def pct(p: str) -> float:
        m = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        value, unit = float(m.group(1)), m.group(2)
        return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value

    return {"rps": rps, "p50": pct("50"), "p99": pct("99"), "errors": int(errors.group(1)) if errors else 0}


def start_ctxstore(port: int) -> subprocess.Popen:
    env = {**os.environ, "CTXSTORE_ACCESS_KEY": ACCESS, "CTXSTORE_SECRET_KEY": SECRET}
    return subprocess.Popen(
        ["taskset", "-c", "0", sys.executable, "-m", "ctxstore_server.serve", "--port", str(port),
         "--memory", "2GiB", "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def start_moto(port: int) -> subprocess.Popen | None:
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent))
    if exe is None:
        return None
    return subprocess.Popen(["taskset", "-c", "0", exe, "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def bench_server(name: str, endpoint: str, sizes: list[int], rounds: int, seconds: int) -> list[dict[str, object]]:
    bucket = "bench"
    s3_request("PUT", f"{endpoint}/{bucket}")
    rows = []
    for size in sizes:
        payload = os.urandom(size)
        with tempfile.NamedTemporaryFile(delete=False) as f:
            f.write(payload)
        url = f"{endpoint}/{bucket}/obj-{size}"
        s3_request("PUT", url, payload)
        for op in ("GET", "PUT", "PUT+sha256"):
            method = op.split("+")[0]
            results = []
            for _ in range(rounds):
                headers = signed_headers(method, url, payload if method == "PUT" else b"",
                                         sign_payload=op.endswith("sha256"))
                results.append(run_wrk(url, method, headers, f.name if method == "PUT" else None, seconds))
            rps = statistics.median(r["rps"] for r in results)
            rows.append({
                "server": name, "op": op, "size": size, "rps": rps, "MBps": rps * size / 1e6,
                "p50_ms": statistics.median(r["p50"] for r in results),
                "p99_ms": statistics.median(r["p99"] for r in results),
                "errors": sum(r["errors"] for r in results),
            })
        os.unlink(f.name)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--sizes", default="65536,1048576")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        print("wrk is missing: apt-get install -y wrk", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    rows: list[dict[str, object]] = []
    servers = [("ctxstore", start_ctxstore), ("moto", start_moto)]
    for name, start in servers:
        port = free_port()
        proc = start(port)
        if proc is None:
            print(f"# {name}: not installed, skipped", file=sys.stderr)
            continue
        try:
            endpoint = f"http://127.0.0.1:{port}"
            wait_http(endpoint + "/")
            rows += bench_server(name, endpoint, sizes, args.rounds, args.seconds)
        finally:
            proc.terminate()
            proc.wait(10)
    print("| server | op | size | req/s | MB/s | p50 ms | p99 ms | non-2xx |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['server']} | {r['op']} | {r['size']} | {r['rps']:.0f} | {r['MBps']:.0f} | "
              f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['errors']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
