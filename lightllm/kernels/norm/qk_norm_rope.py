"""Per-head q/k RMSNorm and rotary embedding in one launch over the fused qkv projection (Qwen3, Qwen3.5).

Reads the q and k heads of ``qkv [tokens, q_heads * Wq + 2 * kv_heads * D]`` in place (v is not touched), gathers
each token's cos/sin rows by position and writes ``q [tokens, q_heads, D]`` and ``k [tokens, kv_heads, D]``.
``Wq`` is ``D``, or ``2 * D`` for gated attention (Qwen3.5: each q head is ``[query | gate]``; the gate is not
read). Rotary turns the first ``R`` dims of each head (``R``: the tables' width; Qwen3.5's partial rotary), the
rest pass through. Rounding as transformers: the norm in float32 then the weight in the order its dtype says
(:func:`lightllm.kernels.norm.rmsnorm.rmsnorm_ref`: Qwen3's cast-then-scale, Qwen3.5's float32 ``1 + w``);
rotary in the model dtype (``x * cos`` and ``rotate_half(x) * sin`` each rounded, then their sum).

With a float KV pool's layers (``QKNormRopePlan(kv_layers=..., token_idx=...)``) the same launch also writes each
token's k and v into its slot of the layer's cache (what ``kv_cache_write.write_kv`` would write after it): one
launch per layer fewer in an eager step. Reference: :func:`qk_norm_rope_kv_ref`.

Tuned as a GENERAL kernel: BLOCK_H (heads per program) and num_warps per token count.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from lightllm.common.autotuner import AutotuneKernelType, PlannedInputs, autotune
from lightllm.kernels.norm.rmsnorm import rmsnorm_ref, scale_normed
from lightllm.kernels.block_configs import head_block_configs, head_block_default
from lightllm.kernels.launch_math import cdiv, next_power_of_2
from lightllm.kernels.direct_launch import DirectLaunch
from lightllm.kernels.kv_cache_write import KVLayers, write_kv_ref
from lightllm.kernels.step_buffer import StepBuffer
from lightllm.kernels.pdl import pdl_release, pdl_wait

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_POSITION_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _qk_norm_rope_kernel(QKV, QW, KW, Cos, Sin, Pos, Q, K, K_cache, V_cache, Token_idx, stride_qkv, stride_cs, eps,
                         Q_HEADS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, Q_WIDTH: tl.constexpr,
                         ROT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                         WRITE_KV: tl.constexpr, USE_PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(USE_PDL)
    # q [tokens, Q_HEADS, D], k [tokens, HEADS - Q_HEADS, D] and the caches [slots, HEADS - Q_HEADS, D] are
    # contiguous: their strides need no arguments.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # q heads first, then k heads, as in qkv's rows
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    half = ROT // 2  # constexpr arithmetic: a constant
    # rotate_half over the first ROT dims: -x[d + half] | x[d - half]; the other dims pass through
    partner = tl.where(d < half, d + half, tl.where(d < ROT, d - half, d))
    sign = tl.where(d < half, -1.0, 1.0)
    mask = (h < HEADS)[:, None] & d_mask[None, :]
    is_q = (h < Q_HEADS)[:, None]

    start = tl.where(h < Q_HEADS, h * Q_WIDTH, Q_HEADS * Q_WIDTH + (h - Q_HEADS) * D)
    row = QKV + t * stride_qkv + start[:, None]
    x = tl.load(row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    w = tl.where(is_q, tl.load(QW + d, mask=d_mask)[None, :], tl.load(KW + d, mask=d_mask)[None, :])
    qw_partner = tl.load(QW + partner, mask=d_mask)[None, :]
    w_partner = tl.where(is_q, qw_partner, tl.load(KW + partner, mask=d_mask)[None, :])
    dt = QKV.dtype.element_ty
    normed = scale_normed(x * rstd, w, dt).to(dt).to(tl.float32)
    normed_partner = scale_normed(x_partner * rstd, w_partner, dt).to(dt).to(tl.float32)

    pos = tl.load(Pos + t).to(tl.int64)
    rot_mask = d < ROT
    cos = tl.load(Cos + pos * stride_cs + d, mask=rot_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Sin + pos * stride_cs + d, mask=rot_mask, other=0.0).to(tl.float32)[None, :]
    rotated = (normed * cos).to(dt).to(tl.float32) + (sign[None, :] * normed_partner * sin).to(dt).to(tl.float32)
    y = tl.where(rot_mask[None, :], rotated, normed).to(dt)

    pdl_release(USE_PDL)
    q_ptr = Q + t * (Q_HEADS * D) + h[:, None] * D + d[None, :]
    tl.store(q_ptr, y.to(Q.dtype.element_ty), mask=mask & is_q)
    k_ptr = K + t * ((HEADS - Q_HEADS) * D) + (h - Q_HEADS)[:, None] * D + d[None, :]
    is_k = mask & (h >= Q_HEADS)[:, None]
    tl.store(k_ptr, y.to(K.dtype.element_ty), mask=is_k)
    if WRITE_KV:  # the KV cache write in this launch: k as stored above, v (after the k heads in qkv) as is; the
        # caches share qkv's dtype (the plan checks)
        kv_heads = HEADS - Q_HEADS
        dst = tl.load(Token_idx + t).to(tl.int64) * (kv_heads * D) + (h - Q_HEADS)[:, None] * D + d[None, :]
        tl.store(K_cache + dst, y, mask=is_k)
        v = tl.load(row + kv_heads * D + d[None, :], mask=is_k)
        tl.store(V_cache + dst, v, mask=is_k)


_QK_NORM_ROPE = DirectLaunch(_qk_norm_rope_kernel)


def _configs(q_out, k_out):
    return head_block_configs(q_out.shape[1] + k_out.shape[1])


def _static_key(qkv, q_weight, cos, q_out, k_out, k_cache):
    d, q_heads, kv_heads = q_out.shape[-1], q_out.shape[1], k_out.shape[1]
    return {"D": d, "q_heads": q_heads, "kv_heads": kv_heads, "dtype": str(qkv.dtype),
            "w_dtype": str(q_weight.dtype), "rotary_dim": cos.shape[-1],
            "gated": qkv.shape[-1] == (2 * q_heads + 2 * kv_heads) * d, "kv_write": k_cache is not None}  # fmt: skip


def _run_key(qkv):
    return qkv.shape[0]


@autotune(
    kernel_name="qk_norm_rope",
    configs_gen_func=_configs,
    static_key_func=_static_key,
    run_key_func=_run_key,
    kernel_type=AutotuneKernelType.GENERAL,
    output_args=("q_out", "k_out"),
)
def _launch_qk_norm_rope(qkv, q_weight, k_weight, cos, sin, positions, eps, q_out, k_out, k_cache=None, v_cache=None,
                         token_idx=None, run_config=None):  # fmt: skip
    # q_out, k_out and the caches contiguous (the plan allocates q/k and checks the caches): few runtime arguments
    # keep the launch cheap. The cache writes are not ``mutates_args``: a candidate writes the same values to the
    # same slots as the one before it, so nothing needs restoring (and a layer's cache is never cloned).
    tokens, q_heads, d = q_out.shape
    kv_heads = k_out.shape[1]
    heads = q_heads + kv_heads
    cfg = run_config or head_block_default(heads)
    if tokens > 0:
        grid = (tokens, cdiv(heads, cfg["BLOCK_H"]))
        q_width = (qkv.shape[-1] - 2 * kv_heads * d) // q_heads  # d, or 2 * d with the gate beside each q head
        _QK_NORM_ROPE.launch(grid, qkv, q_weight, k_weight, cos, sin, positions, q_out, k_out, k_cache, v_cache,
                             token_idx, qkv.stride(0), cos.stride(0), eps, q_heads, heads, d, q_width, cos.shape[-1],
                             cfg["BLOCK_H"], next_power_of_2(d), k_cache is not None,
                             num_warps=cfg["num_warps"])  # fmt: skip
    return q_out, k_out


class QKNormRopePlan:
    """q/k norm + rotary of one step's shapes (every layer runs it): checked once here, the tuned config resolved
    at the first :meth:`run`. The step's ``positions`` and the model's ``cos``/``sin`` tables are fixed here;
    ``run`` checks only what a layer can change: qkv's shape, dtype and strides, the norm weights.

    Args:
        tokens, q_heads, kv_heads, head_dim: qkv is ``[tokens, (q_heads + 2 * kv_heads) * head_dim]``, or
            ``[tokens, (2 * q_heads + 2 * kv_heads) * head_dim]`` when ``gated``.
        dtype: qkv's (the model's) dtype; the tables share it.
        cos, sin: ``[max_positions, R]`` of ``dtype``, last dim contiguous: the first ``R`` dims of each head
            rotate (``R`` even, at most ``head_dim``).
        positions: int32/int64 ``[tokens]``, each below ``max_positions`` (not checked on the device).
        eps: the norm's epsilon; ``run_config`` bypasses tuning.
        gated: each q head of qkv is ``[query | gate]``, ``2 * head_dim`` wide (Qwen3.5's gated attention).
        weight_dtype: the norm weights' dtype (default ``dtype``); float32 scales before the cast (Qwen3.5).
        reuse_outputs: every run writes the same ``q`` and ``k`` tensors (``kernels/step_buffer.py``).
        kv_layers, token_idx: also write each token's k (as returned) and v (qkv's v heads, as they are) into
            slot ``token_idx[t]`` of a layer's cache, in the same launch (``run(..., layer=i)``): a float pool's
            :class:`~lightllm.kernels.kv_cache_write.KVLayers` of ``dtype``, ``kv_heads`` and ``head_dim``, and
            int32/int64 ``[tokens]`` slots, distinct and below its ``num_tokens`` (not checked on the device).
    """

    def __init__(self, tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, eps: float = 1e-6,
                 run_config=None, gated: bool = False, weight_dtype: Optional[torch.dtype] = None,
                 reuse_outputs: bool = False, kv_layers: Optional[KVLayers] = None,
                 token_idx: Optional[torch.Tensor] = None):  # fmt: skip
        weight_dtype = weight_dtype or dtype
        if dtype not in _DTYPES or weight_dtype not in _DTYPES:
            raise ValueError(f"qk_norm_rope plan: dtype and weight_dtype expected one of {_DTYPES}, got {dtype} and "
                             f"{weight_dtype}")  # fmt: skip
        if head_dim % 2 or min(q_heads, kv_heads, head_dim) < 1:
            raise ValueError(f"qk_norm_rope plan: expected q_heads, kv_heads >= 1 and an even head_dim, got "
                             f"{q_heads}, {kv_heads}, {head_dim}")  # fmt: skip
        rot = cos.shape[-1] if cos.dim() == 2 else -1
        if cos.dim() != 2 or cos.shape != sin.shape or rot % 2 or not 2 <= rot <= head_dim or cos.dtype != dtype:
            raise ValueError(f"qk_norm_rope plan: cos and sin expected [positions, R] {dtype} with R even in [2, "
                             f"head_dim {head_dim}], got {tuple(cos.shape)} {cos.dtype} and {tuple(sin.shape)} "
                             f"{sin.dtype}")  # fmt: skip
        if cos.stride(1) != 1 or sin.stride() != cos.stride():
            raise ValueError(f"qk_norm_rope plan: cos and sin expected one row-major layout, got strides "
                             f"{cos.stride()} and {sin.stride()}")  # fmt: skip
        if positions.shape != (tokens,) or positions.dtype not in _POSITION_DTYPES:
            raise ValueError(f"qk_norm_rope plan: positions expected an int32/int64 [{tokens}] tensor, got "
                             f"{tuple(positions.shape)} {positions.dtype}")  # fmt: skip
        _check_kv_write(kv_layers, token_idx, tokens, kv_heads, head_dim, dtype)
        self.kv_layers, self.token_idx = kv_layers, token_idx
        self.q_shape, self.k_shape = (tokens, q_heads, head_dim), (tokens, kv_heads, head_dim)
        self.cos, self.sin, self.positions, self.eps = cos, sin, positions, float(eps)
        width = ((2 if gated else 1) * q_heads + 2 * kv_heads) * head_dim
        weight = (torch.Size((head_dim,)), weight_dtype)
        self.inputs = PlannedInputs("qk_norm_rope", qkv=(torch.Size((tokens, width)), dtype), q_weight=weight,
                                    k_weight=weight)  # fmt: skip
        self._tuned = _launch_qk_norm_rope.plan(run_config=run_config)
        self._q = StepBuffer(self.q_shape, dtype, reuse_outputs)
        self._k = StepBuffer(self.k_shape, dtype, reuse_outputs)

    def run(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
            layer: Optional[int] = None) -> Tuple[torch.Tensor, ...]:  # fmt: skip
        """``(q, k)``, contiguous tensors (new, or the plan's own with ``reuse_outputs``); qkv is read only. With
        ``kv_layers``, ``layer`` (required then, else None) is the cache the tokens' K/V are written to."""
        self.inputs.check((qkv.shape, qkv.dtype), (q_weight.shape, q_weight.dtype), (k_weight.shape, k_weight.dtype))
        if qkv.stride(-1) != 1 or q_weight.stride(0) != 1 or k_weight.stride(0) != 1:
            raise ValueError(f"qk_norm_rope: qkv and the norm weights expected a contiguous last dim, got strides "
                             f"{qkv.stride()}, {q_weight.stride()}, {k_weight.stride()}")  # fmt: skip
        q, k = self._q.get(qkv.device), self._k.get(qkv.device)
        kv = self.kv_layers
        if kv is None or layer is None:
            if kv is not None or layer is not None:
                raise ValueError(f"qk_norm_rope: layer expected with kv_layers (and only then), got layer {layer} "
                                 f"with kv_layers {'set' if kv is not None else 'None'}")  # fmt: skip
            return self._tuned.run(qkv, q_weight, k_weight, self.cos, self.sin, self.positions, self.eps, q, k)
        return self._tuned.run(qkv, q_weight, k_weight, self.cos, self.sin, self.positions, self.eps, q, k,
                               kv.k[layer], kv.v[layer], self.token_idx)  # fmt: skip


def _check_kv_write(kv_layers: Optional[KVLayers], token_idx: Optional[torch.Tensor], tokens: int, kv_heads: int,
                    head_dim: int, dtype: torch.dtype) -> None:  # fmt: skip
    if kv_layers is None and token_idx is None:
        return
    if kv_layers is None or token_idx is None:
        raise ValueError("qk_norm_rope plan: kv_layers and token_idx expected together, got only "
                         f"{'kv_layers' if token_idx is None else 'token_idx'}")  # fmt: skip
    want = (kv_heads, head_dim, dtype)
    if (kv_layers.kv_heads, kv_layers.head_dim, kv_layers.dtype) != want:
        raise ValueError(f"qk_norm_rope plan: kv_layers expected kv_heads, head_dim, dtype {want}, got "
                         f"{(kv_layers.kv_heads, kv_layers.head_dim, kv_layers.dtype)}")  # fmt: skip
    if (token_idx.shape != (tokens,) or token_idx.dtype not in _POSITION_DTYPES or token_idx.stride(0) != 1
            or token_idx.device != kv_layers.device):  # fmt: skip
        raise ValueError(f"qk_norm_rope plan: token_idx expected a contiguous int32/int64 [{tokens}] tensor on "
                         f"{kv_layers.device}, got {tuple(token_idx.shape)} {token_idx.dtype} strides "
                         f"{token_idx.stride()} on {token_idx.device}")  # fmt: skip


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, positions: torch.Tensor, q_heads: int, kv_heads: int, eps: float = 1e-6,
                 run_config: Optional[dict] = None,
                 gated: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per-head RMSNorm then rotary embedding of the q and k heads of a fused qkv projection.

    Args:
        qkv: ``[tokens, (q_heads + 2 * kv_heads) * D]`` (``gated``: ``(2 * q_heads + 2 * kv_heads) * D``, each q
            head ``[query | gate]``) float16/bfloat16/float32, last dim contiguous.
        q_weight, k_weight: ``[D]`` norm weights of qkv's dtype, or float32 (scaled before the cast).
        cos, sin: ``[max_positions, R]`` tables of qkv's dtype (the first ``R`` dims rotate); positions:
            int32/int64 ``[tokens]``.
    Returns:
        ``(q [tokens, q_heads, D], k [tokens, kv_heads, D])``. Every layer of a step: :class:`QKNormRopePlan`.
    """
    if qkv.dim() != 2:
        raise ValueError(f"qk_norm_rope: qkv expected [tokens, width], got shape {tuple(qkv.shape)}")
    plan = QKNormRopePlan(qkv.shape[0], q_heads, kv_heads, q_weight.shape[0], qkv.dtype, cos, sin, positions, eps,
                          run_config, gated, q_weight.dtype)  # fmt: skip
    return plan.run(qkv, q_weight, k_weight)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in x's dtype over the first ``R = cos.shape[-1]`` dims, the rest passed
    through (cos/sin broadcast over heads: ``[tokens, 1, R]``)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((rotary_ref(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def qk_norm_rope_ref(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, q_heads: int, kv_heads: int, eps: float = 1e-6,
                     gated: bool = False):  # fmt: skip
    """Torch reference with the kernel's rounding steps: ``(q, k)``. ``cos``/``sin`` are already gathered by
    position (``[tokens, 1, R]``, once per step)."""
    tokens, d = qkv.shape[0], q_weight.shape[0]
    q_width = 2 * d if gated else d
    q = qkv[:, : q_heads * q_width].reshape(tokens, q_heads, q_width)[..., :d]
    k = qkv[:, q_heads * q_width : q_heads * q_width + kv_heads * d].reshape(tokens, kv_heads, d)
    return rotary_ref(rmsnorm_ref(q, q_weight, eps), cos, sin), rotary_ref(rmsnorm_ref(k, k_weight, eps), cos, sin)


def qk_norm_rope_kv_ref(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, q_heads: int, kv_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        token_idx: torch.Tensor, eps: float = 1e-6, gated: bool = False):  # fmt: skip
    """Torch reference of a plan with ``kv_layers``: :func:`qk_norm_rope_ref`'s ``(q, k)``, with k and qkv's v heads
    written to ``k_cache``/``v_cache`` (one layer, ``[slots, kv_heads, D]``) at ``token_idx``."""
    q, k = qk_norm_rope_ref(qkv, q_weight, k_weight, cos, sin, q_heads, kv_heads, eps, gated)
    tokens, d = qkv.shape[0], q_weight.shape[0]
    write_kv_ref(k, qkv[:, qkv.shape[1] - kv_heads * d :].view(tokens, kv_heads, d), k_cache, v_cache, token_idx)
    return q, k
