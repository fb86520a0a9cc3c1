"""GQA flash decode over the token-level KV cache: bf16/fp16, INT8 and INT4 KV.

One query token per request. ``stage1`` shares each request's KV, in ``BLOCK_N``-token blocks, among a fixed number
of split programs per (request, KV head) (``splits.py``); ``stage2`` merges the splits. Each KV type has its
own tuned kernel (``gqa_flash_decode``, ``gqa_flash_decode_int8kv``, ``gqa_flash_decode_int4kv``), tuned in
the DECODE_ATTENTION phase on a representative batch rebuilt over the existing pool: every request at
``LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN`` tokens, timed also at shorter lengths so that the config a CUDA
graph freezes suits every length it serves. A search times stage 1 and stage 2 together: the split count a
config implies changes stage 2's work too.
"""

import math
from functools import lru_cache
from typing import Optional

import torch
from triton import knobs

from lightllm.common.autotuner import AutotuneKernelType, PlannedInputs, autotune
from lightllm.common.kv_cache.quant import INT4_OFFSET, SCALE_DTYPE
from lightllm.kernels.attention.decode.checks import (
    check_head_dim,
    check_kv_pair,
    check_q_device,
    check_request_rows,
    check_run_q_out,
)
from lightllm.kernels.attention.decode.splits import min_blocks, num_splits
from lightllm.kernels.attention.decode.tuning import (
    decode_attn_autotune_seq_lens,
    decode_attn_run_key_distance,
    decode_attn_run_key_lens,
    inputs_at_lengths,
)
from lightllm.kernels.attention.decode.stage1 import decode_stage1_kernel
from lightllm.kernels.attention.decode.stage2 import decode_stage2_kernel, split_tile
from lightllm.kernels.direct_launch import DirectLaunch
from lightllm.kernels.launch_math import next_power_of_2
from lightllm.kernels.step_buffer import StepBuffer, split_partials

_STAGE1 = DirectLaunch(decode_stage1_kernel)
_STAGE2 = DirectLaunch(decode_stage2_kernel)

HEAD_DIMS = (64, 128, 256)
Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_QUANT_BITS = {"none": 0, "int8": 8, "int4": 4}
_ptx_dequant = True  # set_ptx_dequant


@lru_cache(maxsize=None)  # per launch when no tuned config: computed once per head_dim
def default_config(head_dim: int) -> dict:
    return {"BLOCK_N": 32 if head_dim == 256 else 64, "num_warps": 4, "num_stages": 2, "WAVES": 2}


def _launch_split_kv(
    q,
    k_cache,
    v_cache,
    k_scale,
    v_scale,
    req_to_token,
    b_req_idx,
    b_seq_len,
    max_len_in_batch,
    out,
    sm_scale,
    quant,
    quant_group,
    scratch=None,
    run_config=None,
):
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = q_heads // kv_heads
    cfg = run_config or default_config(head_dim)
    splits = num_splits(batch, kv_heads, max_len_in_batch, cfg["BLOCK_N"], cfg["WAVES"], q.device)
    least = min_blocks(cfg)
    mid_o, mid_lse = split_partials(scratch, (batch, q_heads, splits, head_dim), q.device)
    ks = k_scale if k_scale is not None else k_cache
    vs = v_scale if v_scale is not None else v_cache
    f16 = quant != "none" and q.dtype != torch.float32
    asm = f16 and _ptx_path(q, k_cache, v_cache, quant_group)
    if batch > 0:
        _STAGE1.launch(
            (batch, kv_heads, splits),
            q, k_cache, v_cache, ks, vs, req_to_token, b_req_idx, b_seq_len, mid_o, mid_lse,
            sm_scale * 1.4426950408889634,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
            req_to_token.stride(0),
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
            GROUP=group, BLOCK_H=max(16, next_power_of_2(group)), HALF_D=head_dim // 2,
            BLOCK_N=cfg["BLOCK_N"], MIN_BLOCKS=least, QUANT=_QUANT_BITS[quant], QGROUP=quant_group,
            INT4_OFFSET=INT4_OFFSET, F16=f16, ASM=asm, PEEL=peel_queries(f16, head_dim),
            PRECISION="ieee" if q.dtype == torch.float32 else None,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            maxnreg=register_cap(cfg["num_warps"], asm, head_dim),  # None: no cap (Triton drops None options)
        )  # fmt: skip
        launch_stage2(mid_o, mid_lse, b_seq_len, out, cfg["BLOCK_N"], least)
    return out


