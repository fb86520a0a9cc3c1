"""SwiGLU's activation in one launch over the fused gate/up projection: ``silu(gate) * up``.

``gate_up [rows, 2 * I]`` holds gate in its first ``I`` columns and up in the rest (one GEMM of the fused
weight). Rounding as ``F.silu(gate) * up`` in the model dtype: silu in float32 rounded, then the product rounded.
Tuned as a GENERAL kernel: BLOCK_N (columns per program) and num_warps per row count.
"""

import functools
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lightllm.common.autotuner import AutotuneKernelType, PlannedInputs, autotune
from lightllm.kernels.launch_math import cdiv, next_power_of_2
from lightllm.kernels.direct_launch import DirectLaunch
from lightllm.kernels.step_buffer import StepBuffer
from lightllm.kernels.pdl import pdl_release, pdl_wait

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _silu_mul_kernel(GU, Out, stride_gu, stride_out, N, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    gate = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_gu + N + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(GU.dtype.element_ty)
    pdl_release(USE_PDL)
    tl.store(Out + row * stride_out + cols, (act * up).to(Out.dtype.element_ty), mask=mask)


_SILU_MUL = DirectLaunch(_silu_mul_kernel)


def _configs(out):
    full = next_power_of_2(out.shape[-1])
    blocks = sorted({min(b, full) for b in (256, 512, 1024, 2048, 4096)})
    return [{"BLOCK_N": b, "num_warps": w} for b in blocks for w in (1, 2, 4, 8) if w * 32 <= b]


def _static_key(gate_up):
    return {"N": gate_up.shape[-1] // 2, "dtype": str(gate_up.dtype)}


def _run_key(gate_up):
    return gate_up.shape[0]


@functools.lru_cache(maxsize=None)  # per launch when no tuned config: computed once per size
def _default_config(n: int) -> dict:
    block = min(next_power_of_2(n), 1024)
    return {"BLOCK_N": block, "num_warps": max(1, min(4, block // 128))}


@autotune(
    kernel_name="silu_mul",
    configs_gen_func=_configs,
    static_key_func=_static_key,
    run_key_func=_run_key,
    kernel_type=AutotuneKernelType.GENERAL,
    output_args=("out",),
)
def _launch_silu_mul(gate_up, out, run_config=None):
    rows, n = out.shape
    cfg = run_config or _default_config(n)
    if rows > 0:
        grid = (rows, cdiv(n, cfg["BLOCK_N"]))
        _SILU_MUL.launch(grid, gate_up, out, gate_up.stride(0), out.stride(0), n, cfg["BLOCK_N"],
                         num_warps=cfg["num_warps"])  # fmt: skip
    return out


class SiluMulPlan:
    """``silu(gate) * up`` of one step's ``[rows, 2 * I]`` shape (every layer's MLP): checked once here, the tuned
    config resolved at the first :meth:`run`, which checks only the input's shape, dtype and last-dim stride.

    Args: ``rows``, ``intermediate`` (I), ``dtype`` of gate_up; ``run_config`` bypasses tuning;
    ``reuse_outputs``: every run without ``out`` writes the same output tensor (``kernels/step_buffer.py``).
    """

    def __init__(self, rows: int, intermediate: int, dtype: torch.dtype, run_config=None,
                 reuse_outputs: bool = False):  # fmt: skip
        if dtype not in _DTYPES or rows < 0 or intermediate < 1:
            raise ValueError(f"silu_mul plan: gate_up expected a [rows, 2 * I] tensor of {_DTYPES}, got rows {rows}, "
                             f"I {intermediate}, {dtype}")  # fmt: skip
        self.out_shape = (rows, intermediate)
        self.inputs = PlannedInputs("silu_mul", gate_up=(torch.Size((rows, 2 * intermediate)), dtype))
        self._tuned = _launch_silu_mul.plan(run_config=run_config)
        self._out = StepBuffer(self.out_shape, dtype, reuse_outputs)

    def run(self, gate_up: torch.Tensor, out=None) -> torch.Tensor:
        self.inputs.check((gate_up.shape, gate_up.dtype))
        if gate_up.stride(-1) != 1:
            raise ValueError(f"silu_mul: gate_up expected a contiguous last dim, got strides {gate_up.stride()}")
        if out is None:
            out = self._out.get(gate_up.device)
        elif out.shape != self.out_shape or out.dtype != gate_up.dtype or out.stride(-1) != 1:
            raise ValueError(f"silu_mul: out expected a {self.out_shape} {gate_up.dtype} tensor with a contiguous "
                             f"last dim, got {tuple(out.shape)} {out.dtype} strides {out.stride()}")  # fmt: skip
        return self._tuned.run(gate_up, out)


def silu_mul(gate_up: torch.Tensor, out=None, run_config: Optional[dict] = None) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]``.

    Args:
        gate_up: ``[rows, 2 * I]`` float16/bfloat16/float32, last dim contiguous.
        out: optional ``[rows, I]`` tensor of its dtype.
    Returns:
        ``out`` (allocated when None). Every layer of a step: :class:`SiluMulPlan` checks and resolves once.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: gate_up expected [rows, 2 * I], got shape {tuple(gate_up.shape)}")
    return SiluMulPlan(gate_up.shape[0], gate_up.shape[1] // 2, gate_up.dtype, run_config).run(gate_up, out)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch reference: ``F.silu(gate) * up`` in gate_up's dtype (silu computed in float32 and rounded)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
