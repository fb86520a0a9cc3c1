"""Gated delta rule, one new token per request (Qwen3.5's linear-attention decode), updating the state in place.

One Triton launch per call: program (request, value head, V tile) loads its ``[Dk, BV]`` slice of the request's
state slot, computes the gates, L2-normalizes q/k, applies the delta rule in float32 and stores the slice back
in the pool's dtype. The state read and write dominate the traffic (``B * Hv * Dk * Dv`` elements each way).

Tuned as ``DECODE_ATTENTION`` (the phase in which decode graphs are prepared): its run key is the batch size
(the state read per request does not depend on any KV length). A search times candidates on a fresh dummy state
pool of the batch's size (``_dummy_state_batch``), never on the caller's pool: a launch advances the state it is
given, so the tuner must neither run cached configs on the real pool (``warmup_all_exist_config=False``) nor
clone it (``mutates_args`` then names only the dummy pool the tuner times on).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from lightllm.common.autotuner import AutotuneKernelType, autotune
from lightllm.kernels.linear_attention.checks import (
    DTYPES,
    GateLayerInputs,
    check_bv_config,
    check_devices,
    check_heads_and_state,
    check_state_idx,
    fail,
)
from lightllm.kernels.direct_launch import DirectLaunch
from lightllm.kernels.pdl import pdl_release, pdl_wait
from lightllm.kernels.step_buffer import StepBuffer

BLOCK_VS = (8, 16, 32, 64, 128)  # 8 with one warp is fla-core's fixed choice
NUM_WARPS = (1, 2, 4, 8)
_MAX_TILE_PER_THREAD = 128  # state elements a thread holds; beyond this a config spills registers
_KERNEL = "gated delta decode"


@triton.jit
def _gated_delta_decode_kernel(
    Q, K, V, A, B, A_LOG, DT_BIAS, STATE, STATE_IDX, OUT,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ab, stride_bb,
    stride_sn, stride_ob, stride_oh,
    scale,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels/pdl.py
):  # fmt: skip
    pdl_wait(USE_PDL)
    i_b = tl.program_id(0).to(tl.int64)
    i_hv = tl.program_id(1)
    i_hk = i_hv // GROUP
    offs_k = tl.arange(0, DK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)

    # Gates as the reference rounds them: g in float32, beta = sigmoid(b) in b's dtype.
    x = tl.load(A + i_b * stride_ab + i_hv).to(tl.float32) + tl.load(DT_BIAS + i_hv).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
    decay = tl.exp(-tl.exp(tl.load(A_LOG + i_hv).to(tl.float32)) * softplus)
    b_raw = tl.load(B + i_b * stride_bb + i_hv)
    beta = tl.sigmoid(b_raw.to(tl.float32)).to(b_raw.dtype).to(tl.float32)

    q = tl.load(Q + i_b * stride_qb + i_hk * stride_qh + offs_k).to(tl.float32)
    k = tl.load(K + i_b * stride_kb + i_hk * stride_kh + offs_k).to(tl.float32)
    q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)) * scale
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
    v = tl.load(V + i_b * stride_vb + i_hv * stride_vh + offs_v).to(tl.float32)

    slot = tl.load(STATE_IDX + i_b).to(tl.int64)
    s_ptr = STATE + slot * stride_sn + i_hv * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :]
    s = tl.load(s_ptr).to(tl.float32) * decay
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    pdl_release(USE_PDL)
    tl.store(s_ptr, s.to(STATE.dtype.element_ty))
    tl.store(OUT + i_b * stride_ob + i_hv * stride_oh + offs_v, o.to(OUT.dtype.element_ty))


_GATED_DELTA_DECODE = DirectLaunch(_gated_delta_decode_kernel)


def default_config(head_v_dim: int) -> dict:
    return {"BV": min(32, head_v_dim), "num_warps": 4}


def _launch(q, k, v, a, b, A_log, dt_bias, ssm_state, state_idx, out, run_config=None):
    batch, k_heads, head_k_dim = q.shape
    v_heads, head_v_dim = v.shape[1:]
    cfg = run_config or default_config(head_v_dim)
    if batch > 0:
        _GATED_DELTA_DECODE.launch(
            (batch, v_heads, head_v_dim // cfg["BV"]),
            q, k, v, a, b, A_log, dt_bias, ssm_state, state_idx, out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
            ssm_state.stride(0), out.stride(0), out.stride(1),
            head_k_dim**-0.5,
            GROUP=v_heads // k_heads, DK=head_k_dim, DV=head_v_dim, BV=cfg["BV"], num_warps=cfg["num_warps"],
        )  # fmt: skip
    return out


# ---- tuning declaration ---------------------------------------------------------------------------------


def candidate_configs(head_k_dim: int, head_v_dim: int) -> list:
    """V tile x warps, without the pairs that would spill (a thread holding over 128 state elements). No
    num_stages: the kernel has no loop to pipeline (the verify unrolls its token loop), so stages would only add
    compiles. Shared with ``gated_delta_verify``, whose programs hold the same state tile."""
    return [
        {"BV": bv, "num_warps": w}
        for bv in BLOCK_VS
        if bv <= head_v_dim
        for w in NUM_WARPS
        if head_k_dim * bv <= _MAX_TILE_PER_THREAD * 32 * w
    ]


def _configs(q, v):
    return candidate_configs(q.shape[2], v.shape[2])


def _static_key(q, v, ssm_state):
    return {
        "k_heads": q.shape[1],
        "v_heads": v.shape[1],
        "head_k_dim": q.shape[2],
        "head_v_dim": v.shape[2],
        "dtype": str(q.dtype),
        "state_dtype": str(ssm_state.dtype),
    }


def _run_key(q):
    return q.shape[0]


def _dummy_state_batch(named: dict) -> dict:
    """The caller's inputs on a fresh state pool of one slot per request (random, so no candidate is timed on
    zeros), visited in reverse slot order: timing never reads or writes the caller's pool. Its own generator
    leaves the process's random stream as it was."""
    q, pool = named["q"], named["ssm_state"]
    batch = q.shape[0]
    gen = torch.Generator(device=pool.device).manual_seed(0)
    dummy = torch.randn((batch,) + tuple(pool.shape[1:]), generator=gen, device=pool.device).mul_(0.1).to(pool.dtype)
    order = torch.arange(batch - 1, -1, -1, device=pool.device, dtype=torch.int32)
    return {**named, "ssm_state": dummy, "state_idx": order, "out": torch.empty_like(named["out"])}