# Registers a thread of the PTX path may hold, by warps a program. A warp takes its registers from its scheduler's
# quarter of the file (16384): 168 keeps three 2-warp programs' warps a quarter, 128 four 4-warp ones, as many as
# before the queries moved to registers (stage1._attend_block; uncapped, a 2-warp program fits one block fewer per
# SM, which cost B=16 a wave: docs/decode_attention.md, "register moves").
_REGISTER_CAP = {2: 168, 4: 128}


def register_cap(num_warps: int, asm: bool, head_dim: int) -> Optional[int]:
    """Stage 1's ``maxnreg``: for the PTX path up to head_dim 128 (at 256 the caps spill), else None (no cap)."""
    return _REGISTER_CAP.get(num_warps) if asm and head_dim <= 128 else None


# Stage 1 peels its first block (keeping the queries in registers) for quantized KV up to this head_dim: at 256 the
# queries' registers make some candidates spill and others lose warps per SM, and on the H200 the peel gained at
# most 0.5 % on the best d256 candidate (benchmarks/results/decode_attention_quant_d256_peel_h200.json).
# set_peel_max_head_dim changes it for benchmarks that time the peel where it is off.
_peel_max_head_dim = 128


def peel_queries(f16: bool, head_dim: int) -> bool:
    """Stage 1's ``PEEL``: quantized KV with 16-bit queries (``F16``) up to the peel's head_dim."""
    return f16 and head_dim <= _peel_max_head_dim


def set_peel_max_head_dim(head_dim: int) -> int:
    """Peel stage 1's first block for quantized KV up to ``head_dim`` (128 by default); returns the previous bound."""
    global _peel_max_head_dim
    previous, _peel_max_head_dim = _peel_max_head_dim, int(head_dim)
    return previous


def _ptx_path(q, k_cache, v_cache, quant_group: int) -> bool:
    """Whether stage 1 dequantizes with its PTX word helpers: on a GPU (not the interpreter), for quant groups of
    whole words, with every K/V row 4-byte aligned (codes are read as 32-bit words)."""
    if not (_ptx_dequant and quant_group % 4 == 0 and q.is_cuda and not knobs.runtime.interpret):
        return False
    low_bits = k_cache.data_ptr() | v_cache.data_ptr() | k_cache.stride(0) | k_cache.stride(1)
    return not (low_bits | v_cache.stride(0) | v_cache.stride(1)) & 3


def set_ptx_dequant(on: bool) -> bool:
    """Dequantize INT8/INT4 codes with stage 1's PTX word helpers (the default on a GPU, for quant groups that are
    multiples of 4) or per element as under the interpreter; returns the previous setting. For benchmarks and tests
    that compare the two."""
    global _ptx_dequant
    previous, _ptx_dequant = _ptx_dequant, bool(on)
    return previous


def launch_stage2(mid_o, mid_lse, b_seq_len, out, block_n: int, least: int = 1, num_warps: Optional[int] = None):
    """Merge ``mid_o [batch, q_heads, splits, D]`` / ``mid_lse`` into ``out [batch, q_heads, D]``; ``block_n`` and
    ``least`` are stage 1's ``BLOCK_N`` and ``MIN_BLOCKS``, which cut the splits (not tuned: it takes a few
    microseconds whatever its warps, docs/decode_attention.md)."""
    batch, q_heads, splits, head_dim = mid_o.shape
    _STAGE2.launch(
        (batch, q_heads),
        mid_o, mid_lse, b_seq_len, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1), splits, block_n, least,
        HEAD_DIM=head_dim, SPLIT_TILE=split_tile(splits), num_warps=num_warps or (4 if head_dim <= 128 else 8),
    )  # fmt: skip


# ---- tuning declaration ---------------------------------------------------------------------------------


# (WAVES, MIN_BLOCKS) of the candidates. MIN_BLOCKS 2 (splits.py) only with 2 and 4 waves: there a grid sized for
# 32K gives a 4K request one-block splits, where the H200 loses 12-18 % against half as many two-block splits (d256,
# B=1, benchmarks/results/decode_attention_split_h200.json); a config without the key takes 1 (files stored before).
_SPLIT_SHAPES = ((1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 2))


def _split_candidates(block_ns, warps_stages) -> list:
    return [
        {"BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages, "WAVES": waves,
         **({"MIN_BLOCKS": least} if least > 1 else {})}  # fmt: skip
        for block_n in block_ns
        for num_warps, num_stages in warps_stages
        for waves, least in _SPLIT_SHAPES
    ]


