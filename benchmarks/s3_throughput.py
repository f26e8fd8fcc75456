"""S3 GET and PUT throughput, side by side: a ctxstore node against nginx, the bare ASGI ceiling (or a Go
in-memory S3 server, gofakes3, when a binary is given) and moto, driven by wrk. Writes
docs/benchmarks-s3.png.

Command (from the repository root; results go in docs/benchmarks.md):

    apt-get install -y wrk nginx                 # the native load generator; nginx (static files + WebDAV PUT)
    .venv/bin/pip install -e '.[bench]'                # moto's S3 server, matplotlib
    .venv/bin/python benchmarks/s3_throughput.py       # defaults: --rounds 3 --seconds 4
                                                       #   --cases GET:65536,PUT:65536,GET:1048576
    # optional: --gofakes3 /path/to/gofakes3 (a binary built elsewhere: it is no Debian package)
    # optional: --baseline DIR, a checkout of an earlier commit (git worktree add DIR COMMIT): its server runs
    #   in the same rounds as one more peer, "ctxstore before (<commit>)": before/after under the same load

A server that is not installed (or does not start) is skipped with a message; the run goes on without it.

Servers, each pinned to core 0 (``taskset -c 0``), all on 127.0.0.1:

- ctxstore: one node as a user starts it (``ctxstore serve --port P --memory 2GiB``). Every request carries
  SigV4 headers, signed once (``UNSIGNED-PAYLOAD``) and replayed by wrk: S3 accepts a signature until the
  clock-skew limit, so the load generator does no hashing while the server verifies every request.
  ``PUT+sha256`` (optional case) signs the body's SHA-256 instead, as boto3 does over plain HTTP.
- ASGI ceiling (``benchmarks/asgi_ceiling.py``): uvicorn + uvloop + httptools, the stack ctxstore runs on,
  with a bare ASGI handler over a dict: no routing, authentication, S3 headers or ETag. It stands in for the
  Go server unless ``--gofakes3`` names a binary: gofakes3 is not packaged by Debian and is only published
  as a Go module; Debian's Go (golang-go 1.19) installs here, but the Go module proxy does not resolve from
  these machines, so ``go install github.com/johannesboyne/gofakes3/cmd/gofakes3@v1.2.0`` cannot fetch it.
- gofakes3 (only with ``--gofakes3``): ``-backend memory -initialbucket bench -quiet``.
- nginx (1 process: ``master_process off``): GET of a static file (sendfile) from tmpfs; PUT through
  ngx_http_dav_module (``dav_methods PUT``), which writes the body to a file on tmpfs and renames it into
  place.
- moto (``moto_server``): the Python S3 mock.

Every server gets the same requests (the same signed headers; the others ignore them). Method: for each of
``--rounds`` rounds, each case runs wrk (1 thread, 8 connections, pinned to core 1) for ``--seconds``
against every server in turn, the order reversed every other round. Reported per case and server: the
median over rounds of req/s (and MB/s), the medians of wrk's p50 and p99 latency, ctxstore's req/s over
this server's (from the medians, and the median of the same-round ratios), the server's CPU per request and
per GB moved (from /proc/<pid>/stat around each wrk run), and errors: non-2xx answers plus wrk's socket
errors and time-outs (a server with any has an upper-bound figure). On a shared machine read the same-round ratios and the CPU columns.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    ACCESS,
    CLIENT_CORE,
    DOCS,
    SECRET,
    SERVER_CORE,
    Processes,
    busy_cores,
    cpu_seconds,
    exit_on_sigterm,
    free_port,
    pyplot,
    save_figure,
    source_commit,
    source_state,
    start_ctxstore,
    stats,
    today,
    tool_version,
    version,
    wait_ctxstore,
    wait_port,
)
from ctxstore.sigv4 import Signer

BUCKET = "bench"
PLOT = DOCS / "benchmarks-s3.png"
NGINX_CONF = """\
daemon off;
master_process off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    tcp_nodelay on;
    keepalive_requests 10000000;
    keepalive_timeout 300s;
    client_max_body_size 0;
    client_body_buffer_size 2m;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    types {{ }}
    default_type application/octet-stream;
    server {{
        listen 127.0.0.1:{port};
        root {dir}/root;
        location / {{
            dav_methods PUT;
            create_full_put_path on;
        }}
    }}
}}
"""


class Unavailable(Exception):
    """A server that is not installed here or did not start: its column is skipped."""


@dataclass
class Server:
    name: str
    endpoint: str
    pids: list[int]
    create_bucket: bool = True
    files: Path | None = None  # nginx: objects are files under this folder


@dataclass
class Result:
    rps: list[float] = field(default_factory=list)
    p50: list[float] = field(default_factory=list)
    p99: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # server CPU seconds per request, per round
    errors: int = 0


# ---------------------------------------------------------------------------- requests


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
    headers = {**signed_headers(method, url, body), **BODY_TYPE}
    urllib.request.urlopen(urllib.request.Request(url, data=body or None, method=method, headers=headers),
                           timeout=30).close()


# Sent with every PUT (not signed): without it urllib says form data, and moto then parses the body as a form.
BODY_TYPE = {"content-type": "application/octet-stream"}

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
    fd, script = tempfile.mkstemp(prefix="bench-wrk-", suffix=".lua")
    with os.fdopen(fd, "w") as f:
        f.write(LUA.format(method=method, headers="\n".join(lines), body=body))
    try:
        out = subprocess.run(
            ["taskset", "-c", str(CLIENT_CORE), "wrk", "-t1", "-c8", f"-d{seconds}s", "--latency", "-s", script, url],
            capture_output=True, text=True, check=True, timeout=seconds + 30,
        ).stdout
    finally:
        os.unlink(script)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    socket_errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    if rps is None or total is None:
        raise RuntimeError(f"wrk printed no figures:\n{out}")

    def pct(p: str) -> float:
        m = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", out, re.MULTILINE)
        if m is None:
            return float("nan")
        value, unit = float(m.group(1)), m.group(2)
        return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value

    n_errors = int(errors.group(1)) if errors else 0
    if socket_errors:
        n_errors += sum(int(x) for x in socket_errors.groups())
    return {"rps": float(rps.group(1)), "requests": float(total.group(1)), "p50": pct("50"), "p99": pct("99"),
            "errors": n_errors}


# ---------------------------------------------------------------------------- servers


def start_ctx(procs: S3Processes, workdir: str, args: argparse.Namespace) -> Server:
    port = free_port()
    proc = start_ctxstore(procs, port)
    wait_ctxstore(procs, proc, port)
    return Server("ctxstore", f"http://127.0.0.1:{port}", [proc.pid])


def start_baseline(procs: S3Processes, workdir: str, args: argparse.Namespace) -> Server:
    if args.baseline is None:
        raise Unavailable("no --baseline checkout given")
    port = free_port()
    proc = start_ctxstore(procs, port, source=args.baseline)
    wait_ctxstore(procs, proc, port)
    return Server(f"ctxstore before ({source_commit(args.baseline)})", f"http://127.0.0.1:{port}", [proc.pid])


def start_asgi(procs: S3Processes, workdir: str, args: argparse.Namespace) -> Server:
    try:
        import httptools  # noqa: F401
        import uvicorn  # noqa: F401
        import uvloop  # noqa: F401
    except ImportError as exc:
        raise Unavailable(f"{exc.name} missing: pip install -e '.[bench]'") from exc
    port = free_port()
    proc = procs.start("asgi", [sys.executable, str(Path(__file__).with_name("asgi_ceiling.py")), "--port", str(port)])
    wait_port(procs, proc, port)
    return Server("ASGI ceiling", f"http://127.0.0.1:{port}", [proc.pid])


def start_gofakes3(procs: S3Processes, workdir: str, args: argparse.Namespace) -> Server:
    exe = args.gofakes3 or shutil.which("gofakes3")
    if not exe:
        raise Unavailable("no gofakes3 binary (--gofakes3 PATH): it is no Debian package and only a Go module, and "
                          "the Go module proxy is not reachable here (Debian's Go installs, cannot fetch it); the "
                          "ASGI ceiling stands in for it")
    port = free_port()
    proc = procs.start("gofakes3", [exe, "-backend", "memory", "-host", f"127.0.0.1:{port}",
                                    "-initialbucket", BUCKET, "-quiet"])
    wait_port(procs, proc, port)
    return Server("gofakes3", f"http://127.0.0.1:{port}", [proc.pid], create_bucket=False)


def start_nginx(procs: S3Processes, workdir: str, args: argparse.Namespace) -> Server:
    exe = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if exe is None:
        raise Unavailable("nginx missing: apt-get install -y nginx")
    # tmpfs, so that a GET reads and a PUT writes memory, as the in-memory servers do.
    base = Path(tempfile.mkdtemp(prefix="bench-nginx-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    for sub in ("root/" + BUCKET, "body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    for path in [base, *base.rglob("*")]:
        path.chmod(0o777)  # whoever nginx runs as may write there
    port = free_port()
    conf = base / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=base, port=port))
    proc = procs.start("nginx", [exe, "-c", str(conf), "-p", str(base), "-e", str(base / "error.log")])
    procs.cleanups.append(lambda: shutil.rmtree(base, ignore_errors=True))
    wait_port(procs, proc, port)
    return Server("nginx", f"http://127.0.0.1:{port}", [proc.pid], create_bucket=False, files=base / "root")


def start_moto(procs: S3Processes, workdir: str, args: argparse.Namespace) -> Server:
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
    if exe is None:
        raise Unavailable("moto_server missing: pip install -e '.[bench]' (moto[server])")
    port = free_port()
    proc = procs.start("moto", [exe, "-H", "127.0.0.1", "-p", str(port)])
    wait_port(procs, proc, port)
    return Server("moto", f"http://127.0.0.1:{port}", [proc.pid])


STARTERS: dict[str, Callable[[S3Processes, str, argparse.Namespace], Server]] = {
    "ctxstore": start_ctx, "baseline": start_baseline, "gofakes3": start_gofakes3, "asgi": start_asgi, "nginx": start_nginx, "moto": start_moto,
}


class S3Processes(Processes):
    """Processes plus folder clean-ups to run after they stopped."""

    def __init__(self) -> None:
        super().__init__()
        self.cleanups: list[Callable[[], None]] = []

    def stop(self) -> None:
        super().stop()
        for cleanup in self.cleanups:
            cleanup()
        self.cleanups.clear()


# ---------------------------------------------------------------------------- the run


def parse_cases(text: str) -> list[tuple[str, int]]:
    cases = []
    for item in text.split(","):
        op, size = item.split(":")
        if op not in ("GET", "PUT", "PUT+sha256"):
            raise ValueError(f"unknown operation {op!r} (GET, PUT, PUT+sha256)")
        cases.append((op, int(size)))
    return cases


def prepare(server: Server, cases: Sequence[tuple[str, int]], payloads: dict[int, bytes]) -> None:
    if server.create_bucket:
        s3_request("PUT", f"{server.endpoint}/{BUCKET}")
    for size in sorted({s for _, s in cases}):
        if server.files is not None:
            (server.files / BUCKET / f"obj-{size}").write_bytes(payloads[size])
        else:
            s3_request("PUT", f"{server.endpoint}/{BUCKET}/obj-{size}", payloads[size])
        with urllib.request.urlopen(urllib.request.Request(
                f"{server.endpoint}/{BUCKET}/obj-{size}",
                headers=signed_headers("GET", f"{server.endpoint}/{BUCKET}/obj-{size}")), timeout=30) as resp:
            if resp.read() != payloads[size]:
                raise RuntimeError(f"{server.name}: GET of obj-{size} does not return what was stored")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=4, help="length of one wrk run")
    parser.add_argument("--cases", default="GET:65536,PUT:65536,GET:1048576",
                        help="OP:SIZE,... with OP in GET, PUT, PUT+sha256")
    parser.add_argument("--servers", default="ctxstore,baseline,gofakes3,asgi,nginx,moto")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a checkout of an earlier commit: its server runs as one more peer (before/after)")
    parser.add_argument("--gofakes3", default=None, help="a gofakes3 binary to include as a peer")
    parser.add_argument("--plot", type=Path, default=PLOT, help="where to write the PNG")
    args = parser.parse_args()
    if not 1 <= args.rounds <= 20 or not 1 <= args.seconds <= 60:
        parser.error("--rounds must be 1..20 and --seconds 1..60")
    if shutil.which("wrk") is None:
        print("wrk is missing: apt-get install -y wrk", file=sys.stderr)
        return 2
    cases = parse_cases(args.cases)
    exit_on_sigterm()
    busy = busy_cores()
    load0 = os.getloadavg()
    started = time.monotonic()
    procs = S3Processes()
    workdir = tempfile.mkdtemp(prefix="bench-s3-")
    servers: list[Server] = []
    skipped: list[str] = []
    results: dict[tuple[int, str], Result] = {}
    payloads = {size: os.urandom(size) for size in {s for _, s in cases}}
    try:
        for name in args.servers.split(","):
            if name == "baseline" and args.baseline is None:
                continue  # only with --baseline
            try:
                server = STARTERS[name](procs, workdir, args)
                prepare(server, cases, payloads)
                servers.append(server)
            except (Unavailable, RuntimeError, OSError, urllib.error.URLError) as exc:
                print(f"# {name}: skipped: {exc}", file=sys.stderr)
                skipped.append(f"{name}: {exc}")
        if not servers or servers[0].name != "ctxstore":
            raise RuntimeError("ctxstore did not start: nothing to compare")
        files = {}
        for size, data in payloads.items():
            path = os.path.join(workdir, f"body-{size}")
            with open(path, "wb") as f:
                f.write(data)
            files[size] = path
        for r in range(args.rounds):
            for ci, (op, size) in enumerate(cases):
                method = op.split("+")[0]
                for server in (servers if r % 2 == 0 else servers[::-1]):
                    url = f"{server.endpoint}/{BUCKET}/obj-{size}"
                    headers = signed_headers(method, url, payloads[size] if method == "PUT" else b"",
                                             sign_payload=op.endswith("sha256"))
                    if method == "PUT":
                        headers.update(BODY_TYPE)
                    s0 = sum(cpu_seconds(p) for p in server.pids)
                    out = run_wrk(url, method, headers, files[size] if method == "PUT" else None, args.seconds)
                    cpu = sum(cpu_seconds(p) for p in server.pids) - s0
                    res = results.setdefault((ci, server.name), Result())
                    res.rps.append(out["rps"])
                    res.p50.append(out["p50"])
                    res.p99.append(out["p99"])
                    res.cpu.append(cpu / max(1.0, out["requests"]))
                    res.errors += int(out["errors"])
    finally:
        procs.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    load1 = os.getloadavg()
    state = source_state()
    print(f"s3_throughput, {today()}: {os.cpu_count()} CPUs, each server on core {SERVER_CORE}, wrk (1 thread, "
          f"8 connections) on core {CLIENT_CORE}; {args.rounds} rounds of {args.seconds} s per case and server; "
          f"took {time.monotonic() - started:.0f} s; load average {load0[0]:.1f} → {load1[0]:.1f}; cores busy with "
          f"other work just before: {busy}")
    print(f"Python {sys.version.split()[0]}, ctxstore {version('ctxstore')} ({state}); "
          f"{tool_version(['wrk', '-v']).split(' [')[0]}; "
          f"{tool_version(['nginx', '-v']) or 'nginx not installed'}; moto {version('moto')}, "
          f"uvicorn {version('uvicorn')}, uvloop {version('uvloop')}, httptools {version('httptools')}")
    for s in skipped:
        print(f"skipped {s}")
    print()
    print_table(cases, servers, results)
    plot(cases, servers, results, args.plot, f"benchmarks/s3_throughput.py, {today()}, {state}, "
                                             f"load {load0[0]:.1f}→{load1[0]:.1f}")
    return 0


def _label(op: str, size: int) -> str:
    return f"{op} {size >> 20} MiB" if size >= 1 << 20 else f"{op} {size >> 10} KiB"


def print_table(cases: Sequence[tuple[str, int]], servers: Sequence[Server],
                results: dict[tuple[int, str], Result]) -> None:
    print("| case | server | req/s | MB/s | p50 ms | p99 ms | ctxstore ÷ this (same-round) | server CPU µs/req | "
          "server CPU s/GB | errors |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    summary = []
    for ci, (op, size) in enumerate(cases):
        base = results[(ci, "ctxstore")]
        parts = []
        for server in servers:
            res = results[(ci, server.name)]
            rps = statistics.median(res.rps)
            ratio = "–"
            if server.name != "ctxstore":
                same = statistics.median(b / o for b, o in zip(base.rps, res.rps, strict=True))
                ratio = f"{statistics.median(base.rps) / rps:.2f} ({same:.2f})"
                parts.append(f"{same:.2f}× {server.name}")
            cpu = statistics.median(res.cpu)
            print(f"| {_label(op, size)} | {server.name} | {rps:.0f} | {rps * size / 1e6:.0f} | "
                  f"{statistics.median(res.p50):.2f} | {stats(res.p99)[0]:.2f} | {ratio} | {cpu * 1e6:.0f} | "
                  f"{cpu / (size / 1e9):.3f} | {res.errors} |")
        summary.append(f"- {_label(op, size)}: {', '.join(parts) if parts else 'no peer ran'}")
    print()
    print("Same-round ratios, ctxstore's req/s over each (median of per-round ratios; below 1: ctxstore slower):")
    print()
    for line in summary:
        print(line)


def plot(cases: Sequence[tuple[str, int]], servers: Sequence[Server], results: dict[tuple[int, str], Result],
         path: Path, note: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    colours = {"ctxstore": "#1f77b4", "gofakes3": "#2ca02c", "ASGI ceiling": "#9467bd", "nginx": "#7f7f7f",
               "moto": "#d62728"}
    fig, axes = plt.subplots(1, len(cases), figsize=(3.3 * len(cases), 3.0), squeeze=False)
    for ci, ((op, size), ax) in enumerate(zip(cases, axes[0], strict=True)):
        base = statistics.median(results[(ci, "ctxstore")].rps)
        names = [s.name for s in servers]
        values = [statistics.median(results[(ci, n)].rps) for n in names]
        ax.bar(range(len(names)), values,
               color=["#aec7e8" if n.startswith("ctxstore before") else colours.get(n, "#8c564b") for n in names])
        for i, (n, v) in enumerate(zip(names, values, strict=True)):
            text = f"{v / 1000:.1f}k" if n == "ctxstore" else f"{v / base:.2f}×"
            ax.text(i, v, text, ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(names)), names, rotation=25, fontsize=6)
        ax.set_title(f"{_label(op, size)} (label: server ÷ ctxstore)", fontsize=8)
        ax.set_ylabel("req/s (median)")
        ax.margins(y=0.15)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    save_figure(plt, fig, path, note)


if __name__ == "__main__":
    sys.exit(main())
