"""Dynamo's own KV indexer, as shipped (ai-dynamo-runtime 1.6.1), credits every block a ctxstore node holds and
forgets what it drops: saved blocks on its host tier, demoted ones on its disk tier, a restart's recovered blocks
again, deletes and expiries removed, two salted namespaces apart (tests/integrations/dynamo_scenario.py).

Dynamo's indexer binds its HTTP port on every interface, so the scenario runs in a network namespace of its own
(``unshare -n``, loopback only): the node, the indexer and the client never reach past it. Dynamo lives in a
virtual environment of its own that scripts/test installs (``CTXSTORE_DYNAMO_PYTHON``); without it, or without
the rights to make a network namespace, the test skips and says why."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCENARIO = Path(__file__).with_name("dynamo_scenario.py")
REPO = Path(__file__).resolve().parents[2]


def _dynamo_python() -> str:
    configured = os.environ.get("CTXSTORE_DYNAMO_PYTHON", "")
    if configured:
        return configured
    reason = os.environ.get("CTXSTORE_DYNAMO_UNAVAILABLE", "")
    if reason:
        pytest.skip(reason)
    default = Path(sys.prefix + "-dynamo") / "bin" / "python"  # scripts/test's place for it
    if not default.exists():
        pytest.skip(f"Dynamo is not installed ({default} is missing; scripts/test installs ai-dynamo-runtime 1.6.1)")
    return str(default)


def _check_netns() -> None:
    if os.geteuid() != 0:
        pytest.skip("a network namespace for Dynamo's indexer (it binds every interface) needs root: unshare -n")
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("unshare or ip is missing: no network namespace for Dynamo's indexer")
    probe = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.strip()[:200]}")


def test_dynamo_indexer_credits_what_the_node_holds(tmp_path: Path) -> None:
    dynamo_python = _dynamo_python()
    _check_netns()
    command = f"ip link set lo up && exec {sys.executable} {SCENARIO} {dynamo_python} {tmp_path}"
    done = subprocess.run(["unshare", "-n", "sh", "-c", command], capture_output=True, text=True, timeout=180,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert "every check held" in done.stdout
