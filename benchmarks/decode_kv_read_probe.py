"""How fast decode attention's grid can read a KV pool when its arithmetic is free: the open question of issue 17
goal 1. The quantized stage 1 reads its bytes (codes + scales) at 0.69 (INT8) and 0.45-0.54 (INT4) of the rate bf16
reads its own (decode_attention_quant.py); is that its arithmetic or its reads?

A probe kernel runs stage 1's grid, ``(batch, kv_heads, splits)`` with ``splits`` from ``num_splits`` and each
split's tokens as stage 1 assigns them (``split_tokens``), over the same pool through the same token indirection
(``req_to_token``). Per ``BLOCK_N``-token tile it loads K's and V's codes as 32-bit words and, for INT8/INT4, their
float16 scales as 16-bit words (with ``PREFETCH``, the next tile's before this one is used), and only xors them
together; each program writes one word (so no load is dead and the result is checked against
:func:`probe_reference`). Per cell and KV type it reports the fastest of a config grid (``BLOCK_N``, warps, stages,
waves, ``PREFETCH``), graph-timed, as a byte rate and as a share of the bf16 probe's, beside the real kernel's time
from a saved ``decode_attention_quant.py`` run (``--against``). ``--work`` then adds, per code word, that many
dependent integer multiply-adds before the xor (timed over the 8 fastest configs without work): how much arithmetic
per byte the reads hide at this grid before their rate falls, which is what a quantized kernel spends on
dequantization (INT8: four codes a word, so 4 is about one operation per code).

    python benchmarks/decode_kv_read_probe.py --out benchmarks/results/decode_kv_read_probe_h200.json \
        --against benchmarks/results/decode_attention_quant_token_major_h200.json
"""

import argparse
import itertools
import json
import math
import os
import sys

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling modules, however it is loaded
from decode_attention import SHAPES, check_cells, kv_bytes, make_pool  # noqa: E402

from lightllm.kernels.attention.decode.splits import num_splits, split_token_ranges, split_tokens  # noqa: E402

MIX_ADD = tl.constexpr(-1640531527)  # 0x9E3779B9 as an int32
CONFIGS = [{"BLOCK_N": n, "num_warps": w, "num_stages": s, "WAVES": waves, "PREFETCH": pre}
           for n, w, s, waves, pre in itertools.product((32, 64, 128), (2, 4, 8), (2, 3), (1, 2, 4), (False, True))
           ]  # fmt: skip
DEFAULT_CELLS = ["hq32-hk8-d128:64", "hq32-hk8-d128:16", "hq24-hk4-d256:64"]


@triton.jit
def _mix(words, WORK: tl.constexpr):
    """``WORK`` dependent integer multiply-adds per word (``w * w + c``, wrapping: nothing folds it), standing in
    for dequantization's work per code word."""
    for _ in tl.static_range(WORK):
        words = words * words + MIX_ADD
    return words


@triton.jit
def _load_tile(K, V, KS, VS, REQ_TO_TOKEN, b, h, n0, end,
               stride_kt, stride_kh, stride_vt, stride_vh, stride_kst, stride_ksh, stride_vst, stride_vsh, stride_rt,
               BLOCK_N: tl.constexpr, WORDS: tl.constexpr, SCALE_WORDS: tl.constexpr,
               HAS_SCALES: tl.constexpr):  # fmt: skip
    """The tile of tokens ``[n0, n0 + BLOCK_N)`` below ``end``: K and V words and (zeros without scales) scales."""
    n = n0 + tl.arange(0, BLOCK_N)
    valid = n < end
    offs_w = tl.arange(0, WORDS)
    offs_s = tl.arange(0, SCALE_WORDS)
    tok = tl.load(REQ_TO_TOKEN + b * stride_rt + n, mask=valid, other=0).to(tl.int64)
    k = tl.load(K + tok[:, None] * stride_kt + h * stride_kh + offs_w[None, :], mask=valid[:, None], other=0)
    v = tl.load(V + tok[:, None] * stride_vt + h * stride_vh + offs_w[None, :], mask=valid[:, None], other=0)
    ks = tl.zeros([BLOCK_N, SCALE_WORDS], dtype=tl.int16)
    vs = tl.zeros([BLOCK_N, SCALE_WORDS], dtype=tl.int16)
    if HAS_SCALES:
        ks = tl.load(KS + tok[:, None] * stride_kst + h * stride_ksh + offs_s[None, :], mask=valid[:, None], other=0)
        vs = tl.load(VS + tok[:, None] * stride_vst + h * stride_vsh + offs_s[None, :], mask=valid[:, None], other=0)
    return k, v, ks, vs


