"""How Qwen3.5 splits across tensor-parallel ranks, by heads.

Gated attention: ``q_proj`` (per head ``[query | gate]``), k/v by heads, ``o_proj`` by the matching columns.
Gated DeltaNet: the q and k parts of ``in_proj_qkv`` and of the conv channels by key heads, their v part, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``, ``A_log`` and ``dt_bias`` by value heads (value head ``h`` reads key head
``h // (Hv / Hk)``, so a rank's value heads read only its key heads), ``out_proj`` by the matching columns; so the
state slots split by value heads too. MLP: gate/up rows, down columns. Row-parallel outputs (``o_proj``,
``out_proj``, ``down_proj``) are all-reduced by the model; embedding, norms and lm_head are replicated. The
loader fuses a rank's parts after sharding each (``qkv_proj`` = [its q; its k; its v], ``in_proj`` = [its qkv; z;
b; a], ``gate_up_proj`` = [its gate; its up]), so the spec names the checkpoint's fields.
"""

from typing import Callable, List, Optional, Tuple

from lightllm.models.qwen3_5.config import Qwen3_5ModelConfig

# A layer field's part on this rank: (dim, slices of the full tensor along dim, concatenated), None for all of it.
ShardSpec = Callable[[str], Optional[Tuple[int, List[slice]]]]
_SPLIT = ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
          "intermediate_size")  # fmt: skip


def check_divisible(config: Qwen3_5ModelConfig, tp: int) -> None:
    for name in _SPLIT:
        if getattr(config, name) % tp:
            raise ValueError(f"--tp {tp}: the model's {name} ({getattr(config, name)}) is not divisible by it")


def _part(n: int, r: int, tp: int, offset: int = 0) -> slice:
    size = n // tp
    return slice(offset + r * size, offset + (r + 1) * size)


def shard_spec(c: Qwen3_5ModelConfig, r: int, tp: int) -> Optional[ShardSpec]:
    if tp == 1:
        return None
    q = [_part(c.num_attention_heads * 2 * c.head_dim, r, tp)]  # [query | gate] rows per head stay together
    attn_out = [_part(c.num_attention_heads * c.head_dim, r, tp)]
    kv = [_part(c.num_key_value_heads * c.head_dim, r, tp)]
    kd, vd, hv = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_value_dim, c.linear_num_value_heads
    channels = [_part(kd, r, tp), _part(kd, r, tp, kd), _part(vd, r, tp, 2 * kd)]  # q | k | v of the conv input
    value, heads, mlp = [_part(vd, r, tp)], [_part(hv, r, tp)], [_part(c.intermediate_size, r, tp)]
    parts = {"q_proj": (0, q), "k_proj": (0, kv), "v_proj": (0, kv), "o_proj": (1, attn_out),
             "in_proj_qkv": (0, channels), "conv1d": (0, channels), "in_proj_z": (0, value), "in_proj_b": (0, heads),
             "in_proj_a": (0, heads), "A_log": (0, heads), "dt_bias": (0, heads), "out_proj": (1, value),
             "gate_proj": (0, mlp), "up_proj": (0, mlp), "down_proj": (1, mlp)}  # fmt: skip
    return parts.get
