"""Residual add + RMSNorm in one launch: ``residual += x; y = rmsnorm(residual)`` (both written).

The weight's dtype chooses the rounding order as in :mod:`lightllm.kernels.norm.rmsnorm` (float32: scale, then
cast; else cast, then scale). The sum is rounded to the residual's dtype before it is normalized, as an unfused
``h = h + x`` then ``rmsnorm(h)`` would round it. Tuned as a GENERAL kernel like :mod:`lightllm.kernels.norm.rmsnorm`:
BLOCK_N (one pass when it covers the row, else two chunked passes) and num_warps per row count.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from lightllm.common.autotuner import AutotuneKernelType, PlannedInputs, autotune
from lightllm.kernels.norm.rmsnorm import scale_normed, rmsnorm_ref
from lightllm.kernels.block_configs import row_chunk_configs, row_chunk_default
from lightllm.kernels.direct_launch import DirectLaunch
from lightllm.kernels.step_buffer import StepBuffer
from lightllm.kernels.pdl import pdl_release, pdl_wait

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _add_rmsnorm_kernel(R, X, W, Y, stride_r, stride_x, stride_y, N, eps, BLOCK_N: tl.constexpr,
                        ONE_PASS: tl.constexpr, USE_PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    r_row = R + row * stride_r
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    cols = tl.arange(0, BLOCK_N)
    if ONE_PASS:
        mask = cols < N
        h = tl.load(r_row + cols, mask=mask, other=0.0) + tl.load(x_row + cols, mask=mask, other=0.0)
        pdl_release(USE_PDL)
        tl.store(r_row + cols, h, mask=mask)
        hf = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / N + eps)
        w = tl.load(W + cols, mask=mask, other=0.0)
        tl.store(y_row + cols, scale_normed(hf * rstd, w, R.dtype.element_ty).to(Y.dtype.element_ty), mask=mask)
    else:
        # The second pass adds again instead of reading back the first pass's stores (no barrier needed).
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        num_chunks = tl.cdiv(N, BLOCK_N)
        for i in range(num_chunks):
            off = i * BLOCK_N
            mask = off + cols < N
            h = tl.load(r_row + off + cols, mask=mask, other=0.0) + tl.load(x_row + off + cols, mask=mask, other=0.0)
            hf = h.to(tl.float32)
            acc += hf * hf
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
        pdl_release(USE_PDL)
        for i in range(num_chunks):
            off = i * BLOCK_N
            mask = off + cols < N
            h = tl.load(r_row + off + cols, mask=mask, other=0.0) + tl.load(x_row + off + cols, mask=mask, other=0.0)
            tl.store(r_row + off + cols, h, mask=mask)
            w = tl.load(W + off + cols, mask=mask, other=0.0)
            y = scale_normed(h.to(tl.float32) * rstd, w, R.dtype.element_ty)
            tl.store(y_row + off + cols, y.to(Y.dtype.element_ty), mask=mask)


_ADD_RMSNORM = DirectLaunch(_add_rmsnorm_kernel)


def _configs(residual):
    return row_chunk_configs(residual.shape[-1])


def _static_key(residual, weight):
    return {"N": residual.shape[-1], "x_dtype": str(residual.dtype), "w_dtype": str(weight.dtype)}


def _run_key(residual):
    return residual.shape[0]


@autotune(
    kernel_name="add_rmsnorm",
    configs_gen_func=_configs,
    static_key_func=_static_key,
    run_key_func=_run_key,
    kernel_type=AutotuneKernelType.GENERAL,
    mutates_args=("residual",),
    output_args=("out",),
)
def _launch_add_rmsnorm(residual, x, weight, eps, out, run_config=None):
    n = residual.shape[-1]
    cfg = run_config or row_chunk_default(n)
    block = cfg["BLOCK_N"]
    if residual.shape[0] > 0:
        _ADD_RMSNORM.launch(
            (residual.shape[0],),
            residual, x, weight, out, residual.stride(0), x.stride(0), out.stride(0), n, eps, block, block >= n,
            num_warps=cfg["num_warps"],
        )  # fmt: skip
    return out


class AddRMSNormPlan:
    """Residual add + RMSNorm of one ``[rows, N]`` shape for one step (every layer's post-attention norm and the
    next layer's input norm): checked once here, the tuned config resolved at the first :meth:`run`. ``run``
    checks only what a layer can change: shapes, dtypes, last-dim strides.

    Args: ``shape`` ``(rows, N)`` and ``dtype`` of ``residual`` and ``x``; ``eps``; ``run_config`` bypasses
    tuning; ``weight_dtype`` (default ``dtype``) is part of the tuning key; ``reuse_outputs``: every run without
    ``out`` writes the same output tensor (``kernels/step_buffer.py``).
    """

    def __init__(self, shape: Tuple[int, int], dtype: torch.dtype, eps: float = 1e-6, run_config=None,
                 weight_dtype: Optional[torch.dtype] = None, reuse_outputs: bool = False):  # fmt: skip
        weight_dtype = weight_dtype or dtype
        if dtype not in _DTYPES or len(shape) != 2:
            raise ValueError(f"add_rmsnorm plan: residual expected a [rows, N] tensor of {_DTYPES}, got "
                             f"{tuple(shape)} {dtype}")  # fmt: skip
        self.eps = float(eps)
        shape = torch.Size(shape)
        self.inputs = PlannedInputs(
            "add_rmsnorm", residual=(shape, dtype), x=(shape, dtype), weight=(shape[-1:], weight_dtype)
        )
        self._tuned = _launch_add_rmsnorm.plan(run_config=run_config)
        self._out = StepBuffer(shape, dtype, reuse_outputs)

    def run(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, out=None) -> torch.Tensor:
        self.inputs.check((residual.shape, residual.dtype), (x.shape, x.dtype), (weight.shape, weight.dtype))
        if residual.stride(-1) != 1 or x.stride(-1) != 1:
            raise ValueError(f"add_rmsnorm: residual and x expected a contiguous last dim, got strides "
                             f"{residual.stride()} and {x.stride()}")  # fmt: skip
        if out is None:
            out = self._out.get(residual.device)
        elif out.shape != residual.shape or out.dtype != residual.dtype or out.stride(-1) != 1:
            raise ValueError(
                f"add_rmsnorm: out expected a {tuple(residual.shape)} {residual.dtype} tensor with a "
                f"contiguous last dim, got {tuple(out.shape)} {out.dtype} strides {out.stride()}"
            )
        return self._tuned.run(residual, x, weight, self.eps, out)


def add_rmsnorm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out=None,
                run_config=None) -> torch.Tensor:  # fmt: skip
    """``residual += x`` (in place, rounded to its dtype), then RMSNorm of the sum over the last dim.

    Args:
        residual: ``[rows, N]`` float16/bfloat16/float32, last dim contiguous; updated in place.
        x: ``[rows, N]``, same dtype and device.
        weight: ``[N]``.
        out: optional ``[rows, N]`` tensor of residual's dtype for the normalized rows.
    Returns:
        ``out`` (allocated when None). Every layer of a step: :class:`AddRMSNormPlan` checks and resolves once.
    """
    if residual.dim() != 2:
        raise ValueError(f"add_rmsnorm: residual expected [rows, N], got shape {tuple(residual.shape)}")
    plan = AddRMSNormPlan(residual.shape, residual.dtype, eps, run_config, weight_dtype=weight.dtype)
    return plan.run(residual, x, weight, out)


def add_rmsnorm_ref(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Torch reference with the kernel's rounding steps: ``residual += x`` in its dtype, then :func:`rmsnorm_ref`."""
    residual += x
    return rmsnorm_ref(residual, weight, eps)
