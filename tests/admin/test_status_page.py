"""The status page (GET /_ctx/v1/admin/status) of one node without peers, in a real headless Chromium driven by
selenium: it loads without the token but holds none (and answers HEAD), shows the node's numbers, follows S3
traffic, reports a wrong token in the page, hides the token field once connected, and logs no console errors.
Its layout is measured in the DOM at a wide and a narrow window: figures never break between number and unit
and fit their cards, the cards fill their rows evenly, chart axes have distinct ticks, round binary steps on
byte axes. The pod view (peers, a node going down) is test_status_pod.py."""

from __future__ import annotations

import http.client
import itertools
import json
import re
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from support import browser as browser_support
from support.browser import open_page, row_cells, severe, text_of, value_of, wait_for
from support.nodes import Node, make_client, start_node

TOKEN = "status-page-token-" + secrets.token_hex(8)
STATUS = "/_ctx/v1/admin/status"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    # A small budget so the traffic below evicts.
    n = start_node(tmp_path_factory.mktemp("status-node"), "--memory", "2MiB",
                   env={"CTXSTORE_ADMIN_TOKEN": TOKEN})
    yield n
    n.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if not browser_support.available():  # the tests over plain HTTP run without it
        pytest.skip(browser_support.MISSING)
    driver = browser_support.start(tmp_path_factory.mktemp("chromium-profile"))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def big_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A node as operators run them: 512 MiB of RAM with 100 MiB in it (three-digit figures, the widest the
    cards show) and a flash tier (its card makes seven)."""
    tmp = tmp_path_factory.mktemp("status-big")
    n = start_node(tmp, "--memory", "512MiB", "--disk", str(tmp / "flash"), "--disk-size", "64MiB",
                   "--disk-segment-size", "8MiB", env={"CTXSTORE_ADMIN_TOKEN": TOKEN})
    try:
        s3 = make_client(n.endpoint)
        s3.create_bucket(Bucket="kv-status-big")
        block = b"\x5a" * (4 << 20)
        for i in range(25):
            s3.put_object(Bucket="kv-status-big", Key=f"block/{i:03d}", Body=block)
        yield n
    finally:
        n.stop()


def admin_stats(node: Node) -> dict[str, Any]:
    request = urllib.request.Request(f"{node.endpoint}/_ctx/v1/admin/stats",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.load(resp)


def test_page_loads_without_token_and_holds_none(node: Node) -> None:
    with urllib.request.urlopen(node.endpoint + STATUS, timeout=5) as resp:
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/html")
        csp = resp.headers["content-security-policy"]
        body = resp.read().decode()
    assert TOKEN not in body and "Bearer " + TOKEN not in body
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    # Self-contained: nothing loaded from elsewhere.
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", body, re.I)
    assert not re.search(r"""@import|url\(\s*["']?\s*(?:https?:)?//""", body, re.I)
    # The API behind it still needs the token.
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{node.endpoint}/_ctx/v1/admin/stats", timeout=5)
    assert info.value.code == 401
    info.value.close()


def test_head_answers_as_get_without_a_body(node: Node) -> None:
    """Link checkers and load balancers probe a page with HEAD: it gets the GET's status and headers."""
    with urllib.request.urlopen(node.endpoint + STATUS, timeout=5) as resp:
        page = resp.read()
        get_headers = {k.lower(): v for k, v in resp.headers.items()}
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=5)
    try:
        conn.request("HEAD", STATUS)
        resp = conn.getresponse()
        assert resp.status == 200, resp.status
        assert resp.read() == b""
        head_headers = {k.lower(): v for k, v in resp.getheaders()}
        # The connection stays usable: no stray body bytes ahead of the next answer.
        conn.request("GET", STATUS)
        again = conn.getresponse()
        assert again.status == 200 and again.read() == page
    finally:
        conn.close()
    assert int(head_headers["content-length"]) == len(page)
    for name in ("content-type", "content-security-policy", "cache-control", "x-frame-options"):
        assert head_headers[name] == get_headers[name], name


