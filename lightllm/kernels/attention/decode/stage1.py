"""Split-KV decode attention, stage 1: each program attends one KV head's query group over a range of
``BLOCK_N``-token blocks of one request and writes a partial output and its log-sum-exp (base 2).

The grid is ``(batch, kv_heads, splits)``: it depends on the batch and the graph's maximum length, never on
the real lengths, so a captured graph replays at any length up to that maximum. Split ``s`` of a request
with ``c`` blocks takes blocks ``[s * ceil(c / splits), (s + 1) * ceil(c / splits))`` (``splits.py``); splits
past the end do nothing and stage 2 skips them.

KV is read in two halves of the head dim (``[0, D/2)`` and ``[D/2, D)``), which is what the INT4 layout
packs into one byte (low / high nibble); bf16/fp16 and INT8 use the same two-half loop so one kernel body
serves all three (``QUANT`` = 0, 8 or 4). INT8/INT4 scales are per ``QGROUP`` elements, loaded once per group and
broadcast over it in registers.

Quantized KV with 16-bit queries (``F16``) dequantizes more cheaply (docs/decode_attention.md has what it gains
and what still bounds it): a code becomes a float16 with integer ops only (its bits or'ed into the mantissa of
1024.0, then one subtraction: exact, where an int-to-float conversion runs at a quarter of the ALU rate), is scaled
by its float16 scale in float16 (rounded once, to 11 significant bits where the bf16 path rounds to 8), and both
dots run in float16 with float32 accumulation: bf16 queries become float16 once per program (exactly, inside
float16's range), the probabilities (in [0, 1]) once per tile. So |q|, |K| and |V| must stay below float16's
65504. float32 queries dequantize in float32 and keep IEEE dots.
"""

import triton
import triton.language as tl

from lightllm.kernels.attention.decode.splits import split_tokens


@triton.jit
def _int8_to_f16(codes):
    """int8 codes as exact float16: ``code + 128`` in the low byte of 1024.0's bits is ``1152 + code``."""
    return (codes.to(tl.uint8, bitcast=True).to(tl.uint16) ^ 0x6480).to(tl.float16, bitcast=True) - 1152.0


@triton.jit
def _nibble_to_f16(nibble, INT4_OFFSET: tl.constexpr):
    """A nibble (uint8 in [0, 15]) as the exact float16 ``nibble - INT4_OFFSET``."""
    return (nibble.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + INT4_OFFSET)


