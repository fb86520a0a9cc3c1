"""Argument checks shared by the linear-attention kernels (gated delta rule and conv1d, decode and MTP verify): one
wording, one set of accepted values. Each check names its kernel, the argument, what is allowed and what it got."""

import torch

from lightllm.common.autotuner import PlannedInputs

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
STATE_DTYPES = (torch.float32, torch.bfloat16)  # the gated delta rule's recurrent state
HEAD_DIMS = (16, 32, 64, 128, 256)
TOKENS = (2, 3, 4, 5)  # N + 1 for --mtp_step 1-4
WARPS = (1, 2, 4, 8, 16)  # any num_warps a run_config may ask for

_GATE_INPUTS = ("q", "k", "v", "a", "b", "A_log", "dt_bias")
_UNIT_STRIDES = (1,) * len(_GATE_INPUTS)


def fail(kernel: str, name: str, expected, got):
    raise ValueError(f"{kernel}: {name} expected {expected}, got {got}")


def check_devices(kernel: str, anchor: str = "ssm_state", **tensors) -> None:
    """Every tensor on the device of ``tensors[anchor]``."""
    device = tensors[anchor].device
    for name, t in tensors.items():
        if t.device != device:
            fail(kernel, name, f"{anchor}'s device {device}", t.device)


def check_tokens(kernel: str, name: str, tokens: int) -> None:
    if tokens not in TOKENS:
        fail(kernel, name, f"T = N + 1 tokens per request in {TOKENS} (mtp_step 1-4)", tokens)


def check_state_idx(kernel: str, state_idx: torch.Tensor, batch: int) -> None:
    if state_idx.shape != (batch,) or state_idx.dtype != torch.int32:
        fail(kernel, "state_idx", f"an int32 [{batch}] tensor", f"{tuple(state_idx.shape)} {state_idx.dtype}")


def check_verify_idx(kernel: str, src_idx: torch.Tensor, dst_idx: torch.Tensor, batch: int, tokens: int) -> None:
    """A verify's slots: ``src_idx`` contiguous int32 ``[batch]``, ``dst_idx`` int32 ``[batch, tokens]`` with a
    contiguous last dim (strides of empty or one-row tensors do not matter)."""
    if src_idx.shape != (batch,) or src_idx.dtype != torch.int32 or (batch > 1 and src_idx.stride(0) != 1):
        fail(kernel, "src_idx", f"a contiguous int32 [{batch}] tensor",
             f"{tuple(src_idx.shape)} {src_idx.dtype} strides {src_idx.stride()}")  # fmt: skip
    if dst_idx.shape != (batch, tokens) or dst_idx.dtype != torch.int32 or (batch and dst_idx.stride(1) != 1):
        fail(kernel, "dst_idx", f"an int32 [{batch}, {tokens}] tensor with a contiguous last dim",
             f"{tuple(dst_idx.shape)} {dst_idx.dtype} strides {dst_idx.stride()}")  # fmt: skip


# ---- gated delta rule -------------------------------------------------------------------------------------


def check_heads_and_state(kernel: str, k_heads: int, head_k_dim: int, v_heads: int, head_v_dim: int, gate_dtype,
                          state_shape, state_dtype) -> None:  # fmt: skip
    """What the decode and the verify plan share once q's and v's shapes are parsed: grouped heads, head dims, the
    gates' dtype and the state pool ``[slots, v_heads, head_k_dim, head_v_dim]``."""
    if k_heads < 1 or v_heads % k_heads:
        fail(kernel, "v_heads", f"a multiple of k_heads ({k_heads})", v_heads)
    if head_k_dim not in HEAD_DIMS:
        fail(kernel, "head_k_dim", f"one of {HEAD_DIMS}", head_k_dim)
    if head_v_dim not in HEAD_DIMS:
        fail(kernel, "head_v_dim", f"one of {HEAD_DIMS}", head_v_dim)
    if gate_dtype not in DTYPES:
        fail(kernel, "a/b", f"one of {DTYPES}", gate_dtype)
    if len(state_shape) != 4 or tuple(state_shape[1:]) != (v_heads, head_k_dim, head_v_dim):
        fail(kernel, "ssm_state", f"a [slots, {v_heads}, {head_k_dim}, {head_v_dim}] tensor", tuple(state_shape))
    if state_dtype not in STATE_DTYPES:
        fail(kernel, "ssm_state", f"one of {STATE_DTYPES}", state_dtype)


def check_bv_config(kernel: str, run_config, head_v_dim: int) -> None:
    """Any config the kernel compiles for (the tuning candidates are a subset): head_v_dim is a power of two, so is
    BV."""
    if run_config is None:
        return
    bv = run_config.get("BV") if isinstance(run_config, dict) else None
    if not (isinstance(bv, int) and bv > 0 and head_v_dim % bv == 0 and run_config.get("num_warps") in WARPS):
        fail(kernel, "run_config", f"a dict with BV dividing {head_v_dim} and num_warps in {WARPS}", run_config)


