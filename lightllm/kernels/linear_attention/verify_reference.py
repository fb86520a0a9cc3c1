"""Torch references for the MTP verify step of the linear-attention layers (the test oracle and the CPU path).

A verify step feeds each request ``T = N + 1`` tokens (the last accepted one and ``N`` drafts). Its state starts
from one slot, ``src_idx[b]``, and the state after token ``t`` is written to slot ``dst_idx[b, t]``, so the next
step can start from whichever token was accepted last. The references are exactly ``T`` sequential single-token
updates (``reference.py``), each continuing from the previous token's slot: the state is stored in the pool's
dtype after every token, so accepting ``t + 1`` tokens leaves the very state ``t + 1`` plain decode steps would.

Slots: ``src_idx`` int32 ``[B]``, ``dst_idx`` int32 ``[B, T]``, all ``dst_idx`` distinct; ``src_idx[b]`` may be
one of request ``b``'s own ``dst_idx[b]`` (it is read before it is overwritten), never another request's.
"""

import torch

from lightllm.kernels.linear_attention.reference import causal_conv1d_update_ref, gated_delta_decode_ref


def gated_delta_verify_ref(
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
) -> torch.Tensor:
    """``q``/``k`` ``[B, T, Hk, Dk]``, ``v`` ``[B, T, Hv, Dv]``, ``a``/``b`` ``[B, T, Hv]``; ``ssm_state``
    ``[slots, Hv, Dk, Dv]`` updated in place (``dst_idx`` slots). Returns ``[B, T, Hv, Dv]`` in q's dtype."""
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    prev = src_idx.long()
    for t in range(v.shape[1]):
        cur = dst_idx[:, t]
        ssm_state[cur.long()] = ssm_state[prev]
        out[:, t] = gated_delta_decode_ref(q[:, t], k[:, t], v[:, t], a[:, t], b[:, t], A_log, dt_bias, ssm_state,
                                           cur)  # fmt: skip
        prev = cur.long()
    return out


def causal_conv1d_verify_ref(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> torch.Tensor:
    """``x`` ``[B, T, C]``; ``conv_state`` ``[slots, K - 1, C]``: slot ``dst_idx[b, t]`` gets the window after
    token ``t``. Returns ``[B, T, C]`` in x's dtype."""
    out = torch.empty_like(x)
    prev = src_idx.long()
    for t in range(x.shape[1]):
        cur = dst_idx[:, t]
        conv_state[cur.long()] = conv_state[prev]
        out[:, t] = causal_conv1d_update_ref(x[:, t], conv_state, weight, cur)
        prev = cur.long()
    return out