@triton.jit
def kv_read_probe_kernel(
    K, V, KS, VS, REQ_TO_TOKEN, B_SEQ, OUT,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kst, stride_ksh, stride_vst, stride_vsh,
    stride_rt, stride_ob, stride_oh, splits,
    BLOCK_N: tl.constexpr, WORDS: tl.constexpr, SCALE_WORDS: tl.constexpr, HAS_SCALES: tl.constexpr,
    MIN_BLOCKS: tl.constexpr, PREFETCH: tl.constexpr, WORK: tl.constexpr,
):  # fmt: skip
    """Program (b, h, s): the xor of every 32-bit code word of K and V (``WORDS`` a token) and, with
    ``HAS_SCALES``, of every 16-bit scale of both (``SCALE_WORDS`` a token; sign-extended), over split ``s``'s tokens
    of request ``b``. ``PREFETCH``: the next tile's loads are issued before this tile is used (one tile in flight
    in registers), since Triton does not pipeline loads that feed no dot. ``WORK``: integer multiply-adds per code
    word before the xor (:func:`_mix`)."""
    b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(B_SEQ + b)
    per_split = split_tokens(seq_len, splits, BLOCK_N, MIN_BLOCKS)
    start = s * per_split
    end = tl.minimum(start + per_split, seq_len)
    acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.int32)
    acc_s = tl.zeros([BLOCK_N, SCALE_WORDS], dtype=tl.int16)
    if PREFETCH:
        k, v, ks, vs = _load_tile(K, V, KS, VS, REQ_TO_TOKEN, b, h, start, end,
                                  stride_kt, stride_kh, stride_vt, stride_vh, stride_kst, stride_ksh, stride_vst,
                                  stride_vsh, stride_rt, BLOCK_N, WORDS, SCALE_WORDS, HAS_SCALES)  # fmt: skip
        for n0 in range(start, end, BLOCK_N):
            k2, v2, ks2, vs2 = _load_tile(K, V, KS, VS, REQ_TO_TOKEN, b, h, n0 + BLOCK_N, end,
                                          stride_kt, stride_kh, stride_vt, stride_vh, stride_kst, stride_ksh,
                                          stride_vst, stride_vsh, stride_rt, BLOCK_N, WORDS, SCALE_WORDS,
                                          HAS_SCALES)  # fmt: skip
            acc ^= _mix(k, WORK) ^ _mix(v, WORK)
            acc_s ^= ks ^ vs
            k, v, ks, vs = k2, v2, ks2, vs2
    else:
        for n0 in range(start, end, BLOCK_N):
            k, v, ks, vs = _load_tile(K, V, KS, VS, REQ_TO_TOKEN, b, h, n0, end,
                                      stride_kt, stride_kh, stride_vt, stride_vh, stride_kst, stride_ksh, stride_vst,
                                      stride_vsh, stride_rt, BLOCK_N, WORDS, SCALE_WORDS, HAS_SCALES)  # fmt: skip
            acc ^= _mix(k, WORK) ^ _mix(v, WORK)
            acc_s ^= ks ^ vs
    word = tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0)
    word ^= tl.xor_sum(tl.xor_sum(acc_s, axis=1), axis=0).to(tl.int32)
    tl.store(OUT + b * stride_ob + h * stride_oh + s, word)