def split_kv_configs(q):
    """24 candidates, 8 compiles per shape: WAVES only changes the grid (no recompile), MIN_BLOCKS is a constexpr;
    what was left out (BLOCK_N 16/128, 2 warps, 1 stage) only pays for its compile time at start-up."""
    return _split_candidates((32, 64), ((4, 2), (8, 3)))


def quant_split_kv_configs(q):
    """INT8/INT4 KV: the bf16 space plus two-warp programs at two and three stages. Their dequantization makes a
    program ALU-heavy, so more resident programs per SM keep more loads in flight: on the H200 a two-warp config is
    the fastest candidate in 11 of 15 quantized cells (benchmarks/results/decode_attention_quant_h200.json). With the
    PTX dequantization 22 % of a two-warp program's stall samples sit at the barrier before its next tile (Nsight
    Compute, docs); a third stage, one more tile in flight, won 7 of 12 cells by up to 7 %
    (decode_attention_quant_ptx_h200.json). Two-warp programs also run at 16 and 32 waves (no compile: WAVES is the
    grid): at B=64 and 32K eight waves give 2 splits a request, 1024 programs for 660-800 resident slots, and 16 or
    32 waves were 8-10 % faster at INT8 in two H200 runs (decode_attention_quant_{waves,scale_rows_qk_int8}_h200)."""
    space = _split_candidates((32, 64), ((2, 2), (2, 3), (4, 2), (8, 3)))
    many_waves = [{**c, "WAVES": waves} for c in space if c["num_warps"] == 2 and c["WAVES"] == 8 for waves in (16, 32)]
    return space + many_waves


def _static_key(q, k_cache, quant, quant_group):
    return {
        "group": q.shape[1] // k_cache.shape[1],
        "head_dim": q.shape[2],
        "q_dtype": str(q.dtype),
        "kv": quant if quant != "none" else str(k_cache.dtype),
        "quant_group": quant_group if quant != "none" else 0,
    }


def split_kv_run_key(q, max_len_in_batch):
    return (q.shape[0], *decode_attn_run_key_lens(max_len_in_batch))


def _representative_batches(named: dict) -> list:
    """The caller's batch with every request at each tuning length, over the existing pool (token indices
    wrap modulo its size: no KV is allocated). Launch sizes stay the caller's (``max_len_in_batch`` is the
    graph's maximum when capturing), so timings see the grid the graph will replay."""
    return inputs_at_lengths(named, decode_attn_autotune_seq_lens(named["max_len_in_batch"]))  # capped at it


_TUNING = dict(
    configs_gen_func=split_kv_configs,
    static_key_func=_static_key,
    run_key_func=split_kv_run_key,
    run_key_distance_func=decode_attn_run_key_distance,
    kernel_type=AutotuneKernelType.DECODE_ATTENTION,
    rebuild_input_func=_representative_batches,
    output_args=("out",),
)
# One launcher body, three tuned kernels (each KV type keeps its own config files).
_QUANT_TUNING = {**_TUNING, "configs_gen_func": quant_split_kv_configs}
_launch_gqa_flash_decode = autotune(kernel_name="gqa_flash_decode", **_TUNING)(_launch_split_kv)
_launch_gqa_flash_decode_int8kv = autotune(kernel_name="gqa_flash_decode_int8kv", **_QUANT_TUNING)(_launch_split_kv)
_launch_gqa_flash_decode_int4kv = autotune(kernel_name="gqa_flash_decode_int4kv", **_QUANT_TUNING)(_launch_split_kv)
_LAUNCHERS = {
    "none": _launch_gqa_flash_decode,
    "int8": _launch_gqa_flash_decode_int8kv,
    "int4": _launch_gqa_flash_decode_int4kv,
}


# ---- public API -----------------------------------------------------------------------------------------


