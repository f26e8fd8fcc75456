"""What ``ctxstore serve`` sets up in its process for the data path: the collector's young-generation threshold
above what one request holds."""

from __future__ import annotations

import gc

from ctxstore_server.serve import GC_THRESHOLD, tune_gc


def test_tune_gc_raises_the_young_threshold_above_a_bulk_get_and_freezes_start_up_objects() -> None:
    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == (GC_THRESHOLD, before[1], before[2])
        assert GC_THRESHOLD > 3 * 16384  # a lease and its cells per block of the largest bulk get (bulk_max_keys)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
