"""Causal depthwise conv1d + SiLU for one new input per request, shifting each request's conv state in place.

A plain kernel with a fixed config, not tuned: it moves ``B * C * 2 * K`` elements (the state read and written,
x read, y written), 10.5 MB in bf16 at batch 64 for Qwen3.5-27B (C = 10240, K = 4): under 3 % of the recurrent
update's 403 MB of float32 state. A search per batch size would cost start-up time for a few microseconds at
most; ``run_config`` lets ``benchmarks/linear_attention.py`` time other block sizes against the default.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from lightllm.kernels.direct_launch import DirectLaunch
from lightllm.kernels.pdl import pdl_release, pdl_wait
from lightllm.kernels.launch_math import cdiv
from lightllm.kernels.linear_attention.checks import (
    DTYPES,
    ConvLayerInputs,
    check_block_c_config,
    check_conv_state,
    check_devices,
    check_state_idx,
    fail,
)
from lightllm.kernels.step_buffer import StepBuffer

DEFAULT_CONFIG = {"BLOCK_C": 512, "num_warps": 4}
_KERNEL = "causal conv1d update"


@triton.jit
def _conv1d_update_kernel(X, STATE, W, STATE_IDX, Y, C, stride_xb, stride_sn, stride_sk, stride_yb, K: tl.constexpr,
                          BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(USE_PDL)
    i_b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < C
    slot = tl.load(STATE_IDX + i_b).to(tl.int64)
    state = STATE + slot * stride_sn + cols
    # The new input joins the window in the state's dtype, as the reference rounds it.
    x = tl.load(X + i_b * stride_xb + cols, mask=mask, other=0.0).to(STATE.dtype.element_ty)
    acc = x.to(tl.float32) * tl.load(W + cols * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(K - 1):
        s = tl.load(state + j * stride_sk, mask=mask, other=0.0)
        acc += s.to(tl.float32) * tl.load(W + cols * K + j, mask=mask, other=0.0).to(tl.float32)
        if j > 0:  # shift left: the same thread loaded tap j - 1 in the previous step, so no other thread races it
            tl.store(state + (j - 1) * stride_sk, s, mask=mask)
    tl.store(state + (K - 2) * stride_sk, x, mask=mask)
    y = acc * tl.sigmoid(acc)
    pdl_release(USE_PDL)
    tl.store(Y + i_b * stride_yb + cols, y.to(Y.dtype.element_ty), mask=mask)


_CONV1D_UPDATE = DirectLaunch(_conv1d_update_kernel)


def _launch(x, conv_state, weight, state_idx, out, run_config=None):
    batch, channels = x.shape
    cfg = run_config or DEFAULT_CONFIG
    if batch > 0:
        _CONV1D_UPDATE.launch(
            (batch, cdiv(channels, cfg["BLOCK_C"])),
            x, conv_state, weight, state_idx, out, channels,
            x.stride(0), conv_state.stride(0), conv_state.stride(1), out.stride(0),
            K=weight.shape[1], BLOCK_C=cfg["BLOCK_C"], num_warps=cfg["num_warps"],
        )  # fmt: skip
    return out


class CausalConv1dUpdatePlan:
    """The conv update of one step, checked once from shapes before any layer runs; :meth:`run` checks only the
    planned shapes, dtypes and strides of each layer's tensors.

    Args: ``x_shape`` ``[batch, channels]`` and ``dtype`` of x (and the output), ``state_shape``
    ``[slots, K - 1, channels]`` and ``state_dtype`` of every layer's conv state, ``weight_dtype``, ``state_idx``
    as :func:`causal_conv1d_update`, ``run_config`` (``BLOCK_C``, ``num_warps``; default ``DEFAULT_CONFIG``);
    ``reuse_outputs``: every run without ``out`` writes the same output tensor (``kernels/step_buffer.py``).
    """

    def __init__(self, x_shape, dtype, state_shape, state_dtype, weight_dtype, state_idx, run_config=None,
                 reuse_outputs=False):  # fmt: skip
        x_shape, state_shape = torch.Size(x_shape), torch.Size(state_shape)
        _check_plan(x_shape, dtype, state_shape, state_dtype, weight_dtype, state_idx, run_config)
        self.state_idx, self.run_config = state_idx, run_config
        self.inputs = ConvLayerInputs(_KERNEL, x_shape, dtype, state_shape, state_dtype, weight_dtype,
                                      StepBuffer(x_shape, dtype, reuse_outputs))  # fmt: skip

    def run(self, x, conv_state, weight, out=None) -> torch.Tensor:
        out = self.inputs.output(x, conv_state, weight, out)
        return _launch(x, conv_state, weight, self.state_idx, out, run_config=self.run_config)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    state_idx: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    run_config: Optional[dict] = None,
) -> torch.Tensor:
    """``silu(sum_j window[j] * weight[:, j])`` over each request's window (its slot's last ``K - 1`` inputs, then
    ``x``), computed in float32; the slot then drops its oldest input and appends ``x`` (in place, in the state's
    dtype). Same numerics as ``causal_conv1d_update_ref``.

    Args:
        x: ``[batch, channels]`` float16/bfloat16/float32, last dim contiguous.
        conv_state: ``[slots, K - 1, channels]`` float16/bfloat16/float32, last dim contiguous; ``K >= 2``.
        weight: ``[channels, K]`` contiguous, any of those dtypes.
        state_idx: int32 ``[batch]``: each request's slot, all different (not checked: that would synchronize).
            Rows that share a slot race on it alone: graph padding rows may share one scratch slot.
        out: optional ``[batch, channels]`` of x's dtype.
    Returns ``out`` (allocated when None). Every layer of a step: :class:`CausalConv1dUpdatePlan` checks once.
    """
    check_devices(_KERNEL, "conv_state", conv_state=conv_state, x=x, weight=weight, state_idx=state_idx)
    plan = CausalConv1dUpdatePlan(x.shape, x.dtype, conv_state.shape, conv_state.dtype, weight.dtype, state_idx,
                                  run_config)  # fmt: skip
    return plan.run(x, conv_state, weight, out=out)


def _check_plan(x_shape, dtype, state_shape, state_dtype, weight_dtype, state_idx, run_config) -> None:
    if len(x_shape) != 2 or dtype not in DTYPES:
        fail(_KERNEL, "x", f"a [batch, channels] tensor of {DTYPES}", f"{tuple(x_shape)} {dtype}")
    batch, channels = x_shape
    check_conv_state(_KERNEL, channels, state_shape, state_dtype, weight_dtype)
    check_state_idx(_KERNEL, state_idx, batch)
    check_block_c_config(_KERNEL, run_config)
