from lightllm.kernels.attention.decode.flash_decode import (
    gqa_decode_attention,
    gqa_decode_attention_int4kv,
    gqa_decode_attention_int8kv,
)

__all__ = ["gqa_decode_attention", "gqa_decode_attention_int8kv", "gqa_decode_attention_int4kv"]
