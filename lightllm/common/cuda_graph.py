"""CUDA graphs of the engine's forwards, captured largest first into one memory pool shared by every set.

Decode graphs (one per batch size) are each captured right after one eager decode forward inside
``autotune_warmup(DECODE_ATTENTION)``: decode-attention kernels search there (on the representative inputs they
rebuild themselves) and the capture that follows, with the outer phase restored, freezes the configs they chose.
Prefill graphs (``engine/prefill_graphs.py``) follow into the same pool, each after one eager forward outside any
scope: the GENERAL warm-up has already tuned their keys, so the capture uses the configs an eager prefill of that
size would. The graph API is injectable so the ordering can be tested without a GPU.
"""

import logging
from typing import Callable, Dict, Hashable, Iterable, Optional, Tuple

import torch
from tqdm import tqdm

from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup

logger = logging.getLogger(__name__)


class TorchGraphAPI:
    """The real thing: ``torch.cuda.CUDAGraph`` with a shared pool."""

    def new_graph(self):
        return torch.cuda.CUDAGraph()

    def capture(self, graph, pool):
        return torch.cuda.graph(graph, pool=pool)

    def pool(self, graph):
        return graph.pool()

    def replay(self, graph) -> None:
        graph.replay()

    def memory_used(self) -> int:
        # Cached free blocks released first: capturing empties the cache itself, so without this the
        # before/after difference would count freed warmup blocks as negative graph memory.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved()


class GraphSet:
    """Graphs of one forward by key, captured in descending key order (largest first), all in one memory pool:
    ``pool`` when given (another set's), else the first graph's. ``memory_bytes``: what capturing them added."""

    def __init__(self, keys: Iterable[Hashable], api=None, pool=None):
        self.keys = sorted(set(keys))
        if not self.keys:
            raise ValueError(f"{type(self).__name__}: expected at least one graph key")
        self.api = api or TorchGraphAPI()
        self.pool = pool
        self.graphs: Dict[Hashable, Tuple[object, object]] = {}
        self.memory_bytes = 0

    def capture_each(self, run: Callable[[Hashable], object], warmup_scope: Callable, kind: str,
                     name: Callable[[Hashable], str], remedy: str) -> "GraphSet":  # fmt: skip
        """Per key, largest first: ``run(key)`` eagerly inside ``warmup_scope()``, then ``run(key)`` captured.
        ``kind`` (decode, prefill), ``name(key)`` and ``remedy`` (the flag that turns the graphs off) word the
        error of a failed warmup forward."""
        before = self.api.memory_used()
        for key in tqdm(self.keys[::-1], desc=f"{kind} graphs", leave=False):
            try:
                with warmup_scope():
                    run(key)
            except Exception as e:
                raise RuntimeError(f"{kind} warmup forward before capturing the {name(key)} graph failed "
                                   f"({type(e).__name__}: {e}); nothing was captured for it. Fix the cause or start "
                                   f"with {remedy}") from e  # fmt: skip
            graph = self.api.new_graph()
            with self.api.capture(graph, self.pool):
                out = run(key)
            if self.pool is None:
                self.pool = self.api.pool(graph)
            self.graphs[key] = (graph, out)
        self.memory_bytes = self.api.memory_used() - before
        return self

    def replay(self, key: Hashable):
        graph, out = self.graphs[key]
        self.api.replay(graph)
        return out


class DecodeGraphs(GraphSet):
    """Captured decode steps by batch size; :meth:`pick` maps a live batch to the graph that serves it."""

    def __init__(self, batch_sizes, api=None):
        if not batch_sizes:
            raise ValueError("DecodeGraphs: batch_sizes expected at least one size")
        super().__init__(batch_sizes, api)
        self.batch_sizes = self.keys

    def capture_all(self, run_decode: Callable[[int], object]) -> "DecodeGraphs":
        """``run_decode(bs)`` runs one decode forward over the first ``bs`` rows of static buffers."""
        return self.capture_each(run_decode, lambda: autotune_warmup(AutotuneKernelType.DECODE_ATTENTION),
                                 "decode", lambda bs: f"batch-size-{bs}", "--disable_cudagraph")  # fmt: skip

    def pick(self, batch_size: int) -> Optional[int]:
        """The smallest captured size that holds ``batch_size`` rows, or None (run eagerly)."""
        for bs in self.batch_sizes:
            if bs >= batch_size and bs in self.graphs:
                return bs
        return None
