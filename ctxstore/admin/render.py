"""Formatting numbers and rich tables (rich is imported only when a table is drawn)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from .common import UsageError

# ---------------------------------------------------------------------------------------------- formatting

def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def fmt_ratio(r: float | None) -> str:
    return "–" if r is None else f"{r * 100:.1f}%"


def fmt_rate(r: float | None, unit: str = "/s") -> str:
    if r is None:
        return "–"
    return f"{r:.0f}{unit}" if r >= 100 else f"{r:.1f}{unit}"


def fmt_byte_rate(r: float | None) -> str:
    return "–" if r is None else fmt_bytes(r) + "/s"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    for unit, factor in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= factor and seconds % factor == 0:
            return f"{int(seconds // factor)}{unit}"
    return f"{seconds:g}s"


def fmt_uptime(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    left = int(seconds)
    parts = []
    for unit, factor in (("d", 86400), ("h", 3600), ("m", 60)):
        if left >= factor:
            parts.append(f"{left // factor}{unit}")
            left %= factor
    if not parts or (left and len(parts) < 2):
        parts.append(f"{left}s")
    return " ".join(parts[:2])


def fmt_int(n: int | None) -> str:
    return "–" if n is None else f"{n:,}"


def _console(stderr: bool = False) -> Any:
    try:
        from rich.console import Console
    except ImportError:  # pragma: no cover - rich ships with the cli (admin) extra
        raise UsageError("tables need rich: pip install rich (the cli extra), or use --json") from None
    width = None
    stream = sys.stderr if stderr else sys.stdout
    if not stream.isatty() and "COLUMNS" not in os.environ:
        width = 200  # piped or captured: do not squeeze tables into 80 columns
    return Console(file=stream, width=width, highlight=False, soft_wrap=False)


def _table(title: str | None = None, *, narrow: bool = False) -> Any:
    """``narrow``: two spaces between columns instead of three, for a table with many columns."""
    from rich import box
    from rich.table import Table

    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=narrow)


def _state(entry: dict[str, Any]) -> str:
    if entry["ok"]:
        return "[green]up[/]"
    return "[red]down[/]" if entry["status"] == "down" else "[red]error[/]"


def _print_problems(console: Any, statuses: Sequence[dict[str, Any]]) -> None:
    from rich.markup import escape

    for s in statuses:
        if not s["ok"]:
            console.print(f"[red]✗ {escape(s['node'])} {s['status']}:[/] {escape(s['error'] or '')}")
