"""Gated DeltaNet (linear attention) backend: per-request state slots, and the conv + gated delta rule of prefill
and decode over them.

State (one slot per request row, the same index as ``b_req_idx``; layouts in
``kernels/linear_attention/reference.py``): conv state ``[layers, slots, K - 1, C]`` in the model dtype and the
recurrent state ``[layers, slots, Hv, Dk, Dv]`` in ``--linear_att_ssm_data_type``. Prefill starts every request
from zero state (there is no prefix reuse) and writes its final states into the slot; decode reads and updates
the slot in place, so a captured decode graph indexes the state through the static ``b_req_idx`` buffer.

- CPU: the torch references.
- GPU prefill: fla-core's chunked gated delta rule (packed varlen); the conv as K shifted multiply-adds over
  the whole packed batch (:func:`causal_conv1d_packed`: no per-request loop on the host).
- GPU decode: the Triton recurrent update and conv update (``kernels/linear_attention``).
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from lightllm.kernels.linear_attention.reference import (
    causal_conv1d_prefill_ref,
    causal_conv1d_update_ref,
    gated_delta_decode_ref,
    gated_delta_rule_varlen_ref,
    gdn_gates_ref,
)
from lightllm.layers.infer_state import InferState

SSM_DATA_TYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # --linear_att_ssm_data_type


@dataclass(frozen=True)
class LinearAttentionShape:
    """One layer's gated DeltaNet sizes on this rank."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


class LinearAttentionState:
    """The state slots of every linear-attention layer, allocated once (zeros) at start-up."""

    def __init__(self, num_layers: int, num_slots: int, shape: LinearAttentionShape, conv_dtype: torch.dtype,
                 ssm_dtype: torch.dtype, device) -> None:  # fmt: skip
        s = shape
        self.conv = torch.zeros(num_layers, num_slots, s.conv_kernel - 1, s.conv_channels, dtype=conv_dtype,
                                device=device)  # fmt: skip
        self.ssm = torch.zeros(num_layers, num_slots, s.value_heads, s.key_dim, s.value_dim, dtype=ssm_dtype,
                               device=device)  # fmt: skip

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes


@dataclass
class LinearAttentionPlan:
    """What every layer of one forward shares: the state slots, and for prefill the packed sequence bounds (on
    the device for fla-core, on the host for the references)."""

    state_idx: torch.Tensor  # int32 [batch]
    cu_seqlens: Optional[torch.Tensor] = None  # int64 [batch + 1], prefill only
    cu_seqlens_cpu: Optional[torch.Tensor] = None
    offsets: Optional[torch.Tensor] = None  # int64 [tokens]: each token's index in its request (GPU prefill)