def ptx_multiplies(words, work, block_n=64, num_warps=2, arch=90):
    """32-bit integer multiplies (``mul.lo``/``mad.lo``) in the probe's PTX for ``sm_<arch>`` at ``words`` code words a
    token and ``work``: shows the work chain survives the compiler (each round one per word a thread loads). Compiles
    on any machine (no GPU)."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = kv_read_probe_kernel
    types = {name: "i32" for name in kernel.arg_names}
    types.update(K="*i32", V="*i32", KS="*i16", VS="*i16", REQ_TO_TOKEN="*i32", B_SEQ="*i32", OUT="*i32")
    consts = dict(BLOCK_N=block_n, WORDS=words, SCALE_WORDS=16, HAS_SCALES=True, MIN_BLOCKS=1, PREFETCH=True,
                  WORK=work)  # fmt: skip
    types.update({name: "constexpr" for name in consts})
    compiled = triton.compile(ASTSource(kernel, types, consts), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": 2})  # fmt: skip
    return len(re.findall(r"\b(?:mad|mul)\.lo\.s32\b", compiled.asm["ptx"]))


def as_words(pool):
    """The pool as the probe reads it: codes (or bf16 values) as int32 words, scales as int16 (None for bf16)."""
    k, v, ks, vs = pool
    codes = [t.view(torch.int32) for t in (k, v)]
    scales = [None, None] if ks is None else [t.view(torch.int16) for t in (ks, vs)]
    return (*codes, *scales)


def launch_probe(pool, req_to_token, seq_lens, graph_max, cfg, out=None):
    """Run the probe for a launch serving ``graph_max`` (its split grid), ``cfg`` a config of ``CONFIGS``:
    ``[batch, kv_heads, splits]`` int32 (into ``out`` when given, of that shape)."""
    k, v, ks, vs = as_words(pool)
    batch, kv_heads = seq_lens.shape[0], k.shape[1]
    splits = num_splits(batch, kv_heads, graph_max, cfg["BLOCK_N"], cfg["WAVES"], k.device)
    if out is None:
        out = torch.empty(batch, kv_heads, splits, dtype=torch.int32, device=k.device)
    elif tuple(out.shape) != (batch, kv_heads, splits):
        raise ValueError(f"out: expected shape {(batch, kv_heads, splits)}, got {tuple(out.shape)}")
    ks_, vs_ = (k, v) if ks is None else (ks, vs)  # unread without scales: any pointer does
    kv_read_probe_kernel[(batch, kv_heads, splits)](
        k, v, ks_, vs_, req_to_token, seq_lens, out,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        ks_.stride(0), ks_.stride(1), vs_.stride(0), vs_.stride(1),
        req_to_token.stride(0), out.stride(0), out.stride(1), splits,
        BLOCK_N=cfg["BLOCK_N"], WORDS=k.shape[2], SCALE_WORDS=1 if ks is None else ks.shape[2],
        HAS_SCALES=ks is not None, MIN_BLOCKS=1, PREFETCH=cfg.get("PREFETCH", False), WORK=cfg.get("WORK", 0),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def mix_reference(words, work):
    """:func:`_mix` in numpy (uint32 arithmetic wraps as the kernel's int32 does)."""
    w = words.astype(np.int64).astype(np.uint32)
    for _ in range(work):
        w = w * w + np.uint32(MIX_ADD.value & 0xFFFFFFFF)
    return w.view(np.int32)


def probe_reference(pool, req_to_token, seq_lens, splits, block_n, work=0):
    """What :func:`launch_probe` writes, in numpy: per (request, head, split) the xor of its tokens' words (each
    code word after ``work`` rounds of :func:`_mix`)."""
    k, v, ks, vs = (None if t is None else t.cpu().numpy() for t in as_words(pool))
    r2t, lens = req_to_token.cpu().numpy(), seq_lens.cpu().tolist()
    out = np.zeros((len(lens), k.shape[1], splits), dtype=np.int32)
    for b, length in enumerate(lens):
        for s, (start, end) in enumerate(split_token_ranges(length, splits, block_n)):
            tok = r2t[b, start:end]
            for h in range(k.shape[1]):
                words = np.concatenate([k[tok, h].ravel(), v[tok, h].ravel()])
                word = np.bitwise_xor.reduce(mix_reference(words, work), initial=0)
                if ks is not None:
                    scales = np.concatenate([ks[tok, h].ravel(), vs[tok, h].ravel()])
                    word ^= np.int32(np.bitwise_xor.reduce(scales, initial=np.int16(0)))
                out[b, h, s] = word
    return torch.from_numpy(out)


def time_probe(pool, req_to_token, seq_lens, graph_max, configs=CONFIGS):
    """``[(ms, config), ...]`` fastest first, graph-timed (configs that fail to compile or run are left out)."""
    from lightllm.common.autotuner import cuda_graph_bench

    timed = []
    for cfg in configs:
        try:
            timed.append((cuda_graph_bench(lambda: launch_probe(pool, req_to_token, seq_lens, graph_max, cfg)), cfg))
        except Exception:  # out of resources at some shapes
            continue
    return sorted(timed, key=lambda t: t[0]) or [(math.inf, None)]


def check_probe(kind, kv_heads, head_dim, group, head_major, work=0, length=4096):
    """The probe (with ``work``) against :func:`probe_reference` on a small pool of this KV type (two requests, one
    ragged)."""
    pool = make_pool(kind, 2 * length, kv_heads, head_dim, group, head_major)
    r2t = torch.randperm(2 * length, device="cuda").to(torch.int32).view(2, length)
    seq = torch.tensor([length, length // 3 + 5], device="cuda", dtype=torch.int32)
    cfg = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "WAVES": 1, "PREFETCH": True, "WORK": work}
    got = launch_probe(pool, r2t, seq, length, cfg).cpu()
    if not torch.equal(got, probe_reference(pool, r2t, seq, got.shape[2], cfg["BLOCK_N"], work)):
        raise AssertionError(f"the probe's output differs from its reference ({kind}, {kv_heads} heads, d{head_dim})")


def real_kernel_ms(against, shape, batch, length, kind, group):
    """The real kernel's time for a cell from a saved decode_attention_quant.py run, or None."""
    for row in against or ():
        if (row["shape"], row["B"], row["L"], row["kind"]) == (shape, batch, length, kind) and (
            kind == "none" or row["group"] == group
        ):
            return row["ms"]
    return None


def run(args):
    against = None
    if args.against:
        with open(args.against) as f:
            against = json.load(f)["rows"]
    rows = []
    for cell in args.cells:
        shape, batch = cell.split(":")
        batch = int(batch)
        _, hk, d = SHAPES[shape]
        tokens = batch * args.len
        r2t = torch.arange(tokens, device="cuda", dtype=torch.int32).view(batch, args.len)
        seq = torch.full((batch,), args.len, device="cuda", dtype=torch.int32)
        for kind, group in [("none", 0)] + [(k, g) for k in ("int8", "int4") for g in args.groups]:
            check_probe(kind, hk, d, group or 8, args.head_major, max(args.work))
            pool = make_pool(kind, tokens, hk, d, group or 8, args.head_major)
            nbytes = kv_bytes(kind, batch, args.len, hk, d, group or 8)
            real = real_kernel_ms(against, shape, batch, args.len, kind, group)
            timed = time_probe(pool, r2t, seq, args.len)  # the whole grid without work
            for work in args.work:  # with work: the 8 fastest configs without it
                best = timed if work == 0 else time_probe(pool, r2t, seq, args.len,
                                                          [{**c, "WORK": work} for _, c in timed[:8] if c])  # fmt: skip
                ms, cfg = best[0]
                rows.append({"shape": shape, "B": batch, "L": args.len, "kind": kind, "group": group, "work": work,
                             "probe_ms": ms, "cfg": cfg, "bytes": nbytes, "kernel_ms": real})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
                save(args, rows, against=args.against)  # a run cut short keeps its rows
            del pool
            torch.cuda.empty_cache()
    return rows


def save(args, rows, **extra):
    """``args.out``: the run so far, in the layout this probe and ``decode_stage1_ladder.py`` share (plus ``extra``)."""
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "len": args.len, "head_major": args.head_major, **extra,
                   "rows": rows}, f, indent=1)  # fmt: skip


