"""Per-layer K/V pools, allocated once up front, and their sizing.

``pool.k[layer]`` / ``pool.v[layer]`` are ``[num_tokens, kv_heads, ...]`` views into one buffer per side
(``k`` itself is ``[num_layers, num_tokens, kv_heads, ...]``). Token ``i`` of every layer belongs to whichever
request the allocator gave slot ``i`` to.
"""

import torch

from lightllm.common.kv_cache.allocator import check_count
from lightllm.common.kv_cache.quant import SCALE_DTYPE, check_group_size

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_dims(owner: str, num_tokens: int, num_layers: int, kv_heads: int, head_dim: int) -> None:
    dims = {"num_tokens": num_tokens, "num_layers": num_layers, "kv_heads": kv_heads, "head_dim": head_dim}
    for name, value in dims.items():
        check_count(owner, name, value, 1)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class KVPool:
    """K and V in ``dtype`` (float16 / bfloat16 / float32).

    ``k``, ``v``: ``[num_layers, num_tokens, kv_heads, head_dim]``; ``k[layer]`` is one layer.
    """

    def __init__(self, num_tokens: int, num_layers: int, kv_heads: int, head_dim: int, dtype, device="cuda"):
        _check_dims("KVPool", num_tokens, num_layers, kv_heads, head_dim)
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"KVPool: dtype expected one of {FLOAT_DTYPES}, got {dtype}")
        self.num_tokens, self.num_layers, self.kv_heads, self.head_dim = num_tokens, num_layers, kv_heads, head_dim
        self.dtype = dtype
        shape = (num_layers, num_tokens, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def token_bytes(num_layers: int, kv_heads: int, head_dim: int, dtype) -> int:
        """Bytes one token takes over all layers (K and V), for sizing before the pool exists."""
        return 2 * num_layers * kv_heads * head_dim * _element_size(dtype)

    def bytes_per_token(self) -> int:
        return self.token_bytes(self.num_layers, self.kv_heads, self.head_dim, self.dtype)


class _QuantKVPool:
    """Shared body of the INT8 and INT4 pools: codes plus float16 group scales per layer."""

    INT4 = False

    def __init__(self, num_tokens: int, num_layers: int, kv_heads: int, head_dim: int, device="cuda", group_size=8):
        owner = type(self).__name__
        _check_dims(owner, num_tokens, num_layers, kv_heads, head_dim)
        check_group_size(owner, head_dim, group_size, int4=self.INT4)
        self.num_tokens, self.num_layers, self.kv_heads, self.head_dim = num_tokens, num_layers, kv_heads, head_dim
        self.group_size = group_size
        code_dim = head_dim // 2 if self.INT4 else head_dim
        code_dtype = torch.uint8 if self.INT4 else torch.int8
        codes = (num_layers, num_tokens, kv_heads, code_dim)
        scales = (num_layers, num_tokens, kv_heads, head_dim // group_size)
        self.k = torch.zeros(codes, dtype=code_dtype, device=device)
        self.v = torch.zeros(codes, dtype=code_dtype, device=device)
        self.k_scale = torch.zeros(scales, dtype=SCALE_DTYPE, device=device)
        self.v_scale = torch.zeros(scales, dtype=SCALE_DTYPE, device=device)

    @classmethod
    def token_bytes(cls, num_layers: int, kv_heads: int, head_dim: int, group_size: int = 8) -> int:
        """Bytes one token takes over all layers (codes and scales of K and V)."""
        check_group_size(cls.__name__, head_dim, group_size, int4=cls.INT4)
        code_bytes = head_dim // 2 if cls.INT4 else head_dim
        scale_bytes = (head_dim // group_size) * _element_size(SCALE_DTYPE)
        return 2 * num_layers * kv_heads * (code_bytes + scale_bytes)

    def bytes_per_token(self) -> int:
        return self.token_bytes(self.num_layers, self.kv_heads, self.head_dim, self.group_size)


class Int8KVPool(_QuantKVPool):
    """``k``, ``v``: int8 ``[num_layers, num_tokens, kv_heads, head_dim]``;
    ``k_scale``, ``v_scale``: float16 ``[num_layers, num_tokens, kv_heads, head_dim // group_size]``."""

    INT4 = False


class Int4KVPool(_QuantKVPool):
    """``k``, ``v``: uint8 ``[num_layers, num_tokens, kv_heads, head_dim // 2]`` (split-halves nibbles);
    ``k_scale``, ``v_scale``: float16 ``[num_layers, num_tokens, kv_heads, head_dim // group_size]``."""

    INT4 = True


def tokens_for_budget(bytes_budget: int, bytes_per_token: int) -> int:
    """How many whole tokens fit in ``bytes_budget``; ``ValueError`` if not even one."""
    check_count("tokens_for_budget", "bytes_budget", bytes_budget, 0)
    check_count("tokens_for_budget", "bytes_per_token", bytes_per_token, 1)
    if bytes_budget < bytes_per_token:
        raise ValueError(
            f"tokens_for_budget: bytes_budget expected at least one token ({bytes_per_token} bytes), "
            f"got {bytes_budget}"
        )
    return bytes_budget // bytes_per_token
