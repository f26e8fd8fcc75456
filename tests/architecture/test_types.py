"""The types are checked: mypy over server/ and ctxstore/ with the project's configuration (pyproject.toml:
strict for the engine and the client package) must report nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support import REPO_ROOT


def test_mypy_is_clean() -> None:
    try:
        import mypy  # noqa: F401
    except ImportError:  # the test extra installs it; a bare checkout without it cannot vouch for the types
        pytest.fail("mypy is not installed: pip install -e '.[test]'")
    out = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
