"""Argument checks shared by the gated delta rule kernels (one-token decode and the MTP verify): one wording."""

import torch

_GATE_INPUTS = ("q", "k", "v", "a", "b", "A_log", "dt_bias")
_UNIT_STRIDES = (1,) * len(_GATE_INPUTS)


def fail(kernel: str, name: str, expected, got):
    raise ValueError(f"{kernel}: {name} expected {expected}, got {got}")


def check_devices(kernel: str, **tensors) -> None:
    """Every tensor on ``ssm_state``'s device."""
    device = tensors["ssm_state"].device
    for name, t in tensors.items():
        if t.device != device:
            fail(kernel, name, f"ssm_state's device {device}", t.device)


def run_output(kernel: str, q, k, v, a, b, A_log, dt_bias, ssm_state, slot_strides, out) -> torch.Tensor:
    """What a planned run checks per layer (a layer's tensors may be other views): last dims contiguous, each state
    slot contiguous, ``out`` (made when None) of v's shape and q's dtype. Returns ``out``."""
    lasts = (q.stride(-1), k.stride(-1), v.stride(-1), a.stride(-1), b.stride(-1), A_log.stride(-1),
             dt_bias.stride(-1))  # fmt: skip
    if lasts != _UNIT_STRIDES:
        i = next(i for i, stride in enumerate(lasts) if stride != 1)
        fail(kernel, _GATE_INPUTS[i], "a contiguous last dim", f"last-dim stride {lasts[i]}")
    if ssm_state.stride()[1:] != slot_strides:
        fail(kernel, "ssm_state", f"each slot contiguous (strides [..., {', '.join(map(str, slot_strides))}])",
             ssm_state.stride())  # fmt: skip
    if out is None:
        return torch.empty(v.shape, dtype=q.dtype, device=q.device)
    if out.shape != v.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        fail(kernel, "out", f"a {tuple(v.shape)} {q.dtype} tensor with a contiguous last dim",
             f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")  # fmt: skip
    return out
