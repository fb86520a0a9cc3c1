"""Tensor parallelism, model-independent part: joining the process group and the all-reduce of row-parallel
outputs. How a model splits its weights lives with the model (``models/qwen3/tensor_parallel.py``); ranks
run identical steps and rank 0 alone samples."""

import torch
import torch.distributed as dist

from lightllm.common.autotuner.dist import rank, world

__all__ = ["all_reduce_", "broadcast_", "init_tp", "rank", "world"]


def init_tp(rank_: int, world_: int, init_method: str, device: torch.device) -> None:
    """Join the tensor-parallel group: NCCL on GPUs (one per rank), gloo on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
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
