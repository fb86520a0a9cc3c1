"""CUDA graphs of the engine's forwards, captured largest first into one memory pool shared by every set.

Decode graphs (one per KV length bucket and batch size) are each captured right after one eager decode forward
inside ``autotune_warmup(DECODE_ATTENTION)``, launched for the bucket: decode-attention kernels search there (on the
representative inputs they rebuild themselves, at lengths up to the bucket) and the capture that follows, with the
outer phase restored, freezes the configs they chose and the split grid sized for the bucket.
Prefill graphs (``engine/prefill_graphs.py``) follow into the same pool, each after one eager forward outside any
scope: the GENERAL warm-up has already tuned their keys, so the capture uses the configs an eager prefill of that
size would. The graph API is injectable so the ordering can be tested without a GPU.
"""

import logging
import time
from typing import Callable, Dict, Hashable, Iterable, Optional, Sequence, Tuple

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

    def capture_each(
        self,
        run: Callable[[Hashable], object],
        warmup_scope: Callable,
        kind: str,
        name: Callable[[Hashable], str],
        remedy: str,
        keys: Optional[Sequence] = None,
    ) -> "GraphSet":
        """Per key of ``keys`` (default: all), largest first: ``run(key)`` eagerly inside ``warmup_scope()``, then
        ``run(key)`` captured; ``memory_bytes`` grows by what they added. ``kind`` (decode, prefill), ``name(key)``
        and ``remedy`` (the flag that turns the graphs off) word the error of a failed warmup forward."""
        before = self.api.memory_used()
        keys = sorted(self.keys if keys is None else keys, reverse=True)
        for key in tqdm(keys, desc=f"{kind} graphs", leave=False):
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
        self.memory_bytes += self.api.memory_used() - before
        return self

    def replay(self, key: Hashable):
        graph, out = self.graphs[key]
        self.api.replay(graph)
        return out


class DecodeGraphs(GraphSet):
    """Captured decode steps keyed ``(graph_len, batch_size)``: one graph per KV length bucket and batch size, each
    launched for its bucket (``graph_len``: the most KV tokens it serves). :meth:`pick` maps a live batch to the
    graph that serves it. ``costs[graph_len]``: ``(graphs, seconds, bytes)`` its bucket's capture took."""

    def __init__(self, batch_sizes: Sequence[int], graph_lens: Sequence[int], api=None):
        if not batch_sizes:
            raise ValueError("DecodeGraphs: batch_sizes expected at least one size")
        if not graph_lens:
            raise ValueError("DecodeGraphs: graph_lens expected at least one KV length")
        super().__init__([(n, bs) for n in graph_lens for bs in batch_sizes], api)
        self.batch_sizes = sorted(set(batch_sizes))
        self.graph_lens = sorted(set(graph_lens))
        self.costs: Dict[int, Tuple[int, float, int]] = {}

    def capture_all(self, run_decode: Callable[[int, int], object], clock=time.perf_counter) -> "DecodeGraphs":
        """``run_decode(bs, graph_len)`` runs one decode forward over the first ``bs`` rows of static buffers,
        launched for ``graph_len``, and returns its outputs (a tensor, or a tuple of them). Longest bucket first (its
        largest batch opens the shared pool), each bucket's sizes largest first.

        One output per batch size: the longest bucket's graph keeps its own, and the graphs of the shorter buckets
        copy theirs into it as their last step, so their outputs are freed after capture and the pool reuses the
        memory (the float32 logits are most of what a bucket's graphs keep: 162 MiB at batch sizes up to 64 and a
        152K vocabulary). The copy costs one pass over the outputs per replay of a shorter bucket."""
        longest = self.graph_lens[-1]

        def run(key):
            n, bs = key
            out = run_decode(bs, n)
            return out if n == longest else _copy_into(self.graphs[(longest, bs)][1], out)

        for n in self.graph_lens[::-1]:
            start, before = clock(), self.memory_bytes
            self.capture_each(run,
                              lambda: autotune_warmup(AutotuneKernelType.DECODE_ATTENTION), "decode",
                              lambda key: f"KV-length-{key[0]} batch-size-{key[1]}", "--disable_cudagraph",
                              keys=[k for k in self.keys if k[0] == n])  # fmt: skip
            self.costs[n] = (len(self.batch_sizes), clock() - start, self.memory_bytes - before)
        return self

    def pick(self, batch_size: int, max_len: int) -> Optional[Tuple[int, int]]:
        """The key of the graph serving ``batch_size`` rows whose longest holds ``max_len`` KV tokens: the smallest
        bucket that holds ``max_len``, then its smallest captured size that holds the rows; None (run eagerly) past
        the longest bucket or the largest size."""
        n = next((n for n in self.graph_lens if n >= max_len), None)
        bs = next((bs for bs in self.batch_sizes if bs >= batch_size and (n, bs) in self.graphs), None)
        return None if n is None or bs is None else (n, bs)


def _copy_into(dst, src):
    """``src`` (a tensor or a tuple/list of them) copied into ``dst`` of the same structure; returns ``dst``."""
    if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
        return dst.copy_(src)
    if isinstance(dst, (tuple, list)) and isinstance(src, (tuple, list)) and len(dst) == len(src):
        for d, s in zip(dst, src):
            _copy_into(d, s)
        return dst
    raise TypeError(f"decode graph outputs expected a tensor or a tuple of tensors, like the longest bucket's "
                    f"{type(dst).__name__}, got {type(src).__name__}")  # fmt: skip


def describe_costs(costs: Dict[int, Tuple[int, float, int]]) -> str:
    """Per bucket, what capturing its decode graphs took: ``<=4096: 17 in 1.2 s, 5.0 MiB; ...``."""
    return "; ".join(f"<={n}: {g} in {s:.1f} s, {b / 2**20:.1f} MiB" for n, (g, s, b) in sorted(costs.items()))
