"""Output tensors of a kernel plan: one allocation per forward instead of one per layer.

A plan made with ``reuse_outputs=True`` hands every run the tensors its first run allocated, so the layers of a
forward write their outputs into the same memory. Only for callers that consume a layer's outputs before the next
run of the plan overwrites them (a model's forward: each layer's norm output feeds its GEMM at once). A plan is
made per forward, so what a forward returns is never overwritten by a later one. Split kernels' float32 partials
(``split_partials``) are kept the same way, in a plan's scratch dict.
"""

from typing import Optional, Tuple

import torch


class StepBuffer:
    """One output of a plan, ``shape`` and ``dtype``: :meth:`get` gives a new tensor, or with ``reuse`` the one
    tensor allocated at the first call."""

    __slots__ = ("shape", "dtype", "reuse", "tensor")

    def __init__(self, shape: Tuple[int, ...], dtype: torch.dtype, reuse: bool):
        self.shape, self.dtype, self.reuse = tuple(shape), dtype, reuse
        self.tensor: Optional[torch.Tensor] = None

    def get(self, device: torch.device) -> torch.Tensor:
        tensor = self.tensor
        if tensor is None:
            tensor = torch.empty(self.shape, dtype=self.dtype, device=device)
            if self.reuse:
                self.tensor = tensor
        return tensor


def split_partials(scratch: Optional[dict], shape: tuple, device) -> tuple:
    """Float32 partial outputs ``shape`` (e.g. stage 1's ``[batch, q_heads, splits, D]``) and their log-sum-exps
    ``shape[:-1]``: new, or (``scratch``: a plan's dict, keyed by shape since the split count follows the config)
    made once per plan, so every layer of a step reuses them."""
    found = None if scratch is None else scratch.get(shape)
    if found is None:
        found = (torch.empty(shape, dtype=torch.float32, device=device),
                 torch.empty(shape[:-1], dtype=torch.float32, device=device))  # fmt: skip
        if scratch is not None:
            scratch[shape] = found
    return found