class LinearAttentionBackend:
    def __init__(self, state: LinearAttentionState, device: torch.device):
        self.state = state
        self.on_gpu = device.type == "cuda"

    def plan(self, infer_state: InferState) -> LinearAttentionPlan:
        """Once per forward, before the first layer."""
        if not infer_state.is_prefill:
            return LinearAttentionPlan(infer_state.b_req_idx)
        lens = infer_state.b_q_len.to(torch.int64)
        cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
        cu_cpu = cu.cpu()
        offsets = None
        if self.on_gpu:
            tokens = int(cu_cpu[-1])
            starts = torch.repeat_interleave(cu[:-1], lens, output_size=tokens)  # output_size: no device sync
            offsets = torch.arange(tokens, device=cu.device) - starts
        return LinearAttentionPlan(infer_state.b_req_idx, cu, cu_cpu, offsets)

    # ---- prefill: every request starts from zero state; the final states go to its slot --------------------

    def conv_prefill(self, layer: int, x: torch.Tensor, weight: torch.Tensor, plan: LinearAttentionPlan):
        """Depthwise causal conv + SiLU of the packed ``x`` ``[T, C]`` (``weight`` ``[C, K]``)."""
        if self.on_gpu:
            out, states = causal_conv1d_packed(x, weight, plan.cu_seqlens, plan.offsets)
        else:
            out, states = causal_conv1d_prefill_ref(x, weight, plan.cu_seqlens_cpu)
        self.state.conv[layer][plan.state_idx.long()] = states.to(self.state.conv.dtype)
        return out

    def delta_prefill(self, layer: int, q, k, v, a, b, A_log, dt_bias, plan: LinearAttentionPlan) -> torch.Tensor:
        """The gated delta rule over packed sequences: q/k ``[T, Hk, Dk]`` (not normalized), v ``[T, Hv, Dv]``,
        a/b ``[T, Hv]``. Returns ``[T, Hv, Dv]`` in v's dtype."""
        g, beta = gdn_gates_ref(a, b, A_log, dt_bias)
        if self.on_gpu:
            out, finals = _fla_chunk(q, k, v, g, beta.to(v.dtype), plan)
        else:
            out, finals = gated_delta_rule_varlen_ref(q, k, v, g, beta, plan.cu_seqlens_cpu)
        self.state.ssm[layer][plan.state_idx.long()] = finals.to(self.state.ssm.dtype)
        return out.to(v.dtype)

    # ---- decode: one token per request, its slot updated in place -----------------------------------------

    def conv_decode(self, layer: int, x: torch.Tensor, weight: torch.Tensor, plan: LinearAttentionPlan):
        if self.on_gpu:
            from lightllm.kernels.linear_attention.conv1d_update import causal_conv1d_update

            return causal_conv1d_update(x, self.state.conv[layer], weight, plan.state_idx)
        return causal_conv1d_update_ref(x, self.state.conv[layer], weight, plan.state_idx)

    def delta_decode(self, layer: int, q, k, v, a, b, A_log, dt_bias, plan: LinearAttentionPlan) -> torch.Tensor:
        if self.on_gpu:
            from lightllm.kernels.linear_attention.gated_delta_decode import gated_delta_decode

            return gated_delta_decode(q, k, v, a, b, A_log, dt_bias, self.state.ssm[layer], plan.state_idx)
        return gated_delta_decode_ref(q, k, v, a, b, A_log, dt_bias, self.state.ssm[layer], plan.state_idx)


def _fla_chunk(q, k, v, g, beta, plan: LinearAttentionPlan) -> Tuple[torch.Tensor, torch.Tensor]:
    """fla-core's chunked gated delta rule over the packed batch (batch dim 1, ``cu_seqlens``), q/k L2-normalized
    in the kernel, grouped value heads when Hv > Hk; every sequence from zero state. The plan's bounds are the
    same tensors for every layer, so fla's per-tensor cache derives its chunk indices once per forward."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # lazy: GPU only

    q, k, v, g, beta = (t.contiguous().unsqueeze(0) for t in (q, k, v, g, beta))  # q/k/v: views of the conv out
    out, finals = chunk_gated_delta_rule(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=None,
                                         output_final_state=True, use_qk_l2norm_in_kernel=True,
                                         cu_seqlens=plan.cu_seqlens, cu_seqlens_cpu=plan.cu_seqlens_cpu)  # fmt: skip
    return out[0], finals


def causal_conv1d_packed(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, offsets: torch.Tensor):
    """:func:`causal_conv1d_prefill_ref` over the whole packed batch at once: ``y[t] = sum_s w[K-1-s] * x[t-s]``
    over the shifts ``s`` that stay inside the token's request (``offsets[t] >= s``), SiLU, in float32. Returns
    the output ``[T, C]`` (x's dtype) and each request's last ``K - 1`` inputs ``[N, K - 1, C]`` (zeros before
    its start)."""
    K = weight.shape[1]
    xf, w = x.float(), weight.float()
    y = xf * w[:, K - 1]
    for s in range(1, K):
        shifted = torch.zeros_like(xf)
        shifted[s:] = xf[:-s]
        y += shifted * (offsets >= s).unsqueeze(1) * w[:, K - 1 - s]
    idx = cu_seqlens[1:, None] - (K - 1) + torch.arange(K - 1, device=x.device)  # [N, K - 1]
    states = x[idx.clamp(min=0)] * (idx >= cu_seqlens[:-1, None]).unsqueeze(-1)
    return torch.nn.functional.silu(y).to(x.dtype), states