def print_table(rows):
    """Per cell and KV type: the probe's time and byte rate, its rate over the bf16 probe's, and the real kernel's."""
    base = {(r["shape"], r["B"]): r for r in rows if r["kind"] == "none" and not r.get("work")}
    print(
        "work: integer multiply-adds per 32-bit code word; 'x bf16 probe rate': the rate over the bf16 probe's "
        "without work"
    )
    print(f"{'shape':14s} {'B':>3s} kind  grp work  probe us  probe TB/s  x bf16 probe rate  kernel us  kernel TB/s")
    for r in rows:
        b = base.get((r["shape"], r["B"]))
        rate = r["bytes"] / r["probe_ms"] / 1e9
        rel = rate / (b["bytes"] / b["probe_ms"] / 1e9) if b else float("nan")
        kernel = r.get("kernel_ms")
        k_text = f"{kernel * 1e3:9.1f}  {r['bytes'] / kernel / 1e9:11.2f}" if kernel else f"{'-':>9s}  {'-':>11s}"
        print(f"{r['shape']:14s} {r['B']:3d} {r['kind']:4s} {r['group']:4d} {r.get('work', 0):4d} "
              f"{r['probe_ms'] * 1e3:9.1f} {rate:11.2f} "
              f"{rel:18.2f}  {k_text}")  # fmt: skip


