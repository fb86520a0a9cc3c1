"""Causal prefill attention over packed requests: each request's new tokens attend to its cached prefix (chunked
prefill: the tokens already in the KV pool, read through ``req_to_token``) and causally to themselves.

Grid ``(batch, q_heads, ceil(max_q_len / BLOCK_M) * splits)``; each program streams its request's prefix keys from
the pool, then its new keys up to the diagonal, with one online softmax. Tuned as GENERAL kernels by the prefill
warmup: ``context_attention`` (no prefix) and ``context_attention_prefix`` (the same kernel compiled with the prefix
loop).

A short chunk after a long prefix (chunked prefill's later chunks, a prefix-cache hit) launches few programs, each
streaming the whole prefix alone: 64 programs on 132 SMs for 128 new tokens of 32 heads. There the prefix is split
in ``splits`` ranges read in parallel (the last range's programs also take the new tokens); each writes its rows'
normalized partial output and base-2 log-sum-exp in float32, and a second kernel merges them.

GQA packing (config ``PACK_GQA``, a tuned candidate of ``context_attention_prefix`` only; the default stays
unpacked): a program takes one KV head and BLOCK_M rows that are (token, query head of the group) pairs, token-major,
so each K/V tile it loads serves all the group's heads (the bytes per row are those of an unpacked BLOCK_M), a chunk
shorter than BLOCK_M still fills the MMA's M dimension, and a block spans fewer tokens of the causal diagonal (a
group of 6 packs 6 rows per token, no padding to a power of two). Grid ``(batch, kv_heads, ceil(max_q_len * group /
BLOCK_M) * splits)``; each row's causal limit is its own token; split partials are written per (token, head), so
the merge is the same.
"""

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from lightllm.common.autotuner import AutotuneKernelType, PlannedInputs, autotune
from lightllm.common.envs import get_decode_attn_autotune_seq_len
from lightllm.kernels.direct_launch import DirectLaunch
from lightllm.kernels.launch_math import cdiv, next_power_of_2
from lightllm.kernels.step_buffer import StepBuffer, split_partials


