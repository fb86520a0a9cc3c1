"""Token-level KV cache: allocators, the req_to_token table, per-layer pools and the INT8/INT4 format."""

from lightllm.common.kv_cache.allocator import KVCacheFull, ReqSlotAllocator, TokenAllocator
from lightllm.common.kv_cache.manager import KVCacheManager
from lightllm.common.kv_cache.pools import Int4KVPool, Int8KVPool, KVPool, tokens_for_budget
from lightllm.common.kv_cache.quant import (
    check_group_size,
    dequantize_int4_ref,
    dequantize_int8_ref,
    quantize_int4_ref,
    quantize_int8_ref,
)
from lightllm.common.kv_cache.req_to_token import ReqToTokenTable

__all__ = [
    "KVCacheFull",
    "TokenAllocator",
    "ReqSlotAllocator",
    "ReqToTokenTable",
    "KVCacheManager",
    "KVPool",
    "Int8KVPool",
    "Int4KVPool",
    "tokens_for_budget",
    "check_group_size",
    "quantize_int8_ref",
    "dequantize_int8_ref",
    "quantize_int4_ref",
    "dequantize_int4_ref",
]