def test_page_shows_the_numbers_and_follows_traffic(node: Node, browser: Any, tmp_path: Path) -> None:
    open_page(browser, f"{node.endpoint}{STATUS}#token={TOKEN}&interval=1")
    wait_for(lambda: value_of(browser, "budget"), what="the first stats sample")
    assert value_of(browser, "budget") == 2 * 1024 * 1024
    wait_for(lambda: text_of(browser, "live") == "live" and text_of(browser, "ready") == "ready",
             what="health badges")
    assert not browser.find_element("id", "notice").is_displayed()
    objects_before = value_of(browser, "objects")
    hits_before = value_of(browser, "hits")

    s3 = make_client(node.endpoint)
    s3.create_bucket(Bucket="kv-status-page")
    body = b"\x17" * 20_000
    for i in range(150):  # 3 MB into a 2 MiB budget: evictions
        s3.put_object(Bucket="kv-status-page", Key=f"block/{i:04d}", Body=body)
    for i in range(140, 150):
        s3.get_object(Bucket="kv-status-page", Key=f"block/{i:04d}")
    for i in range(3):
        s3.put_object(Bucket="kv-status-page", Key=f"short/{i}", Body=b"s", Metadata={"ctx-ttl": "1"})

    wait_for(lambda: (value_of(browser, "hits") or 0) >= (hits_before or 0) + 10, what="hits to rise")
    wait_for(lambda: (value_of(browser, "evictions-total") or 0) > 0, what="evictions to show")
    wait_for(lambda: (value_of(browser, "expirations-total") or 0) >= 3, timeout=15,
             what="expirations to show")
    assert value_of(browser, "objects") != objects_before
    # Once the traffic stops, the page agrees with the admin API.
    wait_for(lambda: value_of(browser, "objects") == admin_stats(node)["objects"], what="objects to settle")
    stats = admin_stats(node)
    assert value_of(browser, "used") == stats["used"]
    assert value_of(browser, "evictions-total") == stats["evictions"]
    cells = row_cells(browser, 'tr[data-bucket="kv-status-page"]')
    assert cells[0]["text"] == "kv-status-page"
    assert float(cells[2]["value"] or "nan") == stats["buckets"]["kv-status-page"]["objects"]
    # Without peers the page shows this node alone, and says so.
    assert "No peers configured" in text_of(browser, "pod-source")
    assert value_of(browser, "nodes-up") == 1
    assert len(browser.find_elements("css selector", "#nodes tbody tr[data-status=up]")) == 1
    # The traffic left lines in the charts (a node without a flash tier shows no flash series).
    wait_for(lambda: float(browser.find_element("id", "chart-requests").get_attribute("data-points") or 0) >= 2,
             what="points in the requests chart")
    assert browser.find_elements("css selector", "#chart-requests path.series")
    assert browser.find_elements("css selector", "#chart-evictions path.series")
    assert not browser.find_elements("css selector", '#chart-hits path[data-series="flash hits"]')
    assert not browser.find_element("id", "card-flash").is_displayed()
    assert "%" in text_of(browser, "hit-ratio")

    shot = tmp_path / "status-page.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    errors = severe(browser)
    assert not errors, f"console errors: {errors}"


def test_wrong_token_is_reported_in_the_page(node: Node, browser: Any) -> None:
    open_page(browser, f"{node.endpoint}{STATUS}#token=not-the-token&interval=1")
    notice = wait_for(lambda: browser.find_element("id", "notice").is_displayed()
                      and "rejected" in text_of(browser, "notice") and browser.find_element("id", "notice"),
                      what="the wrong-token error")
    assert "401" in notice.text
    assert text_of(browser, "used") == "–"
    errors = severe(browser)
    # The failed fetches of the first poll, and no script error.
    assert errors and all(e["source"] == "network" and "401" in e["message"] for e in errors), errors
    time.sleep(2.5)  # it stops calling the admin API with a rejected token (health probes go on)
    assert severe(browser) == []
    assert "rejected" in text_of(browser, "notice")


def test_token_typed_into_the_field(node: Node, browser: Any) -> None:
    open_page(browser, f"{node.endpoint}{STATUS}")
    wait_for(lambda: "admin token" in text_of(browser, "notice").lower(), what="the token prompt")
    assert text_of(browser, "used") == "–"
    field = browser.find_element("id", "token-input")
    field.send_keys(TOKEN)
    browser.find_element("css selector", "#token-form button").click()
    wait_for(lambda: value_of(browser, "budget"), what="numbers after typing the token")
    assert not browser.find_element("id", "notice").is_displayed()
    assert field.get_attribute("value") == ""  # not left in the field
    assert TOKEN not in browser.current_url
    errors = severe(browser)
    assert not errors, f"console errors: {errors}"


