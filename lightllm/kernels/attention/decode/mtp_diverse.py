"""MTP diverse decode attention: the ``N + 1`` query tokens of an MTP verify step over one bf16/fp16 token pool.

Token ``t`` (0..N) of a request whose KV length ``L`` already counts the ``N + 1`` new tokens sees its first
``L - N + t`` keys. Stage 1 (``mtp_diverse_stages.py``) reads each split of a request's KV once for all its
query tokens and the query heads sharing the KV head; stage 2 merges the splits per token. Launches are sized by
``max_len_in_batch`` (the graph's maximum when captured), like the plain decode kernel, so a captured graph
serves any length up to it.

Tuned as ``mtp_diverse_decode`` in the DECODE_ATTENTION phase, on representative requests rebuilt over the
existing pool (every request at the tuning lengths, its tokens seeing ``L - N`` .. ``L`` keys), stage 1 and
stage 2 timed together.
"""

import math
from typing import Optional

import torch

from lightllm.common.autotuner import AutotuneKernelType, PlannedInputs, autotune
from lightllm.kernels.attention.decode.checks import (
    check_head_dim,
    check_kv_pair,
    check_q_device,
    check_request_rows,
    check_run_q_out,
)
from lightllm.kernels.attention.decode.flash_decode import (
    HEAD_DIMS,
    Q_DTYPES,
    default_config,
    split_kv_configs,
    split_kv_run_key,
)
from lightllm.kernels.attention.decode.mtp_diverse_stages import mtp_diverse_stage1_kernel, mtp_diverse_stage2_kernel
from lightllm.kernels.attention.decode.splits import min_blocks, num_splits
from lightllm.kernels.attention.decode.tuning import (
    decode_attn_autotune_seq_lens,
    decode_attn_run_key_distance,
    inputs_at_lengths,
)
from lightllm.kernels.launch_math import next_power_of_2
from lightllm.kernels.direct_launch import DirectLaunch
from lightllm.kernels.step_buffer import StepBuffer, split_partials

_MTP_STAGE1 = DirectLaunch(mtp_diverse_stage1_kernel)
_MTP_STAGE2 = DirectLaunch(mtp_diverse_stage2_kernel)

MAX_MTP_STEP = 4  # --mtp_step takes 1..4: q_len is 2..5 (1 is plain decode, accepted too)
MAX_GROUP = 8  # query heads per KV head: the stage-1 tile holds q_len x group rows (at most 40, padded to 64)
LOG2E = 1.4426950408889634


def _launch_mtp_diverse(
    q, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, max_len_in_batch, out, sm_scale, scratch=None,
    run_config=None,
):  # fmt: skip

    cfg = run_config or default_config(q.shape[3])
    if q.shape[0] > 0:
        mid_o, mid_lse = _stage1(q, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, max_len_in_batch, sm_scale,
                                 cfg, scratch)  # fmt: skip
        _stage2(mid_o, mid_lse, b_seq_len, out, cfg["BLOCK_N"], min_blocks(cfg))
    return out