def add_cell_args(p, default_cells, default_groups):
    """The flags this probe and ``decode_stage1_ladder.py`` share: which cells, KV length, quant groups, pool layout,
    and ``--analyze``."""
    p.add_argument("--cells", nargs="+", default=default_cells, help="SHAPE:BATCH, shapes of decode_attention.py")
    p.add_argument("--len", type=int, default=32768, help="every request's KV length (and the launch's maximum)")
    p.add_argument("--groups", nargs="+", type=int, default=default_groups, help="INT8/INT4 quant group sizes")
    p.add_argument("--head-major", action="store_true", help="head-major pools (decode_attention_quant.py's probe)")
    p.add_argument("--analyze", metavar="JSON", help="print the table of a saved run (no GPU needed)")


def cell_main(p, argv, run, print_table, validate):
    """What this probe's and ``decode_stage1_ladder.py``'s ``main`` share once their flags are declared: ``--analyze``
    prints a saved run anywhere; otherwise the cells and ``validate(p, args)`` (one error line each), a CUDA GPU, and
    the run's table."""
    args = p.parse_args(argv)
    if args.analyze:
        with open(args.analyze) as f:
            return print_table(json.load(f)["rows"])
    check_cells(p, args.cells)
    validate(p, args)
    if not torch.cuda.is_available():
        sys.exit(f"{p.prog} needs a CUDA GPU (--analyze reads a saved run anywhere)")
    print_table(run(args))


def _validate(p, args):
    if args.work[0] != 0 or any(w < 0 for w in args.work):
        p.error(f"--work expected 0 first, then non-negative counts, got {args.work}")
    if args.len < 4096:
        p.error(f"--len expected at least 4096 (the correctness check's length), got {args.len}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cell_args(p, DEFAULT_CELLS, [8, 32])
    p.add_argument("--work", nargs="+", type=int, default=[0, 2, 4, 8], help="integer multiply-adds per code "
                   "word to time besides none (0 first; each over the 8 fastest configs without work)")  # fmt: skip
    p.add_argument("--against", metavar="JSON", help="a decode_attention_quant.py run: the real kernels' times")
    p.add_argument("--out", default="benchmarks/results/decode_kv_read_probe.json")
    return cell_main(p, argv, run, print_table, _validate)


if __name__ == "__main__":
    main()
