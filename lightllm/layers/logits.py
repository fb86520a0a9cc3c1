"""The logits GEMM: ``h @ lm_head.T`` as float32, what the logits processor and sampler take."""

from typing import Callable

import torch

from lightllm.kernels.linear.reference import cublas_linear
from lightllm.kernels.linear.small_m_kernel import MAX_ROWS
from lightllm.kernels.linear.small_m_linear import SmallMLinearPlan


def logits_fp32(h: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """``[rows, hidden] x [vocab, hidden]^T -> [rows, vocab]`` float32. On a GPU a bf16/fp16 GEMM writes float32
    itself (cuBLAS's float32 accumulators, not rounded to bf16 first): no half-width logits and no separate cast
    kernel, which at batch 64 over Qwen3.5's 248K vocabulary read and wrote 95 MB per step (:func:`cublas_linear`)."""
    return cublas_linear(h, lm_head.t(), torch.float32)


def plan_logits(rows: int, lm_head: torch.Tensor, use_kernels: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """One forward's logits, ``h [rows, hidden] -> float32 [rows, vocab]``. With kernels and at most 16 rows: the
    tuned small-M linear writing float32 from its accumulators (cuBLAS, as :func:`logits_fp32`, until a search finds
    a faster config); else :func:`logits_fp32`."""
    if not use_kernels or rows > MAX_ROWS:
        return lambda h: logits_fp32(h, lm_head)
    run, lm_head_t = SmallMLinearPlan(rows, *lm_head.shape, lm_head.dtype, torch.float32).run, lm_head.t()
    return lambda h: run(h, lm_head, lm_head_t)