@triton.jit
def _attend_block(q, k, v, valid, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
    """One online-softmax step of a query block over a key block; ``valid`` masks the scores (base-2 logits)."""
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    qk = tl.where(valid, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _context_attention_kernel(
    Q, K, V, Out, b_start, b_len, qk_scale,
    K_cache, V_cache, req_to_token, b_req_idx, b_prefix_len,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kct, stride_kch, stride_vct, stride_vch, stride_rt,
    Part_O, Part_L, stride_pos, stride_pot, stride_poh, stride_pls, stride_plt, splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, HAS_PREFIX: tl.constexpr, SPLIT: tl.constexpr, PACK_GQA: tl.constexpr,
):  # fmt: skip
    # ``splits`` (the prefix ranges, > 1 exactly when SPLIT) is a runtime value: a constexpr would compile every
    # candidate again for each split count, which the chunk's token count changes
    b = tl.program_id(0)
    h = tl.program_id(1)  # a KV head when packed, else a query head
    if SPLIT:
        m_block = tl.program_id(2) // splits
        split = tl.program_id(2) % splits
    else:
        m_block = tl.program_id(2)
        split = 0
    seq_len = tl.load(b_len + b)
    if PACK_GQA:
        n_rows = seq_len * GROUP
    else:
        n_rows = seq_len
    # the exit before the row indices: it keeps the unpacked kernel's PTX as it was before packing
    if m_block * BLOCK_M >= n_rows:
        return
    if PACK_GQA:  # rows are (token, query head of the group) pairs, token-major
        kvh = h
        pairs = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_m = pairs // GROUP  # each row's own token: its causal limit
        heads = kvh * GROUP + pairs % GROUP
        mask_m = pairs < n_rows
    else:
        kvh = h // GROUP
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        heads = h + tl.zeros([BLOCK_M], dtype=tl.int32)
        mask_m = offs_m < seq_len
    start = tl.load(b_start + b).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (start + offs_m)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_m[:, None], other=0.0)  # fmt: skip
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if HAS_PREFIX:  # the request's cached tokens, through its row of req_to_token: every new token sees them all
        prefix = tl.load(b_prefix_len + b)
        row = req_to_token + tl.load(b_req_idx + b).to(tl.int64) * stride_rt
        per_split = tl.cdiv(tl.cdiv(prefix, splits), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(lo + per_split, prefix)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            tok = tl.load(row + offs_n, mask=mask_n, other=0).to(tl.int64)[:, None]
            k = tl.load(K_cache + tok * stride_kct + kvh * stride_kch + offs_d[None, :], mask=mask_n[:, None],
                        other=0.0)  # fmt: skip
            v = tl.load(V_cache + tok * stride_vct + kvh * stride_vch + offs_d[None, :], mask=mask_n[:, None],
                        other=0.0)  # fmt: skip
            m_i, l_i, acc = _attend_block(q, k, v, mask_n[None, :], m_i, l_i, acc, qk_scale, PRECISION)
    if split == splits - 1:  # the new tokens, causally: up to the block's last token
        if PACK_GQA:
            end = (tl.minimum((m_block + 1) * BLOCK_M, n_rows) - 1) // GROUP + 1
        else:
            end = tl.minimum((m_block + 1) * BLOCK_M, seq_len)
        for n0 in range(0, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            rows = (start + offs_n)[:, None]
            k = tl.load(K + rows * stride_kt + kvh * stride_kh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            v = tl.load(V + rows * stride_vt + kvh * stride_vh + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            causal = (offs_m[:, None] >= offs_n[None, :]) & mask_n[None, :]
            m_i, l_i, acc = _attend_block(q, k, v, causal, m_i, l_i, acc, qk_scale, PRECISION)
    if not SPLIT:
        out = acc / l_i[:, None]
        tl.store(Out + (start + offs_m)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=mask_m[:, None])  # fmt: skip
    else:  # an empty range (a prefix shorter than the splits) leaves weight 0 for the merge
        seen = l_i > 0
        l_safe = tl.where(seen, l_i, 1.0)
        tl.store(Part_O + split * stride_pos + (start + offs_m)[:, None] * stride_pot + heads[:, None] * stride_poh
                 + offs_d[None, :], acc / l_safe[:, None], mask=mask_m[:, None])  # fmt: skip
        tl.store(Part_L + split * stride_pls + (start + offs_m) * stride_plt + heads,
                 tl.where(seen, m_i + tl.log2(l_safe), float("-inf")), mask=mask_m)  # fmt: skip


@triton.jit
def _merge_splits_kernel(
    Part_O, Part_L, Out, stride_pos, stride_pot, stride_poh, stride_pls, stride_plt, stride_ot, stride_oh, splits,
    SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    valid = offs_s < splits
    lse = tl.load(Part_L + offs_s * stride_pls + t * stride_plt + h, mask=valid, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # the last split always saw its own tokens: the max is finite
    part = tl.load(Part_O + offs_s[:, None] * stride_pos + t * stride_pot + h * stride_poh + offs_d[None, :],
                   mask=valid[:, None] & (weight[:, None] > 0), other=0.0)  # fmt: skip
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(Out + t * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty))


_CONTEXT_ATTENTION = DirectLaunch(_context_attention_kernel)
_MERGE_SPLITS = DirectLaunch(_merge_splits_kernel)


# Shared memory per block the 3-stage default needs: 112 KiB at head_dim 128 (its sm_90 build, tests/kernels/
# test_context_attention.py): A100 and H100/H200 have 163-227 KiB; Ada and consumer parts have 99 KiB and keep the
# 1-stage tile.
DEEP_PIPELINE_SMEM = 160 << 10


def _default_config(head_dim: int, shared_mem: int = 0) -> dict:
    """The untuned config. Head dims up to 128 with room for it: 64x64 at 4 warps and 3 stages, the least worst loss
    of every candidate and explored config on the H200 (within 18 % of their best at chunks 256-2048 and prefixes
    0-32K; the 1-stage tile lost up to 2.2x to the best candidate at long prefixes:
    ``benchmarks/results/context_attention_h200.json``)."""
    if head_dim <= 128 and shared_mem >= DEEP_PIPELINE_SMEM:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    block = 32 if head_dim == 256 else 64
    return {"BLOCK_M": block, "BLOCK_N": block, "num_warps": 4, "num_stages": 1}


@functools.lru_cache(maxsize=None)
def _shared_mem(device: torch.device) -> int:
    """Shared memory a block may opt into; 0 off the GPU (the interpreter takes the small default)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def default_config(q: torch.Tensor) -> dict:
    return _default_config(q.shape[-1], _shared_mem(q.device))


def _configs(q):
    big = q.shape[-1] == 256
    pairs = [(32, 32), (64, 32), (64, 64)] + ([] if big else [(128, 64), (128, 32)])
    configs = [
        {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s} for m, n in pairs for w, s in ((4, 1), (8, 2))
    ]
    if not big:  # deeper pipelines, the best at most measured H200 cells (a GPU without the room: a failed candidate)
        configs += [{"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
                    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}]  # fmt: skip
    return configs


def _prefix_configs(q):
    """The unpacked candidates and GQA-packed ones (``PACK_GQA``: a program's rows are a KV head's query heads, so
    each prefix tile it loads serves the whole group). Kept few: every candidate is timed at start-up."""
    pairs = [(64, 32), (64, 64)] if q.shape[-1] == 256 else [(64, 64), (128, 64), (128, 32)]
    packed = [
        {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": 2, "PACK_GQA": True}
        for m, n in pairs
        for w in (4, 8)
    ]
    return _configs(q) + packed


def _static_key(q, k):
    return {"head_dim": q.shape[-1], "group": q.shape[1] // k.shape[1], "dtype": str(q.dtype)}


def _run_key(q):
    return next_power_of_2(max(q.shape[0], 16))  # total prefill tokens, in power-of-two buckets


MAX_PREFIX_SPLITS = 16


def prefix_splits(programs: int, sms: int) -> int:
    """Ranges to split a cached prefix into: enough for two programs per SM, at most ``MAX_PREFIX_SPLITS``; 1 when
    the unsplit grid already fills the GPU (a long chunk), so long prefills keep the one-pass kernel."""
    return max(1, min(MAX_PREFIX_SPLITS, cdiv(2 * sms, programs)))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: a nominal GPU, so small test shapes split as short chunks do on a real one
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch(q, k, v, out, b_start, b_len, max_q_len, sm_scale, cfg, prefix, scratch=None):
    """The grid and the kernel call; ``prefix`` is (k_cache, v_cache, req_to_token, b_req_idx, b_prefix_len) or
    None (no cached prefix: the cache arguments are placeholders the compiled kernel never reads). With a prefix,
    ``cfg["PREFIX_SPLITS"]`` fixes the split count (tests); by default :func:`prefix_splits` of the grid.
    ``scratch``: a plan's dict, so the split partials are made once per step (``split_partials``)."""
    k_cache, v_cache, req_to_token, b_req_idx, b_prefix_len = prefix or (k, v, b_start, b_start, b_start)
    group = q.shape[1] // k.shape[1]
    pack = cfg.get("PACK_GQA", False)
    # packed: one program per KV head and BLOCK_M (token, head) rows, BLOCK_M / group tokens
    heads, rows = (k.shape[1], max_q_len * group) if pack else (q.shape[1], max_q_len)
    m_blocks = cdiv(rows, cfg["BLOCK_M"])
    splits = 1
    if prefix is not None:
        splits = cfg.get("PREFIX_SPLITS") or prefix_splits(b_len.shape[0] * heads * m_blocks, _sm_count(q.device))
    part_o = part_l = out  # placeholders a one-pass launch never reads
    if splits > 1:
        part_o, part_l = split_partials(scratch, (splits, *q.shape), q.device)
    grid = (b_len.shape[0], heads, m_blocks * splits)
    _CONTEXT_ATTENTION.launch(
        grid,
        q, k, v, out, b_start, b_len, sm_scale * 1.4426950408889634,
        k_cache, v_cache, req_to_token, b_req_idx, b_prefix_len,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0),
        part_o, part_l, part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l.stride(0), part_l.stride(1),
        splits,
        GROUP=group, HEAD_DIM=q.shape[-1], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        PRECISION="ieee" if q.dtype == torch.float32 else None, HAS_PREFIX=prefix is not None, SPLIT=splits > 1,
        PACK_GQA=pack,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if splits > 1:
        _MERGE_SPLITS.launch(
            (q.shape[0], q.shape[1]),
            part_o, part_l, out, part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l.stride(0),
            part_l.stride(1), out.stride(0), out.stride(1), splits,
            SPLITS_P2=next_power_of_2(splits), HEAD_DIM=q.shape[-1], num_warps=4,
        )  # fmt: skip
    return out


# (new token, cached token) pairs the long-prefix timing may hold: ~1 TFLOP at 32 heads of 128, a few ms a launch
PREFIX_TUNING_PAIRS = 1 << 26


def prefix_tuning_scenarios(named: dict) -> list:
    """What a ``context_attention_prefix`` search times on: the caller's chunk after its own prefix (the start-up
    warm-up's second chunk, whose prefix is as short as the chunk), then the same chunk after a long prefix, over
    the existing pool (one token table wrapping modulo the pool: no KV is allocated). Chunked prefill's later chunks
    and prefix-cache hits read prefixes of many thousand tokens, where the kernel is bound by its throughput, not by
    filling the grid, and a config chosen at the short prefix alone may not suit them; the search takes the config
    with the least worst loss over both (``minimax_loss``).

    The long prefix is ``LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN`` (the representative KV length), capped by the
    longest prefix the request table allows after this chunk and by :data:`PREFIX_TUNING_PAIRS` over the chunk's
    tokens; none when that is no longer than the caller's prefixes."""
    q, batch = named["q"], named["b_len"].shape[0]
    room = named["req_to_token"].shape[1] - int(named["max_q_len"])
    prefix = min(get_decode_attn_autotune_seq_len(), room, PREFIX_TUNING_PAIRS // max(1, q.shape[0]))
    own = {**named, "out": torch.empty_like(named["out"]), "scratch": {}}
    if batch == 0 or prefix <= int(named["b_prefix_len"].max()):
        return [own]
    i32 = dict(dtype=torch.int32, device=q.device)
    table = torch.arange(batch * prefix, device=q.device, dtype=torch.int64) % named["k_cache"].shape[0]
    long = {**own, "req_to_token": table.to(torch.int32).view(batch, prefix), "b_req_idx": torch.arange(batch, **i32),
            "b_prefix_len": torch.full((batch,), prefix, **i32), "out": torch.empty_like(named["out"]),
            "scratch": {}}  # fmt: skip
    return [own, long]


# P is rounded to q's dtype against the running row max, which depends on BLOCK_N: in bf16 a few outlier
# elements of 2^25 differ by ~4 ulps (0.0078 at 0.3, seen on the H200), which the default 2e-2 rejects.
_ACCURACY_TOL = (4e-2, 2e-2)
# Two tuned kernels of one declaration: with a prefix the time grows with it, so each keeps its own configs.
_TUNING = dict(
    configs_gen_func=_configs,
    static_key_func=_static_key,
    run_key_func=_run_key,
    kernel_type=AutotuneKernelType.GENERAL,
    output_args=("out",),
    accuracy_tol=_ACCURACY_TOL,
)

_PREFIX_TUNING = {**_TUNING, "configs_gen_func": _prefix_configs, "rebuild_input_func": prefix_tuning_scenarios}


@autotune(kernel_name="context_attention", **_TUNING)
def _launch_context_attention(q, k, v, out, b_start, b_len, max_q_len, sm_scale, run_config=None):
    return _launch(q, k, v, out, b_start, b_len, max_q_len, sm_scale, run_config or default_config(q),
                   None)  # fmt: skip


@autotune(kernel_name="context_attention_prefix", **_PREFIX_TUNING)
def _launch_context_attention_prefix(q, k, v, out, b_start, b_len, max_q_len, sm_scale, k_cache, v_cache,
                                     req_to_token, b_req_idx, b_prefix_len, scratch=None, run_config=None):  # fmt: skip
    """A sibling of ``context_attention`` tuned apart: its time grows with the prefix, which the other never reads."""
    prefix = (k_cache, v_cache, req_to_token, b_req_idx, b_prefix_len)
    return _launch(q, k, v, out, b_start, b_len, max_q_len, sm_scale, run_config or default_config(q),
                   prefix, scratch)  # fmt: skip


class CachedPrefix:
    """Each request's tokens already in the KV pool before this prefill (chunked prefill): request ``i`` reads
    ``b_prefix_len[i]`` tokens through row ``b_req_idx[i]`` of ``req_to_token`` (int32 tensors, ``[batch]`` and
    ``[max_reqs, max_len]``) from a cache ``[pool tokens, kv_heads, D]`` given per layer."""

    def __init__(self, req_to_token: torch.Tensor, b_req_idx: torch.Tensor, b_prefix_len: torch.Tensor):
        for name, t in (("req_to_token", req_to_token), ("b_req_idx", b_req_idx), ("b_prefix_len", b_prefix_len)):
            if t.dtype != torch.int32:
                raise ValueError(f"context_attention: {name} expected int32, got {t.dtype}")
        if b_req_idx.shape != b_prefix_len.shape or req_to_token.dim() != 2:
            raise ValueError(f"context_attention: b_req_idx and b_prefix_len expected [batch], req_to_token "
                             f"[max_reqs, max_len], got {tuple(b_req_idx.shape)}, {tuple(b_prefix_len.shape)} and "
                             f"{tuple(req_to_token.shape)}")  # fmt: skip
        self.req_to_token, self.b_req_idx, self.b_prefix_len = req_to_token, b_req_idx, b_prefix_len


class ContextAttentionPlan:
    """Prefill attention of one step, made from shapes before any layer runs: checked once here, the tuned config
    resolved at the first :meth:`run`; every layer (same shapes and dtype, checked) then runs with them.

    Args: ``q_shape`` ``(tokens, q_heads, D)``, ``kv_shape`` ``(tokens, kv_heads, D)`` and the dtype of q, k and v;
    ``prefix`` a :class:`CachedPrefix` or None; the rest as :func:`context_attention`. ``reuse_outputs``: every run
    without ``out`` writes the same output tensor (``kernels/step_buffer.py``).
    """

    def __init__(self, q_shape, kv_shape, dtype, b_start, b_len, max_q_len, sm_scale=None, run_config=None,
                 prefix: Optional[CachedPrefix] = None, reuse_outputs: bool = False):  # fmt: skip
        q_shape, kv_shape = torch.Size(q_shape), torch.Size(kv_shape)
        if (
            len(q_shape) != 3
            or len(kv_shape) != 3
            or kv_shape[::2] != q_shape[::2]
            or q_shape[-1] not in (64, 128, 256)
        ):
            raise ValueError(f"context_attention: q, k, v expected [tokens, heads, 64|128|256], got q {tuple(q_shape)} "
                             f"and k, v {tuple(kv_shape)}")  # fmt: skip
        if q_shape[1] % kv_shape[1]:
            raise ValueError(f"context_attention: q_heads expected a multiple of kv_heads, got {q_shape[1]} and "
                             f"{kv_shape[1]}")  # fmt: skip
        if b_start.dtype != torch.int32 or b_len.dtype != torch.int32 or b_start.shape != b_len.shape:
            raise ValueError("context_attention: b_start and b_len expected int32 [batch] tensors")
        if prefix is not None and prefix.b_req_idx.shape != b_len.shape:
            raise ValueError(f"context_attention: the prefix expected one row per request ({b_len.shape[0]}), got "
                             f"{prefix.b_req_idx.shape[0]}")  # fmt: skip
        self.b_start, self.b_len, self.max_q_len = b_start, b_len, int(max_q_len)
        self.sm_scale = float(sm_scale if sm_scale is not None else 1.0 / math.sqrt(q_shape[-1]))
        self.prefix = prefix
        self.kv_shape, self.dtype = kv_shape, dtype
        self.inputs = PlannedInputs("context_attention", q=(q_shape, dtype), k=(kv_shape, dtype), v=(kv_shape, dtype))
        launcher = _launch_context_attention if prefix is None else _launch_context_attention_prefix
        self._tuned = launcher.plan(run_config=run_config)
        self._out = StepBuffer(q_shape, dtype, reuse_outputs)
        self._scratch = {} if reuse_outputs else None

    def run(self, q, k, v, out=None, k_cache=None, v_cache=None) -> torch.Tensor:
        """``k_cache``/``v_cache`` ``[pool tokens, kv_heads, D]`` in q's dtype: this layer's cache, with a prefix."""
        self.inputs.check((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype))
        # the kernel steps through the head dim at unit stride: a transposed view would be read (or written) wrongly
        for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
            if t is not None and t.stride(-1) != 1:
                raise ValueError(f"context_attention: {name} expected a contiguous last dim, got strides {t.stride()}")
        if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
            raise ValueError(f"context_attention: out expected q's {tuple(q.shape)} {q.dtype} with a contiguous last "
                             f"dim, got {tuple(out.shape)} {out.dtype} with strides {out.stride()}")  # fmt: skip
        out = self._out.get(q.device) if out is None else out
        args = (q, k, v, out, self.b_start, self.b_len, self.max_q_len, self.sm_scale)
        p = self.prefix
        if p is None:
            return self._tuned.run(*args)
        if k_cache is None or v_cache is None:
            raise ValueError("context_attention: a plan with a cached prefix expected k_cache and v_cache")
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if c.dtype != q.dtype or c.dim() != 3 or c.shape[1:] != self.kv_shape[1:]:
                raise ValueError(f"context_attention: {name} expected [pool tokens, {self.kv_shape[1]}, "
                                 f"{self.kv_shape[2]}] in {q.dtype}, got {tuple(c.shape)} in {c.dtype}")  # fmt: skip
        return self._tuned.run(*args, k_cache, v_cache, p.req_to_token, p.b_req_idx, p.b_prefix_len, self._scratch)


def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b_start: torch.Tensor,
    b_len: torch.Tensor,
    max_q_len: int,
    out: Optional[torch.Tensor] = None,
    sm_scale: Optional[float] = None,
    run_config: Optional[dict] = None,
    prefix: Optional[CachedPrefix] = None,
    k_cache: Optional[torch.Tensor] = None,
    v_cache: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of packed requests, each over its cached prefix (if any) and its new tokens.

    Args:
        q: ``[tokens, q_heads, D]``; k, v: ``[tokens, kv_heads, D]`` (same dtype; head_dim 64/128/256): the new
            tokens only.
        b_start, b_len: int32 ``[batch]``: first token and token count of each request in the packing.
        max_q_len: the longest request's new tokens (sizes the grid).
        prefix, k_cache, v_cache: chunked prefill: new token ``i`` of a request sits at position
            ``prefix_len + i`` and sees all ``prefix_len`` cached tokens (:class:`CachedPrefix`) of
            ``k_cache``/``v_cache`` ``[pool tokens, kv_heads, D]`` (q's dtype).
    Every layer of a step: :class:`ContextAttentionPlan` checks and resolves once.
    """
    plan = ContextAttentionPlan(q.shape, k.shape, q.dtype, b_start, b_len, max_q_len, sm_scale, run_config, prefix)
    return plan.run(q, k, v, out, k_cache, v_cache)


def context_attention_ref(q, k, v, b_start, b_len, sm_scale: Optional[float] = None, prefix=None, k_cache=None,
                          v_cache=None) -> torch.Tensor:  # fmt: skip
    """Float64 torch reference of :func:`context_attention` (same arguments; the cache may be any float dtype)."""
    group = q.shape[1] // k.shape[1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    rows = [[]] * len(b_len) if prefix is None else _prefix_rows(prefix)
    for s, n, tok in zip(b_start.tolist(), b_len.tolist(), rows):
        ks = torch.cat([k_cache[tok].double(), k[s : s + n].double()]) if tok else k[s : s + n].double()
        vs = torch.cat([v_cache[tok].double(), v[s : s + n].double()]) if tok else v[s : s + n].double()
        scores = torch.einsum("ihd,jhd->hij", q[s : s + n].double(), ks.repeat_interleave(group, dim=1)) * scale
        p = len(tok)
        visible = torch.ones(n, p + n, dtype=torch.bool, device=q.device).tril(diagonal=p)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[s : s + n] = torch.einsum("hij,jhd->ihd", scores.softmax(-1), vs.repeat_interleave(group, dim=1))
    return out


def _prefix_rows(prefix: CachedPrefix) -> list:
    """Each request's cached token indices, as a host list."""
    table = prefix.req_to_token
    return [table[r, :p].long().tolist() for r, p in zip(prefix.b_req_idx.tolist(), prefix.b_prefix_len.tolist())]
