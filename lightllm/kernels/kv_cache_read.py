"""Read tokens of one layer of an INT8/INT4 KV pool back as floats: gather the K and V codes and scales of
``token_idx`` and dequantize them in one pass. The prefill over a cached prefix of a quantized pool reads the prefix
this way, every layer of every chunk.

Bit for bit ``dequantize_int8_ref`` / ``dequantize_int4_ref`` (``lightllm.common.kv_cache.quant``) of the gathered
rows, cast to the output dtype: a code is exact in float32, so is its float16 scale, and so is their product (8 and
11 significant bits), which is rounded once to the output dtype. The torch reference makes float32 temporaries of the
whole prefix (gathered codes, converted codes, products) before the cast; this kernel reads each code and scale once
and writes each output element once. One program per ``BLOCK_T`` tokens and KV head, K and V together.
"""

import torch
import triton
import triton.language as tl

from lightllm.common.kv_cache.quant import INT4_OFFSET, SCALE_DTYPE, dequantize_int4_ref, dequantize_int8_ref
from lightllm.kernels.attention.decode.stage1 import _dequant
from lightllm.kernels.direct_launch import DirectLaunch

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_BLOCK_T = 16


@triton.jit
def _times_group_scales(x, srow, m, g0, BLOCK_T: tl.constexpr, WIDTH: tl.constexpr, QGROUP: tl.constexpr):
    """``x [BLOCK_T, WIDTH]`` (float32) times the scales of its groups (``g0``: the first group's index), by decode
    stage 1's register-local group broadcast."""
    s = tl.load(srow + (g0 + tl.arange(0, WIDTH // QGROUP))[None, :], mask=m, other=0).to(tl.float32)
    return _dequant(x, s, BLOCK_T, WIDTH, QGROUP)


@triton.jit
def _gather_dequant_one(Codes, Scales, Out, src, offs, h, m, stride_ct, stride_ch, stride_st, stride_sh,
                        BLOCK_T: tl.constexpr, HEAD_D: tl.constexpr, QGROUP: tl.constexpr, INT4: tl.constexpr,
                        INT4_OFFSET: tl.constexpr):  # fmt: skip
    """Rows ``src`` of head ``h`` of one cache (K or V), dequantized into ``Out`` at ``offs``."""
    row = Codes + src[:, None] * stride_ct + h * stride_ch
    srow = Scales + src[:, None] * stride_st + h * stride_sh
    if INT4:  # byte j: element j (low nibble) and element j + HEAD_D / 2 (high nibble); no group straddles
        d = tl.arange(0, HEAD_D // 2)
        packed = tl.load(row + d[None, :], mask=m, other=0)
        lo = _times_group_scales((packed & 15).to(tl.float32) - INT4_OFFSET, srow, m, 0, BLOCK_T, HEAD_D // 2,
                                 QGROUP)  # fmt: skip
        hi = _times_group_scales((packed >> 4).to(tl.float32) - INT4_OFFSET, srow, m, HEAD_D // 2 // QGROUP, BLOCK_T,
                                 HEAD_D // 2, QGROUP)  # fmt: skip
        tl.store(Out + offs + d[None, :], lo.to(Out.dtype.element_ty), mask=m)
        tl.store(Out + offs + (d + HEAD_D // 2)[None, :], hi.to(Out.dtype.element_ty), mask=m)
    else:
        d = tl.arange(0, HEAD_D)
        x = _times_group_scales(tl.load(row + d[None, :], mask=m, other=0).to(tl.float32), srow, m, 0, BLOCK_T,
                                HEAD_D, QGROUP)  # fmt: skip
        tl.store(Out + offs + d[None, :], x.to(Out.dtype.element_ty), mask=m)


@triton.jit
def _gather_dequant_kernel(
    K_codes,
    K_scales,
    V_codes,
    V_scales,
    Token_idx,
    K_out,
    V_out,
    n_tokens,
    stride_ct,
    stride_ch,
    stride_st,
    stride_sh,
    stride_ot,
    stride_oh,
    BLOCK_T: tl.constexpr,
    HEAD_D: tl.constexpr,
    QGROUP: tl.constexpr,
    INT4: tl.constexpr,
    INT4_OFFSET: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)
    mask = t < n_tokens
    m = mask[:, None]
    src = tl.load(Token_idx + t, mask=mask, other=0).to(tl.int64)
    offs = t.to(tl.int64)[:, None] * stride_ot + h * stride_oh
    _gather_dequant_one(K_codes, K_scales, K_out, src, offs, h, m, stride_ct, stride_ch, stride_st, stride_sh, BLOCK_T,
                        HEAD_D, QGROUP, INT4, INT4_OFFSET)  # fmt: skip
    _gather_dequant_one(V_codes, V_scales, V_out, src, offs, h, m, stride_ct, stride_ch, stride_st, stride_sh, BLOCK_T,
                        HEAD_D, QGROUP, INT4, INT4_OFFSET)  # fmt: skip


_GATHER_DEQUANT = DirectLaunch(_gather_dequant_kernel)


def gather_dequant_kv(k_codes, k_scale, v_codes, v_scale, token_idx, quant: str, group_size: int, out_dtype,
                      out=None):  # fmt: skip
    """``(k, v)`` ``[n, kv_heads, head_dim]`` in ``out_dtype``: tokens ``token_idx`` (int32/int64 ``[n]``) of one
    layer's codes (int8 ``[tokens, kv_heads, head_dim]``, or uint8 ``[..., head_dim // 2]`` packed INT4) and float16
    scales ``[tokens, kv_heads, head_dim // group_size]``, dequantized. ``out``: a ``(k, v)`` pair to write instead
    of new tensors (the same shape and dtype). Bad input is a ``ValueError`` naming the argument."""
    _check(quant, k_codes, k_scale, v_codes, v_scale, token_idx, group_size, out_dtype)
    n, (heads, width) = token_idx.numel(), k_codes.shape[1:]
    shape = (n, heads, 2 * width if quant == "int4" else width)
    if out is None:
        out = (torch.empty(shape, dtype=out_dtype, device=k_codes.device),
               torch.empty(shape, dtype=out_dtype, device=k_codes.device))  # fmt: skip
    elif any(o.shape != shape or o.dtype != out_dtype or not o.is_contiguous() for o in out):
        raise ValueError(f"gather_dequant_kv: out expected two contiguous {out_dtype} tensors of shape {shape}, got "
                         f"{[(o.dtype, tuple(o.shape)) for o in out]}")  # fmt: skip
    return launch_gather_dequant(k_codes, k_scale, v_codes, v_scale, token_idx, quant, group_size, out)


def launch_gather_dequant(k_codes, k_scale, v_codes, v_scale, token_idx, quant: str, group_size: int, out):
    """``gather_dequant_kv`` without its checks, into ``out``: for a caller that checked one layer's tensors and
    reads every layer of a pool alike (one shape, dtype and strides)."""
    k_out, v_out = out
    n, heads = token_idx.numel(), k_codes.shape[1]
    if n:
        _GATHER_DEQUANT.launch(
            (triton.cdiv(n, _BLOCK_T), heads),
            k_codes, k_scale, v_codes, v_scale, token_idx, k_out, v_out, n,
            k_codes.stride(0), k_codes.stride(1), k_scale.stride(0), k_scale.stride(1),
            k_out.stride(0), k_out.stride(1),
            BLOCK_T=_BLOCK_T, HEAD_D=k_out.shape[2], QGROUP=group_size, INT4=quant == "int4",
            INT4_OFFSET=INT4_OFFSET, num_warps=4 if k_out.shape[2] <= 128 else 8,
        )  # fmt: skip
    return k_out, v_out


def gather_dequant_kv_ref(k_codes, k_scale, v_codes, v_scale, token_idx, quant: str, group_size: int, out_dtype):
    """The torch reference: ``dequantize_*_ref`` of the gathered rows, cast to ``out_dtype``."""
    deq = dequantize_int8_ref if quant == "int8" else dequantize_int4_ref
    idx = token_idx.long()
    return (deq(k_codes[idx], k_scale[idx], group_size).to(out_dtype),
            deq(v_codes[idx], v_scale[idx], group_size).to(out_dtype))  # fmt: skip


def _check(quant, k_codes, k_scale, v_codes, v_scale, token_idx, group_size, out_dtype) -> None:
    owner = "gather_dequant_kv"
    if quant not in ("int8", "int4"):
        raise ValueError(f"{owner}: quant expected 'int8' or 'int4', got {quant!r}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{owner}: out_dtype expected one of {_OUT_DTYPES}, got {out_dtype}")
    code_dtype = torch.int8 if quant == "int8" else torch.uint8
    for name, x, dtype in (("k_codes", k_codes, code_dtype), ("v_codes", v_codes, code_dtype),
                           ("k_scale", k_scale, SCALE_DTYPE), ("v_scale", v_scale, SCALE_DTYPE)):  # fmt: skip
        if not isinstance(x, torch.Tensor) or x.dtype != dtype or x.dim() != 3 or x.stride(-1) != 1:
            got = f"{x.dtype} {tuple(x.shape)} strides {x.stride()}" if isinstance(x, torch.Tensor) else type(x)
            raise ValueError(f"{owner}: {name} expected a 3-d {dtype} tensor [tokens, kv_heads, ...] with a "
                             f"contiguous last dim, got {got}")  # fmt: skip
    if v_codes.shape != k_codes.shape or v_codes.stride() != k_codes.stride():
        raise ValueError(f"{owner}: v_codes expected k_codes' shape {tuple(k_codes.shape)} and strides, got "
                         f"{tuple(v_codes.shape)} {v_codes.stride()}")  # fmt: skip
    if v_scale.shape != k_scale.shape or v_scale.stride() != k_scale.stride():
        raise ValueError(f"{owner}: v_scale expected k_scale's shape {tuple(k_scale.shape)} and strides, got "
                         f"{tuple(v_scale.shape)} {v_scale.stride()}")  # fmt: skip
    head_dim = k_codes.shape[2] * (2 if quant == "int4" else 1)
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise NotImplementedError(f"{owner}: head_dim must be a power of two for this kernel, got {head_dim}")
    span = head_dim // 2 if quant == "int4" else head_dim  # INT4 groups tile each half (the format)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or span % group_size:
        raise ValueError(f"{owner}: group_size expected a divisor of {span}, got {group_size!r}")
    scale_shape = (k_codes.shape[0], k_codes.shape[1], head_dim // group_size)
    if k_scale.shape != scale_shape:
        raise ValueError(f"{owner}: k_scale expected shape {scale_shape}, got {tuple(k_scale.shape)}")
    if not isinstance(token_idx, torch.Tensor) or token_idx.dtype not in _INDEX_DTYPES or token_idx.dim() != 1:
        got = f"{token_idx.dtype} {tuple(token_idx.shape)}" if isinstance(token_idx, torch.Tensor) else type(token_idx)
        raise ValueError(f"{owner}: token_idx expected a 1-d int32/int64 tensor, got {got}")
    if not token_idx.is_contiguous():
        raise ValueError(f"{owner}: token_idx expected a contiguous tensor, got strides {token_idx.stride()}")
    devices = {x.device for x in (k_codes, k_scale, v_codes, v_scale, token_idx)}
    if len(devices) != 1:
        raise ValueError(f"{owner}: every tensor expected on one device, got {sorted(map(str, devices))}")
