"""The INT8 / INT4 KV cache format, as float32 torch references.

Triton writers (``lightllm.kernels.kv_cache_write``) and the quantized decode kernels follow exactly this:

- A group is a contiguous run of ``group_size`` elements along ``head_dim``, per token and per kv head;
  scales are float16 ``[..., head_dim // group_size]``.
- ``scale = float16(max(absmax(group) / QMAX, 1e-7))`` (math in float32, then rounded to float16);
  ``q = clamp(round_half_even(x / float32(scale)), -QMAX, QMAX)``; dequant ``q * float32(scale)``.
- INT8: ``QMAX = 127``, codes stored as int8 ``[..., D]``. The float16 scale is then rounded *up* to 7
  significant bits (its 4 low mantissa bits cleared: ``(bits + 15) & ~15``), at most ``INT8_SCALE_MAX``, before
  the codes are taken: the decode kernel dequantizes a code with one FMA, ``(64 + (code + 128) / 16) * scale -
  72 * scale``, whose bias ``72 * scale`` is exact only so. A normal float16 scale (absmax >= 127 * 2**-14) grows
  by under 1/64, a subnormal one by under 2**-20.
- INT4: ``QMAX = 7``, nibble ``q + 8`` (1..15), "split halves" packing into uint8 ``[..., D // 2]``:
  byte ``j`` holds element ``j`` in its low nibble and element ``j + D/2`` in its high nibble.
  ``group_size`` must divide ``D / 2`` so that no group straddles the two halves.
"""

from typing import Tuple

import torch

INT8_QMAX = 127
INT4_QMAX = 7
INT4_OFFSET = 8
SCALE_MIN = 1e-7
# float16's largest: a group past QMAX x 65504 (fp32 K/V; INT8: 127 x INT8_SCALE_MAX) saturates its codes instead of a
# scale of inf (0 x inf = NaN)
SCALE_MAX = 65504.0
SCALE_DTYPE = torch.float16
# INT8 scales (above): 4 low mantissa bits zero, and at most 512, so a code times its scale (127 x 512 = 65024) and the
# decode kernel's FMA bias (72 x 512) stay inside float16
INT8_SCALE_LOW_BITS = 4
INT8_SCALE_MAX = 512.0


def check_group_size(owner: str, head_dim: int, group_size: int, int4: bool = False) -> None:
    """``ValueError`` unless ``group_size`` tiles ``head_dim`` (for INT4: each half of it, head_dim even)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{owner}: group_size expected a positive int, got {group_size!r}")
    if int4 and head_dim % 2:
        raise ValueError(f"{owner}: head_dim expected an even value for INT4, got {head_dim}")
    span = head_dim // 2 if int4 else head_dim
    if span % group_size:
        what = f"head_dim // 2 = {span} (INT4 split halves)" if int4 else f"head_dim = {span}"
        raise ValueError(f"{owner}: group_size expected a divisor of {what}, got {group_size}")


def _check_float(owner: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        got = f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{owner}: x expected a floating tensor [..., head_dim], got {got}")


def _check_codes(owner: str, q: torch.Tensor, scale: torch.Tensor, dtype, head_dim: int, group_size: int) -> None:
    if q.dtype != dtype:
        raise ValueError(f"{owner}: q expected dtype {dtype}, got {q.dtype}")
    want = (*q.shape[:-1], head_dim // group_size)
    if scale.dtype != SCALE_DTYPE or tuple(scale.shape) != want:
        raise ValueError(f"{owner}: scale expected {SCALE_DTYPE} {want}, got {scale.dtype} {tuple(scale.shape)}")


def _group_scales(x: torch.Tensor, group_size: int, qmax: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x in float32 as ``[..., G_count, group_size]``, float16 scales ``[..., G_count]``)."""
    xg = x.float().reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    top = INT8_SCALE_MAX if qmax == INT8_QMAX else SCALE_MAX
    scale = torch.clamp(xg.abs().amax(dim=-1) / qmax, SCALE_MIN, top).to(SCALE_DTYPE)
    return xg, round_up_scale_bits(scale) if qmax == INT8_QMAX else scale


def round_up_scale_bits(scale: torch.Tensor) -> torch.Tensor:
    """Positive float16 scales rounded up to a multiple of ``2 ** INT8_SCALE_LOW_BITS`` of their ulps: 7 significant
    bits for a normal float16, the INT8 format's scales."""
    step = (1 << INT8_SCALE_LOW_BITS) - 1
    bits = scale.view(torch.int16).to(torch.int32)
    return ((bits + step) & ~step).to(torch.int16).view(SCALE_DTYPE)


def _codes(xg: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    return torch.round(xg / scale.float().unsqueeze(-1)).clamp_(-qmax, qmax)


def quantize_int8_ref(x: torch.Tensor, group_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., D]`` float -> (int8 codes ``[..., D]``, float16 scales ``[..., D // group_size]``)."""
    _check_float("quantize_int8_ref", x)
    check_group_size("quantize_int8_ref", x.shape[-1], group_size)
    xg, scale = _group_scales(x, group_size, INT8_QMAX)
    q = _codes(xg, scale, INT8_QMAX).to(torch.int8).reshape(x.shape)
    return q, scale


def dequantize_int8_ref(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """int8 ``[..., D]`` codes and float16 ``[..., D // group_size]`` scales -> float32 ``[..., D]``."""
    check_group_size("dequantize_int8_ref", q.shape[-1], group_size)
    _check_codes("dequantize_int8_ref", q, scale, torch.int8, q.shape[-1], group_size)
    return (q.float().unflatten(-1, (-1, group_size)) * scale.float().unsqueeze(-1)).flatten(-2)


def quantize_int4_ref(x: torch.Tensor, group_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., D]`` float -> (uint8 packed ``[..., D // 2]``, float16 scales ``[..., D // group_size]``)."""
    _check_float("quantize_int4_ref", x)
    check_group_size("quantize_int4_ref", x.shape[-1], group_size, int4=True)
    xg, scale = _group_scales(x, group_size, INT4_QMAX)
    nib = (_codes(xg, scale, INT4_QMAX) + INT4_OFFSET).to(torch.uint8).reshape(x.shape)
    half = x.shape[-1] // 2
    return nib[..., :half] | (nib[..., half:] << 4), scale


def dequantize_int4_ref(packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """uint8 ``[..., D // 2]`` packed codes and float16 ``[..., D // group_size]`` scales -> float32 ``[..., D]``."""
    head_dim = 2 * packed.shape[-1]
    check_group_size("dequantize_int4_ref", head_dim, group_size, int4=True)
    _check_codes("dequantize_int4_ref", packed, scale, torch.uint8, head_dim, group_size)
    nib = torch.cat([packed & 15, packed >> 4], dim=-1)
    q = nib.float() - INT4_OFFSET
    return (q.unflatten(-1, (-1, group_size)) * scale.float().unsqueeze(-1)).flatten(-2)
