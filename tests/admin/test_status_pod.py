"""The pod view: ``GET /_ctx/v1/admin/pod`` (a node asks its peers, ``--peers``) and the status page drawing it,
in headless Chromium against a real 3-node pod driven by the ctxstore client; one node is killed during the test
and shows as down.

The page tests also save screenshots; with ``CTXSTORE_SCREENSHOTS=docs/img`` they write the ones
docs/operations.md shows (``docs/img/status-pod.png``, ``status-pod-narrow.png``, ``status-pod-flash.png``), with
a minute of traffic in the charts."""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ctxstore import ContextStore
from ctxstore_server.settings import SETTINGS, resolve
from support import REPO_ROOT
from support import browser as browser_support
from support.browser import full_page_screenshot, open_page, row_cells, severe, text_of, value_of, wait_for
from support.nodes import ACCESS_KEY, SECRET_KEY, Node, free_port, make_client, start_node, wait_ready

TOKEN = "status-pod-token-0001"
STATUS = "/_ctx/v1/admin/status"
POD = "/_ctx/v1/admin/pod"
BLOCK = 64 << 10
HAS_FLASH_TIER = "disk" in {s.name for s in SETTINGS}


def admin(endpoint: str, path: str, token: str = TOKEN, timeout: float = 10) -> Any:
    request = urllib.request.Request(endpoint + path, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.load(resp)


def start_pod(tmp: Path, count: int, *args: str, per_node: Callable[[int], list[str]] = lambda i: []) -> list[Node]:
    """``count`` nodes that all list each other as peers (their ports chosen before they start)."""
    ports = [free_port() for _ in range(count)]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    nodes = [start_node(tmp, "--peers", peers, "--node-id", f"node-{i}", *args, *per_node(i), port=port,
                        wait=False, env={"CTXSTORE_ADMIN_TOKEN": TOKEN}) for i, port in enumerate(ports)]
    for node in nodes:
        wait_ready(node)
    return nodes


@pytest.fixture(scope="module")
def pod3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Node]]:
    # 2 MiB per node, so the traffic below evicts.
    nodes = start_pod(tmp_path_factory.mktemp("status-pod"), 3, "--memory", "2MiB")
    try:
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def drive(nodes: list[Node], bucket: str, prompts: int, blocks: int, seed: int = 0) -> None:
    """Save, look up and restore synthetic prompts through the client, as a worker does."""
    payload = bytes(range(256)) * (BLOCK // 256)
    with ContextStore([n.endpoint for n in nodes], access_key=ACCESS_KEY, secret_key=SECRET_KEY) as store:
        ns = store.namespace(bucket, model="status-pod-test")
        for p in range(prompts):
            tokens = [seed * 1_000_000 + p * 10_000 + t for t in range(blocks * ns.block_size)]
            ns.save(tokens, [payload] * blocks)
            ns.lookup(tokens)
            ns.restore(tokens)


def waves(nodes: list[Node], s3: Any, seconds: float, seed: int = 100) -> None:
    """Traffic that rises and falls for ``seconds`` (bounded: at most one wave per second), with short-lived
    objects so that expirations show too."""
    deadline = time.monotonic() + seconds
    wave = 0
    while time.monotonic() < deadline and wave < seconds:
        started = time.monotonic()
        drive(nodes, "kv-pod-waves", prompts=1 + wave % 6, blocks=8, seed=seed + wave)
        s3.put_object(Bucket="kv-pod-ttl", Key=f"wave/{wave}", Body=b"s", Metadata={"ctx-ttl": "2"})
        wave += 1
        time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))


# -------------------------------------------------------------------- the /pod document


