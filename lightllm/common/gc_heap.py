"""The garbage collector in a serving process: start-up's objects kept out of its passes, and every pass timed.

A pass over the oldest generation walks every object the collector tracks and stops the process while it does. A
process holding a model (its modules, kernels, graphs, tuner records) tracks some 220 K objects on the tiny model,
more on a real one, so such a pass in the engine process stalled every running stream's next decode step by 60-90 ms
on the 2-core CI machine. What start-up built is never garbage: ``freeze_startup_heap`` moves it to the collector's
permanent generation, so later passes walk only what serving allocated (requests, prefix-cache nodes). Frozen
objects are still freed by reference counting when they go.

``GcPauses`` times each pass of its process from ``gc.callbacks`` into a histogram per generation (the server's
``lightllm_gc_pause_seconds``), so a stall the collector caused is visible instead of showing up as unexplained
inter-token latency.
"""

import bisect
import gc
import time
from typing import List, Optional, Sequence, Tuple

# 0.1 ms to 1 s: a young generation's pass to a full one over a large heap
GC_PAUSE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
GENERATIONS = 3  # CPython's


def freeze_startup_heap() -> int:
    """Collect start-up's garbage, then keep every object left out of later passes (``gc.freeze``). Call it once a
    process has built what it serves with, before it serves. Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """The collector's passes in this process, timed from ``gc.callbacks``: cumulative counts per generation and
    bucket, and the seconds summed. The callback only counts (the collector does not run again inside its own
    callbacks, so it cannot recurse), and ``snapshot`` copies, so readers take no lock a pass could be waiting on."""

    def __init__(self, buckets: Sequence[float] = GC_PAUSE_BUCKETS):
        self.bounds = tuple(float(b) for b in buckets)
        self.counts = [[0] * (len(self.bounds) + 1) for _ in range(GENERATIONS)]  # the last: above every bound
        self.sums = [0.0] * GENERATIONS
        self.passes = 0  # every timed pass: tells a reader whether anything changed
        self._started: Optional[float] = None

    def install(self) -> "GcPauses":
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # installed during a pass
            return
        seconds, self._started = time.perf_counter() - self._started, None
        generation = min(info["generation"], GENERATIONS - 1)
        self.counts[generation][bisect.bisect_left(self.bounds, seconds)] += 1  # the first bound >= it: "le"
        self.sums[generation] += seconds
        self.passes += 1

    def snapshot(self) -> Tuple[List[List[int]], List[float]]:
        """``(counts, sums)``: per generation, the passes in each bucket (the last above every bound) and their
        seconds, since this was made."""
        return [list(c) for c in self.counts], list(self.sums)
