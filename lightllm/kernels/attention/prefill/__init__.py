from lightllm.kernels.attention.prefill.context_attention import CachedPrefix, context_attention, context_attention_ref

__all__ = ["CachedPrefix", "context_attention", "context_attention_ref"]