def test_pod_document_lists_every_node_once_and_adds_them_up(pod3: list[Node]) -> None:
    drive(pod3, "kv-pod-doc", prompts=4, blocks=4)
    doc = admin(pod3[0].endpoint, POD)
    assert doc["node"] == "node-0" and doc["nodes_total"] == 3 and doc["nodes_up"] == 3
    assert [n["node_id"] for n in doc["nodes"]] == ["node-0", "node-1", "node-2"]
    assert [n["self"] for n in doc["nodes"]] == [True, False, False]  # recognised among its peers by node id
    assert all(n["status"] == "up" and n["error"] is None for n in doc["nodes"])
    per_node = [admin(n.endpoint, "/_ctx/v1/admin/stats") for n in pod3]
    for key in ("budget", "puts", "bytes_in"):  # counters that no one else moves meanwhile
        assert doc["total"][key] == sum(s[key] for s in per_node), key
    assert doc["total"]["budget"] == 3 * 2 * 1024 * 1024
    bucket = next(b for b in doc["buckets"] if b["name"] == "kv-pod-doc")
    assert bucket["nodes"] == 3 and bucket["puts"] == sum(s["buckets"]["kv-pod-doc"]["puts"] for s in per_node)
    # Every node serves the same view of the pod, marking itself.
    other = admin(pod3[2].endpoint, POD)
    assert [n["self"] for n in other["nodes"]] == [False, False, True]


def test_pod_document_needs_the_token(pod3: list[Node]) -> None:
    with pytest.raises(urllib.error.HTTPError) as info:
        admin(pod3[0].endpoint, POD, token="wrong")
    assert info.value.code == 401
    info.value.close()


@pytest.fixture
def silent_peer() -> Iterator[int]:
    """A peer that accepts connections and never answers (a hung node)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                held.append(conn)
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(2)
    for conn in held:
        conn.close()
    server.close()


def test_a_hung_peer_and_an_unreachable_one_are_down_and_the_node_still_answers(
        tmp_path: Path, silent_peer: int) -> None:
    refused = free_port()  # nothing listens there
    node = start_node(tmp_path, "--peers", f"127.0.0.1:{silent_peer},127.0.0.1:{refused}", "--node-id", "alone",
                      env={"CTXSTORE_ADMIN_TOKEN": TOKEN})
    try:
        doc = admin(node.endpoint, POD)
        by_id = {n["node"]: n for n in doc["nodes"]}
        assert doc["nodes_total"] == 3 and doc["nodes_up"] == 1
        assert by_id["alone"]["self"] and by_id["alone"]["ok"]  # not listed: its own numbers, from memory
        hung = by_id[f"127.0.0.1:{silent_peer}"]
        assert hung["status"] == "down" and "timed out" in hung["error"]
        assert by_id[f"127.0.0.1:{refused}"]["status"] == "down"
        assert "refused" in by_id[f"127.0.0.1:{refused}"]["error"]
        # Meanwhile the node went on serving everything else.
        with urllib.request.urlopen(node.endpoint + "/_ctx/health/ready", timeout=5) as resp:
            assert resp.status == 200
        # A peer that answers with the wrong token is an error, not down.
        other = start_node(tmp_path, env={"CTXSTORE_ADMIN_TOKEN": "another-token"})
        try:
            third = start_node(tmp_path, "--peers", f"127.0.0.1:{other.port}", env={"CTXSTORE_ADMIN_TOKEN": TOKEN})
            try:
                entry = admin(third.endpoint, POD)["nodes"][1]
                assert entry["status"] == "error" and "401" in entry["error"]
            finally:
                third.stop()
        finally:
            other.stop()
    finally:
        node.stop()


def test_peers_setting_is_checked_at_start() -> None:
    assert resolve(env={"CTXSTORE_PEERS": "a:9000, b:9001"}).peers == "a:9000, b:9001"
    assert resolve(env={}).peers == ""
    with pytest.raises(ValueError, match="CTXSTORE_PEERS"):
        resolve(env={"CTXSTORE_PEERS": "a:99999"})
    with pytest.raises(ValueError, match="--peers"):
        resolve(argparse.Namespace(peers="ftp://a:1"), env={})


# -------------------------------------------------------------------- the page


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if not browser_support.available():
        pytest.skip(browser_support.MISSING)
    driver = browser_support.start(tmp_path_factory.mktemp("chromium-profile"), width=WIDE, height=1000)
    yield driver
    driver.quit()


WIDE, NARROW = 1400, 420  # a desktop browser; a phone, or a window beside a terminal


def screenshots(tmp_path: Path) -> Path:
    """Where the screenshots go: ``CTXSTORE_SCREENSHOTS`` (docs/img for the docs), else the test's folder."""
    shot = Path(os.environ.get("CTXSTORE_SCREENSHOTS") or tmp_path)
    if not shot.is_absolute():
        shot = REPO_ROOT / shot
    shot.mkdir(parents=True, exist_ok=True)
    return shot


