"""Write the K/V of ``n`` new tokens into one layer of a KV pool at given token slots.

Three writers, one program per (token, kv head), each with a torch reference of the same arguments:

- ``write_kv``: plain copy (float16 / bfloat16 / float32 pool of the input's dtype).
- ``write_kv_int8`` / ``write_kv_int4``: quantize in-kernel to the format of
  ``lightllm.common.kv_cache.quant`` bit for bit (float32 math, IEEE division, scale rounded to float16
  before dividing, round half to even).
"""

import torch
import triton
import triton.language as tl

from lightllm.common.autotuner import PlannedInputs
from lightllm.common.kv_cache.quant import (
    INT4_OFFSET,
    INT4_QMAX,
    INT8_QMAX,
    INT8_SCALE_LOW_BITS,
    INT8_SCALE_MAX,
    SCALE_DTYPE,
    SCALE_MAX,
    SCALE_MIN,
    check_group_size,
    quantize_int4_ref,
    quantize_int8_ref,
)
from lightllm.kernels.launch_math import next_power_of_2
from lightllm.kernels.direct_launch import DirectLaunch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
# Adding then subtracting 1.5 * 2**23 rounds a float32 of magnitude < 2**22 to an integer, ties to even
# (IEEE round-to-nearest adds; libdevice.rint would do the same but the interpreter lacks it).
_ROUND_MAGIC = tl.constexpr(12582912.0)
_SCALE_MIN = tl.constexpr(SCALE_MIN)
_SCALE_MAX = tl.constexpr(SCALE_MAX)
_INT8_QMAX = tl.constexpr(INT8_QMAX)
_INT8_SCALE_MAX = tl.constexpr(INT8_SCALE_MAX)
_INT8_SCALE_STEP = tl.constexpr((1 << INT8_SCALE_LOW_BITS) - 1)


@triton.jit
def _write_kv_kernel(
    K_new,
    V_new,
    K_cache,
    V_cache,
    Token_idx,
    stride_kn_t,
    stride_kn_h,
    stride_vn_t,
    stride_vn_h,
    stride_kc_t,
    stride_kc_h,
    stride_vc_t,
    stride_vc_h,
    head_dim,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    dst = tl.load(Token_idx + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < head_dim
    k = tl.load(K_new + t * stride_kn_t + h * stride_kn_h + offs, mask=mask)
    tl.store(K_cache + dst * stride_kc_t + h * stride_kc_h + offs, k, mask=mask)
    v = tl.load(V_new + t * stride_vn_t + h * stride_vn_h + offs, mask=mask)
    tl.store(V_cache + dst * stride_vc_t + h * stride_vc_h + offs, v, mask=mask)


_WRITE_KV = DirectLaunch(_write_kv_kernel)


@triton.jit
def _quantize_groups(x, NUM_GROUPS: tl.constexpr, GROUP: tl.constexpr, QMAX: tl.constexpr):
    """float32 ``[NUM_GROUPS * GROUP]`` -> (integer-valued float32 codes, same shape; float16 scales)."""
    xg = tl.reshape(x, (NUM_GROUPS, GROUP))
    amax = tl.max(tl.abs(xg), axis=1)
    scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)), _SCALE_MIN)
    if QMAX == _INT8_QMAX:  # 7 significant bits, rounded up, at most 512 (common/kv_cache/quant.py)
        bits = tl.minimum(scale, _INT8_SCALE_MAX).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        scale = ((bits + _INT8_SCALE_STEP) & ~_INT8_SCALE_STEP).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        scale = tl.minimum(scale, _SCALE_MAX).to(tl.float16)  # saturating codes, not an inf scale (0 x inf = NaN)
    scale_b = tl.broadcast_to(scale.to(tl.float32)[:, None], (NUM_GROUPS, GROUP))
    y = tl.math.div_rn(xg, scale_b)
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)  # clamp before rounding: both bounds are integers
    q = (y + _ROUND_MAGIC) - _ROUND_MAGIC
    return tl.reshape(q, (NUM_GROUPS * GROUP,)), scale


