import gc
import weakref

import pytest

from lightllm.common import gc_heap
from lightllm.common.gc_heap import GC_PAUSE_BUCKETS, GcPauses, freeze_startup_heap


@pytest.fixture
def unfrozen():
    """This test process's heap as it was: frozen objects are never collected, so nothing outlives the test frozen."""
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()


def test_freezing_collects_start_up_garbage_and_keeps_what_is_left_out_of_later_passes(unfrozen):
    class Node:
        pass

    kept = [object()]  # tracked: a list
    garbage = Node()
    garbage.me = garbage  # a cycle: only a pass frees it
    gone = weakref.ref(garbage)
    del garbage

    frozen = freeze_startup_heap()

    # frozen objects still die by reference counting (another thread's, say), so the count can only have fallen
    assert frozen >= gc.get_freeze_count() > 0
    assert gone() is None  # collected, not frozen
    assert id(kept) not in {id(o) for o in gc.get_objects()}  # generations 0-2: what a pass walks
    assert gc.is_tracked(kept)  # still an object the collector knows, in the permanent generation
    later = [object()]
    assert id(later) in {id(o) for o in gc.get_objects()}


@pytest.mark.parametrize("generation", [0, 1, 2])
def test_each_pass_is_counted_in_its_generation(generation):
    pauses = GcPauses().install()
    try:
        gc.collect(generation)
    finally:
        pauses.remove()
    counts, sums = pauses.snapshot()
    assert sum(counts[generation]) >= 1 and sums[generation] > 0  # automatic passes may add to any generation
    assert pauses.passes == sum(map(sum, counts))
    gc.collect(generation)  # removed: not counted
    assert pauses.snapshot() == (counts, sums)


def test_installing_twice_counts_a_pass_once():
    pauses = GcPauses().install().install()
    try:
        assert gc.callbacks.count(pauses._callback) == 1
    finally:
        pauses.remove()
    assert pauses._callback not in gc.callbacks


def test_a_pass_lands_in_the_first_bucket_its_time_fits(monkeypatch):
    clock = iter([10.0, 10.003, 20.0, 20.0001, 30.0, 32.0, 40.0, 40.0])  # 3 ms, 0.1 ms (a bound: "le"), 2 s, 0
    monkeypatch.setattr(gc_heap.time, "perf_counter", lambda: next(clock))
    pauses = GcPauses()
    pauses._callback("stop", {"generation": 1})  # installed during a pass: its end alone is not a pause
    for generation in (2, 0, 2, 1):
        pauses._callback("start", {"generation": generation})
        pauses._callback("stop", {"generation": generation})
    counts, sums = pauses.snapshot()
    bounds = list(GC_PAUSE_BUCKETS)
    want = [[0] * (len(bounds) + 1) for _ in range(3)]
    want[2][bounds.index(0.005)] += 1
    want[0][bounds.index(0.0001)] += 1
    want[2][len(bounds)] += 1  # above every bound: +Inf
    want[1][0] += 1
    assert counts == want
    assert sums == pytest.approx([0.0001, 0.0, 2.003])
    assert pauses.passes == 4
