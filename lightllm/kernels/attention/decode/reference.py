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
    """Softmax attention of ``q [batch, q_heads, D]`` over each request's tokens; float64 result.

    ``k_cache``/``v_cache`` are ``[pool_tokens, kv_heads, D]`` in any float dtype (dequantize first)."""
    batch, q_heads, head_dim = q.shape
    group = q_heads // k_cache.shape[1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b in range(batch):
        n = int(b_seq_len[b])
        if n == 0:
            continue
        tokens = req_to_token[int(b_req_idx[b]), :n].long()
        k = k_cache[tokens].double().repeat_interleave(group, dim=1)  # [n, q_heads, D]
        v = v_cache[tokens].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out
