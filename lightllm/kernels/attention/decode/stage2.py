"""Split-KV decode attention, stage 2: merge the non-empty splits of stage 1 by their log-sum-exp."""

import triton
import triton.language as tl

from lightllm.kernels.attention.decode.splits import split_tokens
from lightllm.kernels.pdl import pdl_release, pdl_wait


@triton.jit
def decode_stage2_kernel(
    mid_o,
    mid_lse,
    b_seq_len,
    Out,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    SPLITS,
    block_n,  # stage 1's BLOCK_N: a plain int, so stage 2 compiles once for every stage-1 config
    min_blocks,  # stage 1's MIN_BLOCKS
    HEAD_DIM: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels/pdl.py
):
    pdl_wait(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(b_seq_len + b)
    per_split = split_tokens(seq_len, SPLITS, block_n, min_blocks)
    used = tl.cdiv(seq_len, per_split)  # stage 1's splits with work (splits.py); 0 for an empty request

    d = tl.arange(0, HEAD_DIM)
    o_ptr = mid_o + b.to(tl.int64) * stride_mob + h * stride_moh + d
    lse_ptr = mid_lse + b * stride_mlb + h * stride_mlh
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s in range(0, used):
        lse = tl.load(lse_ptr + s)
        o = tl.load(o_ptr + s * stride_mos)
        m_new = tl.maximum(m_i, lse)
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + o * w
        l_i = l_i * alpha + w
        m_i = m_new
    pdl_release(USE_PDL)
    out = tl.where(used > 0, acc / tl.maximum(l_i, 1e-30), 0.0)
    tl.store(Out + b.to(tl.int64) * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty))
