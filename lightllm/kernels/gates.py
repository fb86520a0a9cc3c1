"""Gated attention's output gate in one launch: ``o * sigmoid(gate)`` per head (Qwen3.5).

``gate`` is read in place from the fused qkv projection, where each q head is ``[query | gate]``: a
``[rows, heads, D]`` view with any row and head strides (last dim contiguous). Rounding as transformers'
``o * torch.sigmoid(gate)`` in the model dtype: the sigmoid in float32 rounded, then the product rounded.
Tuned as a GENERAL kernel: BLOCK_H (heads per program) and num_warps per row count.
"""

from typing import Optional

import torch
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
def _sigmoid_gate_mul_kernel(X, G, Out, stride_ot, stride_oh, stride_gt, stride_gh, HEADS: tl.constexpr,
                             D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                             USE_PDL: tl.constexpr = False):  # fmt: skip
    # out [rows, HEADS, D] is contiguous: its strides need no arguments.
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < HEADS)[:, None] & (d < D)[None, :]
    o = tl.load(X + t * stride_ot + h[:, None] * stride_oh + d[None, :], mask=mask, other=0.0)
    g = tl.load(G + t * stride_gt + h[:, None] * stride_gh + d[None, :], mask=mask, other=0.0).to(tl.float32)
    dt = X.dtype.element_ty
    sig = (1.0 / (1.0 + tl.exp(-g))).to(dt)
    y = (o.to(tl.float32) * sig.to(tl.float32)).to(dt)
    pdl_release(USE_PDL)
    tl.store(Out + t * (HEADS * D) + h[:, None] * D + d[None, :], y.to(Out.dtype.element_ty), mask=mask)


_SIGMOID_GATE_MUL = DirectLaunch(_sigmoid_gate_mul_kernel)


def _configs(out):
    return head_block_configs(out.shape[1])


def _static_key(o):
    return {"heads": o.shape[1], "D": o.shape[2], "dtype": str(o.dtype)}


def _run_key(o):
    return o.shape[0]


@autotune(
    kernel_name="sigmoid_gate_mul",
    configs_gen_func=_configs,
    static_key_func=_static_key,
    run_key_func=_run_key,
    kernel_type=AutotuneKernelType.GENERAL,
    output_args=("out",),
)
def _launch_sigmoid_gate_mul(o, gate, out, run_config=None):
    rows, heads, d = out.shape
    cfg = run_config or head_block_default(heads)
    if rows > 0:
        grid = (rows, cdiv(heads, cfg["BLOCK_H"]))
        _SIGMOID_GATE_MUL.launch(grid, o, gate, out, o.stride(0), o.stride(1), gate.stride(0), gate.stride(1), heads,
                                 d, cfg["BLOCK_H"], next_power_of_2(d), num_warps=cfg["num_warps"])  # fmt: skip
    return out


class SigmoidGatePlan:
    """``o * sigmoid(gate)`` of one step's ``[rows, heads, D]`` shape (every gated-attention layer): checked once
    here, the tuned config resolved at the first :meth:`run`, which checks only what a layer can change.

    Args: ``rows``, ``heads``, ``head_dim`` and ``dtype`` of o and gate; ``run_config`` bypasses tuning;
    ``reuse_outputs``: every run without ``out`` writes the same output tensor (``kernels/step_buffer.py``).
    """

    def __init__(self, rows: int, heads: int, head_dim: int, dtype: torch.dtype, run_config=None,
                 reuse_outputs: bool = False):  # fmt: skip
        if dtype not in _DTYPES or rows < 0 or min(heads, head_dim) < 1:
            raise ValueError(f"sigmoid_gate_mul plan: expected rows >= 0, heads and head_dim >= 1 and a dtype in "
                             f"{_DTYPES}, got {rows}, {heads}, {head_dim}, {dtype}")  # fmt: skip
        shape = torch.Size((rows, heads, head_dim))
        self.inputs = PlannedInputs("sigmoid_gate_mul", o=(shape, dtype), gate=(shape, dtype))
        self._tuned = _launch_sigmoid_gate_mul.plan(run_config=run_config)
        self._out = StepBuffer(shape, dtype, reuse_outputs)

    def run(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """A contiguous ``[rows, heads, D]`` tensor (new, or the plan's own with ``reuse_outputs``)."""
        self.inputs.check((o.shape, o.dtype), (gate.shape, gate.dtype))
        if o.stride(-1) != 1 or gate.stride(-1) != 1:
            raise ValueError(f"sigmoid_gate_mul: o and gate expected a contiguous last dim, got strides {o.stride()} "
                             f"and {gate.stride()}")  # fmt: skip
        return self._tuned.run(o, gate, self._out.get(o.device))


def sigmoid_gate_mul(o: torch.Tensor, gate: torch.Tensor, run_config: Optional[dict] = None) -> torch.Tensor:
    """``o * sigmoid(gate)``.

    Args:
        o: ``[rows, heads, D]`` float16/bfloat16/float32, last dim contiguous (any row and head strides).
        gate: the same shape and dtype, last dim contiguous (a view of the qkv projection's gate columns).
    Returns:
        A new contiguous ``[rows, heads, D]`` tensor. Every layer of a step: :class:`SigmoidGatePlan`.
    """
    if o.dim() != 3:
        raise ValueError(f"sigmoid_gate_mul: o expected [rows, heads, D], got shape {tuple(o.shape)}")
    return SigmoidGatePlan(*o.shape, o.dtype, run_config).run(o, gate)


def sigmoid_gate_mul_ref(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Torch reference with the kernel's rounding steps: ``o * torch.sigmoid(gate)`` in o's dtype."""
    return o * torch.sigmoid(gate)
