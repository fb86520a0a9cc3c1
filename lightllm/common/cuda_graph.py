"""Decode CUDA graphs: one per batch size, captured largest first into one shared memory pool, each right
after one eager decode forward inside ``autotune_warmup(DECODE_ATTENTION)``.

The warmup forward is where decode-attention kernels search (on the representative inputs they rebuild
themselves); the capture that follows, with the outer phase restored, freezes the configs they chose.
The graph API is injectable so the ordering can be tested without a GPU.
"""

import logging
from typing import Callable, Dict, List, Optional, Tuple

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


class DecodeGraphs:
    """Captured decode steps by batch size; :meth:`pick` maps a live batch to the graph that serves it."""

    def __init__(self, batch_sizes: List[int], api=None):
        if not batch_sizes:
            raise ValueError("DecodeGraphs: batch_sizes expected at least one size")
        self.batch_sizes = sorted(set(batch_sizes))
        self.api = api or TorchGraphAPI()
        self.graphs: Dict[int, Tuple[object, object]] = {}
        self.memory_bytes = 0

    def capture_all(self, run_decode: Callable[[int], object]) -> "DecodeGraphs":
        """``run_decode(bs)`` runs one decode forward over the first ``bs`` rows of static buffers."""
        pool = None
        before = self.api.memory_used()
        for bs in tqdm(sorted(self.batch_sizes, reverse=True), desc="decode graphs", leave=False):
            try:
                with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
                    run_decode(bs)
            except Exception as e:
                raise RuntimeError(
                    f"decode warmup forward before capturing the batch-size-{bs} graph failed "
                    f"({type(e).__name__}: {e}); nothing was captured for it. Fix the cause or start with "
                    "--disable_cudagraph"
                ) from e
            graph = self.api.new_graph()
            with self.api.capture(graph, pool):
                out = run_decode(bs)
            if pool is None:
                pool = self.api.pool(graph)
            self.graphs[bs] = (graph, out)
        self.memory_bytes = self.api.memory_used() - before
        return self

    def pick(self, batch_size: int) -> Optional[int]:
        """The smallest captured size that holds ``batch_size`` rows, or None (run eagerly)."""
        for bs in self.batch_sizes:
            if bs >= batch_size and bs in self.graphs:
                return bs
        return None

    def replay(self, bs: int):
        graph, out = self.graphs[bs]
        self.api.replay(graph)
        return out
