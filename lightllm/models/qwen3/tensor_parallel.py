"""How Qwen3 splits across tensor-parallel ranks: q/k/v and gate/up column-parallel (each rank keeps its heads
/ MLP columns), o_proj and down_proj row-parallel (partial sums, all-reduced by the model). Embedding, norms
and lm_head are replicated."""

from typing import Optional, Tuple

from lightllm.models.qwen3.config import Qwen3ModelConfig
from lightllm.models.qwen3.weights import ShardSpec


def check_divisible(config: Qwen3ModelConfig, tp: int) -> None:
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(config, name) % tp:
            raise ValueError(f"--tp {tp}: the model's {name} ({getattr(config, name)}) is not divisible by it")


def shard_spec(config: Qwen3ModelConfig, tp_rank: int, tp: int) -> Optional[ShardSpec]:
    """What this rank reads of each layer tensor: its heads / MLP columns of the column-parallel weights (rows
    of q/k/v and gate/up) and the matching columns of the row-parallel ones (o_proj, down_proj). q, k and v are
    split by heads each, then concatenated into this rank's ``qkv_proj`` (gate and up likewise)."""
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


def local_heads(config: Qwen3ModelConfig, tp: int) -> Tuple[int, int]:
    """This rank's (query heads, KV heads)."""
    return config.num_attention_heads // tp, config.num_key_value_heads // tp
