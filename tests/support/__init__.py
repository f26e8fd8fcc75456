"""Helpers shared by the test suite (importable as ``support`` because pytest puts tests/ on the path)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # the repository (tests/support/ is two levels down)
