"""Shared fixtures: a real ctxstore node (uvicorn on a free loopback port, in a subprocess) and real
clients talking to it. The helpers themselves live in ``support.nodes``.

Two switches for a run by hand (no test sets them; ``tests/serve/test_shards.py`` and
``tests/client/test_threads.py`` test sharding and threads directly):

- ``CTXSTORE_TEST_WORKERS=N`` makes the session's node a ``--workers N`` node (the tests talk to its first
  shard): e.g. ``CTXSTORE_TEST_WORKERS=2 scripts/test tests/bulk tests/s3`` runs those suites against one.
- ``CTXSTORE_THREADS=N`` (N > 1) is every client's default number of threads; with
  ``CTXSTORE_TEST_SMALL_PARTS=1`` the client cuts even the tests' small calls into parts for them, e.g.
  ``CTXSTORE_THREADS=3 CTXSTORE_TEST_SMALL_PARTS=1 scripts/test tests/client``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.inprocess import scratch_bucket
from support.nodes import (  # noqa: F401  (re-exported for test modules)
    ACCESS_KEY,
    OTHER_ACCESS_KEY,
    OTHER_SECRET_KEY,
    SECRET_KEY,
    STARTED,
    Node,
    free_port,
    make_client,
    serving,
    start_node,
    stop_process,
    wait_ready,
)

# The longest files start first. scripts/test gives each pytest process a whole file at a time, in collection
# order: a file of a minute or more (vLLM processes, a cold mypy, flash nodes killed and restarted) left for
# the end runs alone while the other processes have nothing left to do.
FIRST = ("integrations/test_vllm_connector.py", "flash/test_tier_node.py", "adversarial/test_adv_client.py",
         "architecture/test_types.py", "client/test_threads.py", "admin/test_status_page.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    missing = [name for name in FIRST if not (tests / name).is_file()]
    if missing:  # renamed or removed: say so rather than let it drift to wherever it falls
        raise pytest.UsageError(f"tests/conftest.py FIRST names files that do not exist: {missing}")

    def rank(item: pytest.Item) -> int:
        path = item.path.relative_to(tests).as_posix() if item.path.is_relative_to(tests) else ""
        return FIRST.index(path) if path in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: every file's tests keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Stop the nodes a test started and left running (a failed assertion skips its cleanup): a leftover
    node would hold its port and memory, and its Popen would warn when collected, in a later test. Nodes that
    fixtures start are started before the call and left to their fixtures."""
    first = len(STARTED)
    yield
    leftovers = STARTED[first:]
    STARTED[:] = [proc for proc in STARTED[:first] if proc.poll() is None]
    for proc in leftovers:
        stop_process(proc)


@pytest.fixture(scope="session", autouse=True)
def small_parts() -> Iterator[None]:
    """With ``CTXSTORE_TEST_SMALL_PARTS=1``, a call of a few KiB is split over the client's threads as a large
    one is: the tests' blocks are small, and parts of them must cross threads too."""
    if os.environ.get("CTXSTORE_TEST_SMALL_PARTS") != "1":
        yield
        return
    import ctxstore.core

    saved = ctxstore.core.MIN_PART_BYTES, ctxstore.core.MIN_PART_KEYS
    ctxstore.core.MIN_PART_BYTES = ctxstore.core.MIN_PART_KEYS = 1
    yield
    ctxstore.core.MIN_PART_BYTES, ctxstore.core.MIN_PART_KEYS = saved


@pytest.fixture(scope="session")
def tmp_session(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ctxstore")


@pytest.fixture(scope="session")
def server(tmp_session: Path) -> Iterator[Node]:
    tenants = tmp_session / "tenants.json"
    tenants.write_text(
        '[{"tenant": "other", "access_key": "%s", "secret_key": "%s"}]' % (OTHER_ACCESS_KEY, OTHER_SECRET_KEY)
    )
    workers = int(os.environ.get("CTXSTORE_TEST_WORKERS", "1"))
    memory = f"{512 * workers}MiB"  # 512 MiB for the shard the tests use, whatever the number of shards
    node = start_node(tmp_session, "--memory", memory, "--default-ttl", "1h", "--workers", str(workers),
                      env={"CTXSTORE_TENANTS_FILE": str(tenants), "CTXSTORE_DOMAIN": "s3.ctx.test"})
    yield node
    node.stop()


@pytest.fixture(scope="session")
def s3(server: Node):
    return make_client(server.endpoint)


@pytest.fixture(scope="session")
def s3_other(server: Node):
    return make_client(server.endpoint, OTHER_ACCESS_KEY, OTHER_SECRET_KEY)


@pytest.fixture
def bucket(s3) -> Iterator[str]:
    with scratch_bucket(s3) as name:
        yield name


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Node]]:
    """Three nodes on loopback ports (a pod), shared by a test module."""
    tmp = tmp_path_factory.mktemp("pod")
    with serving([start_node(tmp, "--memory", "256MiB", "--default-ttl", "1h", wait=False) for _ in range(3)]) as nodes:
        yield nodes
