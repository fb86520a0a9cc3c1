"""The logits GEMM: ``h @ lm_head.T`` as float32, what the logits processor and sampler take."""

import torch
import torch.nn.functional as F


def logits_fp32(h: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """``[rows, hidden] x [vocab, hidden]^T -> [rows, vocab]`` float32. On a GPU a bf16/fp16 GEMM writes float32
    itself (cuBLAS's float32 accumulators, not rounded to bf16 first): no half-width logits and no separate cast
    kernel, which at batch 64 over Qwen3.5's 248K vocabulary read and wrote 95 MB per step. Elsewhere the GEMM in
    the weights' dtype, then the cast (torch's ``out_dtype`` is CUDA-only)."""
    if h.dtype == torch.float32:
        return F.linear(h, lm_head)
    if h.is_cuda:
        return torch.mm(h, lm_head.t(), out_dtype=torch.float32)
    return F.linear(h, lm_head).float()
