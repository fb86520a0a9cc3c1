"""Stage 1's QK as an integer dot (``QK_INT8``, an INT8/INT4 KV option): the K codes feed an int8 tensor-core dot
as they are stored, with no dequantization, and the scales are applied to the partial sums.

K's scales differ per (token, quant group), so a dot over the whole head dim cannot be scaled afterwards. Each query
row is therefore split into one row per quant group, zero outside that group: row ``r = g * BLOCK_G + h`` holds head
``h``'s query on group ``g``'s dims. One dot ``[BLOCK_R, D] x [D, BLOCK_N]`` gives every (group, head) partial sum;
each is scaled by its query scale and its token's K scale, and the group rows of a head are summed. The query is
quantized to int8 per (head, group) (absmax / 127, round to nearest) once per program, the error SageAttention
accepts for its int8 QK. INT4 nibbles enter the dot unsigned (``nibble = code + INT4_OFFSET``); the offset comes
off each row's sum as ``INT4_OFFSET * sum(q codes)``.

The rows grow with the number of groups (``D / QGROUP``): 16 for 4 heads at group 32 and d128, 64 at group 8.
:func:`qk_int8_rows` is the host's count. The torch oracle of the query's quantization is
``reference.quantize_q_groups_ref``.
"""

import triton
import triton.language as tl

from lightllm.kernels.launch_math import next_power_of_2


def qk_int8_rows(group: int, head_dim: int, quant_group: int) -> tuple:
    """(``BLOCK_G``, ``BLOCK_R``): heads per group row block (``group`` padded to a power of two) and rows of the
    integer dot (one per (quant group, head), at least a 16-row tensor-core tile)."""
    block_g = next_power_of_2(group)
    return block_g, max(16, block_g * (head_dim // quant_group))


@triton.jit
def load_q_int8_rows(Q, b, kvh, stride_qb, stride_qh, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                     BLOCK_R: tl.constexpr, HALF_D: tl.constexpr, QGROUP: tl.constexpr,
                     INT4_OFFSET: tl.constexpr, QUANT: tl.constexpr):  # fmt: skip
    """The query rows of the dot as int8 halves ``[BLOCK_R, HALF_D]``, each row's scale (float32) and, for INT4, the
    offset correction ``INT4_OFFSET * sum(codes)`` per row."""
    r = tl.arange(0, BLOCK_R)
    g = r // BLOCK_G
    h = r % BLOCK_G
    row_ok = (h < GROUP) & (g < 2 * HALF_D // QGROUP)
    d = tl.arange(0, HALF_D)
    ptr = Q + b.to(tl.int64) * stride_qb + (kvh * GROUP + h)[:, None] * stride_qh + d[None, :]
    in_lo = row_ok[:, None] & ((d // QGROUP)[None, :] == g[:, None])
    in_hi = row_ok[:, None] & (((d + HALF_D) // QGROUP)[None, :] == g[:, None])
    q_lo = tl.load(ptr, mask=in_lo, other=0.0).to(tl.float32)
    q_hi = tl.load(ptr + HALF_D, mask=in_hi, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(q_lo), 1), tl.max(tl.abs(q_hi), 1))
    inv = 127.0 / tl.where(amax > 0, amax, 1.0)  # an all-zero row stays zero
    x_lo = q_lo * inv[:, None]
    x_hi = q_hi * inv[:, None]
    # Round half away from zero (|x| <= 127): truncation after adding +-0.5, the same on a GPU and in the interpreter.
    c_lo = (x_lo + tl.where(x_lo >= 0, 0.5, -0.5)).to(tl.int32)
    c_hi = (x_hi + tl.where(x_hi >= 0, 0.5, -0.5)).to(tl.int32)
    correction = tl.zeros([BLOCK_R], dtype=tl.int32)
    if QUANT == 4:
        correction = INT4_OFFSET * (tl.sum(c_lo, 1) + tl.sum(c_hi, 1))
    return c_lo.to(tl.int8), c_hi.to(tl.int8), amax / 127.0, correction


@triton.jit
def qk_int8_scores(q_lo, q_hi, q_scale, correction, K, K_scale, row, srow, mask_n, BLOCK_N: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, HALF_D: tl.constexpr,
                   QGROUP: tl.constexpr, QUANT: tl.constexpr):  # fmt: skip
    """Scores ``[BLOCK_H, BLOCK_N]`` (float32, times whatever ``q_scale`` carries: stage 1 folds the softmax scale in)
    of one K tile at element offsets ``row`` (scales at ``srow``); row ``i`` is head ``i % BLOCK_G`` (rows past
    ``BLOCK_G`` repeat heads when a head block is narrower than the 16-row tile the PV dot needs)."""
    d = tl.arange(0, HALF_D)
    m = mask_n[:, None]
    if QUANT == 4:
        packed = tl.load(K + row[:, None] + d[None, :], mask=m, other=0)
        k_lo = (packed & 15).to(tl.int8)
        k_hi = (packed >> 4).to(tl.int8)
    else:
        k_lo = tl.load(K + row[:, None] + d[None, :], mask=m, other=0)
        k_hi = tl.load(K + row[:, None] + (d + HALF_D)[None, :], mask=m, other=0)
    acc = tl.dot(q_lo, tl.trans(k_lo), out_dtype=tl.int32)
    acc = tl.dot(q_hi, tl.trans(k_hi), acc=acc, out_dtype=tl.int32)
    if QUANT == 4:
        acc -= correction[:, None]
    # K scales once per (token, group), applied to the partial sums laid out [group, head, token]
    groups = tl.arange(0, BLOCK_R // BLOCK_G)
    k_scale = tl.load(K_scale + srow[:, None] + groups[None, :], mask=m & (groups < 2 * HALF_D // QGROUP)[None, :],
                      other=0.0)  # fmt: skip
    part = tl.reshape(acc.to(tl.float32) * q_scale[:, None], [BLOCK_R // BLOCK_G, BLOCK_G, BLOCK_N])
    per_head = tl.sum(part * tl.trans(k_scale.to(tl.float32))[:, None, :], 0)
    if BLOCK_G < BLOCK_H:
        per_head = tl.reshape(tl.broadcast_to(per_head[None, :, :], [BLOCK_H // BLOCK_G, BLOCK_G, BLOCK_N]),
                              [BLOCK_H, BLOCK_N])  # fmt: skip
    return per_head
