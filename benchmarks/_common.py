"""What the benchmark scripts share: starting pinned servers (this checkout's, or a worktree of an earlier
commit's) and stopping exactly those, a node's admin stats, CPU time from /proc, timed ``dd``, interleaved
rounds, medians / p99 / same-round ratios, the run's header, and writing a small PNG plot.

Not a benchmark itself (no command): the scripts of this folder import it (they put this folder on
``sys.path`` first).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from ctxstore.bench import percentile

ACCESS, SECRET = "BENCHACCESSKEY000001", "bench-secret-key-000001"
ADMIN_TOKEN = "bench-admin-token-000001"  # CTXSTORE_ADMIN_TOKEN of the nodes that :class:`Node` starts
SERVER_CORE, CLIENT_CORE = 0, 1
REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


# ---------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the ``finally`` blocks stop every server this benchmark started."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def pin_client() -> bool:
    """Pin this process (and the threads it starts later) to the client core."""
    if len(os.sched_getaffinity(0)) < 2 or (os.cpu_count() or 1) < 2:
        print("# warning: fewer than 2 cores; client and servers are not separated", file=sys.stderr)
        return False
    os.sched_setaffinity(0, {CLIENT_CORE})
    return True


def client_cpu_seconds() -> float:
    """CPU of this process (all threads) plus its finished children (e.g. a curl per call)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) so far, from /proc/<pid>/stat (10 ms ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends it SIGTERM if this benchmark dies, however it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (kept across exec of taskset and the server)


class Processes:
    """Processes started by this benchmark; :meth:`stop` ends exactly these, by their own PIDs."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[bytes], str]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None, *, core: int | str = SERVER_CORE,
              stdin: int | None = None, stdout: int | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` pinned to ``core`` (a core, or a ``taskset -c`` list such as ``"0-7"``; ``taskset`` execs
        it, so the PID is the program's own)."""
        fd, path = tempfile.mkstemp(prefix=f"bench-{name}-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            proc = subprocess.Popen(["taskset", "-c", str(core), *argv], env=env, stdin=stdin,
                                    stdout=stdout if stdout is not None else log, stderr=log,
                                    preexec_fn=_die_with_parent)  # noqa: PLW1509
        self.procs.append((name, proc, path))
        return proc

    def log_tail(self, proc: subprocess.Popen[bytes]) -> str:
        for _, p, path in self.procs:
            if p is proc:
                with open(path, errors="replace") as f:
                    return f.read()[-2000:]
        return ""

    def stop(self) -> None:
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for _, proc, path in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
            os.unlink(path)
        self.procs.clear()


def ctxstore_argv(port: int, memory: str = "2GiB") -> list[str]:
    """A real node, as a user starts one: the ``ctxstore serve`` command of this environment."""
    exe = Path(sys.executable).parent / "ctxstore"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "ctxstore.cli"]
    return [*cmd, "serve", "--port", str(port), "--memory", memory, "--log-level", "warning"]


def start_ctxstore(procs: Processes, port: int, memory: str = "2GiB", source: Path | None = None
                   ) -> subprocess.Popen[bytes]:
    """A node of this environment's ctxstore, or (``source``: a checkout of another commit, e.g. ``git worktree
    add /tmp/before <commit>``) that checkout's server, to measure before and after in the same rounds."""
    env = {**os.environ, "CTXSTORE_ACCESS_KEY": ACCESS, "CTXSTORE_SECRET_KEY": SECRET}
    if source is None:
        return procs.start("ctxstore", ctxstore_argv(port, memory), env)
    return procs.start("ctxstore-baseline", baseline_argv(source, port, memory), {**env, **baseline_env(source)})


def baseline_env(source: Path, *, own_client: bool = False, shim: Path | None = None) -> dict[str, str]:
    """PYTHONPATH that makes ``ctxstore_server`` the server of checkout ``source`` (its folder server/).
    ``own_client``: ``ctxstore`` is that checkout's package too (the definitions its server shares with the
    client: wire format, bucket rules), not this environment's. ``shim``: an empty folder for the package link
    (removed by the caller); else a new temporary one."""
    if not (source / "server" / "serve.py").exists():
        raise RuntimeError(f"{source} is no ctxstore checkout (no server/serve.py)")
    if shim is None:
        shim = Path(tempfile.mkdtemp(prefix="bench-baseline-"))
    (shim / "ctxstore_server").symlink_to((source / "server").resolve())
    return {"PYTHONPATH": f"{source.resolve()}:{shim}" if own_client else str(shim)}


def baseline_argv(source: Path, port: int, memory: str = "2GiB") -> list[str]:
    return [sys.executable, "-m", "ctxstore_server.serve", "--port", str(port), "--memory", memory,
            "--log-level", "warning"]


