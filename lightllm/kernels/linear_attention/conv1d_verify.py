"""Causal depthwise conv1d + SiLU over the ``T = N + 1`` tokens of an MTP verify step, writing the conv window
after every token into that token's slot.

Program (request, channel block) loads the source window (``K - 1`` rows) and the request's ``T`` inputs as one
``[K - 1 + T, BLOCK_C]`` sequence tile before it stores anything, so a request's source slot may be one of its own
destination slots. Token ``t``'s output is rows ``t .. t + K - 1`` of the tile against the ``K`` taps; the window
after it is rows ``t + 1 .. t + K - 1``. A plain kernel with a fixed config, not tuned, as ``conv1d_update``: it
moves ``B * C * (K - 1) * (T + 1)`` state elements, under 3 % of the recurrent verify's state bytes.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from lightllm.kernels.launch_math import cdiv, next_power_of_2
from lightllm.kernels.linear_attention.checks import (
    DTYPES,
    ConvLayerInputs,
    check_block_c_config,
    check_conv_state,
    check_devices,
    check_tokens,
    check_verify_idx,
    fail,
)
from lightllm.kernels.linear_attention.conv1d_update import DEFAULT_CONFIG
from lightllm.kernels.direct_launch import DirectLaunch

_KERNEL = "causal conv1d verify"


@triton.jit
def _conv1d_verify_kernel(
    X, STATE, W, SRC_IDX, DST_IDX, Y, C,
    stride_xb, stride_xt, stride_sn, stride_sk, stride_db, stride_yb, stride_yt,
    T: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    i_b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = tl.arange(0, ROWS)
    col_ok = (cols < C)[None, :]
    in_state = (rows < K - 1)[:, None]
    in_x = ((rows >= K - 1) & (rows < K - 1 + T))[:, None]

    # The whole sequence (source window, then the new inputs in the state's dtype, as the reference rounds them).
    src = tl.load(SRC_IDX + i_b).to(tl.int64)
    old = tl.load(
        STATE + src * stride_sn + rows[:, None] * stride_sk + cols[None, :], mask=in_state & col_ok, other=0.0
    )
    x_rows = tl.where(rows >= K - 1, rows - (K - 1), 0)
    new = tl.load(X + i_b * stride_xb + x_rows[:, None] * stride_xt + cols[None, :], mask=in_x & col_ok, other=0.0)
    seq = tl.where(in_state, old, new.to(STATE.dtype.element_ty))
    seq_f = seq.to(tl.float32)

    for t in tl.static_range(T):
        tap = rows - t
        w = tl.load(W + cols[None, :] * K + tap[:, None], mask=((tap >= 0) & (tap < K))[:, None] & col_ok, other=0.0)
        acc = tl.sum(seq_f * w.to(tl.float32), axis=0)
        y = acc * tl.sigmoid(acc)
        tl.store(Y + i_b * stride_yb + t * stride_yt + cols, y.to(Y.dtype.element_ty), mask=cols < C)
        dst = tl.load(DST_IDX + i_b * stride_db + t).to(tl.int64)
        pos = rows - (t + 1)  # the window after token t: rows t + 1 .. t + K - 1
        keep = ((pos >= 0) & (pos < K - 1))[:, None] & col_ok
        tl.store(STATE + dst * stride_sn + tl.where(pos >= 0, pos, 0)[:, None] * stride_sk + cols[None, :], seq,
                 mask=keep)  # fmt: skip


_CONV1D_VERIFY = DirectLaunch(_conv1d_verify_kernel)


def _launch(x, conv_state, weight, src_idx, dst_idx, out, run_config=None):
    batch, tokens, channels = x.shape
    taps = weight.shape[1]
    cfg = run_config or DEFAULT_CONFIG
    if batch > 0:
        _CONV1D_VERIFY.launch(
            (batch, cdiv(channels, cfg["BLOCK_C"])),
            x, conv_state, weight, src_idx, dst_idx, out, channels,
            x.stride(0), x.stride(1), conv_state.stride(0), conv_state.stride(1), dst_idx.stride(0),
            out.stride(0), out.stride(1),
            T=tokens, K=taps, ROWS=next_power_of_2(taps - 1 + tokens), BLOCK_C=cfg["BLOCK_C"],
            num_warps=cfg["num_warps"],
        )  # fmt: skip
    return out


class CausalConv1dVerifyPlan:
    """The conv of one MTP verify step, checked once from shapes before any layer runs; :meth:`run` checks only the
    planned shapes, dtypes and strides of each layer's tensors.

    Args: ``x_shape`` ``[batch, T, channels]`` and ``dtype`` of x (and the output), ``state_shape``
    ``[slots, K - 1, channels]`` and ``state_dtype`` of every layer's conv state, ``weight_dtype``, ``src_idx`` /
    ``dst_idx`` as :func:`causal_conv1d_verify`, ``run_config`` (``BLOCK_C``, ``num_warps``; default
    ``conv1d_update.DEFAULT_CONFIG``).
    """

    def __init__(self, x_shape, dtype, state_shape, state_dtype, weight_dtype, src_idx, dst_idx, run_config=None):
        x_shape, state_shape = torch.Size(x_shape), torch.Size(state_shape)
        _check_plan(x_shape, dtype, state_shape, state_dtype, weight_dtype, src_idx, dst_idx, run_config)
        self.src_idx, self.dst_idx, self.run_config = src_idx, dst_idx, run_config
        self.inputs = ConvLayerInputs(_KERNEL, x_shape, dtype, state_shape, state_dtype, weight_dtype)

    def run(self, x, conv_state, weight, out=None) -> torch.Tensor:
        out = self.inputs.output(x, conv_state, weight, out)
        return _launch(x, conv_state, weight, self.src_idx, self.dst_idx, out, run_config=self.run_config)


def causal_conv1d_verify(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    run_config: Optional[dict] = None,
) -> torch.Tensor:
    """For each of the ``T = N + 1`` tokens in order, :func:`~lightllm.kernels.linear_attention.conv1d_update.
    causal_conv1d_update` (same numerics): the window starts as slot ``src_idx[b]``; the window after token ``t``
    (its last ``K - 1`` inputs, in the state's dtype) goes to slot ``dst_idx[b, t]``. Same numerics as
    ``causal_conv1d_verify_ref``.

    Args:
        x: ``[batch, T, channels]`` float16/bfloat16/float32, last dim contiguous; ``T`` one of ``checks.TOKENS``.
        conv_state: ``[slots, K - 1, channels]`` float16/bfloat16/float32, last dim contiguous; ``K >= 2``.
        weight: ``[channels, K]`` contiguous, any of those dtypes.
        src_idx: contiguous int32 ``[batch]``: the slot each request starts from (read only).
        dst_idx: int32 ``[batch, T]`` with a contiguous last dim, all different (not checked: that would
            synchronize); ``src_idx[b]`` may be among ``dst_idx[b]``, never among another request's.
        out: optional ``[batch, T, channels]`` of x's dtype.
    Returns ``out`` (allocated when None). Every layer of a step: :class:`CausalConv1dVerifyPlan` checks once.
    """
    check_devices(_KERNEL, "conv_state", conv_state=conv_state, x=x, weight=weight, src_idx=src_idx, dst_idx=dst_idx)
    plan = CausalConv1dVerifyPlan(x.shape, x.dtype, conv_state.shape, conv_state.dtype, weight.dtype, src_idx,
                                  dst_idx, run_config)  # fmt: skip
    return plan.run(x, conv_state, weight, out=out)


def _check_plan(x_shape, dtype, state_shape, state_dtype, weight_dtype, src_idx, dst_idx, run_config) -> None:
    if len(x_shape) != 3 or dtype not in DTYPES:
        fail(_KERNEL, "x", f"a [batch, T, channels] tensor of {DTYPES}", f"{tuple(x_shape)} {dtype}")
    batch, tokens, channels = x_shape
    check_tokens(_KERNEL, "x", tokens)
    check_conv_state(_KERNEL, channels, state_shape, state_dtype, weight_dtype)
    check_verify_idx(_KERNEL, src_idx, dst_idx, batch, tokens)
    check_block_c_config(_KERNEL, run_config)
