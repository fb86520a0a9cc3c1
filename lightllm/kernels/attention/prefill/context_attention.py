"""Causal prefill attention over packed requests (each request's new tokens attend to themselves).

Grid ``(batch, q_heads, ceil(max_q_len / BLOCK_M))``; each program streams its request's keys up to the
diagonal with an online softmax. Tuned as a GENERAL kernel by the prefill warmup.
"""

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from lightllm.common.autotuner import AutotuneKernelType, PlannedInputs, autotune


@triton.jit
def _context_attention_kernel(
    Q, K, V, Out, b_start, b_len, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_block = tl.program_id(2)
    seq_len = tl.load(b_len + b)
    if m_block * BLOCK_M >= seq_len:
        return
    start = tl.load(b_start + b).to(tl.int64)
    kvh = h // GROUP
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < seq_len
    q = tl.load(Q + (start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=mask_m[:, None],
                other=0.0)  # fmt: skip
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    end = tl.minimum((m_block + 1) * BLOCK_M, seq_len)
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        rows = (start + offs_n)[:, None]
        k = tl.load(K + rows * stride_kt + kvh * stride_kh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        causal = (offs_m[:, None] >= offs_n[None, :]) & mask_n[None, :]
        qk = tl.where(causal, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + rows * stride_vt + kvh * stride_vh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + (start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask_m[:, None])  # fmt: skip


def _default_config(head_dim: int) -> dict:
    block = 32 if head_dim == 256 else 64
    return {"BLOCK_M": block, "BLOCK_N": block, "num_warps": 4, "num_stages": 1}


def _configs(q):
    big = q.shape[-1] == 256
    pairs = [(32, 32), (64, 32), (64, 64)] + ([] if big else [(128, 64), (128, 32)])
    return [
        {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s} for m, n in pairs for w, s in ((4, 1), (8, 2))
    ]


def _static_key(q, k):
    return {"head_dim": q.shape[-1], "group": q.shape[1] // k.shape[1], "dtype": str(q.dtype)}


def _run_key(q):
    return triton.next_power_of_2(max(q.shape[0], 16))  # total prefill tokens, in power-of-two buckets


@autotune(
    kernel_name="context_attention",
    configs_gen_func=_configs,
    static_key_func=_static_key,
    run_key_func=_run_key,
    kernel_type=AutotuneKernelType.GENERAL,
    output_args=("out",),
    # P is rounded to q's dtype against the running row max, which depends on BLOCK_N: in bf16 a few outlier
    # elements of 2^25 differ by ~4 ulps (0.0078 at 0.3, seen on the H200), which the default 2e-2 rejects.
    accuracy_tol=(4e-2, 2e-2),
)
def _launch_context_attention(q, k, v, out, b_start, b_len, max_q_len, sm_scale, run_config=None):
    cfg = run_config or _default_config(q.shape[-1])
    grid = (b_len.shape[0], q.shape[1], triton.cdiv(max_q_len, cfg["BLOCK_M"]))
    _context_attention_kernel[grid](
        q, k, v, out, b_start, b_len, sm_scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        GROUP=q.shape[1] // k.shape[1], HEAD_DIM=q.shape[-1], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        PRECISION="ieee" if q.dtype == torch.float32 else None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


class ContextAttentionPlan:
    """Prefill attention of one step, made from shapes before any layer runs: checked once here, the tuned config
    resolved at the first :meth:`run`; every layer (same shapes and dtype, checked) then runs with them.

    Args: ``q_shape`` ``(tokens, q_heads, D)``, ``kv_shape`` ``(tokens, kv_heads, D)`` and the dtype of q, k and v;
    the rest as :func:`context_attention`.
    """

    def __init__(self, q_shape, kv_shape, dtype, b_start, b_len, max_q_len, sm_scale=None, run_config=None):
        q_shape, kv_shape = torch.Size(q_shape), torch.Size(kv_shape)
        if (
            len(q_shape) != 3
            or len(kv_shape) != 3
            or kv_shape[::2] != q_shape[::2]
            or q_shape[-1] not in (64, 128, 256)
        ):
            raise ValueError(f"context_attention: q, k, v expected [tokens, heads, 64|128|256], got q {tuple(q_shape)} "
                             f"and k, v {tuple(kv_shape)}")  # fmt: skip
        if q_shape[1] % kv_shape[1]:
            raise ValueError(f"context_attention: q_heads expected a multiple of kv_heads, got {q_shape[1]} and "
                             f"{kv_shape[1]}")  # fmt: skip
        if b_start.dtype != torch.int32 or b_len.dtype != torch.int32 or b_start.shape != b_len.shape:
            raise ValueError("context_attention: b_start and b_len expected int32 [batch] tensors")
        self.b_start, self.b_len, self.max_q_len = b_start, b_len, int(max_q_len)
        self.sm_scale = float(sm_scale if sm_scale is not None else 1.0 / math.sqrt(q_shape[-1]))
        self.inputs = PlannedInputs("context_attention", q=(q_shape, dtype), k=(kv_shape, dtype), v=(kv_shape, dtype))
        self._tuned = _launch_context_attention.plan(run_config=run_config)

    def run(self, q, k, v, out=None) -> torch.Tensor:
        self.inputs.check((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype))
        out = torch.empty_like(q) if out is None else out
        return self._tuned.run(q, k, v, out, self.b_start, self.b_len, self.max_q_len, self.sm_scale)


def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b_start: torch.Tensor,
    b_len: torch.Tensor,
    max_q_len: int,
    out: Optional[torch.Tensor] = None,
    sm_scale: Optional[float] = None,
    run_config: Optional[dict] = None,
) -> torch.Tensor:
    """Causal attention of packed requests.

    Args:
        q: ``[tokens, q_heads, D]``; k, v: ``[tokens, kv_heads, D]`` (same dtype; head_dim 64/128/256).
        b_start, b_len: int32 ``[batch]``: first token and token count of each request in the packing.
        max_q_len: the longest request (sizes the grid).
    Every layer of a step: :class:`ContextAttentionPlan` checks and resolves once.
    """
    plan = ContextAttentionPlan(q.shape, k.shape, q.dtype, b_start, b_len, max_q_len, sm_scale, run_config)
    return plan.run(q, k, v, out)


def context_attention_ref(q, k, v, b_start, b_len, sm_scale: Optional[float] = None) -> torch.Tensor:
    """Float64 torch reference of :func:`context_attention`."""
    group = q.shape[1] // k.shape[1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for s, n in zip(b_start.tolist(), b_len.tolist()):
        qs = q[s : s + n].double()
        ks = k[s : s + n].double().repeat_interleave(group, dim=1)
        vs = v[s : s + n].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out[s : s + n] = torch.einsum("hij,jhd->ihd", scores.softmax(-1), vs)
    return out
