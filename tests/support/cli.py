"""``ctxstore ...`` run in the test process: the function the command runs (``ctxstore.cli.main``), with the
environment set for the call and its streams captured, for command-line tests that do not need a process of
their own (a process costs a fraction of a second of imports per invocation)."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence

import pytest


def run_in_process(argv: Sequence[str], *, drop: Iterable[str] = (),
                   env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``ctxstore ARGV`` with the variables in ``drop`` unset and ``env`` set (both only for the call); the
    answer as ``subprocess.run`` would give it: a ``SystemExit`` becomes the status the interpreter exits with
    (its message, if any, on stderr)."""
    from ctxstore.cli import main

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        for name in drop:
            patch.delenv(name, raising=False)
        for name, value in (env or {}).items():
            patch.setenv(name, value)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exc:
                code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
                if exc.code is not None and not isinstance(exc.code, int):
                    print(exc.code, file=sys.stderr)
    return subprocess.CompletedProcess(["ctxstore", *argv], code, out.getvalue(), err.getvalue())
