"""Where quantized decode attention's time goes, step by step (issue 17 goal 1).

``decode_kv_read_probe.py`` showed that stage 1's grid reads an INT8 pool's bytes at 0.95 of the rate it reads a
bf16 pool's when it does nothing with them (INT4: 0.81), and that one integer operation per code costs under 1 %
there; yet the real INT8 kernel takes 1.39x the probe's time at d128, B=64, 32K. This times the kernel's
work as a ladder, every rung on the same grid, pool and config candidates (the tuner's for that KV type):

0. ``reads``: the probe (its own config grid): codes and scales loaded and xor'ed.
1. ``dequant``: stage 1's own K and V loading and dequantization (``stage1._load_kv_halves``, the PTX word path on a
   GPU), summed into a float32 tile per program (a conversion and an add per element).
2. ``dots``: and both dots as the kernel does them (``q K^T``, then that product in the values' 16-bit type times
   V), no softmax.
3. ``kernel``: the real decode (stage 1 and its few-microsecond stage 2; ``decode_attention.py``'s launch).

A rung's time over the one before it is what that work costs where the reads do not hide it. Each rung writes a
``[batch, kv_heads, splits, head_dim]`` float32 result checked against :func:`ladder_reference` before timing.

    python benchmarks/decode_stage1_ladder.py --out benchmarks/results/decode_stage1_ladder_h200.json
"""

import argparse
import json
import math
import os
import sys
from functools import partial

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling modules, however it is loaded
from decode_attention import SHAPES, candidate_configs, decode_fn, kv_bytes, make_pool  # noqa: E402
from decode_kv_read_probe import add_cell_args, cell_main, save, time_probe  # noqa: E402

from lightllm.common.kv_cache.quant import INT4_OFFSET, dequantize_int4_ref, dequantize_int8_ref  # noqa: E402
from lightllm.kernels.attention.decode.flash_decode import _QUANT_BITS, _ptx_path  # noqa: E402
from lightllm.kernels.attention.decode.splits import (  # noqa: E402
    min_blocks,
    num_splits,
    split_token_ranges,
    split_tokens,
)
from lightllm.kernels.attention.decode.stage1 import INT8_PTX_UNIT, _load_kv_halves, _load_q_halves  # noqa: E402
from lightllm.kernels.launch_math import next_power_of_2  # noqa: E402

RUNGS = ("reads", "dequant", "dots", "kernel")
DEFAULT_CELLS = ["hq32-hk8-d128:64"]


