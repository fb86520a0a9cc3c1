"""Gated delta rule over the ``T = N + 1`` tokens of an MTP verify step, writing the state after every token.

One Triton launch per call: program (request, value head, V tile) loads its ``[Dk, BV]`` slice of the request's
source slot once, then for each token computes the gates, L2-normalizes q/k, applies the delta rule in float32,
stores the slice in the pool's dtype to that token's slot and continues from the stored (rounded) value, so the
result equals ``T`` single-token decodes (``verify_reference.py``). Each program reads its source tile before it
writes any slot, so a request's source slot may be one of its own destination slots.

Traffic per request: one state read, ``T`` state writes. Tuned as ``DECODE_ATTENTION`` (the eager forward before
each verify graph capture): run key = query tokens ``B * T`` rounded up to a multiple of ``4 * T``. A search
times candidates on a dummy pool of that many requests (``_dummy_verify_batch``) whose source slots are apart
from its destination slots, so every launch computes the same thing: no snapshot, no clone, and the caller's pool
is never launched on but once, by the call itself (``warmup_all_exist_config=False``).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from lightllm.common.autotuner import AutotuneKernelType, autotune
from lightllm.kernels.launch_math import cdiv
from lightllm.kernels.linear_attention.checks import (
    DTYPES,
    GateLayerInputs,
    check_bv_config,
    check_devices,
    check_heads_and_state,
    check_tokens,
    check_verify_idx,
    fail,
)
from lightllm.kernels.linear_attention.gated_delta_decode import candidate_configs, default_config
from lightllm.kernels.direct_launch import DirectLaunch

BATCH_BUCKET = 4  # run keys round the batch up to a multiple of this
_KERNEL = "gated delta verify"


@triton.jit
def _gated_delta_verify_kernel(
    Q, K, V, A, B, A_LOG, DT_BIAS, STATE, SRC_IDX, DST_IDX, OUT,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ab, stride_at, stride_bb, stride_bt, stride_sn, stride_db, stride_ob, stride_ot, stride_oh,
    scale,
    T: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    i_b = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    i_hk = i_hv // GROUP
    offs_k = tl.arange(0, DK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    tile = i_hv * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :]
    neg_a = -tl.exp(tl.load(A_LOG + i_hv).to(tl.float32))
    dt_bias = tl.load(DT_BIAS + i_hv).to(tl.float32)

    src = tl.load(SRC_IDX + i_b).to(tl.int64)
    s = tl.load(STATE + src * stride_sn + tile).to(tl.float32)
    for t in tl.static_range(T):
        x = tl.load(A + i_b * stride_ab + t * stride_at + i_hv).to(tl.float32) + dt_bias
        decay = tl.exp(neg_a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x))))
        b_raw = tl.load(B + i_b * stride_bb + t * stride_bt + i_hv)
        beta = tl.sigmoid(b_raw.to(tl.float32)).to(b_raw.dtype).to(tl.float32)  # rounded as the reference does
        q = tl.load(Q + i_b * stride_qb + t * stride_qt + i_hk * stride_qh + offs_k).to(tl.float32)
        k = tl.load(K + i_b * stride_kb + t * stride_kt + i_hk * stride_kh + offs_k).to(tl.float32)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)) * scale
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
        v = tl.load(V + i_b * stride_vb + t * stride_vt + i_hv * stride_vh + offs_v).to(tl.float32)

        s = s * decay
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(OUT + i_b * stride_ob + t * stride_ot + i_hv * stride_oh + offs_v, o.to(OUT.dtype.element_ty))
        stored = s.to(STATE.dtype.element_ty)
        dst = tl.load(DST_IDX + i_b * stride_db + t).to(tl.int64)
        tl.store(STATE + dst * stride_sn + tile, stored)
        s = stored.to(tl.float32)  # the next token starts from the stored state, as a plain decode step would


_GATED_DELTA_VERIFY = DirectLaunch(_gated_delta_verify_kernel)


def _launch(q, k, v, a, b, A_log, dt_bias, ssm_state, src_idx, dst_idx, out, run_config=None):
    batch, tokens, k_heads, head_k_dim = q.shape
    v_heads, head_v_dim = v.shape[2:]
    cfg = run_config or default_config(head_v_dim)
    if batch > 0:
        _GATED_DELTA_VERIFY.launch(
            (batch, v_heads, head_v_dim // cfg["BV"]),
            q, k, v, a, b, A_log, dt_bias, ssm_state, src_idx, dst_idx, out,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            ssm_state.stride(0), dst_idx.stride(0), out.stride(0), out.stride(1), out.stride(2),
            head_k_dim**-0.5,
            T=tokens, GROUP=v_heads // k_heads, DK=head_k_dim, DV=head_v_dim, BV=cfg["BV"],
            num_warps=cfg["num_warps"],
        )  # fmt: skip
    return out


# ---- tuning declaration ---------------------------------------------------------------------------------


def _configs(q, v):
    return candidate_configs(q.shape[3], v.shape[3])


def _static_key(q, v, ssm_state):
    return {
        "v_heads": v.shape[2],
        "group": v.shape[2] // q.shape[2],
        "head_k_dim": q.shape[3],
        "head_v_dim": v.shape[3],
        "tokens_per_request": q.shape[1],
        "dtype": str(q.dtype),
        "state_dtype": str(ssm_state.dtype),
    }


def verify_run_key(batch: int, tokens: int) -> int:
    """Query tokens ``batch * tokens`` rounded up to a multiple of ``BATCH_BUCKET * tokens``."""
    return cdiv(batch, BATCH_BUCKET) * BATCH_BUCKET * tokens


def _run_key(q):
    return verify_run_key(q.shape[0], q.shape[1])


def _dummy_verify_batch(named: dict) -> dict:
    """Timing inputs at the run key's own batch (the caller's rows repeated, so every batch of a bucket times the
    same size) on a fresh pool: one random source slot per request (its own generator, the process's random stream
    untouched) apart from ``T`` destination slots per request, visited in reverse order. Launches never read what
    they write, so every candidate computes the same result and nothing needs restoring."""
    q, pool = named["q"], named["ssm_state"]
    tokens = q.shape[1]
    batch = verify_run_key(q.shape[0], tokens) // tokens
    device = pool.device
    rows = torch.arange(batch, device=device) % max(1, q.shape[0])
    picked = {name: named[name][rows] for name in ("q", "k", "v", "a", "b")}
    dummy = torch.empty((batch * (tokens + 1),) + tuple(pool.shape[1:]), dtype=pool.dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    src_shape = (batch,) + tuple(pool.shape[1:])
    dummy[batch * tokens :] = torch.randn(src_shape, generator=gen, device=device).mul_(0.1).to(pool.dtype)
    dst = torch.arange(batch * tokens - 1, -1, -1, device=device, dtype=torch.int32).view(batch, tokens)
    src = torch.arange(batch * tokens, batch * (tokens + 1), device=device, dtype=torch.int32).flip(0)
    out = torch.empty((batch,) + tuple(named["out"].shape[1:]), dtype=named["out"].dtype, device=device)
    return {**named, **picked, "ssm_state": dummy, "src_idx": src, "dst_idx": dst, "out": out}


_launch_gated_delta_verify = autotune(
    kernel_name="gated_delta_verify",
    configs_gen_func=_configs,
    static_key_func=_static_key,
    run_key_func=_run_key,
    kernel_type=AutotuneKernelType.DECODE_ATTENTION,
    rebuild_input_func=_dummy_verify_batch,
    warmup_all_exist_config=False,
    output_args=("out",),
)(_launch)


# ---- public API -----------------------------------------------------------------------------------------


class GatedDeltaVerifyPlan:
    """The linear-attention verify of one MTP step, planned as
    :class:`~lightllm.kernels.linear_attention.gated_delta_decode.GatedDeltaDecodePlan` plans a decode step: checked
    once, tuned at the first :meth:`run`, each layer's inputs held to the planned shapes and dtypes.

    Args: ``q_shape`` ``[batch, T, k_heads, head_k_dim]`` (also k's), ``v_shape`` ``[batch, T, v_heads,
    head_v_dim]``, ``dtype`` of q/k/v (and of the output), ``state_shape`` ``[slots, v_heads, head_k_dim,
    head_v_dim]`` and ``state_dtype`` of every layer's pool, ``src_idx`` / ``dst_idx`` as
    :func:`gated_delta_verify`, ``gate_dtype`` of a/b (default ``dtype``), ``run_config`` to launch one config
    untuned.
    """

    def __init__(self, q_shape, v_shape, dtype, state_shape, state_dtype, src_idx, dst_idx, gate_dtype=None,
                 run_config=None):  # fmt: skip
        q_shape, v_shape, state_shape = torch.Size(q_shape), torch.Size(v_shape), torch.Size(state_shape)
        gate_dtype = gate_dtype or dtype
        _check_plan(q_shape, v_shape, dtype, state_shape, state_dtype, src_idx, dst_idx, gate_dtype, run_config)
        self.src_idx, self.dst_idx = src_idx, dst_idx
        self.inputs = GateLayerInputs(_KERNEL, q_shape, v_shape, dtype, gate_dtype, state_shape, state_dtype)
        self._tuned = _launch_gated_delta_verify.plan(run_config=run_config)

    def run(self, q, k, v, a, b, A_log, dt_bias, ssm_state, out=None) -> torch.Tensor:
        out = self.inputs.output(q, k, v, a, b, A_log, dt_bias, ssm_state, out)
        return self._tuned.run(q, k, v, a, b, A_log, dt_bias, ssm_state, self.src_idx, self.dst_idx, out)


def gated_delta_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    run_config: Optional[dict] = None,
) -> torch.Tensor:
    """``T = N + 1`` tokens per request: for each token in order, the gated delta rule of
    :func:`~lightllm.kernels.linear_attention.gated_delta_decode.gated_delta_decode` (same gates, normalization and
    rounding), starting from slot ``src_idx[b]`` and storing the state after token ``t`` in slot ``dst_idx[b, t]``
    (in the pool's dtype, which the next token continues from). Same numerics as ``gated_delta_verify_ref``.

    Args:
        q, k: ``[batch, T, k_heads, head_k_dim]`` float16/bfloat16/float32, last dim contiguous (may be strided
            views of one conv output ``[batch * T, channels]``); ``T`` one of ``checks.TOKENS``.
        v: ``[batch, T, v_heads, head_v_dim]`` of q's dtype, last dim contiguous; ``v_heads % k_heads == 0``.
            Head dims: one of ``checks.HEAD_DIMS``.
        a, b: ``[batch, T, v_heads]`` (last dim contiguous); A_log, dt_bias: ``[v_heads]``.
        ssm_state: ``[slots, v_heads, head_k_dim, head_v_dim]`` float32 or bfloat16, each slot contiguous.
        src_idx: contiguous int32 ``[batch]``: the slot each request starts from (read only).
        dst_idx: int32 ``[batch, T]`` with a contiguous last dim: the slot of each token's state, all different
            (not checked: that would synchronize); ``src_idx[b]`` may be among ``dst_idx[b]``, never among another
            request's. Padding rows may share one scratch slot for every entry: they race on it alone.
        out: optional ``[batch, T, v_heads, head_v_dim]`` of q's dtype.
    Returns ``out`` (allocated when None). Every layer of a step: :class:`GatedDeltaVerifyPlan` checks once.
    """
    check_devices(_KERNEL, q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ssm_state=ssm_state,
                  src_idx=src_idx, dst_idx=dst_idx)  # fmt: skip
    plan = GatedDeltaVerifyPlan(q.shape, v.shape, q.dtype, ssm_state.shape, ssm_state.dtype, src_idx, dst_idx,
                                gate_dtype=a.dtype, run_config=run_config)  # fmt: skip
    return plan.run(q, k, v, a, b, A_log, dt_bias, ssm_state, out=out)


def _check_plan(q_shape, v_shape, dtype, state_shape, state_dtype, src_idx, dst_idx, gate_dtype, run_config):
    if dtype not in DTYPES:
        fail(_KERNEL, "q", f"one of {DTYPES}", dtype)
    if len(q_shape) != 4:
        fail(_KERNEL, "q", "a [batch, T, k_heads, head_k_dim] tensor", tuple(q_shape))
    batch, tokens, k_heads, head_k_dim = q_shape
    check_tokens(_KERNEL, "q", tokens)
    if len(v_shape) != 4 or tuple(v_shape[:2]) != (batch, tokens):
        fail(_KERNEL, "v", f"a [{batch}, {tokens}, v_heads, head_v_dim] tensor", tuple(v_shape))
    v_heads, head_v_dim = v_shape[2:]
    check_heads_and_state(_KERNEL, k_heads, head_k_dim, v_heads, head_v_dim, gate_dtype, state_shape, state_dtype)
    check_verify_idx(_KERNEL, src_idx, dst_idx, batch, tokens)
    check_bv_config(_KERNEL, run_config, head_v_dim)
