"""Causal depthwise conv1d + SiLU over a packed prefill: every request's new tokens, each request starting from its
slot's conv window (a continued request: a chunk after the first, a prefix-cache hit) or from zeros, its window
after its last token written back into the slot.

Two launches, both reading the sequence bounds on the device only (a prefill graph replays them for any lengths):

- the output: program (token block, channel block); token ``t`` of request ``r`` (``seq_ids[t]``, ``offsets[t]``
  its index in ``r``) sums ``w[K - 1 - s] * x[t - s]`` over the ``K`` shifts, taking shifts before ``r``'s first
  token from its slot's window (when ``continues[r]``) or as zero;
- the windows: program (request, channel block) gathers the request's last ``K - 1`` inputs (those before its
  first token from its old window or zeros) into registers before it stores them, so the slot it reads is the slot
  it writes. It runs after the output launch, which read the old windows.

One kernel launch each instead of the ~25 torch ops per layer of the shifted multiply-adds it replaces. A plain
kernel with a fixed config, not tuned, as ``conv1d_update``: it reads x once (from the cache for the ``K - 1`` shifts
after the first) and writes y once; ``benchmarks/conv_prefill.py`` times it against those torch ops. Same numerics
as ``causal_conv1d_prefill_ref`` (float32 sums; an old window's values enter in x's dtype, a new window in the
state's).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from lightllm.kernels.direct_launch import DirectLaunch
from lightllm.kernels.launch_math import cdiv, next_power_of_2
from lightllm.kernels.linear_attention.checks import (
    DTYPES,
    ConvLayerInputs,
    check_block_c_config,
    check_conv_state,
    check_devices,
    fail,
)
from lightllm.kernels.step_buffer import StepBuffer

DEFAULT_CONFIG = {"BLOCK_T": 16, "BLOCK_C": 256, "num_warps": 4}
_KERNEL = "causal conv1d prefill"


@triton.jit
def _conv1d_prefill_kernel(
    X, W, STATE, STATE_IDX, SEQ_IDS, OFFSETS, CONTINUES, Y, T, C,
    stride_xt, stride_sn, stride_sk, stride_yt,
    K: tl.constexpr, HAS_INIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tok_ok = toks < T
    col_ok = (cols < C)[None, :]
    offs = tl.load(OFFSETS + toks, mask=tok_ok, other=0)
    if HAS_INIT:
        seq = tl.load(SEQ_IDS + toks, mask=tok_ok, other=0)
        from_state = tl.load(CONTINUES + seq, mask=tok_ok, other=0) != 0
        slot = tl.load(STATE_IDX + seq, mask=tok_ok, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for s in tl.static_range(K):
        w = tl.load(W + cols * K + (K - 1 - s), mask=cols < C, other=0.0).to(tl.float32)
        inside = (offs >= s) & tok_ok
        prev = tl.where(inside, toks - s, 0)
        xv = tl.load(X + prev[:, None] * stride_xt + cols[None, :], mask=inside[:, None] & col_ok, other=0.0)
        if HAS_INIT:  # shift s reaches back past the request's start: entry K - 1 + offs - s of its old window
            old = from_state & tok_ok & (offs < s)
            entry = tl.where(old, K - 1 + offs - s, 0)
            sv = tl.load(STATE + slot[:, None] * stride_sn + entry[:, None] * stride_sk + cols[None, :],
                         mask=old[:, None] & col_ok, other=0.0)  # fmt: skip
            xv += sv.to(X.dtype.element_ty)
        acc += xv.to(tl.float32) * w[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(Y + toks[:, None] * stride_yt + cols[None, :], y.to(Y.dtype.element_ty), mask=tok_ok[:, None] & col_ok)


@triton.jit
def _conv1d_prefill_states_kernel(
    X, STATE, STATE_IDX, CU_SEQLENS, CONTINUES, C, stride_xt, stride_sn, stride_sk,
    K: tl.constexpr, HAS_INIT: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    i_n = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = (cols < C)[None, :]
    rows = tl.arange(0, ROWS)
    row_ok = rows < K - 1
    start = tl.load(CU_SEQLENS + i_n).to(tl.int64)
    length = tl.load(CU_SEQLENS + i_n + 1).to(tl.int64) - start
    slot = tl.load(STATE_IDX + i_n).to(tl.int64)
    # window row j holds the input at (request-relative) position length - (K - 1) + j
    pos = length - (K - 1) + rows
    new = row_ok & (pos >= 0)
    win = tl.load(X + (start + tl.where(new, pos, 0))[:, None] * stride_xt + cols[None, :], mask=new[:, None] & col_ok,
                  other=0.0).to(STATE.dtype.element_ty)  # fmt: skip
    if HAS_INIT:  # before the request's start: its old window's row K - 1 + pos, when it continues
        old = row_ok & (pos < 0) & (tl.load(CONTINUES + i_n) != 0)
        entry = tl.where(old, K - 1 + pos, 0)
        sv = tl.load(STATE + slot * stride_sn + entry[:, None] * stride_sk + cols[None, :], mask=old[:, None] & col_ok,
                     other=0.0)  # fmt: skip
        win = tl.where(old[:, None], sv.to(X.dtype.element_ty).to(STATE.dtype.element_ty), win)
    tl.store(STATE + slot * stride_sn + rows[:, None] * stride_sk + cols[None, :], win, mask=row_ok[:, None] & col_ok)


_CONV1D_PREFILL = DirectLaunch(_conv1d_prefill_kernel)
_CONV1D_PREFILL_STATES = DirectLaunch(_conv1d_prefill_states_kernel)


class CausalConv1dPrefillPlan:
    """The conv of one prefill forward, checked once before any layer runs (the packing's index tensors, the
    shapes every layer shares); :meth:`run` checks only the planned shapes, dtypes and layouts of each layer's
    tensors and launches.

    Args: ``x_shape`` ``[T, channels]`` and ``dtype`` of x (and the output), ``state_shape`` ``[slots, K - 1,
    channels]`` and ``state_dtype`` of every layer's conv state, ``weight_dtype``; ``state_idx``, ``cu_seqlens``,
    ``seq_ids``, ``offsets``, ``continues`` and ``run_config`` as :func:`causal_conv1d_prefill`; ``reuse_outputs``:
    every run without ``out`` writes the same output tensor (``kernels/step_buffer.py``).
    """

    def __init__(self, x_shape, dtype, state_shape, state_dtype, weight_dtype, state_idx, cu_seqlens, seq_ids,
                 offsets, continues=None, run_config=None, reuse_outputs=False):  # fmt: skip
        x_shape, state_shape = torch.Size(x_shape), torch.Size(state_shape)
        _check_plan(x_shape, dtype, state_shape, state_dtype, weight_dtype, state_idx, cu_seqlens, seq_ids, offsets,
                    continues, run_config)  # fmt: skip
        self.index = (state_idx, cu_seqlens, seq_ids, offsets, continues)
        self.cfg = run_config or DEFAULT_CONFIG
        self.inputs = ConvLayerInputs(_KERNEL, x_shape, dtype, state_shape, state_dtype, weight_dtype,
                                      StepBuffer(x_shape, dtype, reuse_outputs))  # fmt: skip

    def run(self, x, conv_state, weight, out=None) -> torch.Tensor:
        out = self.inputs.output(x, conv_state, weight, out)
        _launch(x, conv_state, weight, *self.index, out, self.cfg)
        return out


def _launch(x, conv_state, weight, state_idx, cu_seqlens, seq_ids, offsets, continues, out, cfg) -> None:
    tokens, channels = x.shape
    taps, requests = weight.shape[1], state_idx.shape[0]
    has_init = continues is not None
    flags = continues if has_init else state_idx  # a placeholder pointer, never read without HAS_INIT
    if tokens:
        _CONV1D_PREFILL.launch(
            (cdiv(tokens, cfg["BLOCK_T"]), cdiv(channels, cfg["BLOCK_C"])),
            x, weight, conv_state, state_idx, seq_ids, offsets, flags, out, tokens, channels,
            x.stride(0), conv_state.stride(0), conv_state.stride(1), out.stride(0),
            K=taps, HAS_INIT=has_init, BLOCK_T=cfg["BLOCK_T"], BLOCK_C=cfg["BLOCK_C"], num_warps=cfg["num_warps"],
        )  # fmt: skip
    if requests:
        _CONV1D_PREFILL_STATES.launch(
            (requests, cdiv(channels, cfg["BLOCK_C"])),
            x, conv_state, state_idx, cu_seqlens, flags, channels, x.stride(0), conv_state.stride(0),
            conv_state.stride(1),
            K=taps, HAS_INIT=has_init, ROWS=next_power_of_2(taps - 1), BLOCK_C=cfg["BLOCK_C"],
            num_warps=cfg["num_warps"],
        )  # fmt: skip


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_idx: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seq_ids: torch.Tensor,
    offsets: torch.Tensor,
    continues: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    run_config: Optional[dict] = None,
) -> torch.Tensor:
    """``causal_conv1d_prefill_ref(x, weight, cu_seqlens, initial_states)`` with the initial states read from, and
    the final ones written to, ``conv_state[state_idx]``; returns the output.

    Args:
        x: ``[T, channels]`` float16/bfloat16/float32 with a contiguous last dim (a view of a wider projection is fine).
        weight: ``[channels, K]`` contiguous.
        conv_state: ``[slots, K - 1, channels]`` with a contiguous last dim (one layer's).
        state_idx: int32/int64 ``[N]``, the requests' slots, all different (not checked: that would synchronize).
        cu_seqlens: int32/int64 ``[N + 1]``, the packed requests' bounds (``cu_seqlens[-1] == T``, not checked).
        seq_ids, offsets: int64 ``[T]``: each token's request and its index in it (from ``cu_seqlens``).
        continues: bool ``[N]`` (a request starts from its slot's window) or None (every request from zeros).
        out: optional ``[T, channels]`` of x's dtype, last dim contiguous.
        run_config: ``BLOCK_T``, ``BLOCK_C`` (powers of two >= 16) and ``num_warps``; default ``DEFAULT_CONFIG``.
    Every layer of a forward: :class:`CausalConv1dPrefillPlan` checks once.
    """
    check_devices(_KERNEL, "conv_state", conv_state=conv_state, x=x, weight=weight, state_idx=state_idx,
                  cu_seqlens=cu_seqlens, seq_ids=seq_ids, offsets=offsets,
                  **({} if continues is None else {"continues": continues}))  # fmt: skip
    plan = CausalConv1dPrefillPlan(x.shape, x.dtype, conv_state.shape, conv_state.dtype, weight.dtype, state_idx,
                                   cu_seqlens, seq_ids, offsets, continues, run_config)  # fmt: skip
    return plan.run(x, conv_state, weight, out=out)


def _check_plan(x_shape, dtype, state_shape, state_dtype, weight_dtype, state_idx, cu_seqlens, seq_ids, offsets,
                continues, run_config) -> None:  # fmt: skip
    if len(x_shape) != 2 or dtype not in DTYPES:
        fail(_KERNEL, "x", f"a [T, channels] tensor of {DTYPES}", f"{tuple(x_shape)} {dtype}")
    tokens, channels = x_shape
    check_conv_state(_KERNEL, channels, state_shape, state_dtype, weight_dtype)
    requests = state_idx.shape[0] if state_idx.dim() == 1 else -1
    index_dtypes = (torch.int32, torch.int64)
    for name, t, n, dtypes in (("state_idx", state_idx, requests, index_dtypes),
                               ("cu_seqlens", cu_seqlens, requests + 1, index_dtypes),
                               ("seq_ids", seq_ids, tokens, (torch.int64,)),
                               ("offsets", offsets, tokens, (torch.int64,)),
                               ("continues", continues, requests, (torch.bool,))):  # fmt: skip
        if t is None:
            continue
        if t.shape != (max(n, 0),) or t.dtype not in dtypes or (n > 1 and t.stride(0) != 1):
            want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            fail(_KERNEL, name, f"a contiguous {want} [{max(n, 0)}] tensor",
                 f"{tuple(t.shape)} {t.dtype} strides {t.stride()}")  # fmt: skip
    if run_config is not None:
        check_block_c_config(_KERNEL, run_config)
        block_t = run_config.get("BLOCK_T")
        if not (isinstance(block_t, int) and block_t >= 16 and block_t & (block_t - 1) == 0):
            fail(_KERNEL, "run_config", "a dict with BLOCK_T a power of two >= 16", run_config)