_launch_gated_delta_decode = autotune(
    kernel_name="gated_delta_decode",
    configs_gen_func=_configs,
    static_key_func=_static_key,
    run_key_func=_run_key,
    mutates_args=("ssm_state",),
    kernel_type=AutotuneKernelType.DECODE_ATTENTION,
    rebuild_input_func=_dummy_state_batch,
    warmup_all_exist_config=False,
    output_args=("out",),
)(_launch)


# ---- public API -----------------------------------------------------------------------------------------


class GatedDeltaDecodePlan:
    """The linear-attention decode of one step, made from shapes before any layer runs: the arguments are
    checked once here and the tuned config resolved at the first :meth:`run`; every linear-attention layer then
    runs with them. Each layer's inputs must have the planned shapes and dtypes (``run`` checks).

    Args: ``q_shape`` ``[batch, k_heads, head_k_dim]`` (also k's), ``v_shape`` ``[batch, v_heads, head_v_dim]``,
    ``dtype`` of q/k/v (and of the output), ``state_shape`` ``[slots, v_heads, head_k_dim, head_v_dim]`` and
    ``state_dtype`` of every layer's pool, ``state_idx`` as :func:`gated_delta_decode`, ``gate_dtype`` of a/b
    (default ``dtype``), ``run_config`` to launch one config untuned; ``reuse_outputs``: every run without ``out``
    writes the same output tensor (``kernels/step_buffer.py``).
    """

    def __init__(self, q_shape, v_shape, dtype, state_shape, state_dtype, state_idx, gate_dtype=None,
                 run_config=None, reuse_outputs=False):  # fmt: skip
        q_shape, v_shape, state_shape = torch.Size(q_shape), torch.Size(v_shape), torch.Size(state_shape)
        gate_dtype = gate_dtype or dtype
        _check_plan(q_shape, v_shape, dtype, state_shape, state_dtype, state_idx, gate_dtype, run_config)
        self.state_idx = state_idx
        self.inputs = GateLayerInputs(_KERNEL, q_shape, v_shape, dtype, gate_dtype, state_shape, state_dtype)
        self._tuned = _launch_gated_delta_decode.plan(run_config=run_config)
        self._out = StepBuffer(v_shape, dtype, reuse_outputs)

    def run(self, q, k, v, a, b, A_log, dt_bias, ssm_state, out=None) -> torch.Tensor:
        out = self._out.get(q.device) if out is None else out
        out = self.inputs.output(q, k, v, a, b, A_log, dt_bias, ssm_state, out)
        return self._tuned.run(q, k, v, a, b, A_log, dt_bias, ssm_state, self.state_idx, out)


