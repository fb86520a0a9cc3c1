"""Gated RMSNorm per head in one launch (Qwen3.5's gated DeltaNet output): ``w * norm(x)`` times ``silu(z)``.

``x`` is the delta rule's output ``[rows, heads, D]``; ``z`` is read in place from the fused input projection (a
``[rows, heads, D]`` view with any row and head strides, last dim contiguous). Rounding as transformers'
``Qwen3_5RMSNormGated``: the norm in float32 cast to the model dtype, times the plain weight (rounded), then
``* silu(z)`` in float32 and cast. Tuned as a GENERAL kernel: BLOCK_H (heads per program) and num_warps.
"""

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lightllm.common.autotuner import AutotuneKernelType, PlannedInputs, autotune
from lightllm.kernels.block_configs import head_block_configs, head_block_default
from lightllm.kernels.launch_math import cdiv, next_power_of_2
from lightllm.kernels.direct_launch import DirectLaunch
from lightllm.kernels.pdl import pdl_release, pdl_wait
from lightllm.kernels.step_buffer import StepBuffer

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _gated_rmsnorm_kernel(X, Z, W, Out, stride_xt, stride_xh, stride_zt, stride_zh, eps, HEADS: tl.constexpr,
                          D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                          USE_PDL: tl.constexpr = False):  # fmt: skip
    # out [rows, HEADS, D] is contiguous: its strides need no arguments.
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    mask = (h < HEADS)[:, None] & d_mask[None, :]
    x = tl.load(X + t * stride_xt + h[:, None] * stride_xh + d[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(Z + t * stride_zt + h[:, None] * stride_zh + d[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + d, mask=d_mask, other=0.0)[None, :]
    dt = X.dtype.element_ty
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    scaled = (w * (x * rstd).to(dt)).to(tl.float32)  # promoted as in torch: rounded to dt unless w is float32
    y = (scaled * (z / (1.0 + tl.exp(-z)))).to(dt)
    pdl_release(USE_PDL)
    tl.store(Out + t * (HEADS * D) + h[:, None] * D + d[None, :], y.to(Out.dtype.element_ty), mask=mask)


_GATED_RMSNORM = DirectLaunch(_gated_rmsnorm_kernel)


def _configs(out):
    return head_block_configs(out.shape[1])


def _static_key(x, weight):
    return {"heads": x.shape[1], "D": x.shape[2], "dtype": str(x.dtype), "w_dtype": str(weight.dtype)}


def _run_key(x):
    return x.shape[0]


@autotune(
    kernel_name="gated_rmsnorm",
    configs_gen_func=_configs,
    static_key_func=_static_key,
    run_key_func=_run_key,
    kernel_type=AutotuneKernelType.GENERAL,
    output_args=("out",),
)
def _launch_gated_rmsnorm(x, z, weight, eps, out, run_config=None):
    rows, heads, d = out.shape
    cfg = run_config or head_block_default(heads)
    if rows > 0:
        grid = (rows, cdiv(heads, cfg["BLOCK_H"]))
        _GATED_RMSNORM.launch(grid, x, z, weight, out, x.stride(0), x.stride(1), z.stride(0), z.stride(1), eps, heads,
                              d, cfg["BLOCK_H"], next_power_of_2(d), num_warps=cfg["num_warps"])  # fmt: skip
    return out


class GatedRMSNormPlan:
    """The gated norm of one step's ``[rows, heads, D]`` shape (every gated-DeltaNet layer): checked once here,
    the tuned config resolved at the first :meth:`run`, which checks only what a layer can change.

    Args: ``rows``, ``heads``, ``head_dim`` and ``dtype`` of x and z; ``eps``; ``run_config`` bypasses tuning;
    ``weight_dtype`` (default ``dtype``) is part of the tuning key; ``reuse_outputs``: every run writes the same
    output tensor (``kernels/step_buffer.py``).
    """

    def __init__(self, rows: int, heads: int, head_dim: int, dtype: torch.dtype, eps: float = 1e-6, run_config=None,
                 weight_dtype: Optional[torch.dtype] = None, reuse_outputs: bool = False):  # fmt: skip
        weight_dtype = weight_dtype or dtype
        if dtype not in _DTYPES or weight_dtype not in _DTYPES or rows < 0 or min(heads, head_dim) < 1:
            raise ValueError(f"gated_rmsnorm plan: expected rows >= 0, heads and head_dim >= 1 and dtypes in "
                             f"{_DTYPES}, got {rows}, {heads}, {head_dim}, {dtype}, {weight_dtype}")  # fmt: skip
        self.eps = float(eps)
        shape = torch.Size((rows, heads, head_dim))
        self.inputs = PlannedInputs("gated_rmsnorm", x=(shape, dtype), z=(shape, dtype),
                                    weight=(shape[-1:], weight_dtype))  # fmt: skip
        self._tuned = _launch_gated_rmsnorm.plan(run_config=run_config)
        self._out = StepBuffer(shape, dtype, reuse_outputs)

    def run(self, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A contiguous ``[rows, heads, D]`` tensor (new, or the plan's own with ``reuse_outputs``)."""
        self.inputs.check((x.shape, x.dtype), (z.shape, z.dtype), (weight.shape, weight.dtype))
        if x.stride(-1) != 1 or z.stride(-1) != 1 or weight.stride(0) != 1:
            raise ValueError(f"gated_rmsnorm: x, z and weight expected a contiguous last dim, got strides "
                             f"{x.stride()}, {z.stride()} and {weight.stride()}")  # fmt: skip
        return self._tuned.run(x, z, weight, self.eps, self._out.get(x.device))


def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                  run_config: Optional[dict] = None) -> torch.Tensor:  # fmt: skip
    """RMSNorm of each head of ``x`` scaled by ``weight``, gated by ``silu(z)``.

    Args:
        x: ``[rows, heads, D]`` float16/bfloat16/float32, last dim contiguous (any row and head strides).
        z: the same shape and dtype, last dim contiguous (a view of the input projection's z columns).
        weight: ``[D]``, the gated norm's plain weight.
    Returns:
        A new contiguous ``[rows, heads, D]`` tensor. Every layer of a step: :class:`GatedRMSNormPlan`.
    """
    if x.dim() != 3:
        raise ValueError(f"gated_rmsnorm: x expected [rows, heads, D], got shape {tuple(x.shape)}")
    return GatedRMSNormPlan(*x.shape, x.dtype, eps, run_config, weight.dtype).run(x, z, weight)


def gated_rmsnorm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Torch reference with transformers' rounding steps: ``weight * norm(x)`` (the norm cast to x's dtype first),
    then ``* silu(z)`` in float32, cast back."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed).float() * F.silu(z.float())).to(x.dtype)