@triton.jit
def _dequant(codes, scale, BLOCK_N: tl.constexpr, HALF_D: tl.constexpr, QGROUP: tl.constexpr):
    """``codes [BLOCK_N, HALF_D] * scale [BLOCK_N, HALF_D // QGROUP]`` broadcast over each group, in the scale's
    dtype (float32, or float16 on the ``F16`` path where the codes already are float16).

    Reshaping the fastest dim keeps the register layout, so this is a broadcast multiply, not a gather:
    the scales are read once per group with wide loads."""
    grouped = tl.reshape(codes.to(scale.dtype), [BLOCK_N, HALF_D // QGROUP, QGROUP])
    return tl.reshape(grouped * scale[:, :, None], [BLOCK_N, HALF_D])


@triton.jit
def _load_kv_halves(
    Base,
    Scale,
    row,
    srow,
    mask_n,
    d,
    BLOCK_N: tl.constexpr,
    HALF_D: tl.constexpr,
    QUANT: tl.constexpr,
    QGROUP: tl.constexpr,
    INT4_OFFSET: tl.constexpr,
    F16: tl.constexpr,
    DTYPE,
):
    """Both halves ``[BLOCK_N, HALF_D]`` of the K or V rows at element offsets ``row`` (scales at ``srow``)."""
    m = mask_n[:, None]
    if QUANT == 4:
        packed = tl.load(Base + row[:, None] + d[None, :], mask=m, other=0)
        if F16:
            lo = _nibble_to_f16(packed & 15, INT4_OFFSET)
            hi = _nibble_to_f16(packed >> 4, INT4_OFFSET)
        else:
            lo = (packed.to(tl.int32) & 15) - INT4_OFFSET
            hi = (packed.to(tl.int32) >> 4) - INT4_OFFSET
    else:
        lo = tl.load(Base + row[:, None] + d[None, :], mask=m, other=0)
        hi = tl.load(Base + row[:, None] + (d + HALF_D)[None, :], mask=m, other=0)
        if QUANT == 8 and F16:
            lo = _int8_to_f16(lo)
            hi = _int8_to_f16(hi)
    if QUANT != 0:
        g = tl.arange(0, HALF_D // QGROUP)
        s_lo = tl.load(Scale + srow[:, None] + g[None, :], mask=m, other=0)
        s_hi = tl.load(Scale + srow[:, None] + (g + HALF_D // QGROUP)[None, :], mask=m, other=0)
        if not F16:
            s_lo = s_lo.to(tl.float32)
            s_hi = s_hi.to(tl.float32)
        lo = _dequant(lo, s_lo, BLOCK_N, HALF_D, QGROUP)
        hi = _dequant(hi, s_hi, BLOCK_N, HALF_D, QGROUP)
    return lo.to(DTYPE), hi.to(DTYPE)


@triton.jit
def decode_stage1_kernel(
    Q,
    K,
    V,
    K_scale,
    V_scale,
    req_to_token,
    b_req_idx,
    b_seq_len,
    mid_o,
    mid_lse,
    qk_scale,  # softmax scale * log2(e)
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kst,
    stride_ksh,
    stride_vst,
    stride_vsh,
    stride_rr,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_H: tl.constexpr,  # GROUP padded to a tensor-core tile (>= 16)
    HALF_D: tl.constexpr,
    BLOCK_N: tl.constexpr,  # the tile, and the unit splits share a request's tokens in
    MIN_BLOCKS: tl.constexpr,  # the fewest blocks a split takes (splits.py)
    QUANT: tl.constexpr,
    QGROUP: tl.constexpr,
    INT4_OFFSET: tl.constexpr,  # nibble = code + offset (common/kv_cache/quant.py)
    F16: tl.constexpr,  # quantized KV with 16-bit queries: dequantize and dot in float16 (module docstring)
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

    h = tl.arange(0, BLOCK_H)
    mask_h = h < GROUP
    heads = kvh * GROUP + h
    d = tl.arange(0, HALF_D)
    q_ptr = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :]
    q_lo = tl.load(q_ptr, mask=mask_h[:, None], other=0.0)
    q_hi = tl.load(q_ptr + HALF_D, mask=mask_h[:, None], other=0.0)
    if F16:  # exact for bf16 queries in float16's normal range (8 significant bits into 11)
        q_lo = q_lo.to(tl.float16)
        q_hi = q_hi.to(tl.float16)
        kv_dtype = tl.float16
    else:
        kv_dtype = Q.dtype.element_ty

    slot = tl.load(b_req_idx + b).to(tl.int64)
    tokens = req_to_token + slot * stride_rr
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_lo = tl.zeros([BLOCK_H, HALF_D], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_H, HALF_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        tok = tl.load(tokens + offs_n, mask=mask_n, other=0).to(tl.int64)
        k_lo, k_hi = _load_kv_halves(K, K_scale, tok * stride_kt + kvh * stride_kh, tok * stride_kst + kvh * stride_ksh,
                                     mask_n, d, BLOCK_N, HALF_D, QUANT, QGROUP, INT4_OFFSET, F16, kv_dtype)  # fmt: skip
        qk = tl.dot(q_lo, tl.trans(k_lo), input_precision=PRECISION) + tl.dot(
            q_hi, tl.trans(k_hi), input_precision=PRECISION
        )
        qk = tl.where(mask_n[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_lo, v_hi = _load_kv_halves(V, V_scale, tok * stride_vt + kvh * stride_vh, tok * stride_vst + kvh * stride_vsh,
                                     mask_n, d, BLOCK_N, HALF_D, QUANT, QGROUP, INT4_OFFSET, F16, kv_dtype)  # fmt: skip
        p = p.to(v_lo.dtype)
        acc_lo = acc_lo * alpha[:, None] + tl.dot(p, v_lo, input_precision=PRECISION)
        acc_hi = acc_hi * alpha[:, None] + tl.dot(p, v_hi, input_precision=PRECISION)
        m_i = m_new

    o_ptr = mid_o + b.to(tl.int64) * stride_mob + heads[:, None] * stride_moh + split * stride_mos + d[None, :]
    tl.store(o_ptr, acc_lo / l_i[:, None], mask=mask_h[:, None])
    tl.store(o_ptr + HALF_D, acc_hi / l_i[:, None], mask=mask_h[:, None])
    tl.store(mid_lse + b * stride_mlb + heads * stride_mlh + split, m_i + tl.log2(l_i), mask=mask_h)
