"""Torch references of the linear layers: what the models call without the tuned kernel (cuBLAS on a GPU), and the
float64 oracle of the tests."""

from typing import Optional

import torch


def cublas_linear(x: torch.Tensor, w_t: torch.Tensor, out_dtype: torch.dtype, out: Optional[torch.Tensor] = None):
    """``x @ w_t`` as the models compute it with no tuned config: ``torch.mm`` on the weight's ``[in, out]`` view
    (``F.linear``'s own mm). A float32 ``out_dtype`` of half inputs has cuBLAS write its float32 accumulators on a
    GPU (``layers/logits.py``); elsewhere (torch's ``out_dtype`` is CUDA-only) the GEMM in x's dtype, then the cast."""
    if out_dtype == x.dtype:
        return torch.mm(x, w_t) if out is None else torch.mm(x, w_t, out=out)
    if x.is_cuda:
        if out is None:
            return torch.mm(x, w_t, out_dtype=out_dtype)
        return torch.mm(x, w_t, out_dtype=out_dtype, out=out)
    y = torch.mm(x, w_t).to(out_dtype)
    return y if out is None else out.copy_(y)


def mm_on_view(x: torch.Tensor, w: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """A model projection ``(x, w, w_t) -> x @ w^T`` as ``torch.mm(x, w_t)`` on the load-time ``[in, out]`` view:
    the CPU path, and the GPU's above 16 rows (nothing keyed or checked per layer)."""
    return torch.mm(x, w_t)


def linear_ref(x: torch.Tensor, w: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x [M, K] @ w [N, K]^T`` computed in float64, cast to ``out_dtype`` (default x's dtype)."""
    return (x.double() @ w.double().t()).to(out_dtype or x.dtype)
