"""Tensor parallelism: process group set-up, weight sharding and the all-reduce of row-parallel outputs.

Attention heads and MLP columns are split across ranks: q/k/v and gate/up are column-parallel (each rank
keeps its heads / columns), o_proj and down_proj row-parallel (partial sums, all-reduced). Embedding,
norms and lm_head are replicated. Ranks run identical steps; rank 0 alone samples.
"""

from typing import Optional

import torch
import torch.distributed as dist

from lightllm.models.qwen3.config import Qwen3ModelConfig
from lightllm.models.qwen3.weights import ShardSpec


def world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


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


def check_divisible(config: Qwen3ModelConfig, tp: int) -> None:
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(config, name) % tp:
            raise ValueError(f"--tp {tp}: the model's {name} ({getattr(config, name)}) is not divisible by it")


def shard_spec(config: Qwen3ModelConfig, tp_rank: int, tp: int) -> Optional[ShardSpec]:
    """What this rank reads of each layer tensor: its heads / MLP columns of the column-parallel weights (rows
    of q/k/v and gate/up) and the matching columns of the row-parallel ones (o_proj, down_proj)."""
    if tp == 1:
        return None
    d = config.head_dim
    q = _part(config.num_attention_heads * d, tp_rank, tp)
    kv = _part(config.num_key_value_heads * d, tp_rank, tp)
    mlp = _part(config.intermediate_size, tp_rank, tp)
    parts = {"q_proj": (0, q), "k_proj": (0, kv), "v_proj": (0, kv), "gate_proj": (0, mlp), "up_proj": (0, mlp),
             "o_proj": (1, q), "down_proj": (1, mlp)}  # fmt: skip
    return parts.get


def _part(n: int, r: int, tp: int) -> slice:
    size = n // tp
    return slice(r * size, (r + 1) * size)


def local_heads(config: Qwen3ModelConfig, tp: Optional[int] = None):
    tp = tp or world()
    return config.num_attention_heads // tp, config.num_key_value_heads // tp