@contextlib.contextmanager
def git_worktree(rev: str, parent: Path) -> Iterator[Path]:
    """A detached checkout of ``rev`` of this repository (``git worktree add``) under ``parent``, removed with
    its registration afterwards; the working tree of this checkout is not touched."""
    rev = rev.strip()
    if not rev or rev.startswith("-"):
        raise ValueError(f"not a revision: {rev!r}")
    path = parent / f"worktree-{rev.replace('/', '_')}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(path), rev], check=True,
                   timeout=120)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False,
                       timeout=120)
        shutil.rmtree(path, ignore_errors=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], check=False, timeout=60)


class Node:
    """One node started by this benchmark, pinned to the server core, with :data:`ADMIN_TOKEN` for its admin
    API: this environment's ``ctxstore serve``, or (``source``) a checkout's server under this environment's
    Python (:func:`baseline_env` with its own client package; ``shim``: the folder for the package link).
    ``extra``: more ``serve`` options. Stopped with the others by :meth:`Processes.stop`."""

    def __init__(self, procs: Processes, memory: str, *extra: str, source: Path | None = None,
                 shim: Path | None = None, timeout: float = 120) -> None:
        self.procs = procs
        self.port = free_port()
        self.timeout = timeout
        self.env = {**os.environ, "CTXSTORE_ACCESS_KEY": ACCESS, "CTXSTORE_SECRET_KEY": SECRET,
                    "CTXSTORE_ADMIN_TOKEN": ADMIN_TOKEN}
        if source is None:
            self.name, self.argv = "ctxstore", [*ctxstore_argv(self.port, memory), *extra]
        else:
            self.env.update(baseline_env(source, own_client=True, shim=shim))
            self.name, self.argv = "ctxstore-baseline", [*baseline_argv(source, self.port, memory), *extra]
        self.proc = self.start()

    def start(self) -> subprocess.Popen[bytes]:
        """Start (or, after a stop, restart) the node with :attr:`argv`; :attr:`ready_after` is how long it
        took to answer ready."""
        started = time.perf_counter()
        self.proc = self.procs.start(self.name, self.argv, self.env)
        wait_ctxstore(self.procs, self.proc, self.port, timeout=self.timeout)
        self.ready_after = time.perf_counter() - started
        return self.proc

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, Any]:
        """The node's admin stats document (``GET /_ctx/v1/admin/stats``)."""
        req = urllib.request.Request(f"{self.endpoint}/_ctx/v1/admin/stats",
                                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            data: dict[str, Any] = json.load(resp)
            return data


def source_commit(source: Path) -> str:
    """The short commit a checkout is at (a folder that is no checkout, e.g. a ``git archive``: its name)."""
    done = subprocess.run(["git", "-C", str(source), "rev-parse", "--short", "HEAD"], check=False,
                          capture_output=True, text=True, timeout=10)
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else source.name


def wait_ctxstore(procs: Processes, proc: subprocess.Popen[bytes], port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{port}/_ctx/health/ready"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ctxstore on port {port} exited:\n{procs.log_tail(proc)}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    raise RuntimeError(f"ctxstore on port {port} did not become ready in {timeout:g} s")


def wait_port(procs: Processes, proc: subprocess.Popen[bytes], port: int, timeout: float = 30) -> None:
    """Until something accepts TCP connections on 127.0.0.1:``port`` (or the process died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process for port {port} exited:\n{procs.log_tail(proc)}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port} after {timeout:g} s")


def shard_pids(parent: int, n: int, timeout: float = 20) -> list[int]:
    """The PIDs of the ``n`` shard processes of a ``ctxstore serve --workers n`` node (its children)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            pids = []
        if len(pids) == n:
            return pids
        time.sleep(0.1)
    raise RuntimeError(f"the node did not start {n} shards")


# ---------------------------------------------------------------------------- the run's context


def busy_cores(seconds: float = 2.0) -> str:
    """How busy each core was (all processes, before this benchmark starts its own): the noise to expect."""

    def snap() -> dict[str, list[int]]:
        with open("/proc/stat") as f:
            return {p[0]: [int(x) for x in p[1:]] for p in (line.split() for line in f)
                    if p[0].startswith("cpu") and p[0] != "cpu"}

    a = snap()
    time.sleep(seconds)
    b = snap()
    out = []
    for cpu in sorted(a):
        delta = [y - x for x, y in zip(a[cpu], b[cpu], strict=True)]
        idle = delta[3] + delta[4]
        out.append(f"{cpu} {100 * (1 - idle / max(1, sum(delta))):.0f}%")
    return ", ".join(out)


def source_state() -> str:
    """The commit the code under test is at, and whether the working tree (outside docs/) differs from it."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], check=False,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        # docs/ holds results (tables, the plots these scripts rewrite), not the code under test.
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":(exclude)docs"],
                               check=False, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "source: unknown"
    return f"source: {head or 'unknown'}{' + uncommitted changes' if dirty else ''}"


def today() -> str:
    return datetime.date.today().isoformat()


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def tool_version(argv: list[str]) -> str:
    """First line a tool prints about its version ('' when it is missing)."""
    try:
        done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return (done.stdout or done.stderr).strip().splitlines()[0] if (done.stdout or done.stderr).strip() else ""


# ---------------------------------------------------------------------------- measurement


def timed_dd(*args: str) -> float:
    """Seconds one ``dd`` with these operands takes (e.g. ``of=<file> bs=1M count=N oflag=direct``)."""
    t0 = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True, timeout=3600)
    return time.perf_counter() - t0


def vllm_python() -> str:
    """The vLLM venv's python: $CTXSTORE_VLLM_PYTHON, else the one scripts/test installs beside this venv."""
    configured = os.environ.get("CTXSTORE_VLLM_PYTHON")
    if configured:
        return configured
    beside = Path(sys.prefix + "-vllm") / "bin" / "python"
    if not beside.exists():
        raise SystemExit("no vLLM venv: run scripts/test once (it installs it) or set CTXSTORE_VLLM_PYTHON")
    return str(beside)


def distinct_blocks(size: int, n: int) -> list[memoryview]:
    """``n`` different blocks of ``size`` random bytes, without ``n × size`` bytes of urandom."""
    base = memoryview(os.urandom(size + n))
    return [base[i:i + size] for i in range(n)]


def stats(samples: Sequence[float]) -> tuple[float, float]:
    """(median, p99 by nearest rank) of ``samples``."""
    ordered = sorted(samples)
    return statistics.median(ordered), percentile(ordered, 0.99)


@dataclass
class Timed:
    """What a call returns when it measured its own time (a native client timing its own round trip)."""

    result: object
    seconds: float


@dataclass
class Variant:
    """One system in a scenario. ``call`` does one timed operation and returns what must equal ``expect``
    (or a :class:`Timed`); ``prepare`` / ``cleanup`` run before / after it, outside the timed region.
    ``client_pids``: the processes that are the client (None: this process, its threads and finished
    children); ``server_pids``: every server process of the system."""

    system: str
    call: Callable[[], object]
    expect: object
    server_pids: list[int]
    client_pids: list[int] | None = None
    prepare: Callable[[], None] | None = None
    cleanup: Callable[[], None] | None = None
    times: list[float] = field(default_factory=list)
    client_cpu: float = 0.0
    server_cpu: float = 0.0

    def client_seconds(self) -> float:
        if self.client_pids is None:
            return client_cpu_seconds()
        return sum(cpu_seconds(p) for p in self.client_pids)

    def run_once(self) -> None:
        if self.prepare is not None:
            self.prepare()
        s0 = sum(cpu_seconds(p) for p in self.server_pids)
        c0 = self.client_seconds()
        t0 = time.perf_counter()
        got = self.call()
        elapsed = time.perf_counter() - t0
        self.client_cpu += self.client_seconds() - c0
        self.server_cpu += sum(cpu_seconds(p) for p in self.server_pids) - s0
        if isinstance(got, Timed):
            elapsed = got.seconds
            got = got.result
        self.times.append(elapsed)
        if self.cleanup is not None:
            self.cleanup()
        self.check(got)

    def warm(self) -> None:
        if self.prepare is not None:
            self.prepare()
        got = self.call()
        if self.cleanup is not None:
            self.cleanup()
        self.check(got.result if isinstance(got, Timed) else got)

    def check(self, got: object) -> None:
        if got != self.expect:
            raise RuntimeError(f"{self.system}: got {got!r}, expected {self.expect!r}")


def measure(variants: list[Variant], warmup: int, runs: int, budget: float) -> None:
    """Warm-ups, then rounds of one timed call per variant (order reversed every other round, so drifting
    noise hits every system alike), within ``budget`` seconds of rounds."""
    for v in variants:
        for _ in range(warmup):
            v.warm()
    deadline = time.monotonic() + budget
    for r in range(runs):
        if time.monotonic() > deadline:
            print(f"# budget of {budget:g} s reached after {r} rounds", file=sys.stderr)
            break
        for v in (variants if r % 2 == 0 else variants[::-1]):
            v.run_once()


def paired_ratio(base: Sequence[float], other: Sequence[float]) -> float:
    """Median over rounds of other / base (for times: the base's throughput over the other's, per round)."""
    return statistics.median(o / b for o, b in zip(other, base, strict=False))


# ---------------------------------------------------------------------------- plots


def pyplot() -> Any | None:
    """matplotlib's pyplot on the file-only backend, or None (with a message) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib is missing (pip install -e '.[bench]'): no plot written", file=sys.stderr)
        return None
    plt.rcParams.update({"font.size": 8, "axes.titlesize": 9, "legend.fontsize": 7, "figure.dpi": 80})
    return plt


def save_figure(plt: Any, fig: Any, path: Path, note: str) -> None:
    """Write ``fig`` as a small PNG (a few tens of KiB), with ``note`` (date, commit, machine) at the foot."""
    fig.text(0.005, 0.005, note, fontsize=6, color="0.4", ha="left", va="bottom")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=80, metadata={"Software": None})
    plt.close(fig)
    print(f"# plot written to {path} ({path.stat().st_size // 1024} KiB)", file=sys.stderr)
