"""RMSNorm in two rounding orders, chosen by the weight's dtype:

- a weight of the input's dtype (Qwen3): normalize in float32, cast to the input dtype, then scale;
- a float32 weight (Qwen3.5's zero-centred norms, ``1 + weight`` kept in float32): scale the float32 norm, then
  cast. For float32 inputs the two are the same.

Tuned as a GENERAL kernel: prefill warmup searches BLOCK_N (one pass when it covers the row, else two
chunked passes) and num_warps per row count.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from lightllm.common.autotuner import AutotuneKernelType, PlannedInputs, autotune
from lightllm.kernels.block_configs import row_chunk_configs, row_chunk_default
from lightllm.kernels.direct_launch import DirectLaunch
from lightllm.kernels.step_buffer import StepBuffer
from lightllm.kernels.pdl import pdl_release, pdl_wait

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def scale_normed(normed, w, dtype: tl.constexpr):
    """``normed`` (float32) times the weight, in the order the weight's dtype says (see the module docstring)."""
    if w.dtype == tl.float32:  # a compile-time branch: one body per weight dtype
        y = (normed * w).to(dtype)
    else:
        y = normed.to(dtype) * w
    return y


@triton.jit
def _rmsnorm_kernel(X, W, Y, stride_x, stride_y, N, eps, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr,
                    USE_PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    cols = tl.arange(0, BLOCK_N)
    if ONE_PASS:
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        w = tl.load(W + cols, mask=mask, other=0.0)
        pdl_release(USE_PDL)
        tl.store(y_row + cols, scale_normed(x * rstd, w, X.dtype.element_ty).to(Y.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        num_chunks = tl.cdiv(N, BLOCK_N)
        for i in range(num_chunks):
            off = i * BLOCK_N
            mask = off + cols < N
            x = tl.load(x_row + off + cols, mask=mask, other=0.0).to(tl.float32)
            acc += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
        pdl_release(USE_PDL)
        for i in range(num_chunks):
            off = i * BLOCK_N
            mask = off + cols < N
            x = tl.load(x_row + off + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(W + off + cols, mask=mask, other=0.0)
            tl.store(
                y_row + off + cols, scale_normed(x * rstd, w, X.dtype.element_ty).to(Y.dtype.element_ty), mask=mask
            )


_RMSNORM = DirectLaunch(_rmsnorm_kernel)


def _configs(x):
    return row_chunk_configs(x.shape[-1])


def _static_key(x, weight):
    return {"N": x.shape[-1], "x_dtype": str(x.dtype), "w_dtype": str(weight.dtype)}


def _run_key(x):
    return x.numel() // x.shape[-1]


@autotune(
    kernel_name="rmsnorm",
    configs_gen_func=_configs,
    static_key_func=_static_key,
    run_key_func=_run_key,
    kernel_type=AutotuneKernelType.GENERAL,
    output_args=("out",),
)
def _launch_rmsnorm(x, weight, eps, out, run_config=None):
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    y2 = out.view(-1, n)
    cfg = run_config or row_chunk_default(n)
    block = cfg["BLOCK_N"]
    if x2.shape[0] > 0:
        _RMSNORM.launch(
            (x2.shape[0],),
            x2,
            weight,
            y2,
            x2.stride(0),
            y2.stride(0),
            n,
            eps,
            block,
            block >= n,
            num_warps=cfg["num_warps"],
        )
    return out


class RMSNormPlan:
    """RMSNorm of one input shape for one step, made from the shape before any layer runs: checked once here,
    the tuned config resolved at the first :meth:`run`; every input of that shape and dtype (each layer's norm)
    runs with them. ``run`` checks only what can change between layers: shape, dtype, last-dim stride, weight.

    Args: ``shape`` and ``dtype`` of ``x``; ``eps`` and ``run_config`` as :func:`rmsnorm`; ``weight_dtype``
    (default ``dtype``): the weights' dtype is part of the tuning key, so a layer with another is refused;
    ``reuse_outputs``: every run without ``out`` writes the same output tensor (``kernels/step_buffer.py``).
    :meth:`run`'s ``out`` of a 2-D shape may have strided rows: a column block of a wider buffer (Qwen3.5's MTP head
    norms its two inputs into the halves of its ``fc`` input, so no concatenation copies them).
    """

    def __init__(self, shape: Tuple[int, ...], dtype: torch.dtype, eps: float = 1e-6, run_config=None,
                 weight_dtype: Optional[torch.dtype] = None, reuse_outputs: bool = False):  # fmt: skip
        weight_dtype = weight_dtype or dtype  # a model's norm weights share its dtype
        if dtype not in _DTYPES or len(shape) < 1:
            raise ValueError(f"rmsnorm plan: x expected a [..., N] tensor of {_DTYPES}, got {tuple(shape)} {dtype}")
        self.eps = float(eps)
        self.inputs = PlannedInputs(
            "rmsnorm", x=(torch.Size(shape), dtype), weight=(torch.Size(shape[-1:]), weight_dtype)
        )
        self._tuned = _launch_rmsnorm.plan(run_config=run_config)
        self._out = StepBuffer(shape, dtype, reuse_outputs)

    def run(self, x: torch.Tensor, weight: torch.Tensor, out=None) -> torch.Tensor:
        self.inputs.check((x.shape, x.dtype), (weight.shape, weight.dtype))
        if x.stride(-1) != 1:
            raise ValueError(f"rmsnorm: x expected a contiguous last dim, got strides {x.stride()}")
        if out is None:
            out = self._out.get(x.device)
        else:
            _check_out(x, out)
        return self._tuned.run(x, weight, self.eps, out)


def _check_out(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` must have x's shape and dtype and be writable row by row: contiguous, or 2-D with a contiguous last
    dim (the halves of a wider row, as the MTP head's fc input)."""
    rows = out.is_contiguous() or (out.dim() == 2 and out.stride(-1) == 1)
    if out.shape != x.shape or out.dtype != x.dtype or not rows:
        raise ValueError(f"rmsnorm: out expected a {tuple(x.shape)} {x.dtype} tensor, contiguous (2-D: its last "
                         f"dim only), got {tuple(out.shape)} {out.dtype} strides {out.stride()}")  # fmt: skip


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out=None, run_config=None) -> torch.Tensor:
    """RMSNorm over the last dim.

    Args:
        x: ``[..., N]`` float16/bfloat16/float32, last dim contiguous.
        weight: ``[N]``, same device.
        out: optional ``[..., N]`` tensor of x's shape and dtype to write into.
    Returns:
        ``out`` (allocated when None), ``weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)``.
    Many calls of one shape in a step (every layer): :class:`RMSNormPlan` checks and resolves once.
    """
    _check(x, weight, out)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    return _launch_rmsnorm(x, weight, eps, y, run_config=run_config)


def _check(x: torch.Tensor, weight: torch.Tensor, out) -> None:
    if x.dtype not in _DTYPES:
        raise ValueError(f"rmsnorm: x must be one of {_DTYPES}, got {x.dtype}")
    if x.dim() < 1 or x.stride(-1) != 1:
        raise ValueError(f"rmsnorm: x must have a contiguous last dim, got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],) or weight.device != x.device:
        raise ValueError(f"rmsnorm: weight must be [{x.shape[-1]}] on {x.device}, got {tuple(weight.shape)}")
    if out is not None:
        _check_out(x, out)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Torch reference with the kernel's rounding steps, computed in float32: a float32 ``weight`` scales before
    the cast to x's dtype (Qwen3.5, transformers' ``(norm(x) * (1 + w)).to(dtype)``), any other after it."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (normed * weight).to(x.dtype)
    return (normed.to(x.dtype).float() * weight.float()).to(x.dtype)
