"""The engine tests' fake clock, started at ``T0``."""

from __future__ import annotations

import pytest

from support.inprocess import FakeClock

from engine_support import T0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)
