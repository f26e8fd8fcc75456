"""Helpers shared by the test suite (importable as ``support`` because pytest puts tests/ on the path)."""
