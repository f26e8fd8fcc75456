"""Bounded by default, long by hand: ``CTXSTORE_SOAK=1`` turns the adversarial suite's case counts and
durations up to soak levels (tens of minutes instead of about two)."""

from __future__ import annotations

import os

SOAK = os.environ.get("CTXSTORE_SOAK", "") not in ("", "0")


def scaled(ci: int, soak: int) -> int:
    """``ci`` cases in a normal run, ``soak`` with ``CTXSTORE_SOAK=1``."""
    return soak if SOAK else ci


def seconds(ci: float, soak: float) -> float:
    return soak if SOAK else ci


SOAK_SECONDS = float(os.environ.get("CTXSTORE_SOAK_SECONDS", "600"))
# pytest-timeout's limit for a test that soaks (the suite's default of 120 s is for normal runs).
SOAK_TIMEOUT = int(SOAK_SECONDS + 600) if SOAK else 120