class GQADecodePlan:
    """Decode attention of one step, made from shapes and the pool before any layer runs: the arguments are
    checked once here and the tuned config resolved at the first :meth:`run`; every layer then runs with them.
    Each layer's ``q`` and caches must have the planned shapes and dtype (one pool, one model): ``run`` checks.

    Args: ``kv`` (``"none"``, ``"int8"`` or ``"int4"``), ``q_shape`` ``[batch, q_heads, head_dim]`` and
    ``q_dtype`` for ``q``, any layer's ``k_cache``/``v_cache`` (and, quantized, ``k_scale``/``v_scale`` and
    ``quant_group``); the rest as :func:`gqa_decode_attention`. ``reuse_outputs``: every run without ``out`` writes
    the same output, and every run the same split partials (``kernels/step_buffer.py``).
    """

    def __init__(
        self, kv, q_shape, q_dtype, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, max_len_in_batch,
        k_scale=None, v_scale=None, sm_scale=None, quant_group=8, run_config=None, reuse_outputs=False,
    ):  # fmt: skip
        if kv not in _LAUNCHERS:
            raise ValueError(f"gqa decode attention: kv expected one of {tuple(_LAUNCHERS)}, got {kv!r}")
        quant_group = quant_group if kv != "none" else 0
        q_shape = torch.Size(q_shape)
        _check(q_shape, q_dtype, k_cache, v_cache, k_scale, v_scale, req_to_token, b_req_idx, b_seq_len, None, kv,
               quant_group)  # fmt: skip
        self.kv, self.quant_group = kv, quant_group
        self.req_to_token, self.b_req_idx, self.b_seq_len = req_to_token, b_req_idx, b_seq_len
        self.max_len_in_batch = int(max_len_in_batch)
        self.sm_scale = float(sm_scale if sm_scale is not None else 1.0 / math.sqrt(q_shape[-1]))
        self.inputs = PlannedInputs(
            f"gqa decode attention ({kv} KV)", q=(q_shape, q_dtype), k_cache=(k_cache.shape, k_cache.dtype)
        )
        self._tuned = _LAUNCHERS[kv].plan(run_config=run_config)
        self._out = StepBuffer(q_shape, q_dtype, reuse_outputs)
        self._scratch = {} if reuse_outputs else None

    def run(self, q, k_cache, v_cache, k_scale=None, v_scale=None, out=None) -> torch.Tensor:
        self.inputs.check((q.shape, q.dtype), (k_cache.shape, k_cache.dtype))
        check_run_q_out(f"gqa decode attention ({self.kv} KV)", q, out)
        if out is None:
            out = self._out.get(q.device)
        return self._tuned.run(q, k_cache, v_cache, k_scale, v_scale, self.req_to_token, self.b_req_idx,
                               self.b_seq_len, self.max_len_in_batch, out, self.sm_scale, self.kv, self.quant_group,
                               self._scratch)  # fmt: skip


def gqa_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    b_req_idx: torch.Tensor,
    b_seq_len: torch.Tensor,
    max_len_in_batch: int,
    out: Optional[torch.Tensor] = None,
    sm_scale: Optional[float] = None,
    run_config: Optional[dict] = None,
) -> torch.Tensor:
    """Decode attention of one query token per request over a bf16/fp16/fp32 token pool.

    Args:
        q: ``[batch, q_heads, head_dim]``; head_dim 64, 128 or 256.
        k_cache, v_cache: ``[pool_tokens, kv_heads, head_dim]`` of q's dtype; ``q_heads % kv_heads == 0``.
        req_to_token: int32 ``[max_reqs, max_len]``, token index of each position of each request slot.
        b_req_idx, b_seq_len: int32 ``[batch]``: slot and KV length (including the current token) per request.
        max_len_in_batch: upper bound of ``b_seq_len`` this launch must serve (the graph's maximum when
            captured); sizes the split grid.
        out: optional ``[batch, q_heads, head_dim]`` of q's dtype.
    Every layer of a step: :class:`GQADecodePlan` checks and resolves once.
    """
    check_q_device("gqa decode attention", q, k_cache)
    plan = GQADecodePlan("none", q.shape, q.dtype, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len,
                         max_len_in_batch, sm_scale=sm_scale, run_config=run_config)  # fmt: skip
    return plan.run(q, k_cache, v_cache, out=out)