def test_node_down_is_shown_in_the_page(tmp_path: Path, browser: Any) -> None:
    victim = start_node(tmp_path, env={"CTXSTORE_ADMIN_TOKEN": TOKEN})
    try:
        open_page(browser, f"{victim.endpoint}{STATUS}#token={TOKEN}&interval=1")
        wait_for(lambda: value_of(browser, "budget"), what="the first stats sample")
        victim.stop()
        wait_for(lambda: "Cannot reach the node that serves this page" in text_of(browser, "notice"),
             what="the unreachable error")
        wait_for(lambda: text_of(browser, "live") == "down", what="the live badge to turn down")
    finally:
        victim.stop()


# -------------------------------------------------------------------- layout, measured in the DOM

NARROW = 420  # a phone, or a browser window beside a terminal


def at_width(driver: Any, width: int) -> None:
    """Resize the window and wait until the page has laid itself out again (two animation frames: the resize
    observers run before the first)."""
    driver.set_window_size(width, 1000)
    wait_for(lambda: driver.execute_script("return innerWidth") == width, what=f"a window {width} px wide")
    driver.execute_async_script("const done = arguments[arguments.length - 1];"
                                "requestAnimationFrame(() => requestAnimationFrame(() => done()));")


# Every figure of the cards (the big ones, their units, the values on the right of each row): each text on one
# line, each inline element on one line, all inside the card.
FIGURE_PROBLEMS = """
// Boxes on separate lines (Chromium gives an inline element a box per child too, side by side on one line).
const lines = (rects) => {
  let count = 0, bottom = -Infinity;
  for (const r of Array.from(rects).filter((r) => r.width).sort((a, b) => a.top - b.top)) {
    if (r.top >= bottom - 1) count++;
    bottom = Math.max(bottom, r.bottom);
  }
  return count;
};
const problems = [];
for (const card of document.querySelectorAll(".cards > .card")) {
  const c = card.getBoundingClientRect();
  if (!c.width) continue;  // hidden: the flash card of a node without flash
  if (card.scrollWidth > card.clientWidth) problems.push(`${card.id}: its content is wider than the card`);
  for (const e of card.querySelectorAll(".big, .big *, .row > :last-child, .row > :last-child *")) {
    const rects = e.getClientRects();
    if (!rects.length) continue;  // not shown (a flash-only row)
    const name = `${card.id} ${e.id ? "#" + e.id : "." + e.className}`;
    for (const t of e.childNodes) {
      if (t.nodeType !== Node.TEXT_NODE || !t.textContent.trim()) continue;
      const range = document.createRange();
      range.selectNodeContents(t);
      const n = lines(range.getClientRects());
      if (n > 1) problems.push(`${name}: "${t.textContent}" broken over ${n} lines`);
    }
    const n = lines(rects);
    if (getComputedStyle(e).display === "inline" && n > 1)
      problems.push(`${name}: "${e.textContent}" broken over ${n} lines`);
    for (const r of rects)
      if (r.left < c.left - 0.5 || r.right > c.right + 0.5)
        problems.push(`${name}: "${e.textContent}" sticks out of its card`);
  }
}
return problems;
"""

# The rows of each card grid: how many cards each holds and where it starts and ends.
GRID_ROWS = """
return Array.from(document.querySelectorAll(".cards, .charts"), (grid) => {
  const g = grid.getBoundingClientRect(), rows = [];
  for (const card of grid.children) {
    const r = card.getBoundingClientRect();
    if (!r.width) continue;
    let row = rows.find((x) => Math.abs(x.top - r.top) < 2);
    if (!row) rows.push(row = {top: r.top, left: r.left, right: r.right, cards: 0});
    row.left = Math.min(row.left, r.left);
    row.right = Math.max(row.right, r.right);
    row.cards++;
  }
  return {grid: grid.className, left: g.left, right: g.right, rows: rows};
});
"""


def assert_laid_out(driver: Any, width: int) -> None:
    at_width(driver, width)
    problems = driver.execute_script(FIGURE_PROBLEMS)
    assert not problems, f"at {width} px: {problems}"
    for grid in driver.execute_script(GRID_ROWS):
        counts = [row["cards"] for row in grid["rows"]]
        assert max(counts) - min(counts) <= 1, f"at {width} px, .{grid['grid']} rows of {counts} cards"
        for row in grid["rows"]:
            assert abs(row["left"] - grid["left"]) <= 1 and abs(row["right"] - grid["right"]) <= 1, \
                f"at {width} px, .{grid['grid']}: a row of {counts} does not span the grid: {row}, {grid}"


