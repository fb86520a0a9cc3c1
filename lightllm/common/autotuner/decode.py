"""Helpers for decode-attention kernels' run keys."""

from lightllm.common import envs
from lightllm.common.autotuner.phase import AutotuneKernelType, current_warmup_kernel_type, is_searching_level
from lightllm.common.envs import get_decode_attn_autotune_seq_len

KV_LEN_BUCKET = 512


def round_up_kv_len(kv_len: int, bucket: int = KV_LEN_BUCKET) -> int:
    """KV length rounded up to a multiple of ``bucket`` (at least one bucket), for run keys."""
    return max(1, -(-int(kv_len) // bucket)) * bucket


def is_decode_attn_tuning() -> bool:
    """True while a DECODE_ATTENTION warmup scope is active at level 1 (adaptive) or 2 (force)."""
    if current_warmup_kernel_type() is not AutotuneKernelType.DECODE_ATTENTION:
        return False
    return is_searching_level(envs.get_triton_autotune_level())


def decode_attn_run_key_kv_len(real_kv_len: int) -> int:
    """The KV length a run key should use: the representative length while decode attention is being
    tuned (the dummy capture batch has tiny real lengths), the real length otherwise. Not rounded."""
    return get_decode_attn_autotune_seq_len() if is_decode_attn_tuning() else int(real_kv_len)


__all__ = [
    "KV_LEN_BUCKET",
    "decode_attn_run_key_kv_len",
    "get_decode_attn_autotune_seq_len",
    "is_decode_attn_tuning",
    "round_up_kv_len",
]