def _stage1(q, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, max_len_in_batch, sm_scale, cfg, scratch=None):
    """Partial outputs ``[batch, q_len, q_heads, splits, D]`` and log-sum-exps (base 2) per split; a split past a
    request's blocks is not written, one that a token does not see holds 0 and -inf. ``scratch``: a plan's dict
    (``split_partials``), so the layers of one step share the partials."""
    batch, q_len, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = q_heads // kv_heads
    splits = num_splits(batch, kv_heads, max_len_in_batch, cfg["BLOCK_N"], cfg["WAVES"], q.device)
    mid_o, mid_lse = split_partials(scratch, (batch, q_len, q_heads, splits, head_dim), q.device)
    _MTP_STAGE1.launch(
        (batch, kv_heads, splits),
        q, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, mid_o, mid_lse, sm_scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_o.stride(3),
        mid_lse.stride(0), mid_lse.stride(1), mid_lse.stride(2),
        GROUP=group, Q_LEN=q_len, BLOCK_M=max(16, next_power_of_2(q_len * group)), HEAD_DIM=head_dim,
        BLOCK_N=cfg["BLOCK_N"], MIN_BLOCKS=min_blocks(cfg), PRECISION="ieee" if q.dtype == torch.float32 else None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return mid_o, mid_lse


def _stage2(mid_o, mid_lse, b_seq_len, out, block_n, least):
    """Merge the splits of each (request, token, head) into ``out``; ``block_n``, ``least``: stage 1's ``BLOCK_N``
    and ``MIN_BLOCKS`` (not tuned: as the plain kernel's stage 2)."""
    batch, q_len, q_heads, splits, head_dim = mid_o.shape
    _MTP_STAGE2.launch(
        (batch, q_len, q_heads),
        mid_o, mid_lse, b_seq_len, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_o.stride(3),
        mid_lse.stride(0), mid_lse.stride(1), mid_lse.stride(2),
        out.stride(0), out.stride(1), out.stride(2), splits, block_n, least,
        Q_LEN=q_len, HEAD_DIM=head_dim, num_warps=4 if head_dim <= 128 else 8,
    )  # fmt: skip


# ---- tuning declaration ---------------------------------------------------------------------------------


def _static_key(q, k_cache):
    return {
        "group": q.shape[2] // k_cache.shape[1],
        "head_dim": q.shape[3],
        "q_len": q.shape[1],
        "q_dtype": str(q.dtype),
        "kv_dtype": str(k_cache.dtype),
    }


def representative_mtp_groups(named: dict) -> list:
    """The caller's batch with every request (one MTP group of ``q_len`` tokens) at each tuning length ``L``, its
    tokens seeing ``L - N`` .. ``L`` keys, through one token table over the existing pool (indices wrap modulo
    its size: no KV is allocated). Launch sizes stay the caller's, so timings see the grid the graph replays."""
    q_len, launch_len = named["q"].shape[1], named["max_len_in_batch"]
    lens = decode_attn_autotune_seq_lens(launch_len)  # capped at launch_len
    if lens[-1] < q_len:
        raise ValueError(
            f"mtp diverse attention tuning: representative KV length expected at least q_len = mtp_step + 1 = "
            f"{q_len} (every token of a group sees one key or more), got {lens[-1]} (LIGHTLLM_DECODE_ATTN_AUTOTUNE_"
            f"SEQ_LEN capped at max_len_in_batch = {launch_len})"
        )
    return inputs_at_lengths(named, lens)


_launch_mtp_diverse_decode = autotune(
    kernel_name="mtp_diverse_decode",
    configs_gen_func=split_kv_configs,  # the plain decode kernel's candidates and run key
    static_key_func=_static_key,
    run_key_func=split_kv_run_key,
    run_key_distance_func=decode_attn_run_key_distance,
    kernel_type=AutotuneKernelType.DECODE_ATTENTION,
    rebuild_input_func=representative_mtp_groups,
    output_args=("out",),
)(_launch_mtp_diverse)


# ---- public API -----------------------------------------------------------------------------------------


class MTPDiverseDecodePlan:
    """MTP verify attention of one step, made from shapes and the pool before any layer runs: the arguments are
    checked once here and the tuned config resolved at the first :meth:`run`; every layer then runs with them.

    Args: ``q_shape`` ``[batch, q_len, q_heads, head_dim]`` and ``q_dtype`` for ``q``, any layer's
    ``k_cache``/``v_cache``; the rest as :func:`mtp_diverse_decode_attention`. ``reuse_outputs``: every run without
    ``out`` writes the same output, and every run the same split partials (``kernels/step_buffer.py``).
    """

    def __init__(
        self, q_shape, q_dtype, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, max_len_in_batch,
        sm_scale=None, run_config=None, reuse_outputs=False,
    ):  # fmt: skip
        q_shape = torch.Size(q_shape)
        _check(q_shape, q_dtype, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, max_len_in_batch)
        self.req_to_token, self.b_req_idx, self.b_seq_len = req_to_token, b_req_idx, b_seq_len
        self.max_len_in_batch = int(max_len_in_batch)
        self.sm_scale = float(sm_scale if sm_scale is not None else 1.0 / math.sqrt(q_shape[-1]))
        self.inputs = PlannedInputs(
            "mtp diverse attention", q=(q_shape, q_dtype), k_cache=(k_cache.shape, k_cache.dtype)
        )
        self._tuned = _launch_mtp_diverse_decode.plan(run_config=run_config)
        self._out = StepBuffer(q_shape, q_dtype, reuse_outputs)
        self._scratch = {} if reuse_outputs else None

    def run(self, q, k_cache, v_cache, out=None) -> torch.Tensor:
        self.inputs.check((q.shape, q.dtype), (k_cache.shape, k_cache.dtype))
        check_run_q_out("mtp diverse attention", q, out)
        if out is None:
            out = self._out.get(q.device)
        return self._tuned.run(q, k_cache, v_cache, self.req_to_token, self.b_req_idx, self.b_seq_len,
                               self.max_len_in_batch, out, self.sm_scale, self._scratch)  # fmt: skip


def mtp_diverse_decode_attention(
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
    """Decode attention of the ``q_len = N + 1`` tokens of each request of an MTP verify step.

    Args:
        q: ``[batch, q_len, q_heads, head_dim]``, q_len 1..5, head_dim 64/128/256; token ``t`` sees the first
            ``b_seq_len - q_len + 1 + t`` keys of its request (a token that sees none, in a padded row, gets 0).
        k_cache, v_cache: ``[pool_tokens, kv_heads, head_dim]`` of q's dtype; ``q_heads / kv_heads`` in 1..8.
        req_to_token, b_req_idx: as for :func:`gqa_decode_attention`.
        b_seq_len: int32 ``[batch]``: KV length per request, counting the ``q_len`` new tokens (already written).
        max_len_in_batch: upper bound of ``b_seq_len`` this launch serves (the graph's maximum when captured).
        out: optional ``[batch, q_len, q_heads, head_dim]`` of q's dtype.
    Every layer of a step: :class:`MTPDiverseDecodePlan` checks and resolves once.
    """
    check_q_device("mtp diverse attention", q, k_cache)
    plan = MTPDiverseDecodePlan(q.shape, q.dtype, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len,
                                max_len_in_batch, sm_scale, run_config)  # fmt: skip
    return plan.run(q, k_cache, v_cache, out=out)


def _check(q_shape, q_dtype, k_cache, v_cache, req_to_token, b_req_idx, b_seq_len, max_len_in_batch):
    def fail(name, expected, got):
        raise ValueError(f"mtp diverse attention: {name} expected {expected}, got {got}")

    if len(q_shape) != 4 or q_dtype not in Q_DTYPES:
        fail("q", f"a [batch, q_len, q_heads, head_dim] tensor of {Q_DTYPES}", f"{tuple(q_shape)} {q_dtype}")
    batch, q_len, q_heads, head_dim = q_shape
    if not 1 <= q_len <= MAX_MTP_STEP + 1:
        fail("q_len", f"1..{MAX_MTP_STEP + 1} (mtp_step + 1)", q_len)
    check_head_dim(fail, head_dim, HEAD_DIMS)
    device = k_cache.device
    check_kv_pair(fail, k_cache, v_cache, head_dim, q_dtype)
    kv_heads = k_cache.shape[1]
    if v_cache.shape[:2] != k_cache.shape[:2] or q_heads % kv_heads or not 1 <= q_heads // kv_heads <= MAX_GROUP:
        fail("kv_heads", f"k/v of one shape with q_heads ({q_heads}) = 1..{MAX_GROUP} x kv_heads", kv_heads)
    if req_to_token.dim() != 2 or req_to_token.dtype != torch.int32 or req_to_token.device != device:
        fail("req_to_token", f"an int32 [max_reqs, max_len] tensor on {device}",
             f"{tuple(req_to_token.shape)} {req_to_token.dtype} on {req_to_token.device}")  # fmt: skip
    check_request_rows(fail, batch, device, b_req_idx, b_seq_len)
    if int(max_len_in_batch) < 1:
        fail("max_len_in_batch", "a length >= 1", max_len_in_batch)
