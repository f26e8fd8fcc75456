"""Headless Chromium (Debian's chromium and chromium-driver packages) driven by selenium, for the status page
tests: starting it, waiting on the page, reading numbers the page exposes as ``data-value`` attributes."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
MISSING = (f"headless Chromium not installed ({CHROMIUM}, {CHROMEDRIVER}); CI installs the chromium and "
           "chromium-driver packages (.ci/run)")


def available() -> bool:
    return Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()


def start(profile: Path, width: int = 1280, height: int = 1000) -> Any:
    """A headless Chromium with its own profile folder; quit() it when done."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", f"--window-size={width},{height}", f"--user-data-dir={profile}",
                "--hide-scrollbars", "--force-color-profile=srgb"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(15)
    return driver


def wait_for(condition: Callable[[], Any], timeout: float = 10, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def value_of(driver: Any, element_id: str) -> float | None:
    raw = driver.find_element("id", element_id).get_attribute("data-value")
    return float(raw) if raw not in (None, "") else None


def text_of(driver: Any, element_id: str) -> str:
    return driver.find_element("id", element_id).text


def open_page(driver: Any, url: str) -> None:
    driver.get("about:blank")  # a fresh document (a fragment-only change would not reload)
    driver.get_log("browser")  # drop earlier console lines
    driver.get(url)


def severe(driver: Any) -> list[dict[str, Any]]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def full_page_screenshot(driver: Any, path: Path, width: int = 1280) -> None:
    """The whole page, not just the window: the window is resized to the document's height first."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(width, max(600, int(height) + 20))
    driver.save_screenshot(str(path))


def row_cells(driver: Any, selector: str) -> list[dict[str, str | None]]:
    """Text and ``data-value`` of each cell of the first row matching ``selector``, read in one script: a page
    that redraws its tables makes elements found earlier go stale."""
    cells: list[dict[str, str | None]] = driver.execute_script(
        "const r = document.querySelector(arguments[0]);"
        "return r ? Array.from(r.cells, (c) => ({text: c.textContent, value: c.dataset.value ?? null})) : [];",
        selector)
    return cells
