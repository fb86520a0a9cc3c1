"""MTP diverse decode attention, the two Triton stages.

An MTP verify step has ``Q_LEN = N + 1`` query tokens per request; token ``t`` of a request with KV length ``L``
sees keys ``[0, L - N + t)``. Stage 1 gives each (request, KV head, split) program all ``Q_LEN x GROUP`` query
rows that share the KV head, so the split's K/V tiles are read once for every row; each row masks the keys it
does not see. Splits cut the request's ``L`` keys exactly as the plain decode kernel does (``splits.py``), on a
grid sized by the launch's maximum length, never the real one. A row that sees no key of a split writes a zero
output and a log-sum-exp of ``-inf``; stage 2 merges, per row, only the splits that hold a key the row sees.
"""

import triton
import triton.language as tl

from lightllm.kernels.attention.decode.splits import split_tokens
from lightllm.kernels.attention.decode.stage2 import merge_splits


@triton.jit
def mtp_diverse_stage1_kernel(
    Q,
    K,
    V,
    req_to_token,
    b_req_idx,
    b_seq_len,
    mid_o,
    mid_lse,
    qk_scale,  # softmax scale * log2(e)
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_rr,
    stride_mob,
    stride_mot,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlt,
    stride_mlh,
    GROUP: tl.constexpr,  # query heads per KV head
    Q_LEN: tl.constexpr,  # query tokens per request (mtp_step + 1)
    BLOCK_M: tl.constexpr,  # Q_LEN * GROUP rows padded to a tensor-core tile (>= 16)
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,  # the tile, and the unit splits share a request's keys in
    MIN_BLOCKS: tl.constexpr,  # the fewest blocks a split takes (splits.py)
    PRECISION: tl.constexpr,  # "ieee" for float32 queries (no tf32 rounding), None (default) for 16-bit
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)

    seq_len = tl.load(b_seq_len + b)
    per_split = split_tokens(seq_len, splits, BLOCK_N, MIN_BLOCKS)
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    if start >= end:
        return

    m = tl.arange(0, BLOCK_M)  # row m is query token m // GROUP of head kvh * GROUP + m % GROUP
    tok_t = m // GROUP
    heads = kvh * GROUP + m % GROUP
    mask_m = m < Q_LEN * GROUP
    visible = seq_len - (Q_LEN - 1) + tok_t  # keys [0, visible) of the row
    d = tl.arange(0, HEAD_DIM)
    q_rows = b.to(tl.int64) * stride_qb + tok_t * stride_qt + heads * stride_qh
    q = tl.load(Q + q_rows[:, None] + d[None, :], mask=mask_m[:, None], other=0.0)

    slot = tl.load(b_req_idx + b).to(tl.int64)
    tokens = req_to_token + slot * stride_rr
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        tok = tl.load(tokens + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(K + tok[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=mask_n[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        seen = mask_n[None, :] & (offs_n[None, :] < visible[:, None])
        qk = tl.where(seen, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen no key yet keeps m = -inf; shifting by 0 keeps its alpha and p at 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(qk - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + tok[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=mask_n[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    seen_any = l_i > 0.0
    out = acc / tl.where(seen_any, l_i, 1.0)[:, None]
    lse = tl.where(seen_any, m_i + tl.log2(tl.where(seen_any, l_i, 1.0)), float("-inf"))
    o_rows = b.to(tl.int64) * stride_mob + tok_t * stride_mot + heads * stride_moh + split * stride_mos
    tl.store(mid_o + o_rows[:, None] + d[None, :], out, mask=mask_m[:, None])
    l_rows = b * stride_mlb + tok_t * stride_mlt + heads * stride_mlh + split
    tl.store(mid_lse + l_rows, lse, mask=mask_m)


@triton.jit
def mtp_diverse_stage2_kernel(
    mid_o,
    mid_lse,
    b_seq_len,
    Out,
    stride_mob,
    stride_mot,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlt,
    stride_mlh,
    stride_ob,
    stride_ot,
    stride_oh,
    SPLITS,
    block_n,  # stage 1's BLOCK_N: a plain int, so stage 2 compiles once for every stage-1 config
    min_blocks,  # stage 1's MIN_BLOCKS
    Q_LEN: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    b = tl.program_id(0)
    t = tl.program_id(1)
    h = tl.program_id(2)
    seq_len = tl.load(b_seq_len + b)
    per_split = split_tokens(seq_len, SPLITS, block_n, min_blocks)  # stage 1's ranges, cut by the request's length
    visible = tl.maximum(seq_len - (Q_LEN - 1) + t, 0)
    used = tl.cdiv(visible, per_split)  # splits holding a key this row sees; 0 for a padded row

    o_ptr = mid_o + b.to(tl.int64) * stride_mob + t * stride_mot + h * stride_moh
    lse_ptr = mid_lse + b * stride_mlb + t * stride_mlt + h * stride_mlh
    out = merge_splits(o_ptr, lse_ptr, used, stride_mos, HEAD_DIM, 1)  # one split a step: the tiles are unmeasured here
    d = tl.arange(0, HEAD_DIM)
    tl.store(Out + b.to(tl.int64) * stride_ob + t * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty))