class GateLayerInputs:
    """What a gated delta plan checks per layer (a layer's tensors may be other views of other shapes' buffers):
    the planned shapes and dtypes, last dims contiguous, each state slot contiguous, ``out`` of v's shape and q's
    dtype. ``v_shape`` ends ``[..., v_heads, head_v_dim]``; a/b are v's shape without its last dim."""

    __slots__ = ("kernel", "planned", "slot_strides")

    def __init__(self, kernel: str, q_shape, v_shape, dtype, gate_dtype, state_shape, state_dtype):
        self.kernel = kernel
        self.slot_strides = (state_shape[2] * state_shape[3], state_shape[3], 1)
        gate_shape, heads = v_shape[:-1], v_shape[-2:-1]
        self.planned = PlannedInputs(
            kernel,
            q=(q_shape, dtype),
            k=(q_shape, dtype),
            v=(v_shape, dtype),
            a=(gate_shape, gate_dtype),
            b=(gate_shape, gate_dtype),
            A_log=(heads,),
            dt_bias=(heads,),
            ssm_state=(state_shape, state_dtype),
        )

    def output(self, q, k, v, a, b, A_log, dt_bias, ssm_state, out) -> torch.Tensor:
        """Checks one layer's tensors; returns ``out`` (made when None)."""
        kernel = self.kernel
        self.planned.check(
            (q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype), (a.shape, a.dtype), (b.shape, b.dtype),
            (A_log.shape,), (dt_bias.shape,), (ssm_state.shape, ssm_state.dtype),
        )  # fmt: skip
        lasts = (q.stride(-1), k.stride(-1), v.stride(-1), a.stride(-1), b.stride(-1), A_log.stride(-1),
                 dt_bias.stride(-1))  # fmt: skip
        if lasts != _UNIT_STRIDES:
            i = next(i for i, stride in enumerate(lasts) if stride != 1)
            fail(kernel, _GATE_INPUTS[i], "a contiguous last dim", f"last-dim stride {lasts[i]}")
        if ssm_state.stride()[1:] != self.slot_strides:
            fail(kernel, "ssm_state", f"each slot contiguous (strides [..., {', '.join(map(str, self.slot_strides))}])",
                 ssm_state.stride())  # fmt: skip
        if out is None:
            return torch.empty(v.shape, dtype=q.dtype, device=q.device)
        if out.shape != v.shape or out.dtype != q.dtype or out.stride(-1) != 1:
            fail(kernel, "out", f"a {tuple(v.shape)} {q.dtype} tensor with a contiguous last dim",
                 f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")  # fmt: skip
        return out


# ---- conv1d -----------------------------------------------------------------------------------------------


def check_conv_state(kernel: str, channels: int, state_shape, state_dtype, weight_dtype) -> None:
    if len(state_shape) != 3 or state_shape[1] < 1 or state_shape[2] != channels:
        fail(kernel, "conv_state", f"a [slots, K - 1 >= 1, {channels}] tensor", tuple(state_shape))
    for name, t in (("conv_state", state_dtype), ("weight", weight_dtype)):
        if t not in DTYPES:
            fail(kernel, name, f"one of {DTYPES}", t)


def check_block_c_config(kernel: str, run_config) -> None:
    if run_config is None:
        return
    block = run_config.get("BLOCK_C") if isinstance(run_config, dict) else None
    power_of_two = isinstance(block, int) and block >= 16 and block & (block - 1) == 0
    if not (power_of_two and run_config.get("num_warps") in WARPS):
        fail(kernel, "run_config", f"a dict with BLOCK_C a power of two >= 16 and num_warps in {WARPS}", run_config)


def check_conv_layouts(kernel: str, x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> None:
    """Per layer: x and the conv state with a contiguous last dim, the weight contiguous."""
    for name, t in (("x", x), ("conv_state", conv_state)):
        if t.stride(-1) != 1:
            fail(kernel, name, "a contiguous last dim", f"strides {t.stride()}")
    if not weight.is_contiguous():
        fail(kernel, "weight", "contiguous", f"strides {weight.stride()}")


class ConvLayerInputs:
    """What a conv plan (update, verify, prefill) checks per layer: the planned shapes and dtypes of x, the conv
    state and the weight (``[channels, K]``, ``K`` from the state's ``K - 1`` rows), their layouts
    (:func:`check_conv_layouts`), and ``out`` of x's shape and dtype; without ``out``, the plan's output buffer
    (``kernels/step_buffer.py``) or, with none, a new tensor."""

    __slots__ = ("kernel", "planned", "buffer")

    def __init__(self, kernel: str, x_shape, dtype, state_shape, state_dtype, weight_dtype, buffer=None):
        self.kernel, self.buffer = kernel, buffer
        weight_shape = torch.Size((x_shape[-1], state_shape[1] + 1))
        self.planned = PlannedInputs(kernel, x=(x_shape, dtype), conv_state=(state_shape, state_dtype),
                                     weight=(weight_shape, weight_dtype))  # fmt: skip

    def output(self, x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, out=None) -> torch.Tensor:
        """Checks one layer's tensors; returns ``out`` (made when None)."""
        self.planned.check((x.shape, x.dtype), (conv_state.shape, conv_state.dtype), (weight.shape, weight.dtype))
        check_conv_layouts(self.kernel, x, conv_state, weight)
        if out is None:
            buffer = self.buffer
            return buffer.get(x.device) if buffer is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
            fail(self.kernel, "out", f"a {tuple(x.shape)} {x.dtype} tensor with a contiguous last dim",
                 f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")  # fmt: skip
        return out
