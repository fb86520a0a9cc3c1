"""The accuracy gate: a candidate config must reproduce the launcher default's outputs."""

from typing import Any, List, Optional, Sequence, Tuple

import torch

# (rtol, atol as a fraction of the reference's RMS): one or two roundings of the output dtype,
# plus tf32 dot products for float32 Triton kernels.
_DEFAULT_TOL = {
    torch.float64: (1e-6, 1e-6),
    torch.float32: (1e-3, 1e-3),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}
_FALLBACK_TOL = (1e-1, 1e-1)  # float8 and anything else floating


def collect_tensors(value: Any) -> List[torch.Tensor]:
    """Tensors in a launcher's return value (a tensor, or a tuple/list/dict of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in collect_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in collect_tensors(v)]
    return []


def mismatch(
    reference: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], tol: Optional[Tuple[float, float]] = None
) -> Optional[str]:
    """None when ``outputs`` match ``reference``, else a short reason for the log."""
    if len(reference) != len(outputs):
        return f"{len(outputs)} outputs instead of {len(reference)}"
    for i, (ref, out) in enumerate(zip(reference, outputs)):
        if ref.shape != out.shape or ref.dtype != out.dtype:
            return f"output {i} is {tuple(out.shape)}/{out.dtype}, default gave {tuple(ref.shape)}/{ref.dtype}"
        if not ref.is_floating_point():
            if not torch.equal(ref, out):
                return f"output {i} differs ({int((ref != out).sum())} elements)"
            continue
        rtol, atol = tol or _DEFAULT_TOL.get(ref.dtype, _FALLBACK_TOL)
        r, o = ref.double(), out.double()
        finite = torch.isfinite(r)
        scale = r[finite].square().mean().sqrt().item() if finite.any() else 0.0
        close = (o - r).abs() <= atol * scale + rtol * r.abs()
        close |= (o == r) | (torch.isnan(o) & torch.isnan(r))
        if not bool(close.all()):
            bad = int((~close).sum())
            worst = (o - r).abs().nan_to_num(float("inf")).max().item()
            return f"output {i}: {bad}/{r.numel()} elements off (max abs diff {worst:.3g}, rms {scale:.3g})"
    return None