def screenshot(driver: Any, path: Path, width: int, full_page: bool = True) -> None:
    """The whole page ``width`` px wide, or the top of it in a window 1000 px high. The docs' copies are
    written in 256 colours when Pillow is there: the page's flat colours lose nothing and the PNG shrinks to
    about a third."""
    if full_page:
        full_page_screenshot(driver, path, width=width)
    else:
        driver.set_window_size(width, 1000)
        wait_for(lambda: driver.execute_script("return innerWidth") == width, what=f"a window {width} px wide")
        driver.execute_async_script("window.scrollTo(0, 0); const done = arguments[arguments.length - 1];"
                                    "requestAnimationFrame(() => requestAnimationFrame(() => done()));")
        driver.save_screenshot(str(path))
    if not os.environ.get("CTXSTORE_SCREENSHOTS"):
        return
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
    small.save(path, optimize=True)


# The page redraws its tables and charts on every poll: read them in one script, never through elements
# found earlier (they go stale).

def row_text(driver: Any, node: str, selector: str = "") -> str | None:
    return driver.execute_script(
        "const r = document.querySelector(`#nodes tbody tr[data-node='${arguments[0]}']`);"
        "const e = r && (arguments[1] ? r.querySelector(arguments[1]) : r); return e ? e.textContent : null;",
        node, selector)


def status_of(driver: Any, node: str) -> str | None:
    return driver.execute_script(
        "const r = document.querySelector(`#nodes tbody tr[data-node='${arguments[0]}']`);"
        "return r ? r.dataset.status : null;", node)


def series_points(driver: Any, chart: str) -> dict[str, int]:
    return driver.execute_script(
        "const out = {}; for (const p of document.querySelectorAll(`#${arguments[0]} path.series`))"
        " out[p.dataset.series] = Number(p.dataset.points); return out;", chart)


def test_page_shows_the_pod_moving_and_a_killed_node_as_down(pod3: list[Node], browser: Any, tmp_path: Path) -> None:
    page = pod3[0]
    open_page(browser, f"{page.endpoint}{STATUS}#token={TOKEN}&interval=1")
    wait_for(lambda: value_of(browser, "nodes-up") == 3, what="three nodes up")
    names = [f"127.0.0.1:{n.port}" for n in pod3]
    wait_for(lambda: all(status_of(browser, name) == "up" for name in names), what="a row per node, all up")
    assert value_of(browser, "budget") == 3 * 2 * 1024 * 1024  # the pod's RAM
    assert "peers: 127.0.0.1:" in text_of(browser, "pod-source")
    assert text_of(browser, "pod-source").count(", 127.0.0.1:") == 2  # breaks between addresses, not in one
    assert "(this node)" in row_text(browser, names[0])

    # Traffic through the client: 24 prompts x 8 blocks of 64 KiB = 12 MiB into 6 MiB of RAM -> evictions.
    drive(pod3, "kv-pod-page", prompts=24, blocks=8, seed=1)
    s3 = make_client(pod3[1].endpoint)
    s3.create_bucket(Bucket="kv-pod-ttl")
    for i in range(3):
        s3.put_object(Bucket="kv-pod-ttl", Key=f"short/{i}", Body=b"s", Metadata={"ctx-ttl": "1"})
    wait_for(lambda: (value_of(browser, "evictions-total") or 0) > 0, what="evictions in the pod totals")
    wait_for(lambda: (value_of(browser, "expirations-total") or 0) >= 3, timeout=15, what="expirations")
    # Every node's line in the requests chart has points; the pod's bytes and hits charts too.
    wait_for(lambda: len(series_points(browser, "chart-requests")) == 3
             and min(series_points(browser, "chart-requests").values()) >= 3, timeout=15,
             what="three node lines in the requests chart")
    assert all(v > 0 for v in series_points(browser, "chart-bytes").values())
    assert {"RAM hits", "misses"} <= set(series_points(browser, "chart-hits"))
    assert "flash hits" not in series_points(browser, "chart-hits")  # no flash tier: no flash series
    assert len(series_points(browser, "chart-memory")) == 3
    assert not browser.find_element("id", "card-flash").is_displayed()
    assert row_cells(browser, 'tr[data-bucket="kv-pod-page"]')[1]["text"] == "3"  # on every node

    if os.environ.get("CTXSTORE_SCREENSHOTS"):
        waves(pod3, s3, seconds=60)  # the screenshot for the docs: a minute of traffic in the charts

    # Kill one node: the page (served by another) marks it down; the pod goes on.
    pod3[2].stop()
    wait_for(lambda: status_of(browser, names[2]) == "down", timeout=15, what="the killed node to show down")
    wait_for(lambda: value_of(browser, "nodes-up") == 2, what="two nodes up")
    assert names[2] in text_of(browser, "pod-down")
    assert "refused" in row_text(browser, names[2], ".why")
    assert value_of(browser, "budget") == 2 * 2 * 1024 * 1024  # totals count the nodes that answered
    assert not browser.find_element("id", "notice").is_displayed()  # the page's own node is fine
    drive(pod3[:2], "kv-pod-after", prompts=4, blocks=4, seed=2)  # traffic on the survivors moves the chart on
    if os.environ.get("CTXSTORE_SCREENSHOTS"):
        waves(pod3[:2], s3, seconds=15, seed=200)
    before = series_points(browser, "chart-requests")
    wait_for(lambda: series_points(browser, "chart-requests")[names[0]] > before[names[0]],
             what="the chart to go on after the node died")

    shot = screenshots(tmp_path)
    screenshot(browser, shot / "status-pod.png", WIDE)
    assert (shot / "status-pod.png").stat().st_size > 30_000
    screenshot(browser, shot / "status-pod-narrow.png", NARROW, full_page=False)
    assert (shot / "status-pod-narrow.png").stat().st_size > 10_000
    browser.set_window_size(WIDE, 1000)
    errors = severe(browser)
    assert not errors, f"console errors: {errors}"


