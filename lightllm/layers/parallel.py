"""Tensor parallelism, model-independent part: joining the process group and the all-reduce of row-parallel
outputs. How a model splits its weights lives with the model (``models/qwen3/tensor_parallel.py``); ranks
run identical steps and rank 0 alone samples."""

import os
from typing import Optional

import torch
import torch.distributed as dist

from lightllm.common.autotuner.dist import rank, world

__all__ = ["all_reduce_", "broadcast_", "cpu_threads_per_rank", "init_tp", "rank", "world"]


def cpu_threads_per_rank(world_: int, cpu_count: Optional[int], omp_num_threads: Optional[str]) -> Optional[int]:
    """Intra-op threads for each rank of a CPU group: the cores shared out (at least one), or None to leave torch's
    own choice (one rank, or ``OMP_NUM_THREADS`` set by the user). Every rank spinning one OpenMP thread per core
    oversubscribes the cores ``world`` times, and a spinning rank starves the gloo collective the others wait in
    (two ranks on two cores: about 50x slower per step)."""
    if world_ <= 1 or omp_num_threads:
        return None
    return max(1, (cpu_count or 1) // world_)


def init_tp(rank_: int, world_: int, init_method: str, device: torch.device) -> None:
    """Join the tensor-parallel group: NCCL on GPUs (one per rank), gloo on the CPU (the cores shared out)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        threads = cpu_threads_per_rank(world_, os.cpu_count(), os.environ.get("OMP_NUM_THREADS"))
        if threads is not None:
            torch.set_num_threads(threads)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank_,
                            world_size=world_)  # fmt: skip


def all_reduce_(x: torch.Tensor) -> torch.Tensor:
    if world() > 1:
        dist.all_reduce(x)
    return x


def broadcast_(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Every rank's ``x`` becomes rank ``src``'s (over the default group: NCCL on GPUs, no host round trip)."""
    if world() > 1:
        dist.broadcast(x, src)
    return x