@triton.jit
def _write_int8_head(src, dst, dst_scale, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, QMAX: tl.constexpr):
    offs = tl.arange(0, HEAD_DIM)
    x = tl.load(src + offs).to(tl.float32)
    q, scale = _quantize_groups(x, HEAD_DIM // GROUP, GROUP, QMAX)
    tl.store(dst + offs, q.to(tl.int8))
    tl.store(dst_scale + tl.arange(0, HEAD_DIM // GROUP), scale)


@triton.jit
def _write_int4_head(
    src, dst, dst_scale, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, QMAX: tl.constexpr, OFFSET: tl.constexpr
):
    HALF: tl.constexpr = HEAD_DIM // 2
    HALF_GROUPS: tl.constexpr = HALF // GROUP
    offs = tl.arange(0, HALF)
    q_lo, s_lo = _quantize_groups(tl.load(src + offs).to(tl.float32), HALF_GROUPS, GROUP, QMAX)
    q_hi, s_hi = _quantize_groups(tl.load(src + HALF + offs).to(tl.float32), HALF_GROUPS, GROUP, QMAX)
    nib_lo = (q_lo + OFFSET).to(tl.int32)
    nib_hi = (q_hi + OFFSET).to(tl.int32)
    tl.store(dst + offs, (nib_lo | (nib_hi << 4)).to(tl.uint8))
    g = tl.arange(0, HALF_GROUPS)
    tl.store(dst_scale + g, s_lo)
    tl.store(dst_scale + HALF_GROUPS + g, s_hi)


@triton.jit
def _write_kv_quant_kernel(
    K_new,
    V_new,
    K_cache,
    V_cache,
    K_scale,
    V_scale,
    Token_idx,
    stride_kn_t,
    stride_kn_h,
    stride_vn_t,
    stride_vn_h,
    stride_kc_t,
    stride_kc_h,
    stride_vc_t,
    stride_vc_h,
    stride_ks_t,
    stride_ks_h,
    stride_vs_t,
    stride_vs_h,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    INT4: tl.constexpr,
    QMAX: tl.constexpr,
    OFFSET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    dst = tl.load(Token_idx + t).to(tl.int64)
    k_src = K_new + t * stride_kn_t + h * stride_kn_h
    v_src = V_new + t * stride_vn_t + h * stride_vn_h
    k_dst = K_cache + dst * stride_kc_t + h * stride_kc_h
    v_dst = V_cache + dst * stride_vc_t + h * stride_vc_h
    k_sc = K_scale + dst * stride_ks_t + h * stride_ks_h
    v_sc = V_scale + dst * stride_vs_t + h * stride_vs_h
    if INT4:
        _write_int4_head(k_src, k_dst, k_sc, HEAD_DIM, GROUP, QMAX, OFFSET)
        _write_int4_head(v_src, v_dst, v_sc, HEAD_DIM, GROUP, QMAX, OFFSET)
    else:
        _write_int8_head(k_src, k_dst, k_sc, HEAD_DIM, GROUP, QMAX)
        _write_int8_head(v_src, v_dst, v_sc, HEAD_DIM, GROUP, QMAX)


_WRITE_KV_QUANT = DirectLaunch(_write_kv_quant_kernel)


def _num_warps(head_dim: int) -> int:
    return 1 if head_dim <= 128 else 2


def _launch_quant(k_new, v_new, k_cache, v_cache, k_scale, v_scale, token_idx, group_size, int4):
    n, kv_heads, head_dim = k_new.shape
    if n == 0:
        return
    _WRITE_KV_QUANT.launch(
        (n, kv_heads),
        k_new,
        v_new,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        token_idx,
        *k_new.stride()[:2],
        *v_new.stride()[:2],
        *k_cache.stride()[:2],
        *v_cache.stride()[:2],
        *k_scale.stride()[:2],
        *v_scale.stride()[:2],
        HEAD_DIM=head_dim,
        GROUP=group_size,
        INT4=int4,
        QMAX=INT4_QMAX if int4 else INT8_QMAX,
        OFFSET=INT4_OFFSET,
        num_warps=_num_warps(head_dim),
    )


def write_kv(k_new, v_new, k_cache, v_cache, token_idx) -> None:
    """``k_cache[token_idx] = k_new``, ``v_cache[token_idx] = v_new``, in place.

    Args:
        k_new, v_new: ``[n, kv_heads, head_dim]`` float16/bfloat16/float32, last dim contiguous.
        k_cache, v_cache: one layer of a ``KVPool``, ``[num_tokens, kv_heads, head_dim]`` of the same dtype.
        token_idx: int32/int64 ``[n]`` on the same device; distinct, in ``[0, num_tokens)`` (not checked).
    """
    _check_new("write_kv", k_new, v_new, token_idx)
    _check_cache("write_kv", "k_cache", k_cache, k_new.dtype, k_new.shape[1:], k_new.device)
    _check_cache("write_kv", "v_cache", v_cache, k_new.dtype, k_new.shape[1:], k_new.device)
    _launch_plain(k_new, v_new, k_cache, v_cache, token_idx)


def _launch_plain(k_new, v_new, k_cache, v_cache, token_idx) -> None:
    n, kv_heads, head_dim = k_new.shape
    if n == 0:
        return
    _WRITE_KV.launch(
        (n, kv_heads),
        k_new,
        v_new,
        k_cache,
        v_cache,
        token_idx,
        *k_new.stride()[:2],
        *v_new.stride()[:2],
        *k_cache.stride()[:2],
        *v_cache.stride()[:2],
        head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        num_warps=_num_warps(head_dim),
    )


def write_kv_int8(k_new, v_new, k_cache, v_cache, k_scale, v_scale, token_idx, group_size: int) -> None:
    """Quantize ``k_new`` / ``v_new`` to INT8 and write codes and scales at ``token_idx``, in place.

    Args:
        k_new, v_new: ``[n, kv_heads, head_dim]`` float16/bfloat16/float32, last dim contiguous; head_dim and
            group_size powers of two, group_size dividing head_dim.
        k_cache, v_cache: one layer of an ``Int8KVPool``, int8 ``[num_tokens, kv_heads, head_dim]``.
        k_scale, v_scale: float16 ``[num_tokens, kv_heads, head_dim // group_size]``.
        token_idx: int32/int64 ``[n]`` on the same device; distinct, in ``[0, num_tokens)`` (not checked).
    """
    _check_quant("write_kv_int8", k_new, v_new, k_cache, v_cache, k_scale, v_scale, token_idx, group_size, False)
    _launch_quant(k_new, v_new, k_cache, v_cache, k_scale, v_scale, token_idx, group_size, int4=False)


def write_kv_int4(k_new, v_new, k_cache, v_cache, k_scale, v_scale, token_idx, group_size: int) -> None:
    """Quantize ``k_new`` / ``v_new`` to packed INT4 and write codes and scales at ``token_idx``, in place.

    Args:
        k_new, v_new: ``[n, kv_heads, head_dim]`` float16/bfloat16/float32, last dim contiguous; head_dim and
            group_size powers of two, group_size dividing head_dim // 2.
        k_cache, v_cache: one layer of an ``Int4KVPool``, uint8 ``[num_tokens, kv_heads, head_dim // 2]``.
        k_scale, v_scale: float16 ``[num_tokens, kv_heads, head_dim // group_size]``.
        token_idx: int32/int64 ``[n]`` on the same device; distinct, in ``[0, num_tokens)`` (not checked).
    """
    _check_quant("write_kv_int4", k_new, v_new, k_cache, v_cache, k_scale, v_scale, token_idx, group_size, True)
    _launch_quant(k_new, v_new, k_cache, v_cache, k_scale, v_scale, token_idx, group_size, int4=True)


class KVLayers:
    """A float pool's per-layer K and V views, made once per pool, for a kernel that writes a layer's new K/V in its
    own launch (``QKNormRopePlan(kv_layers=...)``): ``k[layer]`` and ``v[layer]`` are contiguous ``[num_tokens,
    kv_heads, head_dim]`` tensors of one dtype and device, checked here once, so a step's plan checks the summary
    and its layers only index a tuple.

    Args: ``k_pool``, ``v_pool``: ``[num_layers, num_tokens, kv_heads, head_dim]`` float16/bfloat16/float32,
    contiguous (a ``KVPool``'s ``k`` and ``v``).
    """

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor):
        for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
            if pool.dim() != 4 or pool.dtype not in _DTYPES or not pool.is_contiguous():
                raise ValueError(f"KV layers: {name} expected a contiguous [num_layers, num_tokens, kv_heads, "
                                 f"head_dim] tensor of {_DTYPES}, got {pool.dtype} {tuple(pool.shape)} strides "
                                 f"{pool.stride()}")  # fmt: skip
        if v_pool.shape != k_pool.shape or v_pool.dtype != k_pool.dtype or v_pool.device != k_pool.device:
            raise ValueError(f"KV layers: v_pool expected k_pool's {k_pool.dtype} {tuple(k_pool.shape)} on "
                             f"{k_pool.device}, got {v_pool.dtype} {tuple(v_pool.shape)} on "
                             f"{v_pool.device}")  # fmt: skip
        self.k, self.v = tuple(k_pool.unbind(0)), tuple(v_pool.unbind(0))
        self.num_tokens, self.kv_heads, self.head_dim = k_pool.shape[1:]
        self.dtype, self.device = k_pool.dtype, k_pool.device


class KVWritePlan:
    """The KV writes of one forward, made at its first layer's write from that layer's tensors: every check of
    :func:`write_kv` (``quant`` "none"), :func:`write_kv_int8` ("int8") or :func:`write_kv_int4` ("int4") runs once
    here; :meth:`run` checks only what a later layer can change (shapes, dtypes, last-dim strides; the devices are
    the first layer's) and launches. ``token_idx`` is fixed for the forward.
    """

    def __init__(self, quant, k_new, v_new, k_cache, v_cache, token_idx, k_scale=None, v_scale=None, group_size=8):
        if quant not in ("none", "int8", "int4"):
            raise ValueError(f"KV write plan: quant expected 'none', 'int8' or 'int4', got {quant!r}")
        owner = "write_kv" if quant == "none" else f"write_kv_{quant}"
        if quant == "none":
            _check_new(owner, k_new, v_new, token_idx)
            _check_cache(owner, "k_cache", k_cache, k_new.dtype, k_new.shape[1:], k_new.device)
            _check_cache(owner, "v_cache", v_cache, k_new.dtype, k_new.shape[1:], k_new.device)
            scales = {}
        else:
            _check_quant(
                owner, k_new, v_new, k_cache, v_cache, k_scale, v_scale, token_idx, group_size, quant == "int4"
            )
            scales = dict(k_scale=(k_scale.shape, k_scale.dtype), v_scale=(v_scale.shape, v_scale.dtype))
        self.quant, self.token_idx, self.group_size = quant, token_idx, group_size
        self.inputs = PlannedInputs(owner, k_new=(k_new.shape, k_new.dtype), v_new=(v_new.shape, v_new.dtype),
                                    k_cache=(k_cache.shape, k_cache.dtype), v_cache=(v_cache.shape, v_cache.dtype),
                                    **scales)  # fmt: skip

    def run(self, k_new, v_new, k_cache, v_cache, k_scale=None, v_scale=None) -> None:
        tensors = (k_new, v_new, k_cache, v_cache)
        if self.quant != "none":
            tensors += (k_scale, v_scale)
        self.inputs.check(*[(t.shape, t.dtype) for t in tensors])
        if any(t.stride(-1) != 1 for t in tensors):
            raise ValueError(f"{self.inputs.kernel}: every tensor expected a contiguous last dim, got strides "
                             f"{[t.stride() for t in tensors]}")  # fmt: skip
        if self.quant == "none":
            _launch_plain(k_new, v_new, k_cache, v_cache, self.token_idx)
        else:
            _launch_quant(k_new, v_new, k_cache, v_cache, k_scale, v_scale, self.token_idx, self.group_size,
                          int4=self.quant == "int4")  # fmt: skip


def _check_new(owner: str, k_new, v_new, token_idx) -> None:
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES:
            raise ValueError(f"{owner}: {name} expected a tensor of {_DTYPES}, got {getattr(x, 'dtype', type(x))}")
        if x.dim() != 3 or x.stride(-1) != 1:
            raise ValueError(
                f"{owner}: {name} expected [n, kv_heads, head_dim] with a contiguous last dim, "
                f"got shape {tuple(x.shape)} strides {x.stride()}"
            )
    if v_new.shape != k_new.shape or v_new.dtype != k_new.dtype or v_new.device != k_new.device:
        raise ValueError(
            f"{owner}: v_new expected {k_new.dtype} {tuple(k_new.shape)} on {k_new.device} like k_new, "
            f"got {v_new.dtype} {tuple(v_new.shape)} on {v_new.device}"
        )
    if not isinstance(token_idx, torch.Tensor) or token_idx.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{owner}: token_idx expected int32/int64, got {getattr(token_idx, 'dtype', token_idx)}")
    if tuple(token_idx.shape) != (k_new.shape[0],) or token_idx.device != k_new.device:
        raise ValueError(
            f"{owner}: token_idx expected [{k_new.shape[0]}] on {k_new.device}, "
            f"got {tuple(token_idx.shape)} on {token_idx.device}"
        )
    if not token_idx.is_contiguous():
        raise ValueError(f"{owner}: token_idx expected a contiguous tensor, got strides {token_idx.stride()}")


def _check_cache(owner: str, name: str, cache, dtype, inner_shape, device) -> None:
    want = ("num_tokens", *inner_shape)
    if (
        not isinstance(cache, torch.Tensor)
        or cache.dtype != dtype
        or cache.dim() != len(want)
        or tuple(cache.shape[1:]) != tuple(inner_shape)
        or cache.device != device
        or cache.stride(-1) != 1
    ):
        got = f"{cache.dtype} {tuple(cache.shape)} on {cache.device}" if isinstance(cache, torch.Tensor) else cache
        raise ValueError(
            f"{owner}: {name} expected {dtype} [{', '.join(map(str, want))}] on {device} with a contiguous last dim, "
            f"got {got}"
        )


def _check_quant(owner, k_new, v_new, k_cache, v_cache, k_scale, v_scale, token_idx, group_size, int4) -> None:
    _check_new(owner, k_new, v_new, token_idx)
    _, kv_heads, head_dim = k_new.shape
    check_group_size(owner, head_dim, group_size, int4=int4)
    for name, value in (("head_dim", head_dim), ("group_size", group_size)):
        if value & (value - 1):
            raise NotImplementedError(f"{owner}: {name} must be a power of two for this kernel, got {value}")
    code_dtype, code_dim = (torch.uint8, head_dim // 2) if int4 else (torch.int8, head_dim)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_cache(owner, name, cache, code_dtype, (kv_heads, code_dim), k_new.device)
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        _check_cache(owner, name, scale, SCALE_DTYPE, (kv_heads, head_dim // group_size), k_new.device)
    if not k_cache.shape[0] == v_cache.shape[0] == k_scale.shape[0] == v_scale.shape[0]:
        raise ValueError(
            f"{owner}: k_cache, v_cache, k_scale, v_scale expected the same num_tokens, got "
            f"{k_cache.shape[0]}, {v_cache.shape[0]}, {k_scale.shape[0]}, {v_scale.shape[0]}"
        )


def write_kv_ref(k_new, v_new, k_cache, v_cache, token_idx) -> None:
    """Torch reference of ``write_kv``."""
    idx = token_idx.long()
    k_cache[idx] = k_new.to(k_cache.dtype)
    v_cache[idx] = v_new.to(v_cache.dtype)


def write_kv_int8_ref(k_new, v_new, k_cache, v_cache, k_scale, v_scale, token_idx, group_size: int) -> None:
    """Torch reference of ``write_kv_int8`` (``quantize_int8_ref`` per token and head)."""
    _write_quantized_ref(quantize_int8_ref, k_new, v_new, k_cache, v_cache, k_scale, v_scale, token_idx, group_size)


def write_kv_int4_ref(k_new, v_new, k_cache, v_cache, k_scale, v_scale, token_idx, group_size: int) -> None:
    """Torch reference of ``write_kv_int4`` (``quantize_int4_ref`` per token and head)."""
    _write_quantized_ref(quantize_int4_ref, k_new, v_new, k_cache, v_cache, k_scale, v_scale, token_idx, group_size)


def _write_quantized_ref(quantize, k_new, v_new, k_cache, v_cache, k_scale, v_scale, token_idx, group_size):
    idx = token_idx.long()
    for new, cache, scale in ((k_new, k_cache, k_scale), (v_new, v_cache, v_scale)):
        codes, s = quantize(new, group_size)
        cache[idx] = codes
        scale[idx] = s
