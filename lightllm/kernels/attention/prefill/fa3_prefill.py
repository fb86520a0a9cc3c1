"""Prefill attention through FlashAttention-3 (``--llm_prefill_att_backend fa3``): the packed new tokens of each
request (varlen ``cu_seqlens_q``) attend causally over the request's whole KV in the pool, its cached prefix and its
own new K/V, which the layer has already written there. FA3's causal mask is aligned to the end of each request's
KV, which is exactly chunked prefill's: new token ``i`` of ``n`` after ``p`` cached ones sees keys ``[0, p + i]``.

The pool is read in the layouts of the FA3 decode (``decode/fa3.py``): pages of one token through
``req_to_token`` (providers with paged KV), or each request slot's fixed row (``cache_batch_idx``; the ``fa3-fwd``
wheel). Nothing is tuned: FA3 picks its own tiles and splits for a prefill.

Every step: ``cu_seqlens_q`` is built on the device from ``b_q_start`` and the last request's ``b_q_len`` (not from
the packed row count), so a prefill graph's padding rows after the real ones are never attended or written.
"""

import math
from typing import Optional

import torch

from lightllm.common.autotuner import PlannedInputs
from lightllm.kernels.attention.decode.fa3 import FA3Provider, check_pool, pool_rows, pool_views, require_fa3

OWNER = "fa3 prefill attention"


class FA3PrefillPlan:
    """One forward's FA3 prefill, planned before any layer: layout chosen, arguments checked, ``cu_seqlens_q`` and
    the page table built once; every layer's :meth:`run` checks only its shapes.

    Args:
        q_shape, q_dtype: the packed queries ``[tokens, q_heads, D]`` (float16/bfloat16).
        k_cache, v_cache: any layer's token pool ``[pool_tokens, kv_heads, D]`` (all layers share the shape).
        req_to_token, b_req_idx: the KV table and each request's row of it (int32).
        b_seq_len: int32 ``[batch]``, each request's KV length after this step (cached prefix + new tokens).
        b_q_start, b_q_len: int32 ``[batch]``, each request's first packed row and its number of new tokens.
        max_q_len: the most new tokens of one request (a prefill graph: its bucket).
        max_len_in_batch: the longest ``b_seq_len`` the step may have (the page table's width; paged only).
        layout: ``"paged"`` or ``"slots"``; default: paged when the provider can.
    """

    def __init__(
        self, q_shape, q_dtype, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, b_q_start, b_q_len, max_q_len,
        max_len_in_batch, layout: Optional[str] = None, sm_scale: Optional[float] = None,
        provider: Optional[FA3Provider] = None,
    ):  # fmt: skip
        provider = provider or require_fa3(k_cache.device, "--llm_prefill_att_backend")
        layout = layout or ("paged" if provider.paged else "slots")
        q_shape = torch.Size(q_shape)
        if len(q_shape) != 3 or q_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"{OWNER}: q expected a [tokens, q_heads, head_dim] float16/bfloat16 tensor, got "
                             f"{tuple(q_shape)} {q_dtype}")  # fmt: skip
        tokens, q_heads, head_dim = q_shape
        check_pool(OWNER, q_heads, head_dim, q_dtype, k_cache, v_cache, req_to_token, layout, provider)
        batch = b_req_idx.shape[0] if b_req_idx.dim() == 1 else -1
        for name, t in (("b_req_idx", b_req_idx), ("b_seq_len", b_seq_len), ("b_q_start", b_q_start),
                        ("b_q_len", b_q_len)):  # fmt: skip
            if batch < 1 or t.shape != (batch,) or t.dtype != torch.int32 or t.device != k_cache.device:
                raise ValueError(f"{OWNER}: {name} expected an int32 [batch] tensor (batch >= 1, b_req_idx's) on "
                                 f"{k_cache.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")  # fmt: skip
        if not 0 < max_q_len <= tokens:
            raise ValueError(f"{OWNER}: max_q_len expected a length in [1, {tokens}] (q's rows), got {max_q_len}")
        if layout == "paged" and not 0 < max_len_in_batch <= req_to_token.shape[1]:
            raise ValueError(f"{OWNER}: max_len_in_batch expected a length in [1, {req_to_token.shape[1]}], got "
                             f"{max_len_in_batch}")  # fmt: skip
        self.page_table, self.batch_idx, self.slot_shape = pool_rows(layout, req_to_token, b_req_idx, max_len_in_batch)
        self.cu_seqlens_q = torch.cat([b_q_start, b_q_start[-1:] + b_q_len[-1:]])
        self.inputs = PlannedInputs(OWNER, q=(q_shape, q_dtype), k_cache=(k_cache.shape, k_cache.dtype))
        self.b_seq_len, self.max_q_len, self.provider = b_seq_len, int(max_q_len), provider
        self.sm_scale = float(sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim))

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """``[tokens, q_heads, D]`` in q's dtype: rows past the last request's new tokens are left unwritten."""
        self.inputs.check((q.shape, q.dtype), (k_cache.shape, k_cache.dtype))
        k4, v4 = pool_views(k_cache, v_cache, self.slot_shape)
        return self.provider.fn(
            q, k4, v4, cache_seqlens=self.b_seq_len, cache_batch_idx=self.batch_idx, page_table=self.page_table,
            cu_seqlens_q=self.cu_seqlens_q, max_seqlen_q=self.max_q_len, softmax_scale=self.sm_scale, causal=True,
        )  # fmt: skip