@pytest.mark.skipif(not HAS_FLASH_TIER, reason="this node has no flash tier setting (`disk`) yet")
def test_page_shows_the_flash_tier_when_a_node_has_one(tmp_path: Path, browser: Any) -> None:
    nodes = start_pod(tmp_path, 2, "--memory", "2MiB", "--disk-size", "64MiB", "--disk-segment-size", "8MiB",
                      per_node=lambda i: ["--disk", str(tmp_path / f"flash-{i}")])
    try:
        open_page(browser, f"{nodes[0].endpoint}{STATUS}#token={TOKEN}&interval=1")
        wait_for(lambda: value_of(browser, "nodes-up") == 2, what="two nodes up")
        wait_for(lambda: browser.find_element("id", "card-flash").is_displayed(), what="the flash card")
        assert value_of(browser, "disk-budget") == 2 * 64 * 1024 * 1024
        drive(nodes, "kv-pod-flash", prompts=16, blocks=8, seed=3)  # 8 MiB into 4 MiB of RAM: demotions
        wait_for(lambda: (value_of(browser, "disk-objects") or 0) > 0, timeout=20, what="blocks on flash")
        # Read the early prompts again: RAM no longer holds them, flash does.
        drive(nodes, "kv-pod-flash", prompts=4, blocks=8, seed=3)
        wait_for(lambda: (value_of(browser, "hit-ratio-flash") or 0) > 0, timeout=20, what="hits served from flash")
        assert "flash hits" in series_points(browser, "chart-hits")
        assert {"from RAM", "from flash", "demoted to flash"} <= set(series_points(browser, "chart-evictions"))
        wait_for(lambda: "MiB / 64.0 MiB" in (row_text(browser, f"127.0.0.1:{nodes[0].port}") or ""),
                 what="the node's flash use in its row")
        if os.environ.get("CTXSTORE_SCREENSHOTS"):  # the screenshot for the docs: half a minute of traffic
            s3 = make_client(nodes[1].endpoint)
            s3.create_bucket(Bucket="kv-pod-ttl")
            waves(nodes, s3, seconds=30, seed=300)
            drive(nodes, "kv-pod-waves", prompts=6, blocks=8, seed=300)  # the first waves, back from flash
        # 1440 px: the flash tier's columns make the node table wider than 1400 px.
        screenshot(browser, screenshots(tmp_path) / "status-pod-flash.png", 1440)
        browser.set_window_size(WIDE, 1000)
        errors = severe(browser)
        assert not errors, f"console errors: {errors}"
    finally:
        for node in nodes:
            node.stop()