def test_figures_stay_whole_and_cards_fill_their_rows(big_node: Node, browser: Any) -> None:
    """Seven cards (a flash tier) with three-digit figures: no figure breaks between number and unit or leaves
    its card, and no row of cards is left half empty, wide or narrow."""
    open_page(browser, f"{big_node.endpoint}{STATUS}#token={TOKEN}&interval=1")
    wait_for(lambda: browser.find_element("id", "card-flash").is_displayed(), what="the flash card")
    wait_for(lambda: (value_of(browser, "used") or 0) > 100 << 20, what="the RAM in use")
    assert text_of(browser, "budget") == "512.0 MiB"
    try:
        for width in (1400, 1000, NARROW):
            assert_laid_out(browser, width)
    finally:
        browser.set_window_size(1280, 1000)


def test_cards_fill_their_rows_without_a_flash_tier(node: Node, browser: Any) -> None:
    open_page(browser, f"{node.endpoint}{STATUS}#token={TOKEN}&interval=1")
    wait_for(lambda: value_of(browser, "budget"), what="the first stats sample")
    assert not browser.find_element("id", "card-flash").is_displayed()  # six cards
    try:
        for width in (1400, 1280, 900, NARROW):
            assert_laid_out(browser, width)
    finally:
        browser.set_window_size(1280, 1000)


CHARTS = ("chart-requests", "chart-bytes", "chart-hits", "chart-memory", "chart-evictions", "chart-expirations")
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
BYTE_TICK = re.compile(r"(\d+(?:\.\d{1,2})?) (B|KiB|MiB|GiB|TiB)(?:/s)?")


def ticks(driver: Any, chart: str) -> list[tuple[str, float]]:
    """The labels of a chart's value axis (the texts left of its gridlines), bottom first, with their height."""
    found: list[list[Any]] = driver.execute_script(
        "const svg = document.getElementById(arguments[0]);"
        "const left = Math.min(...Array.from(svg.querySelectorAll('line'), (l) => Number(l.getAttribute('x1'))));"
        "return Array.from(svg.querySelectorAll('text'))"
        "  .filter((t) => Number(t.getAttribute('x')) < left)"
        "  .map((t) => [t.textContent, Number(t.getAttribute('y'))]).sort((a, b) => b[1] - a[1]);", chart)
    return [(text, y) for text, y in found]


def assert_distinct_ticks(chart: str, labels: Sequence[tuple[str, float]]) -> None:
    texts = [text for text, _ in labels]
    assert len(texts) >= 3, f"{chart}: {texts}"
    assert len(set(texts)) == len(texts), f"{chart}: the same tick twice: {texts}"
    assert texts[0].startswith("0"), f"{chart}: {texts}"
    gaps = [a[1] - b[1] for a, b in itertools.pairwise(labels)]
    assert max(gaps) - min(gaps) < 1 and min(gaps) > 0, f"{chart}: uneven ticks {labels}"


def byte_ticks(labels: Sequence[tuple[str, float]]) -> list[float] | None:
    """The byte values of an axis' labels, or None where one is not a number and a binary unit."""
    values = []
    for text, _ in labels:
        match = BYTE_TICK.fullmatch(text)
        if not match:
            return None
        values.append(float(match[1]) * UNITS[match[2]])
    return values


def assert_round_binary_steps(chart: str, labels: Sequence[tuple[str, float]]) -> None:
    """0, s, 2s ... with s a power of two bytes: each label exact in the unit it shows (256 MiB, 512 MiB, 768 MiB,
    1 GiB; never 95.4 MiB, the decimal 100 MB)."""
    assert_distinct_ticks(chart, labels)
    values = byte_ticks(labels)
    assert values is not None, f"{chart}: {labels}"
    step = int(values[1])
    assert values[1] == step and step & (step - 1) == 0, f"{chart}: a step of {step} bytes: {labels}"
    assert values == [k * step for k in range(len(values))], f"{chart}: {labels}"


