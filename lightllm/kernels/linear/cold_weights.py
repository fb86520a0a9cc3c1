"""Timing a decode GEMM as a decode step runs it: with its weight read from HBM, not from L2.

A step streams every layer's weights once, so each GEMM's weight comes from HBM. The tuner's timer replays one
launch on the same inputs, and a weight smaller than the L2 cache (Qwen3-8B's o_proj: 32 MB against the H200's
50 MB) would be timed L2-warm, where the ranking of configs can differ. So a search times on a ring of copies of
the weight: each launch it captures reads the next copy, the copies together ``COLD_BYTES``, far beyond L2. The ring
has at most ``MAX_COPIES`` copies, so a weight under about 0.8 MB (a small model's, or a wide tensor-parallel shard)
still fits the H200's 50 MB L2 with all its copies and is timed warm. A weight of at
least half ``COLD_BYTES`` is timed alone (it cannot stay in L2 either), and so is one whose ring does not fit in
memory (logged).
"""

import logging
from typing import Tuple

import torch

from lightllm.kernels.launch_math import cdiv

logger = logging.getLogger(__name__)

COLD_BYTES = 256 << 20  # the ring's bytes: several times a Hopper GPU's L2
MAX_COPIES = 64


class WeightRing:
    """Copies of one weight (and their transposed views) handed out in turn by :meth:`next`."""

    def __init__(self, w: torch.Tensor, copies: int):
        self.weights = [w] + [w.clone() for _ in range(copies - 1)]
        self.views = [c.t() for c in self.weights]
        self.turn = 0

    def next(self) -> Tuple[torch.Tensor, torch.Tensor]:
        i = self.turn % len(self.weights)
        self.turn += 1
        return self.weights[i], self.views[i]


def cold_weight_inputs(named: dict) -> dict:
    """The tuner's ``rebuild_input_func``: the call's arguments with a ring of ``w``'s copies (``w_ring``) to read."""
    w = named["w"]
    size = w.numel() * w.element_size()
    if 2 * size >= COLD_BYTES:
        return named
    copies = min(MAX_COPIES, cdiv(COLD_BYTES, size))
    try:
        ring = WeightRing(w, copies)
    except torch.OutOfMemoryError:
        logger.info("small_m_linear: no memory for %d copies of a %s weight; timing on the one weight (L2-warm)",
                    copies, tuple(w.shape))  # fmt: skip
        return named
    return {**named, "w_ring": ring}