@triton.jit
def stage1_ladder_kernel(
    Q, K, V, K_scale, V_scale, req_to_token, b_seq_len, OUT,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kst, stride_ksh, stride_vst, stride_vsh, stride_rr, stride_ob, stride_oh, stride_os,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HALF_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_BLOCKS: tl.constexpr, QUANT: tl.constexpr, QGROUP: tl.constexpr, INT4_OFFSET: tl.constexpr,
    F16: tl.constexpr, ASM: tl.constexpr, DOTS: tl.constexpr,
):  # fmt: skip
    """Program (b, h, s) over split ``s``'s tokens of request ``b`` (request ``b`` in row ``b`` of
    ``req_to_token``), as stage 1 splits them. Without ``DOTS``: ``sum_t K[t] + V[t]`` (dequantized). With ``DOTS``:
    ``sum_h sum_t f16(q_h . K[t]) V[t]`` over the group's query heads. Splits without tokens write zeros."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(b_seq_len + b)
    per_split = split_tokens(seq_len, tl.num_programs(2), BLOCK_N, MIN_BLOCKS)
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    d = tl.arange(0, HALF_D)
    h = tl.arange(0, BLOCK_H)
    q_lo, q_hi = _load_q_halves(Q, b, kvh * GROUP + h, h < GROUP, stride_qb, stride_qh, HALF_D, F16)
    kv_dtype = q_lo.dtype
    tokens = req_to_token + b.to(tl.int64) * stride_rr
    if DOTS:
        acc_lo = tl.zeros([BLOCK_H, HALF_D], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_H, HALF_D], dtype=tl.float32)
    else:
        acc_lo = tl.zeros([BLOCK_N, HALF_D], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_N, HALF_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        tok = tl.load(tokens + offs_n, mask=mask_n, other=0).to(tl.int64)
        k_lo, k_hi = _load_kv_halves(K, K_scale, tok * stride_kt + kvh * stride_kh, tok * stride_kst + kvh * stride_ksh,
                                     mask_n, d, BLOCK_N, HALF_D, QUANT, QGROUP, INT4_OFFSET, F16, ASM,
                                     kv_dtype)  # fmt: skip
        if DOTS:
            qk = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))
            if ASM and QUANT == 8:
                qk = qk * INT8_PTX_UNIT  # the PTX INT8 path's K is 1/16 of its value (stage1._int8_word_to_f16)
        v_lo, v_hi = _load_kv_halves(V, V_scale, tok * stride_vt + kvh * stride_vh, tok * stride_vst + kvh * stride_vsh,
                                     mask_n, d, BLOCK_N, HALF_D, QUANT, QGROUP, INT4_OFFSET, F16, ASM,
                                     kv_dtype)  # fmt: skip
        if DOTS:
            p = qk.to(v_lo.dtype)
            acc_lo += tl.dot(p, v_lo)
            acc_hi += tl.dot(p, v_hi)
        else:
            acc_lo += k_lo.to(tl.float32) + v_lo.to(tl.float32)
            acc_hi += k_hi.to(tl.float32) + v_hi.to(tl.float32)
    if ASM and QUANT == 8:  # and so is V
        acc_lo = acc_lo * INT8_PTX_UNIT
        acc_hi = acc_hi * INT8_PTX_UNIT
    o_ptr = OUT + b.to(tl.int64) * stride_ob + kvh * stride_oh + split * stride_os + d
    tl.store(o_ptr, tl.sum(acc_lo, 0))
    tl.store(o_ptr + HALF_D, tl.sum(acc_hi, 0))


def launch_rung(dots, kind, q, pool, req_to_token, seq_lens, graph_max, group, cfg, out=None):
    """Rung ``dequant`` (``dots`` False) or ``dots`` for a launch serving ``graph_max``: ``[batch, kv_heads, splits,
    head_dim]`` float32 (into ``out`` when given, of that shape). Request ``b`` reads row ``b`` of ``req_to_token``."""
    k, v, ks, vs = pool
    batch, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    splits = num_splits(batch, kv_heads, graph_max, cfg["BLOCK_N"], cfg["WAVES"], q.device)
    shape = (batch, kv_heads, splits, head_dim)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=q.device)
    elif tuple(out.shape) != shape:
        raise ValueError(f"out: expected shape {shape}, got {tuple(out.shape)}")
    ks = k if ks is None else ks  # unread without scales: any pointer does
    vs = v if vs is None else vs
    f16 = kind != "none" and q.dtype != torch.float32
    stage1_ladder_kernel[(batch, kv_heads, splits)](
        q, k, v, ks, vs, req_to_token, seq_lens, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1), req_to_token.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        GROUP=q_heads // kv_heads, BLOCK_H=max(16, next_power_of_2(q_heads // kv_heads)), HALF_D=head_dim // 2,
        BLOCK_N=cfg["BLOCK_N"], MIN_BLOCKS=min_blocks(cfg), QUANT=_QUANT_BITS[kind], QGROUP=group,
        INT4_OFFSET=INT4_OFFSET, F16=f16, ASM=f16 and _ptx_path(q, k, v, group), DOTS=dots,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def dequantized(kind, pool, group):
    """K and V of the pool as float32 ``[tokens, kv_heads, head_dim]``."""
    k, v, ks, vs = pool
    if kind == "none":
        return k.float(), v.float()
    deq = dequantize_int8_ref if kind == "int8" else dequantize_int4_ref
    return deq(k, ks, group).float(), deq(v, vs, group).float()


def ladder_reference(dots, kind, q, pool, req_to_token, seq_lens, splits, block_n, group, least=1):
    """What :func:`launch_rung` writes, in float32 from the dequantized pool (the products ``q . K`` rounded to the
    kernel's 16-bit type before they weigh V, as the kernel does)."""
    k, v = dequantized(kind, pool, group)
    batch, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    per = q_heads // kv_heads
    p_dtype = torch.float16 if kind != "none" else q.dtype
    out = torch.zeros(batch, kv_heads, splits, head_dim, dtype=torch.float32)
    for b, length in enumerate(seq_lens.tolist()):
        for s, (start, end) in enumerate(split_token_ranges(length, splits, block_n, least)):
            tok = req_to_token[b, start:end].long().cpu()
            for h in range(kv_heads):
                kt, vt = k[tok, h].cpu(), v[tok, h].cpu()
                if not dots:
                    out[b, h, s] = (kt + vt).sum(0)
                    continue
                qh = q[b, h * per : (h + 1) * per].float().cpu()
                p = (qh @ kt.T).to(p_dtype).float()
                out[b, h, s] = (p @ vt).sum(0)
    return out


def check_rung(dots, kind, q, pool, req_to_token, seq_lens, graph_max, group, cfg):
    """The rung against :func:`ladder_reference` (every element written, within 16-bit rounding)."""
    batch, _, head_dim = q.shape
    splits = num_splits(batch, pool[0].shape[1], graph_max, cfg["BLOCK_N"], cfg["WAVES"], q.device)
    out = torch.full((batch, pool[0].shape[1], splits, head_dim), float("nan"), device=q.device)
    launch_rung(dots, kind, q, pool, req_to_token, seq_lens, graph_max, group, cfg, out=out)
    want = ladder_reference(dots, kind, q, pool, req_to_token, seq_lens, splits, cfg["BLOCK_N"], group,
                            min_blocks(cfg))  # fmt: skip
    got = out.cpu()
    if not torch.isfinite(got).all():
        raise AssertionError(f"rung {'dots' if dots else 'dequant'} ({kind}) left elements unwritten")
    tol = 2e-2 * float(want.abs().max())
    torch.testing.assert_close(got, want, atol=tol, rtol=2e-2)


def time_rung(fn, configs):
    """``(ms, config)`` of the fastest config (graph-timed; configs that fail to compile or run are left out)."""
    from lightllm.common.autotuner import cuda_graph_bench

    best = (math.inf, None)
    for cfg in configs:
        try:
            best = min(best, (cuda_graph_bench(fn(cfg)), cfg), key=lambda t: t[0])
        except Exception as e:  # out of resources at some shapes
            print(f"  {cfg}: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr)
    return best


def run(args):
    rows = []
    for cell in args.cells:
        shape, batch = cell.split(":")
        batch = int(batch)
        q_heads, kv_heads, head_dim = SHAPES[shape]
        for kind, group in [("none", 0)] + [(k, g) for k in ("int8", "int4") for g in args.groups]:
            q_small = torch.randn(2, q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
            small = make_pool(kind, 2 * 4096, kv_heads, head_dim, group or 8, args.head_major)
            r2t_small = torch.randperm(2 * 4096, device="cuda").to(torch.int32).view(2, 4096)
            seq_small = torch.tensor([4096, 1500], device="cuda", dtype=torch.int32)
            for dots in (False, True):
                check_rung(dots, kind, q_small, small, r2t_small, seq_small, 4096, group or 8,
                           {"BLOCK_N": 64, "num_warps": 2, "num_stages": 3, "WAVES": 2})  # fmt: skip
            small = None

            tokens = batch * args.len
            pool = make_pool(kind, tokens, kv_heads, head_dim, group or 8, args.head_major)
            q = torch.randn(batch, q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
            r2t = torch.arange(tokens, device="cuda", dtype=torch.int32).view(batch, args.len)
            idx = torch.arange(batch, device="cuda", dtype=torch.int32)
            seq = torch.full((batch,), args.len, device="cuda", dtype=torch.int32)
            out = torch.empty_like(q)
            configs = candidate_configs(kind, q)
            times = {"reads": time_probe(pool, r2t, seq, args.len)[0]}
            for name, dots in (("dequant", False), ("dots", True)):
                rung = partial(launch_rung, dots, kind, q, pool, r2t, seq, args.len, group or 8)
                times[name] = time_rung(lambda cfg, rung=rung: partial(rung, cfg), configs)
            times["kernel"] = time_rung(partial(decode_fn, kind, q, pool, r2t, idx, seq, args.len, out, group or 8),
                                        configs)  # fmt: skip
            rows.append({"shape": shape, "B": batch, "L": args.len, "kind": kind, "group": group,
                         "bytes": kv_bytes(kind, batch, args.len, kv_heads, head_dim, group or 8),
                         **{f"{rung}_ms": times[rung][0] for rung in RUNGS},
                         "cfg": {rung: times[rung][1] for rung in RUNGS}})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            save(args, rows)  # a run cut short keeps its finished rows
            pool = None  # free before the next KV type's pool
            torch.cuda.empty_cache()
    return rows


def print_table(rows):
    """Per cell and KV type: each rung's time (us) and what it adds over the rung before, and the byte rate of the
    reads and of the kernel."""
    print("us per decode; '+' what a rung adds over the one before it; TB/s of the KV bytes (codes + scales)")
    print(f"{'shape':14s} {'B':>3s} kind  grp    reads  dequant (+)     dots (+)        kernel (+)      "
          f"reads TB/s  kernel TB/s")  # fmt: skip
    for r in rows:
        us = [r[f"{rung}_ms"] * 1e3 for rung in RUNGS]
        steps = "  ".join(f"{us[i]:7.1f} ({us[i] - us[i - 1]:+6.1f})" for i in range(1, len(RUNGS)))
        print(f"{r['shape']:14s} {r['B']:3d} {r['kind']:4s} {r['group']:4d} {us[0]:8.1f}  {steps}  "
              f"{r['bytes'] / r['reads_ms'] / 1e9:10.2f}  {r['bytes'] / r['kernel_ms'] / 1e9:11.2f}")  # fmt: skip


def _validate(p, args):
    bad = [g for g in args.groups if g not in (8, 16, 32, 64)]
    if bad:
        p.error(f"--groups expected quant groups of 8, 16, 32 or 64 elements, got {bad}")
    if args.len < 1:
        p.error(f"--len expected a KV length of at least 1 token, got {args.len}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cell_args(p, DEFAULT_CELLS, [8])
    p.add_argument("--out", default="benchmarks/results/decode_stage1_ladder.json")
    return cell_main(p, argv, run, print_table, _validate)


if __name__ == "__main__":
    main()
