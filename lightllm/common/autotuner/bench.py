"""Timers for candidate configs: ``fn(run) -> milliseconds`` where ``run()`` launches the kernel once.

The default on a GPU times CUDA-graph replays with CUDA events, the way a captured decode step will run
the kernel (no Python or launch overhead in the number). Without CUDA a wall-clock timer is used. A search screens
every candidate with fewer replays (``screen_bench_func``) and times its finalists again with the full count.
"""

import functools
import logging
import math
import statistics
import time
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)

BenchFunc = Callable[[Callable[[], object]], float]

_TARGET_GRAPH_MS = 1.0  # launches per graph are chosen so one replay takes about this long
_MAX_RUNS_PER_GRAPH = 100
_REPLAYS = 15
# Replays of a search's first pass over every candidate (a replay is ~1 ms of launches); the finalists and the
# default are timed again at _REPLAYS (tuner.Autotuner._retime). On an H100 this took 36 % off real decode searches'
# time with picks as good as a second search at 15 (docs/autotune.md, "How a search runs").
SCREEN_REPLAYS = 5


def cuda_graph_bench(run: Callable[[], object], replays: int = _REPLAYS) -> float:
    """Median time of one ``run()`` in ms, from CUDA-graph replays timed with CUDA events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # allocator and lazy-init work stays out of the graph
    torch.cuda.current_stream().wait_stream(stream)

    probe = _capture(run, 1)
    per_run = _time_replays(probe, 1, 3)
    del probe
    runs = max(1, min(_MAX_RUNS_PER_GRAPH, math.ceil(_TARGET_GRAPH_MS / max(per_run, 1e-4))))
    graph = _capture(run, runs)
    try:
        return _time_replays(graph, runs, replays)
    finally:
        del graph


def _capture(run: Callable[[], object], runs: int) -> "torch.cuda.CUDAGraph":
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(runs):
            run()
    return graph


def _time_replays(graph: "torch.cuda.CUDAGraph", runs: int, replays: int) -> float:
    graph.replay()  # warm-up
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / runs


def wall_clock_bench(run: Callable[[], object], repeats: int = 5) -> float:
    """Median wall-clock ms of ``run()`` (CPU fallback; synchronizes CUDA when present)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def default_bench(run: Callable[[], object]) -> float:
    return cuda_graph_bench(run) if torch.cuda.is_available() else wall_clock_bench(run)


_bench_func: Optional[BenchFunc] = None


def set_bench_func(fn: Optional[BenchFunc]) -> None:
    """Swap the timer (tests, custom timing); ``None`` restores the default."""
    global _bench_func
    if fn is not None and not callable(fn):
        raise TypeError(f"set_bench_func expects a callable run -> milliseconds, got {fn!r}")
    _bench_func = fn


def get_bench_func() -> BenchFunc:
    return _bench_func or default_bench


def screen_bench_func() -> BenchFunc:
    """The timer of a search's first pass: the CUDA-graph timer at ``SCREEN_REPLAYS`` replays; a timer swapped in
    by :func:`set_bench_func`, or the CPU's wall clock, times both passes alike."""
    if _bench_func is None and torch.cuda.is_available():
        return functools.partial(cuda_graph_bench, replays=SCREEN_REPLAYS)
    return get_bench_func()