def test_chart_axes_of_a_quiet_node_have_distinct_ticks(tmp_path: Path, browser: Any) -> None:
    """Nothing moves: every chart's axis still reads 0 and distinct round steps above it (it read "1 B/s,
    1 B/s, 0 B/s"); then one tiny write, a few bytes a second on the byte chart."""
    quiet = start_node(tmp_path, env={"CTXSTORE_ADMIN_TOKEN": TOKEN})
    try:
        open_page(browser, f"{quiet.endpoint}{STATUS}#token={TOKEN}&interval=1")
        wait_for(lambda: float(browser.find_element("id", "chart-bytes").get_attribute("data-points") or 0) >= 4,
                 what="two pairs of samples in the bytes chart")
        for chart in CHARTS:
            assert_distinct_ticks(chart, ticks(browser, chart))
        assert_round_binary_steps("chart-bytes", ticks(browser, "chart-bytes"))
        assert_round_binary_steps("chart-memory", ticks(browser, "chart-memory"))

        s3 = make_client(quiet.endpoint)
        s3.create_bucket(Bucket="kv-status-quiet")
        s3.put_object(Bucket="kv-status-quiet", Key="tiny", Body=b"x" * 7)
        s3.get_object(Bucket="kv-status-quiet", Key="tiny")["Body"].read()
        wait_for(lambda: (value_of(browser, "used") or 0) > 0, what="the tiny object in the RAM figures")
        points = float(browser.find_element("id", "chart-bytes").get_attribute("data-points") or 0)
        wait_for(lambda: float(browser.find_element("id", "chart-bytes").get_attribute("data-points") or 0)
                 >= points + 4, what="two more pairs of samples")
        for chart in CHARTS:
            assert_distinct_ticks(chart, ticks(browser, chart))
        assert_round_binary_steps("chart-bytes", ticks(browser, "chart-bytes"))
        assert_round_binary_steps("chart-memory", ticks(browser, "chart-memory"))
        errors = severe(browser)
        assert not errors, f"console errors: {errors}"
    finally:
        quiet.stop()


def test_byte_axes_step_in_round_binary_units(big_node: Node, browser: Any) -> None:
    open_page(browser, f"{big_node.endpoint}{STATUS}#token={TOKEN}&interval=1")
    wait_for(lambda: float(browser.find_element("id", "chart-memory").get_attribute("data-points") or 0) >= 2,
             what="samples in the RAM chart")
    s3 = make_client(big_node.endpoint)
    block = b"\x3c" * (1 << 20)
    for i in range(12):  # a few MiB/s in and out while the page watches
        s3.put_object(Bucket="kv-status-big", Key=f"moving/{i:02d}", Body=block)
        s3.get_object(Bucket="kv-status-big", Key=f"moving/{i:02d}")["Body"].read()
    wait_for(lambda: max(byte_ticks(ticks(browser, "chart-bytes")) or [0]) > 1 << 20,
             what="the bytes chart to show MiB/s")
    for chart in ("chart-bytes", "chart-memory"):
        assert_round_binary_steps(chart, ticks(browser, chart))
    assert max(byte_ticks(ticks(browser, "chart-memory")) or [0]) >= 100 << 20


def test_token_field_goes_once_connected_and_comes_back_on_disconnect(node: Node, browser: Any) -> None:
    form = ("id", "token-form")
    open_page(browser, f"{node.endpoint}{STATUS}#token={TOKEN}&interval=1")
    wait_for(lambda: value_of(browser, "budget"), what="the first stats sample")
    assert not browser.find_element(*form).is_displayed()
    assert not browser.find_element("id", "token-input").is_displayed()
    disconnect = browser.find_element("id", "disconnect")
    assert disconnect.is_displayed()

    # Disconnecting forgets the token (the URL's too, so a reload does not bring it back) and asks for one.
    disconnect.click()
    wait_for(lambda: "admin token" in text_of(browser, "notice").lower(), what="the token prompt")
    assert TOKEN not in browser.current_url
    assert "interval=1" in browser.current_url  # the other options stay
    assert text_of(browser, "used") == "–"
    assert browser.find_element(*form).is_displayed()
    assert not browser.find_element("id", "disconnect").is_displayed()

    # A token typed in: the field goes again once the node accepted it.
    browser.find_element("id", "token-input").send_keys(TOKEN)
    browser.find_element("css selector", "#token-form button").click()
    wait_for(lambda: value_of(browser, "budget"), what="numbers after typing the token")
    wait_for(lambda: not browser.find_element(*form).is_displayed(), what="the token field to go")
    assert browser.find_element("id", "disconnect").is_displayed()

    # A rejected token brings the field back, without a disconnect button.
    open_page(browser, f"{node.endpoint}{STATUS}#token=not-the-token&interval=1")
    wait_for(lambda: "rejected" in text_of(browser, "notice"), what="the wrong-token error")
    assert browser.find_element(*form).is_displayed()
    assert not browser.find_element("id", "disconnect").is_displayed()
