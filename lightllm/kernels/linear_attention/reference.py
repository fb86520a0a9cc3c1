"""Torch references for Qwen3.5's gated DeltaNet (the test oracle and the CPU engine's path).

Numerics follow transformers' ``Qwen3_5GatedDeltaNet``: gates in float32, q/k L2-normalized in float32, the
recurrent state in float32 while it is updated (stored back in the state pool's dtype), q scaled by
``1/sqrt(head_k_dim)``. Grouped value heads: value head ``h`` reads q/k head ``h // (Hv // Hk)``.

Layouts (shared with the Triton kernels):
- conv state pool ``[slots, K - 1, C]``: the last ``K - 1`` conv inputs of each request, oldest first;
- recurrent state pool ``[slots, Hv, Dk, Dv]``;
- ``state_idx`` int32 ``[batch]``: each request's slot (its row of ``req_to_token``).
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def l2norm_ref(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gdn_gates_ref(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` (in b's dtype, as the
    reference rounds it), both returned as float32 ``[tokens, Hv]``."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid().float()


def gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token. ``q``/``k`` ``[T, Hk, Dk]`` (not yet normalized), ``v`` ``[T, Hv, Dv]``,
    ``g``/``beta`` ``[T, Hv]``; ``initial_state`` ``[Hv, Dk, Dv]`` or None (zeros). Returns float32 output
    ``[T, Hv, Dv]`` and the float32 final state."""
    T, Hk, Dk = k.shape
    Hv, Dv = v.shape[1:]
    rep = Hv // Hk
    q = l2norm_ref(q.float()).repeat_interleave(rep, dim=1) / Dk**0.5
    k = l2norm_ref(k.float()).repeat_interleave(rep, dim=1)
    v, g, beta = v.float(), g.float(), beta.float()
    s = torch.zeros(Hv, Dk, Dv, dtype=torch.float32, device=v.device)
    if initial_state is not None:
        s = initial_state.float().clone()
    out = torch.empty(T, Hv, Dv, dtype=torch.float32, device=v.device)
    for t in range(T):
        s = s * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out, s


def gated_delta_rule_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_states: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences (``cu_seqlens`` ``[N + 1]``): float32 output ``[T, Hv, Dv]``, final states
    ``[N, Hv, Dk, Dv]``; ``initial_states`` ``[N, Hv, Dk, Dv]`` or None (every sequence starts from zeros)."""
    bounds = cu_seqlens.tolist()
    out = torch.empty(q.shape[0], v.shape[1], v.shape[2], dtype=torch.float32, device=v.device)
    finals = []
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        init = None if initial_states is None else initial_states[i]
        out[s:e], final = gated_delta_rule_ref(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], init)
        finals.append(final)
    return out, torch.stack(finals)


def gated_delta_decode_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    state_idx: torch.Tensor,
) -> torch.Tensor:
    """One new token per request: gates, the state update in place (``ssm_state[state_idx]``, stored in the
    pool's dtype) and the output ``[B, Hv, Dv]`` in q's dtype. ``q``/``k`` ``[B, Hk, Dk]``, ``v`` ``[B, Hv, Dv]``,
    ``a``/``b`` ``[B, Hv]``; q/k/v may be strided views of one conv output."""
    g, beta = gdn_gates_ref(a, b, A_log, dt_bias)
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    for i, slot in enumerate(state_idx.tolist()):
        o, s = gated_delta_rule_ref(q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1],
                                    ssm_state[slot])  # fmt: skip
        ssm_state[slot] = s.to(ssm_state.dtype)
        out[i] = o[0].to(q.dtype)
    return out


def causal_conv1d_prefill_ref(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, initial_states: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU (in float32) over packed sequences. ``x`` ``[T, C]``, ``weight`` ``[C, K]``;
    ``initial_states`` ``[N, K - 1, C]``: each sequence's previous ``K - 1`` inputs (taken in x's dtype), or None
    (zeros: a fresh start). Returns the output ``[T, C]`` (x's dtype) and each sequence's conv state
    ``[N, K - 1, C]`` (its last ``K - 1`` inputs, the previous ones where it is shorter)."""
    C, K = weight.shape
    bounds = cu_seqlens.tolist()
    out = torch.empty_like(x)
    states = torch.zeros(len(bounds) - 1, K - 1, C, dtype=x.dtype, device=x.device)
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        prev = states[i] if initial_states is None else initial_states[i].to(x.dtype)
        seq = torch.cat([prev, x[s:e]])  # [K - 1 + n, C]
        if e > s:
            y = F.conv1d(seq.t().unsqueeze(0).float(), weight.float().unsqueeze(1), groups=C)  # [1, C, n]
            out[s:e] = F.silu(y)[0].t().to(x.dtype)
        states[i] = seq[-(K - 1) :]
    return out, states


def causal_conv1d_update_ref(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, state_idx: torch.Tensor
) -> torch.Tensor:
    """One new input per request: ``x`` ``[B, C]`` convolved with its slot's last ``K - 1`` inputs, SiLU; the slot
    shifts by one in place (``conv_state`` ``[slots, K - 1, C]``). Returns ``[B, C]`` in x's dtype."""
    idx = state_idx.long()
    window = torch.cat([conv_state[idx], x.unsqueeze(1).to(conv_state.dtype)], dim=1)  # [B, K, C]
    y = (window.float() * weight.float().t().unsqueeze(0)).sum(dim=1)
    conv_state[idx] = window[:, 1:]
    return F.silu(y).to(x.dtype)
