"""ctxstore as a secondary tier of vLLM's own KV offloading (``ctxstore.integrations.vllm.tier``), against a real
2-node pod.

vLLM's ``TieringOffloadingSpec`` refuses CPU workers, so no engine runs: one child process in the vLLM venv
(tests/integrations/vllm_tier_driver.py; this process never imports vLLM) makes the tier with vLLM's own
``SecondaryTierFactory`` from the out-of-tree config (``{"type": "CtxStoreTier", "module_path": ...}``), over the
``memoryview`` of a primary tier made by vLLM's ``SharedOffloadRegion``, on a real ``OffloadingSpec``, and drives
it as vLLM's tiering manager does: lookups flushed at each step's end, synthetic ``TransferJob``\\ s,
``get_finished_jobs`` polled per step; and vLLM's own ``TieringOffloadingManager`` over the tier. It runs every
case once (vLLM's import costs seconds); the tests below check its report.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.faultproxy import FaultProxy, flip
from support.nodes import ACCESS_KEY, SECRET_KEY, Node, serving, start_node
from test_vllm_connector import VLLM_PYTHON

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(300)]

DRIVER = Path(__file__).resolve().parent / "vllm_tier_driver.py"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("tier-pod")
    with serving([start_node(tmp, "--memory", "128MiB", "--default-ttl", "1h", wait=False)
                  for _ in range(2)]) as nodes:
        hung: Node = nodes[1]
        flipper = FaultProxy(("127.0.0.1", nodes[0].port), [flip("payload", offset=100, path="/get", times=1)])
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}  # vLLM's hash seed: the default
        env.update({"CTXSTORE_ACCESS_KEY": ACCESS_KEY, "CTXSTORE_SECRET_KEY": SECRET_KEY,
                    "PYTHONWARNINGS": "ignore", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
        try:
            with flipper:
                out = subprocess.run([str(VLLM_PYTHON), str(DRIVER), ",".join(n.endpoint for n in nodes),
                                      "tier-" + secrets.token_hex(4), "--hang-pid", str(hung.proc.pid),
                                      "--direct", nodes[0].endpoint, "--proxied", f"http://{flipper.address}"],
                                     check=False, capture_output=True, text=True, timeout=240, env=env)
        finally:
            os.kill(hung.proc.pid, signal.SIGCONT)
        assert out.returncode == 0, out.stderr[-4000:]
        yield json.loads(next(line for line in out.stdout.splitlines() if line.startswith("REPORT "))[7:])


def test_vllm_loads_the_tier_out_of_tree_and_namespaces_it(report: dict[str, Any]) -> None:
    assert report["tier_class"] == "ctxstore.integrations.vllm.tier.CtxStoreTier"
    # Declared to vLLM (its Prometheus definitions) as the names get_stats reports them under.
    assert "vllm:kv_offload_ctxstore_lookup_deadline_misses" in report["metric_definitions"]
    assert "vllm:kv_offload_ctxstore_lookup_seconds" in report["metric_definitions"]
    assert set(report["stats"]) - {f"{m}_count" for m in report["metric_definitions"]} \
        - {f"{m}_sum" for m in report["metric_definitions"]} <= set(report["metric_definitions"])
    assert report["same_namespace"]  # two vLLMs of one model find each other's chunks
    assert report["other_model_namespace_differs"]
    refused = report["refused"]
    assert refused["unknown option"].startswith("ConfigurationError") and "nodez" in refused["unknown option"]
    assert refused["random hash seed"].startswith("ConfigurationError")  # no PYTHONHASHSEED in the child
    assert refused["bad nodes"].startswith("ConfigurationError")
    assert report["refusals_left_threads"] == 0  # a refused tier starts no client thread
    assert report["loops_closed"]  # shut down: each tier's client loop closed (its selector and wake-up pipe)


def test_chunks_round_trip_byte_exact_between_two_primaries(report: dict[str, Any]) -> None:
    assert report["store"]["success"] is True
    assert report["store"]["events"] == [[8, False, "STORAGE"]]  # the pod's "stored", as a vLLM KV event
    assert report["lookup"]["answers"] == ["HIT"] * 8
    assert report["lookup"]["steps"] >= 1  # answered from the batch flushed at a step's end
    assert report["load"] == {"success": True, "bytes": 8 * (64 << 10), "exact": True, "rest_untouched": True}


def test_a_load_with_missing_chunks_fails_and_names_the_chunks_that_arrived(report: dict[str, Any]) -> None:
    assert report["absent_lookup"] == ["MISS"] * 3
    partial = report["partial_load"]
    assert partial["success"] is False and partial["successful_keys"] == [0, 1]
    assert partial["events"] == []  # the absent chunk: nothing to delete, nothing "removed"
    assert partial["absent_after"] == "MISS"  # mark_miss: vLLM does not retry the doomed chunk


def test_a_pending_lookup_survives_a_failed_load_of_its_key(report: dict[str, Any]) -> None:
    assert report["pending_mark_miss"] == ["HIT", "MISS"]  # the other key's lookup went out with its batch


def test_a_load_flipped_on_the_wire_fails_and_leaves_the_good_copy(report: dict[str, Any]) -> None:
    flipped = report["flipped_load"]
    assert flipped["stored"] is True and flipped["loaded"] is False
    assert flipped["kept"] and flipped["removed"] == []  # whole in the pod: not deleted, not "removed"


def test_a_stored_copy_that_is_not_whole_fails_and_is_replaced(report: dict[str, Any]) -> None:
    short = report["short_copy"]
    assert short["success"] is False
    assert short["size_after"] < 0  # deleted (wire.ABSENT), so the next store is not "already there"
    assert short["restored_store"] is True and short["reload"] is True and short["exact"] is True


def test_a_hung_node_costs_a_miss_within_the_deadline_and_drain_waits(report: dict[str, Any]) -> None:
    assert report["hang_store_before"] is True
    hang = report["hang_lookup"]
    assert "RETRY" not in hang["answers"]  # never an unbounded RETRY
    # The hung node's chunks miss at the deadline; the other node's answers count (HIT where it answered in time).
    assert hang["hung_node_answers"] == ["MISS"]
    assert hang["seconds"] < hang["deadline"] + 0.5, hang  # the deadline, not the read timeout (1 s)
    assert hang["asked_again"] == ["MISS"]  # past its deadline a key stays a miss until its answer comes
    load = report["hang_load"]
    assert load["pending_at_return"]  # submit_load returned at once: the scheduler does not wait for a job
    assert load["reported_after_drain"] and load["success"] is False  # a failed job, reported
    assert load["drain_s"] < 2.0 + 1.5 and not load["pending_after"]
    assert report["hang_second_lookup"]["answers"] == ["MISS"]
    assert report["hang_second_lookup"]["seconds"] < hang["deadline"] + 0.5
    # The hung node marked down (by the load's timeout, and by lookups alone): the other node's chunks are HITs
    # again, at once. 32 chunks over 2 nodes: P(all on one node) = 2**-31.
    for name in ("hang_node_down_lookup", "hang_node_down_lookups_only_lookup"):
        down = report[name]
        assert down["hits"] > 0 and down["misses"] > 0 and down["seconds"] < hang["deadline"], (name, down)
    first = report["hang_node_down_lookups_only_lookup"]
    assert "RETRY" not in first["first"] and first["first_on_hung_node"] == ["MISS"]
    assert report["stats"].get("vllm:kv_offload_ctxstore_lookup_deadline_misses", 0) >= 1
    assert report["hang_chunks_kept"] == 32  # the failed load deleted none of the hung node's good chunks


def test_vllms_own_tiering_manager_cascades_promotes_and_closes(report: dict[str, Any]) -> None:
    """vLLM's TieringOffloadingManager (its scheduler side runs on CPU) over two instances sharing the pod."""
    managed = report["real_manager"]
    assert managed["cascaded"] and managed["stored_events"] == 3
    assert managed["answers"] == ["HIT"] * 3 and managed["exact"]
    # The tier let go of the primary tier's shared memory: vLLM closed it, without a warning.
    assert managed["shared_memory_closed"] and managed["close_warnings"] == []


def test_topology_free_chunks_share_one_namespace(report: dict[str, Any]) -> None:
    assert report["namespaces"] == {"agnostic": 1, "per_topology": 3}


def test_a_tier_whose_hash_is_not_vllms_misses_and_fails_its_jobs(report: dict[str, Any]) -> None:
    check = report["hash_check"]
    assert check["wrong_lookup"] == ["MISS", "MISS"] and check["wrong_store"] is False
    assert check["right_lookup"] == ["MISS", "MISS"] and check["right_store"] is True
