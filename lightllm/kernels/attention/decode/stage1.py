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
float16's range), the probabilities (in [0, 1]) once per tile. The queries take the softmax scale (base 2) once
there, not every score. So |K| and |V| must stay below float16's 65504, and |q| times that scale too (on the PTX INT8
path, below, times 16 more: |q| < 32K at head_dim 128). float32 queries dequantize in float32 and keep IEEE dots.

On a GPU (``ASM``) the same float16 values come from PTX: the codes are read as 32-bit words of four, and per word
two PRMTs place the four codes under float16 exponent bytes. INT8 then takes one packed FMA per pair, by the scale
plus an exact bias, which leaves 1/16 of the value (``INT8_PTX_UNIT``, so the bias stays inside float16; the softmax
scale and the output's normalization take the 16 back, exactly). INT4 takes one packed subtraction and one packed
scale multiply per pair (and one LOP3 per pair picks a nibble). Written per element, Triton keeps one code per
register and spends a PRMT per byte to extract and re-pack it (docs/decode_attention.md has the profile).

Two things keep the quantized loop free of register moves (a fifth of its instructions before): the first block runs
before the loop (up to head_dim 128), so the queries' dot operand is built once and stays in registers, and
dequantized V passes through an opaque move so Triton reads V and the probabilities as 2-wide operands by
``ldmatrix``. The launcher caps the registers this adds (``flash_decode.register_cap``). After the peeled block the
loop takes whole blocks only, with no masks on its loads and scores; a split's partial last block runs after it.
"""

import triton
import triton.language as tl

from lightllm.kernels.attention.decode.splits import split_tokens
from lightllm.kernels.pdl import pdl_release, pdl_wait

# The PTX INT8 path (_int8_word_to_f16) dequantizes K and V to 1/16 of their values; stage 1 scales them back
INT8_PTX_UNIT = tl.constexpr(16.0)
# Its FMA's bias per unit of scale: code + 128 under 0x54 (64.0's high byte) is 64 + (code + 128) / 16, so 64 + 8 off
# leaves code / 16
INT8_PTX_BIAS = tl.constexpr(-72.0)


@triton.jit
def _int8_to_f16(codes):
    """int8 codes as exact float16: ``code + 128`` in the low byte of 1024.0's bits is ``1152 + code``."""
    return (codes.to(tl.uint8, bitcast=True).to(tl.uint16) ^ 0x6480).to(tl.float16, bitcast=True) - 1152.0


@triton.jit
def _nibble_to_f16(nibble, INT4_OFFSET: tl.constexpr):
    """A nibble (uint8 in [0, 15]) as the exact float16 ``nibble - INT4_OFFSET``."""
    return (nibble.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + INT4_OFFSET)


# Dequantization as PTX on 32-bit words of four codes (GPU only: the interpreter runs the helpers above). Codes
# loaded as int8 live one per register and Triton extracts and re-packs each with PRMTs (the H200's profile: PRMT 24 %
# and IMAD 18 % of the quantized stage 1's instructions, 213 registers); a word load keeps four per register and
# two PRMTs place them under float16 exponent bytes, then one packed FMA (INT8) or a subtraction and a multiply (INT4)
# per pair.
@triton.jit
def _int8_word_to_f16(words, scale, bias):
    """Four int8 codes per int32 word, with their float16 scale and ``bias = INT8_PTX_BIAS * scale`` (-72 times it;
    one each per word), as four float16 tensors in memory order, each ``code * scale / 16`` (``INT8_PTX_UNIT``)
    rounded once.

    ``code ^ 0x80`` is ``code + 128`` unsigned; placed under 0x54 (64.0's high byte) it is ``64 + (code + 128) / 16``,
    and one FMA by the scale plus the bias leaves ``code * scale / 16``. The bias is exact because INT8 scales have 7
    significant bits (common/kv_cache/quant.py). The 1/16 keeps the bias inside float16 for every scale the format
    allows (``72 * 512``); with 1024.0's byte the bias would be ``1152 * scale``, finite only below 57."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 u, m, lo, hi, s, b;
        xor.b32 u, $4, 0x80808080;
        mov.b32 m, 0x54545454;
        prmt.b32 lo, u, m, 0x4140;
        prmt.b32 hi, u, m, 0x4342;
        mov.b32 s, {$5, $5};
        mov.b32 b, {$6, $6};
        fma.rn.f16x2 lo, lo, s, b;
        fma.rn.f16x2 hi, hi, s, b;
        mov.b32 {$0, $1}, lo;
        mov.b32 {$2, $3}, hi;
        }""",
        constraints="=h,=h,=h,=h,r,h,h",
        args=[words, scale, bias],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _int4_word_to_f16(words, s_lo, s_hi):
    """Four packed INT4 bytes per int32 word: the low nibbles (four elements of the low half of the head dim) times
    ``s_lo`` and the high ones times ``s_hi``, as eight float16 tensors (low four, then high four), ``nibble - 8``
    (INT4_OFFSET 8). PRMT spreads two bytes to the low bytes of two halves; one LOP3 keeps a nibble and or's in
    1024.0's exponent: the low nibble gives ``1024 + n`` (one subtraction), the high one ``1024 + 16 n`` (one exact
    FMA by 1/16)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 z, s01, s23, mlo, mhi, e, c, r, t, a0, a1, b0, b1, sl, sh;
        mov.b32 z, 0;
        prmt.b32 s01, $8, z, 0x4140;
        prmt.b32 s23, $8, z, 0x4342;
        mov.b32 mlo, 0x000F000F;
        mov.b32 mhi, 0x00F000F0;
        mov.b32 e, 0x64006400;
        lop3.b32 a0, s01, mlo, e, 0xea;
        lop3.b32 a1, s23, mlo, e, 0xea;
        lop3.b32 b0, s01, mhi, e, 0xea;
        lop3.b32 b1, s23, mhi, e, 0xea;
        mov.b32 c, 0x64086408;
        sub.rn.f16x2 a0, a0, c;
        sub.rn.f16x2 a1, a1, c;
        mov.b32 r, 0x2C002C00;
        mov.b32 t, 0xD480D480;
        fma.rn.f16x2 b0, b0, r, t;
        fma.rn.f16x2 b1, b1, r, t;
        mov.b32 sl, {$9, $9};
        mov.b32 sh, {$10, $10};
        mul.rn.f16x2 a0, a0, sl;
        mul.rn.f16x2 a1, a1, sl;
        mul.rn.f16x2 b0, b0, sh;
        mul.rn.f16x2 b1, b1, sh;
        mov.b32 {$0, $1}, a0;
        mov.b32 {$2, $3}, a1;
        mov.b32 {$4, $5}, b0;
        mov.b32 {$6, $7}, b1;
        }""",
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,h,h",
        args=[words, s_lo, s_hi],
        dtype=(tl.float16,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _join4(e0, e1, e2, e3, BLOCK_N: tl.constexpr, HALF_D: tl.constexpr):
    """``[BLOCK_N, HALF_D // 4]`` x 4 (element ``4 w + j`` in ``e<j>[:, w]``) as ``[BLOCK_N, HALF_D]``."""
    return tl.reshape(tl.join(tl.join(e0, e2), tl.join(e1, e3)), [BLOCK_N, HALF_D])


@triton.jit
def _word_scales(scale, BLOCK_N: tl.constexpr, HALF_D: tl.constexpr, QGROUP: tl.constexpr):
    """``scale [BLOCK_N, HALF_D // QGROUP]`` broadcast to one per word ``[BLOCK_N, HALF_D // 4]`` (register-local)."""
    per = tl.broadcast_to(scale[:, :, None], [BLOCK_N, HALF_D // QGROUP, QGROUP // 4])
    return tl.reshape(per, [BLOCK_N, HALF_D // 4])


@triton.jit
def _load_dequant_words(Base, Scale, row, srow, m, BLOCK_N: tl.constexpr, HALF_D: tl.constexpr,
                        QUANT: tl.constexpr, QGROUP: tl.constexpr):  # fmt: skip
    """The ``ASM`` path of ``_load_kv_halves``: codes read as int32 words (``row`` in bytes, a multiple of 4)."""
    w = tl.arange(0, HALF_D // 4)
    g = tl.arange(0, HALF_D // QGROUP)
    words = Base.to(tl.pointer_type(tl.int32)) + (row >> 2)[:, None] + w[None, :]
    g_lo = tl.load(Scale + srow[:, None] + g[None, :], mask=m, other=0)
    g_hi = tl.load(Scale + srow[:, None] + (g + HALF_D // QGROUP)[None, :], mask=m, other=0)
    s_lo = _word_scales(g_lo, BLOCK_N, HALF_D, QGROUP)
    s_hi = _word_scales(g_hi, BLOCK_N, HALF_D, QGROUP)
    if QUANT == 4:
        a0, a1, a2, a3, b0, b1, b2, b3 = _int4_word_to_f16(tl.load(words, mask=m, other=0), s_lo, s_hi)
    else:
        c_lo = _word_scales(g_lo * INT8_PTX_BIAS, BLOCK_N, HALF_D, QGROUP)  # exact: 7-bit scales
        c_hi = _word_scales(g_hi * INT8_PTX_BIAS, BLOCK_N, HALF_D, QGROUP)
        a0, a1, a2, a3 = _int8_word_to_f16(tl.load(words, mask=m, other=0), s_lo, c_lo)
        b0, b1, b2, b3 = _int8_word_to_f16(tl.load(words + HALF_D // 4, mask=m, other=0), s_hi, c_hi)
    return _join4(a0, a1, a2, a3, BLOCK_N, HALF_D), _join4(b0, b1, b2, b3, BLOCK_N, HALF_D)


@triton.jit
def _dequant(codes, scale, BLOCK_N: tl.constexpr, HALF_D: tl.constexpr, QGROUP: tl.constexpr):
    """``codes [BLOCK_N, HALF_D] * scale [BLOCK_N, HALF_D // QGROUP]`` broadcast over each group, in the scale's
    dtype (float32, or float16 on the ``F16`` path where the codes already are float16).

    Reshaping the fastest dim keeps the register layout, so this is a broadcast multiply, not a gather:
    the scales are read once per group with wide loads."""
    grouped = tl.reshape(codes.to(scale.dtype), [BLOCK_N, HALF_D // QGROUP, QGROUP])
    return tl.reshape(grouped * scale[:, :, None], [BLOCK_N, HALF_D])


@triton.jit
def _load_dequant_elements(Base, Scale, row, srow, m, d, BLOCK_N: tl.constexpr, HALF_D: tl.constexpr,
                           QUANT: tl.constexpr, QGROUP: tl.constexpr, INT4_OFFSET: tl.constexpr,
                           F16: tl.constexpr):  # fmt: skip
    """``_load_kv_halves`` per element: bf16/fp16 KV, float32 queries, and the interpreter."""
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
    return lo, hi


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
    ASM: tl.constexpr,
    DTYPE,
):
    """Both halves ``[BLOCK_N, HALF_D]`` of the K or V rows at element offsets ``row`` (scales at ``srow``)."""
    m = mask_n[:, None]
    if ASM:
        tl.static_assert(QUANT == 8 or INT4_OFFSET == 8, "the PTX nibble conversion is written for INT4_OFFSET 8")
        tl.static_assert(QGROUP % 4 == 0, "the PTX path scales whole words")
        lo, hi = _load_dequant_words(Base, Scale, row, srow, m, BLOCK_N, HALF_D, QUANT, QGROUP)
    else:
        lo, hi = _load_dequant_elements(Base, Scale, row, srow, m, d, BLOCK_N, HALF_D, QUANT, QGROUP, INT4_OFFSET, F16)
    return lo.to(DTYPE), hi.to(DTYPE)


@triton.jit
def _load_q_halves(Q, b, heads, mask_h, stride_qb, stride_qh, HALF_D: tl.constexpr, F16: tl.constexpr):
    """Request ``b``'s query rows ``heads`` (zeros where ``mask_h`` is off) as two halves ``[len(heads), HALF_D]``,
    as float16 with ``F16`` (exact for bf16 queries in float16's normal range: 8 significant bits into 11)."""
    d = tl.arange(0, HALF_D)
    q_ptr = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :]
    q_lo = tl.load(q_ptr, mask=mask_h[:, None], other=0.0)
    q_hi = tl.load(q_ptr + HALF_D, mask=mask_h[:, None], other=0.0)
    if F16:
        q_lo = q_lo.to(tl.float16)
        q_hi = q_hi.to(tl.float16)
    return q_lo, q_hi


@triton.jit
def _operand_width_barrier(x):
    """``x`` (float16) unchanged, through an instruction Triton cannot see into.

    Triton sizes a dot operand's per-thread K run (``kWidth``) from the narrowest load it traces the operand back to,
    through elementwise ops and joins: for dequantized V that is 4 (the codes' words), which makes the probabilities
    the same 4-wide operand. Both then reach the MMA through 64-bit shared-memory loads and a register move per
    fragment word, where a 2-wide operand is one ``ldmatrix`` (V's tile goes through shared memory either way).
    A side-effecting asm stops the trace; ptxas drops the move."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float16, is_pure=False, pack=2)


@triton.jit
def _attend_block(n0, end, m_i, l_i, acc_lo, acc_hi, q_lo, q_hi, tokens, K, V, K_scale, V_scale, kvh, qk_scale,
                  stride_kt, stride_kh, stride_vt, stride_vh, stride_kst, stride_ksh, stride_vst, stride_vsh, d,
                  BLOCK_N: tl.constexpr, HALF_D: tl.constexpr, QUANT: tl.constexpr, QGROUP: tl.constexpr,
                  INT4_OFFSET: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr, PRECISION: tl.constexpr,
                  kv_dtype, FULL: tl.constexpr = False):  # fmt: skip
    """Online softmax over the block of tokens ``[n0, n0 + BLOCK_N)`` (those below ``end``; ``FULL``: all of them,
    so no load or score is masked)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if FULL:
        mask_n = tl.full([BLOCK_N], 1, tl.int1)
    else:
        mask_n = offs_n < end
    tok = tl.load(tokens + offs_n, mask=mask_n, other=0).to(tl.int64)
    k_row = tok * stride_kt + kvh * stride_kh
    k_srow = tok * stride_kst + kvh * stride_ksh
    v_srow = tok * stride_vst + kvh * stride_vsh
    if QUANT != 0:  # whole scale rows (the host checks the strides): vector loads, pipelined as async copies
        k_srow = tl.multiple_of(k_srow, 2 * HALF_D // QGROUP)
        v_srow = tl.multiple_of(v_srow, 2 * HALF_D // QGROUP)
    k_lo, k_hi = _load_kv_halves(K, K_scale, k_row, k_srow, mask_n, d, BLOCK_N, HALF_D, QUANT, QGROUP, INT4_OFFSET,
                                 F16, ASM, kv_dtype)  # fmt: skip
    qk = tl.dot(q_lo, tl.trans(k_lo), input_precision=PRECISION) + tl.dot(
        q_hi, tl.trans(k_hi), input_precision=PRECISION
    )
    qk = tl.where(mask_n[None, :], qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_lo, v_hi = _load_kv_halves(V, V_scale, tok * stride_vt + kvh * stride_vh, v_srow, mask_n, d, BLOCK_N, HALF_D,
                                 QUANT, QGROUP, INT4_OFFSET, F16, ASM, kv_dtype)  # fmt: skip
    if ASM:
        v_lo = _operand_width_barrier(v_lo)
        v_hi = _operand_width_barrier(v_hi)
    p = p.to(kv_dtype)
    acc_lo = acc_lo * alpha[:, None] + tl.dot(p, v_lo, input_precision=PRECISION)
    acc_hi = acc_hi * alpha[:, None] + tl.dot(p, v_hi, input_precision=PRECISION)
    return m_new, l_i, acc_lo, acc_hi


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
    ASM: tl.constexpr,  # F16 on a GPU: codes to float16 by the PTX helpers, four per register
    PEEL: tl.constexpr,  # F16: the first block before the loop, q kept in registers (flash_decode.peel_queries)
    PRECISION: tl.constexpr,  # "ieee" for float32 queries (no tf32 rounding), None (default) for 16-bit
    USE_PDL: tl.constexpr = False,  # kernels/pdl.py
):
    pdl_wait(USE_PDL)
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
    q_lo, q_hi = _load_q_halves(Q, b, heads, mask_h, stride_qb, stride_qh, HALF_D, F16)
    kv_dtype = q_lo.dtype  # what K and V become for the dots

    slot = tl.load(b_req_idx + b).to(tl.int64)
    tokens = req_to_token + slot * stride_rr
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_lo = tl.zeros([BLOCK_H, HALF_D], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_H, HALF_D], dtype=tl.float32)
    if ASM and QUANT == 8:
        qk_scale = qk_scale * INT8_PTX_UNIT  # K arrives as code * scale / 16 (_int8_word_to_f16)
    if F16:
        # the softmax scale goes into the float16 queries once (one more rounding, far under K's quantization)
        # instead of into every score
        q_lo = (q_lo.to(tl.float32) * qk_scale).to(tl.float16)
        q_hi = (q_hi.to(tl.float32) * qk_scale).to(tl.float16)
        qk_scale = 1.0
    # PEEL: the first block before the loop, so the queries' conversion to the dot operand has a user outside it:
    # Triton then keeps q in registers instead of re-reading it from shared memory in every iteration (and, with the
    # 4-wide operand the codes need, re-assembling each MMA fragment with register moves). bf16 reads q with
    # ldmatrix and gains nothing but registers, so only the quantized path peels (the launcher decides). The loop
    # then takes whole blocks without masks, and the split's partial last block, if any, comes after it (splits
    # share whole blocks, so only a request's last block can be partial). At head_dim 256 (no peel) the unmasked
    # loop holds 30-50 more registers a thread, so there it stays one masked loop.
    loop_start = start
    loop_end = end
    if PEEL:
        m_i, l_i, acc_lo, acc_hi = _attend_block(
            start, end, m_i, l_i, acc_lo, acc_hi, q_lo, q_hi, tokens, K, V, K_scale, V_scale, kvh, qk_scale,
            stride_kt, stride_kh, stride_vt, stride_vh, stride_kst, stride_ksh, stride_vst, stride_vsh, d,
            BLOCK_N, HALF_D, QUANT, QGROUP, INT4_OFFSET, F16, ASM, PRECISION, kv_dtype,
        )  # fmt: skip
        loop_start = start + BLOCK_N
        loop_end = loop_start + (tl.maximum(end - loop_start, 0) // BLOCK_N) * BLOCK_N
    for n0 in range(loop_start, loop_end, BLOCK_N):
        m_i, l_i, acc_lo, acc_hi = _attend_block(
            n0, end, m_i, l_i, acc_lo, acc_hi, q_lo, q_hi, tokens, K, V, K_scale, V_scale, kvh, qk_scale,
            stride_kt, stride_kh, stride_vt, stride_vh, stride_kst, stride_ksh, stride_vst, stride_vsh, d,
            BLOCK_N, HALF_D, QUANT, QGROUP, INT4_OFFSET, F16, ASM, PRECISION, kv_dtype, PEEL,
        )  # fmt: skip
    if PEEL:
        if loop_end < end:
            m_i, l_i, acc_lo, acc_hi = _attend_block(
                loop_end, end, m_i, l_i, acc_lo, acc_hi, q_lo, q_hi, tokens, K, V, K_scale, V_scale, kvh, qk_scale,
                stride_kt, stride_kh, stride_vt, stride_vh, stride_kst, stride_ksh, stride_vst, stride_vsh, d,
                BLOCK_N, HALF_D, QUANT, QGROUP, INT4_OFFSET, F16, ASM, PRECISION, kv_dtype,
            )  # fmt: skip

    pdl_release(USE_PDL)
    o_ptr = mid_o + b.to(tl.int64) * stride_mob + heads[:, None] * stride_moh + split * stride_mos + d[None, :]
    norm = l_i
    if ASM and QUANT == 8:
        norm = l_i / INT8_PTX_UNIT  # so does V: exact, a power of two
    tl.store(o_ptr, acc_lo / norm[:, None], mask=mask_h[:, None])
    tl.store(o_ptr + HALF_D, acc_hi / norm[:, None], mask=mask_h[:, None])
    tl.store(mid_lse + b * stride_mlb + heads * stride_mlh + split, m_i + tl.log2(l_i), mask=mask_h)