def gqa_decode_attention_int8kv(
    q, k_cache, v_cache, k_scale, v_scale, req_to_token, b_req_idx, b_seq_len, max_len_in_batch,
    out=None, sm_scale=None, quant_group=8, run_config=None,
) -> torch.Tensor:  # fmt: skip
    """As :func:`gqa_decode_attention` over an INT8 pool: ``k_cache``/``v_cache`` int8
    ``[pool_tokens, kv_heads, head_dim]``, ``k_scale``/``v_scale`` float16 ``[pool_tokens, kv_heads,
    head_dim // quant_group]`` in the format of ``lightllm.common.kv_cache.quant`` (7 significant bits, at most 512,
    as its writers make them: other scales make the GPU path's one-FMA dequantization inexact). With 16-bit queries,
    |q| x ``sm_scale`` must stay below 65504 / (16 log2 e), about 2838 (|q| < 32K at the default scale, head_dim 128).
    """
    check_q_device("gqa decode attention", q, k_cache)
    plan = GQADecodePlan("int8", q.shape, q.dtype, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len,
                         max_len_in_batch, k_scale, v_scale, sm_scale, quant_group, run_config)  # fmt: skip
    return plan.run(q, k_cache, v_cache, k_scale, v_scale, out=out)


def gqa_decode_attention_int4kv(
    q, k_cache, v_cache, k_scale, v_scale, req_to_token, b_req_idx, b_seq_len, max_len_in_batch,
    out=None, sm_scale=None, quant_group=8, run_config=None,
) -> torch.Tensor:  # fmt: skip
    """As :func:`gqa_decode_attention` over an INT4 pool: ``k_cache``/``v_cache`` uint8
    ``[pool_tokens, kv_heads, head_dim // 2]`` (byte j: element j low nibble, j + head_dim/2 high nibble),
    scales float16 ``[pool_tokens, kv_heads, head_dim // quant_group]``."""
    check_q_device("gqa decode attention", q, k_cache)
    plan = GQADecodePlan("int4", q.shape, q.dtype, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len,
                         max_len_in_batch, k_scale, v_scale, sm_scale, quant_group, run_config)  # fmt: skip
    return plan.run(q, k_cache, v_cache, k_scale, v_scale, out=out)


def _check(q_shape, q_dtype, k_cache, v_cache, k_scale, v_scale, req_to_token, b_req_idx, b_seq_len, out, quant,
           quant_group):  # fmt: skip

    def fail(name, expected, got):
        raise ValueError(f"gqa decode attention ({quant} KV): {name} expected {expected}, got {got}")

    if len(q_shape) != 3 or q_dtype not in Q_DTYPES:
        fail("q", f"a [batch, q_heads, head_dim] tensor of {Q_DTYPES}", f"{tuple(q_shape)} {q_dtype}")
    batch, q_heads, head_dim = q_shape
    check_head_dim(fail, head_dim, HEAD_DIMS)
    device = k_cache.device
    packed_dim = head_dim // 2 if quant == "int4" else head_dim
    kv_dtype = {"none": q_dtype, "int8": torch.int8, "int4": torch.uint8}[quant]
    check_kv_pair(fail, k_cache, v_cache, packed_dim, kv_dtype)
    kv_heads = k_cache.shape[1]
    if v_cache.shape[:2] != k_cache.shape[:2] or q_heads % kv_heads:
        fail("kv_heads", f"k/v of one shape with q_heads ({q_heads}) a multiple of kv_heads", kv_heads)
    if quant != "none":
        half = head_dim // 2  # stage 1 reads each row as two halves (INT4 packs them; INT8 too has groups per half)
        if quant_group <= 0 or half % quant_group or quant_group & (quant_group - 1):
            fail("quant_group", f"a power of two dividing {half}", quant_group)
        groups = head_dim // quant_group
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            shape = (k_cache.shape[0], kv_heads, groups)
            if t is None or tuple(t.shape) != shape or t.dtype != SCALE_DTYPE or t.device != device:
                got = None if t is None else f"{tuple(t.shape)} {t.dtype} on {t.device}"
                fail(name, f"a {str(SCALE_DTYPE).removeprefix('torch.')} {list(shape)} tensor on {device}", got)
            # stage 1 reads a head's scales as one vector (its loads assume whole rows: stage1.py)
            if t.stride(2) != 1 or t.stride(0) % groups or t.stride(1) % groups:
                fail(name, f"contiguous rows of {groups} scales (strides multiples of {groups}, last 1)", t.stride())
    if req_to_token.dim() != 2 or req_to_token.dtype != torch.int32 or req_to_token.device != device:
        fail("req_to_token", "an int32 [max_reqs, max_len] tensor on the cache's device", f"{req_to_token.dtype}")
    check_request_rows(fail, batch, device, b_req_idx, b_seq_len)
    if out is not None and (out.shape != q_shape or out.dtype != q_dtype or out.stride(-1) != 1):
        fail("out", f"a {tuple(q_shape)} {q_dtype} tensor", f"{tuple(out.shape)} {out.dtype}")