def gated_delta_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    state_idx: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    run_config: Optional[dict] = None,
) -> torch.Tensor:
    """One new token per request: gates ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``, q/k
    L2-normalized and q scaled by ``1/sqrt(head_k_dim)``, the delta rule in float32 on each request's state slot
    (updated in place, stored in the pool's dtype). Same numerics as ``gated_delta_decode_ref``.

    Args:
        q, k: ``[batch, k_heads, head_k_dim]`` float16/bfloat16/float32, last dim contiguous (may be strided views
            of one conv output).
        v: ``[batch, v_heads, head_v_dim]`` of q's dtype, last dim contiguous; ``v_heads % k_heads == 0`` (value
            head ``h`` reads q/k head ``h // (v_heads // k_heads)``). Head dims: one of ``checks.HEAD_DIMS``.
        a, b: ``[batch, v_heads]`` (last dim contiguous); A_log, dt_bias: ``[v_heads]``.
        ssm_state: ``[slots, v_heads, head_k_dim, head_v_dim]`` float32 or bfloat16, each slot contiguous.
        state_idx: int32 ``[batch]``: each request's slot, all different (not checked: that would synchronize).
            Rows that share a slot race on it alone: graph padding rows may share one scratch slot.
        out: optional ``[batch, v_heads, head_v_dim]`` of q's dtype.
    Returns ``out`` (allocated when None). Every layer of a step: :class:`GatedDeltaDecodePlan` checks once.
    """
    check_devices(_KERNEL, q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ssm_state=ssm_state,
                  state_idx=state_idx)  # fmt: skip
    plan = GatedDeltaDecodePlan(q.shape, v.shape, q.dtype, ssm_state.shape, ssm_state.dtype, state_idx,
                                gate_dtype=a.dtype, run_config=run_config)  # fmt: skip
    return plan.run(q, k, v, a, b, A_log, dt_bias, ssm_state, out=out)


def _check_plan(q_shape, v_shape, dtype, state_shape, state_dtype, state_idx, gate_dtype, run_config) -> None:
    if dtype not in DTYPES:
        fail(_KERNEL, "q", f"one of {DTYPES}", dtype)
    if len(q_shape) != 3:
        fail(_KERNEL, "q", "a [batch, k_heads, head_k_dim] tensor", tuple(q_shape))
    batch, k_heads, head_k_dim = q_shape
    if len(v_shape) != 3 or v_shape[0] != batch:
        fail(_KERNEL, "v", f"a [{batch}, v_heads, head_v_dim] tensor", tuple(v_shape))
    v_heads, head_v_dim = v_shape[1:]
    check_heads_and_state(_KERNEL, k_heads, head_k_dim, v_heads, head_v_dim, gate_dtype, state_shape, state_dtype)
    check_state_idx(_KERNEL, state_idx, batch)
    check_bv_config(_KERNEL, run_config, head_v_dim)
