from lightllm.kernels.attention.prefill.context_attention import context_attention, context_attention_ref

__all__ = ["context_attention", "context_attention_ref"]
