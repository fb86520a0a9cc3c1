"""Torch references for decode attention (the test oracle), in float64."""

import math
from typing import Optional

import torch


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    b_req_idx: torch.Tensor,
    b_seq_len: torch.Tensor,
    sm_scale: Optional[float] = None,
) -> torch.Tensor:
    """Softmax attention of each request's query tokens over its KV; float64 result of q's shape.

    ``q`` is ``[batch, q_heads, D]`` (one token) or ``[batch, q_len, q_heads, D]`` (the last ``q_len`` tokens
    of each request, e.g. MTP verify: token ``t`` sees the first ``seq_len - q_len + t + 1`` keys).
    ``k_cache``/``v_cache`` are ``[pool_tokens, kv_heads, D]`` in any float dtype (dequantize first)."""
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    batch, q_len, q_heads, head_dim = q4.shape
    group = q_heads // k_cache.shape[1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.zeros(q4.shape, dtype=torch.float64, device=q.device)
    for b in range(batch):
        n = int(b_seq_len[b])
        if n == 0:
            continue
        tokens = req_to_token[int(b_req_idx[b]), :n].long()
        k = k_cache[tokens].double().repeat_interleave(group, dim=1)  # [n, q_heads, D]
        v = v_cache[tokens].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,nhd->thn", q4[b].double(), k) * scale
        visible = (
            torch.arange(n, device=q.device)[None, :] < (n - q_len + 1 + torch.arange(q_len, device=q.device))[:, None]
        )
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out[b] = torch.einsum("thn,nhd->thd", scores.softmax(-1), v)
    return out.squeeze(1) if q.dim() == 3 else out


def merge_splits_ref(mid_o: torch.Tensor, mid_lse: torch.Tensor, used) -> torch.Tensor:
    """Stage 2 in float64: request ``b``'s first ``used[b]`` splits of ``mid_o [batch, heads, splits, D]`` weighted by
    ``2^mid_lse [batch, heads, splits]`` (base-2 log-sum-exps), ``[batch, heads, D]``; zeros where ``used[b]`` is 0."""
    out = torch.zeros(mid_o.shape[0], mid_o.shape[1], mid_o.shape[3], dtype=torch.float64)
    for b, n in enumerate(used):
        if n:
            w = torch.softmax(mid_lse[b, :, :n].double().cpu() * math.log(2.0), dim=-1)
            out[b] = (w.unsqueeze(-1) * mid_o[b, :, :n].double().cpu()).sum(1)
    return out
