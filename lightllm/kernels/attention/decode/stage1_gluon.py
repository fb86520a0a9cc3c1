"""INT8 KV decode stage 1 in Gluon (Triton's layout-explicit language): the dequantized K and V tiles go from the
loaded 32-bit code words straight into the tensor-core operand registers, with no trip through shared memory.

Why (docs/decode_attention.md, "V without the shared-memory round trip"): in ``stage1.py`` Triton stages the
dequantized V tile (and the probabilities) through shared memory to reach the ``p @ V`` operand layout, with a barrier
per tile, because for that dot a thread holds consecutive *tokens* of one head-dim column while a code word holds four
consecutive head-dim columns of one token. Here the layouts are written out instead:

- Each thread loads four consecutive code words (16 bytes) of a token per load, and one 4-byte load brings the two
  group scales they need (quant group 8). One PTX block per pair of words (``inline_asm_elementwise``, ``pack=2``)
  gives four packed float16 pairs, byte ``j`` of both words, times their scales: for V the pair is tokens
  ``(t, t + 1)`` of one word column, for K two words of one token. Each dot runs as four, one per byte ``j``:
  ``S = sum_j Q_j K_j`` and ``O_j = P V_j``.
- Which head-dim column a tensor-core row or column holds is chosen so that the loaded registers already are the
  operands: the loads use linear layouts by physical word, and a reshape and permute relabels them into the mma
  operand layout without moving data (``convert_layout(..., assert_trivial=True)`` checks it at compile time). The
  queries are loaded in the same column order, and the output columns are put back at the store.
- The values are ``stage1.py``'s PTX path's exactly: ``code ^ 0x80`` under 1024.0's exponent byte, minus 1152, times
  its float16 scale (one rounding), float16 dots with float32 accumulation.
- One warp per program, so the probabilities go from the QK accumulator to the PV operand in registers. Each tile's
  K and V loads are issued before its K is dequantized, so V's bytes are in flight during the QK dot.

GPU only (Gluon has no interpreter): ``stage1.py`` stays the kernel the engine and the CPU tests run. Scope: INT8
codes, 16-bit queries, quant group 8, query groups up to 16, head_dim 128 or 256. The next tile's loads are
issued ahead only with ``PREFETCH`` (the next tile's codes and scales loaded while this one's are used: more bytes in
flight per warp, about 50 more registers).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import constexpr_function
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

# Two int32 words (the pair along the reduction axis) and their two float16 scales (one register) -> the four float16
# pairs of bytes 0..3: XOR turns a code into code + 128 unsigned; PRMT interleaves the two words' bytes and puts each
# under 0x64 (1024.0's high byte), so 1024 + code + 128 minus 1152 is the code, exactly; one scale multiply per pair.
_WORD_PAIR_TO_F16 = gl.constexpr("""{
.reg .b32 a, b, m, c, x01, x23;
xor.b32 a, $4, 0x80808080;
xor.b32 b, $5, 0x80808080;
prmt.b32 x01, a, b, 0x5140;
prmt.b32 x23, a, b, 0x7362;
mov.b32 m, 0x64646464;
prmt.b32 $0, x01, m, 0x4140;
prmt.b32 $1, x01, m, 0x4342;
prmt.b32 $2, x23, m, 0x4140;
prmt.b32 $3, x23, m, 0x4342;
mov.b32 c, 0x64806480;
sub.rn.f16x2 $0, $0, c;
sub.rn.f16x2 $1, $1, c;
sub.rn.f16x2 $2, $2, c;
sub.rn.f16x2 $3, $3, c;
mul.rn.f16x2 $0, $0, $6;
mul.rn.f16x2 $1, $1, $6;
mul.rn.f16x2 $2, $2, $6;
mul.rn.f16x2 $3, $3, $6;
}""")


@gluon.jit
def _dequant_pairs(words, scales):
    """Bytes 0..3 of each pair of consecutive words (in the layout's register order) times their scale pair."""
    return gl.inline_asm_elementwise(_WORD_PAIR_TO_F16, "=r,=r,=r,=r,r,r,r", [words, scales],
                                     dtype=(gl.float16,) * 4, is_pure=True, pack=2)  # fmt: skip


@constexpr_function
def _steps(lo, hi):
    """The powers of two from ``lo`` up to below ``hi``: a dimension's strides past what the lanes cover."""
    return [x for x in (1 << i for i in range(max(hi, 1).bit_length())) if lo <= x < hi]


@constexpr_function
def _v_words_layout(block_n, w, tokens_first):
    """V words ``[BLOCK_N, W]`` by physical word: lane ``L`` holds tokens ``2 (L % 4) + {0, 1} + 8 r`` and the four
    consecutive words ``4 (L // 4) + {0..3}`` (+ 32 e): one 16-byte load per token. ``tokens_first``: the token pair in
    consecutive registers (what the PTX pairs), else the four words (what a vector load wants)."""
    words = [[0, 1], [0, 2]]
    pair = [[1, 0]]
    rest = [[t, 0] for t in _steps(8, block_n)] + [[0, x] for x in _steps(32, w)]
    regs = pair + words + rest if tokens_first else words + pair + rest
    lanes = [[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [block_n, w])


@constexpr_function
def _v_scales_layout(block_n, w):
    """V scales ``[BLOCK_N, W // 2]`` (quant group 8: word ``w``'s group is ``w // 2``), matching ``_v_words_layout``:
    a lane's two groups of one token in consecutive registers (one 4-byte load)."""
    regs = [[0, 1], [1, 0]] + [[t, 0] for t in _steps(8, block_n)] + [[0, x // 2] for x in _steps(32, w)]
    lanes = [[2, 0], [4, 0], [0, 2], [0, 4], [0, 8]]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [block_n, w // 2])


@constexpr_function
def _k_words_layout(block_n, w):
    """K^T words ``[W, BLOCK_N]`` by physical word: lane ``L`` holds token ``L // 4`` (+ 8 r) and the four consecutive
    words ``4 (L % 4) + {0..3}`` of every 16: one 16-byte load per token and 16 words; consecutive registers are the
    word pairs the PTX takes."""
    regs = [[1, 0], [2, 0]] + [[x, 0] for x in _steps(16, w)] + [[0, t] for t in _steps(8, block_n)]
    lanes = [[4, 0], [8, 0], [0, 1], [0, 2], [0, 4]]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [w, block_n])


@constexpr_function
def _k_scales_layout(block_n, w):
    """K scales ``[W // 2, BLOCK_N]`` matching ``_k_words_layout``: a lane's two groups of one token, one 4-byte
    load."""
    regs = [[1, 0]] + [[x // 2, 0] for x in _steps(16, w)] + [[0, t] for t in _steps(8, block_n)]
    lanes = [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [w // 2, block_n])


@gluon.jit
def _pair_rows(scales, ROWS: gl.constexpr, COLS: gl.constexpr):
    """``[ROWS // 2, COLS]`` group scales as ``[ROWS, COLS]``, each repeated for its two words (rows 2 g, 2 g + 1)."""
    return gl.reshape(gl.permute(gl.join(scales, scales), [0, 2, 1]), [ROWS, COLS])


@gluon.jit
def _pair_cols(scales, ROWS: gl.constexpr, COLS: gl.constexpr):
    """``[ROWS, COLS // 2]`` group scales as ``[ROWS, COLS]``, each repeated for its two words (columns 2 g and
    2 g + 1)."""
    return gl.reshape(gl.join(scales, scales), [ROWS, COLS])


@gluon.jit
def _v_logical(x, BLOCK_N: gl.constexpr, W: gl.constexpr):
    """Physical word ``w = 4 m + a`` to mma column ``n = (W / 4) a + m``: a lane's four consecutive words land in
    the same column of four n-tiles."""
    return gl.reshape(gl.permute(gl.reshape(x, [BLOCK_N, W // 4, 4]), [0, 2, 1]), [BLOCK_N, W])


@gluon.jit
def _k_logical(x, BLOCK_N: gl.constexpr, W: gl.constexpr):
    """Physical word ``w = 16 t + 4 q + 2 h + i`` to mma reduction index ``16 t + 8 h + 2 q + i``: a lane's four
    consecutive words are its ``k_width`` 2 pairs of one k-tile."""
    x = gl.reshape(x, [W // 16, 4, 2, 2, BLOCK_N])
    return gl.reshape(gl.permute(x, [0, 2, 1, 3, 4]), [W, BLOCK_N])


@gluon.jit
def _load_tile(tokens, K32, V32, K_scale, V_scale, n0, end, kvh, stride_kt, stride_kh, stride_vt, stride_vh,
               stride_kst, stride_ksh, stride_vst, stride_vsh, kn, kw, ksn, kg, vn, vw, vsn, vg):  # fmt: skip
    """Tokens ``[n0, n0 + BLOCK_N)`` (those from ``end`` on masked off): K^T words, K group scales, V words, V group
    scales, each in the layout of its index vectors."""
    k_ok = n0 + kn < end
    k_tok = gl.load(tokens + n0 + kn, mask=k_ok, other=0).to(gl.int64)
    k_words = gl.load(K32 + ((k_tok * stride_kt + kvh * stride_kh) >> 2)[None, :] + kw[:, None],
                      mask=k_ok[None, :], other=0)  # fmt: skip
    ks_ok = n0 + ksn < end
    ks_tok = gl.load(tokens + n0 + ksn, mask=ks_ok, other=0).to(gl.int64)
    k_sc = gl.load(K_scale + (ks_tok * stride_kst + kvh * stride_ksh)[None, :] + kg[:, None],
                   mask=ks_ok[None, :], other=0.0)  # fmt: skip
    v_ok = n0 + vn < end
    v_tok = gl.load(tokens + n0 + vn, mask=v_ok, other=0).to(gl.int64)
    v_words = gl.load(V32 + ((v_tok * stride_vt + kvh * stride_vh) >> 2)[:, None] + vw[None, :],
                      mask=v_ok[:, None], other=0)  # fmt: skip
    vs_ok = n0 + vsn < end
    vs_tok = gl.load(tokens + n0 + vsn, mask=vs_ok, other=0).to(gl.int64)
    v_sc = gl.load(V_scale + (vs_tok * stride_vst + kvh * stride_vsh)[:, None] + vg[None, :],
                   mask=vs_ok[:, None], other=0.0)  # fmt: skip
    return k_words, k_sc, v_words, v_sc


@gluon.jit
def decode_stage1_int8_gluon_kernel(
    Q, K, V, K_scale, V_scale, req_to_token, b_req_idx, b_seq_len, mid_o, mid_lse,
    qk_scale,  # softmax scale * log2(e)
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kst, stride_ksh, stride_vst, stride_vsh, stride_rr,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, MIN_BLOCKS: gl.constexpr,
    QGROUP: gl.constexpr, PREFETCH: gl.constexpr,
):  # fmt: skip
    gl.static_assert(QGROUP == 8, "the vector-load layouts take quant group 8")
    gl.static_assert(BLOCK_N >= 16, "a tile is the reduction of the PV dot: at least one 16-deep mma")
    W: gl.constexpr = HEAD_DIM // 4  # code words per token and KV head
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    kl: gl.constexpr = _k_words_layout(BLOCK_N, W)
    ksl: gl.constexpr = _k_scales_layout(BLOCK_N, W)
    vl: gl.constexpr = _v_words_layout(BLOCK_N, W, False)
    vpl: gl.constexpr = _v_words_layout(BLOCK_N, W, True)
    vsl: gl.constexpr = _v_scales_layout(BLOCK_N, W)

    b = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    splits = gl.num_programs(2)
    seq_len = gl.load(b_seq_len + b)
    blocks = (seq_len + BLOCK_N - 1) // BLOCK_N
    per_split = gl.maximum((blocks + splits - 1) // splits, MIN_BLOCKS) * BLOCK_N  # splits.py's split_tokens
    start = split * per_split
    end = gl.minimum(start + per_split, seq_len)
    if start < end:
        # queries as Q_j [16, W]: reduction index k holds column 4 w(k) + j, w(k) the physical word _k_logical maps
        # to k (rows past GROUP are zero)
        qh = gl.arange(0, 16, layout=gl.SliceLayout(1, a_op))
        qk = gl.arange(0, W, layout=gl.SliceLayout(0, a_op))
        qw = (qk // 16) * 16 + ((qk % 8) // 2) * 4 + ((qk % 16) // 8) * 2 + qk % 2
        q_ptr = Q + b.to(gl.int64) * stride_qb + (kvh * GROUP + qh)[:, None] * stride_qh + 4 * qw[None, :]
        q_mask = (qh < GROUP)[:, None]
        q0 = gl.load(q_ptr, mask=q_mask, other=0.0).to(gl.float16)
        q1 = gl.load(q_ptr + 1, mask=q_mask, other=0.0).to(gl.float16)
        q2 = gl.load(q_ptr + 2, mask=q_mask, other=0.0).to(gl.float16)
        q3 = gl.load(q_ptr + 3, mask=q_mask, other=0.0).to(gl.float16)

        slot = gl.load(b_req_idx + b).to(gl.int64)
        tokens = req_to_token + slot * stride_rr
        kw = gl.arange(0, W, layout=gl.SliceLayout(1, kl))
        kn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, kl))
        kg = gl.arange(0, W // 2, layout=gl.SliceLayout(1, ksl))
        ksn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, ksl))
        vn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, vl))
        vw = gl.arange(0, W, layout=gl.SliceLayout(0, vl))
        vsn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, vsl))
        vg = gl.arange(0, W // 2, layout=gl.SliceLayout(0, vsl))
        sn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
        K32 = K.to(gl.pointer_type(gl.int32))
        V32 = V.to(gl.pointer_type(gl.int32))

        m_i = gl.full([16], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma))
        l_i = gl.zeros([16], gl.float32, layout=gl.SliceLayout(1, mma))
        acc0 = gl.zeros([16, W], gl.float32, layout=mma)
        acc1 = gl.zeros([16, W], gl.float32, layout=mma)
        acc2 = gl.zeros([16, W], gl.float32, layout=mma)
        acc3 = gl.zeros([16, W], gl.float32, layout=mma)
        if PREFETCH:
            k_words, k_sc, v_words, v_sc = _load_tile(
                tokens, K32, V32, K_scale, V_scale, start, end, kvh, stride_kt, stride_kh, stride_vt, stride_vh,
                stride_kst, stride_ksh, stride_vst, stride_vsh, kn, kw, ksn, kg, vn, vw, vsn, vg)  # fmt: skip
        for n0 in range(start, end, BLOCK_N):
            if PREFETCH:  # the next tile's codes and scales in flight through this one's arithmetic
                nk_words, nk_sc, nv_words, nv_sc = _load_tile(
                    tokens, K32, V32, K_scale, V_scale, n0 + BLOCK_N, end, kvh, stride_kt, stride_kh, stride_vt,
                    stride_vh, stride_kst, stride_ksh, stride_vst, stride_vsh, kn, kw, ksn, kg, vn, vw, vsn,
                    vg)  # fmt: skip
            else:  # this tile's, all before any arithmetic: V's bytes are in flight while K's are dotted
                k_words, k_sc, v_words, v_sc = _load_tile(
                    tokens, K32, V32, K_scale, V_scale, n0, end, kvh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_kst, stride_ksh, stride_vst, stride_vsh, kn, kw, ksn, kg, vn, vw, vsn, vg)  # fmt: skip

            k_scales = gl.convert_layout(_pair_rows(k_sc, W, BLOCK_N), kl, assert_trivial=True)
            k0, k1, k2, k3 = _dequant_pairs(k_words, k_scales)
            k0 = gl.convert_layout(_k_logical(k0, BLOCK_N, W), b_op, assert_trivial=True)
            k1 = gl.convert_layout(_k_logical(k1, BLOCK_N, W), b_op, assert_trivial=True)
            k2 = gl.convert_layout(_k_logical(k2, BLOCK_N, W), b_op, assert_trivial=True)
            k3 = gl.convert_layout(_k_logical(k3, BLOCK_N, W), b_op, assert_trivial=True)
            s = mma_v2(q0, k0, gl.zeros([16, BLOCK_N], gl.float32, layout=mma))
            s = mma_v2(q1, k1, s)
            s = mma_v2(q2, k2, s)
            s = mma_v2(q3, k3, s)
            s = gl.where(((n0 + sn) < end)[None, :], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            p16 = gl.convert_layout(p.to(gl.float16), a_op)

            v_scales = gl.convert_layout(_pair_cols(v_sc, BLOCK_N, W), vpl)
            v0, v1, v2, v3 = _dequant_pairs(gl.convert_layout(v_words, vpl, assert_trivial=True), v_scales)
            v0 = gl.convert_layout(_v_logical(v0, BLOCK_N, W), b_op, assert_trivial=True)
            v1 = gl.convert_layout(_v_logical(v1, BLOCK_N, W), b_op, assert_trivial=True)
            v2 = gl.convert_layout(_v_logical(v2, BLOCK_N, W), b_op, assert_trivial=True)
            v3 = gl.convert_layout(_v_logical(v3, BLOCK_N, W), b_op, assert_trivial=True)
            acc0 = mma_v2(p16, v0, acc0 * alpha[:, None])
            acc1 = mma_v2(p16, v1, acc1 * alpha[:, None])
            acc2 = mma_v2(p16, v2, acc2 * alpha[:, None])
            acc3 = mma_v2(p16, v3, acc3 * alpha[:, None])
            m_i = m_new
            if PREFETCH:
                k_words, k_sc, v_words, v_sc = nk_words, nk_sc, nv_words, nv_sc

        # output column n of O_j is head-dim column 4 w(n) + j, w(n) the physical word _v_logical maps to n
        oh = gl.arange(0, 16, layout=gl.SliceLayout(1, mma))
        on = gl.arange(0, W, layout=gl.SliceLayout(0, mma))
        ow = 4 * (on % (W // 4)) + on // (W // 4)
        heads = kvh * GROUP + oh
        o_mask = (oh < GROUP)[:, None]
        o_ptr = mid_o + b.to(gl.int64) * stride_mob + heads[:, None] * stride_moh + split * stride_mos + 4 * ow[None, :]
        inv = 1.0 / l_i
        gl.store(o_ptr, acc0 * inv[:, None], mask=o_mask)
        gl.store(o_ptr + 1, acc1 * inv[:, None], mask=o_mask)
        gl.store(o_ptr + 2, acc2 * inv[:, None], mask=o_mask)
        gl.store(o_ptr + 3, acc3 * inv[:, None], mask=o_mask)
        gl.store(mid_lse + b * stride_mlb + heads * stride_mlh + split, m_i + gl.log2(l_i), mask=oh < GROUP)


def check_supported(q, k_cache, quant_group: int) -> None:
    """``ValueError`` naming what this kernel does not take (the Triton stage 1 takes the rest)."""
    group = q.shape[1] // k_cache.shape[1]
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"q: expected float16 or bfloat16 for the Gluon INT8 stage 1, got {q.dtype}")
    if q.stride(2) != 1:
        raise ValueError(f"q: expected a contiguous last dim for the Gluon INT8 stage 1, got strides {q.stride()}")
    if k_cache.dtype != torch.int8:
        raise ValueError(f"k_cache: expected int8 codes for the Gluon INT8 stage 1, got {k_cache.dtype}")
    if q.shape[2] not in (128, 256):
        raise ValueError(f"head_dim: expected 128 or 256 for the Gluon INT8 stage 1, got {q.shape[2]}")
    if not 1 <= group <= 16:
        raise ValueError(f"query heads per KV head: expected 1-16 for the Gluon INT8 stage 1, got {group}")
    if quant_group != 8:
        raise ValueError(f"quant_group: expected 8 for the Gluon INT8 stage 1, got {quant_group}")


def check_word_aligned(k_cache, v_cache) -> None:
    """Codes are read as 32-bit words: every K/V row must start on a multiple of 4 bytes."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (t.data_ptr() | t.stride(0) | t.stride(1)) & 3:
            raise ValueError(f"{name}: expected 4-byte aligned rows (data pointer and strides multiples of 4) for "
                             f"the Gluon INT8 stage 1, got strides {tuple(t.stride())}")  # fmt: skip


def launch_stage1_int8_gluon(
    q, k_cache, v_cache, k_scale, v_scale, req_to_token, b_req_idx, b_seq_len, mid_o, mid_lse,
    sm_scale: float, block_n: int, min_blocks: int = 1, quant_group: int = 8, prefetch: bool = False,
):  # fmt: skip
    """Stage 1 over the grid ``(batch, kv_heads, splits)`` with ``splits = mid_o.shape[2]``, writing what
    ``stage1.py`` writes (stage 2 merges either)."""
    check_supported(q, k_cache, quant_group)
    check_word_aligned(k_cache, v_cache)
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    decode_stage1_int8_gluon_kernel[(batch, kv_heads, mid_o.shape[2])](
        q, k_cache, v_cache, k_scale, v_scale, req_to_token, b_req_idx, b_seq_len, mid_o, mid_lse,
        sm_scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        k_scale.stride(0), k_scale.stride(1), v_scale.stride(0), v_scale.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_N=block_n, MIN_BLOCKS=min_blocks, QGROUP=quant_group,
        PREFETCH=prefetch, num_warps=1,
    )  # fmt: skip
