"""Decode attention on the GPU: Triton GQA flash decode (bf16, INT8, INT4 KV) against FlashAttention-3.

Matrix B x L for two shapes, every time a CUDA-graph replay median on random data, launched for a graph
whose maximum length is the largest L (as a captured decode graph is):

- per cell: the default config, the per-cell best of the configs the tuner searches for that KV type ("tuned"), the
  config a graph
  freezes under each choice rule, FA3 (``fa3_fwd_interface``) at each ``num_splits`` and its best, achieved
  bandwidth as % of the device-to-device copy measured in the same run, INT8/INT4 speed-ups over bf16;
- the frozen-config analysis: per batch, the config each choice rule picks from the tuner's ladder of lengths
  (``decode_attn_autotune_seq_lens``; FA3's own ladder for FA3), applied at every L, against that L's best and
  against the default (FA3: its own split heuristic), and FA3's geo-mean gain over its heuristic at B >= 16;
- stage 2's share of the time and whether its num_warps matters.

Each launch is timed in ``--passes`` passes (default 2), alternating the order, and keeps its fastest: in one H200 run
of a single pass, the first launches of each batch's first cell (a new KV pool) ran up to 12 % slow at 1K, which
flattered the tuned configs against the default (timed first) and moved the frozen choice.

    python benchmarks/decode_attention.py --out benchmarks/results/decode_attention_h200.json

``--buckets 4096 ...`` instead measures decode graphs per KV length bucket (the engine's ``--graph_len_buckets``,
``decode_attention_buckets.py``): per cell the graph of the smallest bucket >= L replays the config each rule picks
from that bucket's ladder, launched for the bucket; its loss vs the cell's best and default eager launches, beside
one bucket (today). Triton only (no FA3, no stage-2 study); only the (length, launch length) points the analysis
needs are timed, each for every candidate:

    python benchmarks/decode_attention.py --buckets 4096 --batches 1 8 16 --lens 1024 8192 32768 --kinds none \
        --no-fa3 --out benchmarks/results/decode_attention_buckets_h200.json

``--analyze RUN --nearest 8192 16384`` reads a saved bucket run instead: a graph of each of those lengths, never
tuned itself, replays the config tuned for a graph of each ``--tuned-lens`` length (default 4096 32768, what ships),
and the table says which one the tuner's nearest-key rule takes. ``--analyze RUN --level0 16384 4096,16384`` gives
those bucket sets at level 0 with configs tuned only at ``--tuned-lens``: each bucket's graph replays what the rule
takes for it. No GPU; the run must have timed those graphs (as ``--also-buckets`` does):

    python benchmarks/decode_attention.py --analyze benchmarks/results/decode_attention_bucket_sets_h200.json \
        --nearest 8192 16384 --out benchmarks/results/decode_attention_nearest_tuned_len_h200.json
"""

import argparse
import json
import math
import statistics
import sys
import time

import torch
import triton

from bandwidth import copy_gbs
from bench_io import read_saved_runs, save_json
from decode_attention_buckets import (
    analyze_buckets,
    analyze_level0,
    analyze_nearest,
    bucket_ladders,
    bucket_sets,
    graph_lens,
    parse_set,
    print_bucket_table,
    print_level0_table,
    print_nearest_table,
    set_name,
    timing_points,
)
from lightllm.common.autotuner import cuda_graph_bench
from lightllm.common.autotuner.choice import choose, per_scenario_best
from lightllm.common.kv_cache.quant import round_up_scale_bits
from lightllm.common.envs import AUTOTUNE_CHOICE_RULES as RULES
from lightllm.kernels.attention.decode.fa3 import FA3_LADDER_DIVISORS
from lightllm.kernels.attention.decode.tuning import decode_attn_autotune_seq_lens, seq_len_ladder
from lightllm.kernels.attention.decode import flash_decode, stage2

SHAPES = {"hq32-hk8-d128": (32, 8, 128), "hq64-hk8-d128": (64, 8, 128), "hq24-hk4-d256": (24, 4, 256)}
FA3_SPLITS = (0, 1, 2, 4, 8, 16, 32)
KINDS = ("none", "int8", "int4")


def check_cells(p, cells):
    """One error line (``p.error``) unless every cell is ``SHAPE:BATCH`` with a shape of :data:`SHAPES`: the cells of
    decode_attention_quant.py, decode_kv_read_probe.py and decode_stage1_ladder.py."""
    bad = [c for c in cells if c.split(":")[0] not in SHAPES or not c.partition(":")[2].isdigit()]
    if bad:
        p.error(f"--cells expected SHAPE:BATCH with SHAPE one of {list(SHAPES)}, got {bad}")


def make_pool(kind, tokens, kv_heads, head_dim, group, head_major=False, device="cuda", generator=None):
    """Random KV for timing (codes and scales drawn directly; correctness is the tests' job). ``head_major``: each
    head's tokens contiguous (``[heads, tokens, ...]`` storage seen as ``[tokens, heads, ...]``), so a tile of a
    program's tokens is one contiguous run instead of one row per token strided by every head's. ``device`` and
    ``generator``: where and from what it is drawn (the benchmarks' CPU tests draw seeded pools)."""

    def draw(make, width):
        t = make((kv_heads, tokens, width) if head_major else (tokens, kv_heads, width))
        return t.transpose(0, 1) if head_major else t

    if kind == "none":
        values = lambda s: torch.randn(s, device=device, dtype=torch.bfloat16, generator=generator)  # noqa: E731
        return draw(values, head_dim), draw(values, head_dim), None, None
    width = head_dim if kind == "int8" else head_dim // 2
    dtype = torch.int8 if kind == "int8" else torch.uint8
    lo, hi = (-127, 128) if kind == "int8" else (0, 256)
    codes = lambda s: torch.randint(lo, hi, s, device=device, dtype=dtype, generator=generator)  # noqa: E731

    def scale(s):  # INT8's in its format's 7 significant bits, which the GPU path's exact FMA bias needs (quant.py)
        x = torch.rand(s, device=device, generator=generator).add_(0.5).mul_(0.02).half()
        return round_up_scale_bits(x) if kind == "int8" else x

    return draw(codes, width), draw(codes, width), draw(scale, head_dim // group), draw(scale, head_dim // group)


def kv_bytes(kind, batch, length, kv_heads, head_dim, group):
    per_elem = {"none": 2.0, "int8": 1.0, "int4": 0.5}[kind] + (0 if kind == "none" else 2.0 / group)
    return 2 * batch * length * kv_heads * head_dim * per_elem


def candidate_configs(kind, q):
    """What the tuner searches for this KV type (INT8/INT4 add two-warp programs)."""
    return (flash_decode.split_kv_configs if kind == "none" else flash_decode.quant_split_kv_configs)(q)


def decode_fn(kind, q, pool, r2t, idx, seq, graph_max, out, group, cfg):
    k, v, ks, vs = pool
    if kind == "none":
        return lambda: flash_decode.gqa_decode_attention(q, k, v, r2t, idx, seq, graph_max, out=out, run_config=cfg)
    fn = flash_decode.gqa_decode_attention_int8kv if kind == "int8" else flash_decode.gqa_decode_attention_int4kv
    return lambda: fn(q, k, v, ks, vs, r2t, idx, seq, graph_max, out=out, quant_group=group, run_config=cfg)


def time_configs(kind, q, pool, r2t, idx, seq, launch_len, out, group, configs, passes=1):
    """``(default ms, [[config, ms], ...])``: graph-timed launches for ``launch_len`` (inf where a config fails).

    With ``passes`` > 1 the default and every config are timed that many times, each pass in the reverse order of the
    one before, and each keeps its fastest: in one H200 run the first launches of a new KV pool ran up to 12 % slow
    at 1K (the default first; docs/decode_attention.md, "A single timing pass is not enough at 1K")."""
    launches = [None] + list(configs)
    best = [math.inf] * len(launches)
    for n in range(passes):
        for i in range(len(launches)) if n % 2 == 0 else reversed(range(len(launches))):
            if n > 0 and best[i] == math.inf:
                continue  # failed in the first pass
            try:
                ms = cuda_graph_bench(decode_fn(kind, q, pool, r2t, idx, seq, launch_len, out, group, launches[i]))
            except Exception as e:  # out of resources at some shapes
                ms = math.inf
                print(f"  {launches[i]}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            best[i] = min(best[i], ms)
    return best[0], [[cfg, ms] for cfg, ms in zip(configs, best[1:])]


def fa3_times(fa3, q, pool, batch, max_len, seq):
    k, v = pool[0].view(batch, max_len, *pool[0].shape[1:]), pool[1].view(batch, max_len, *pool[1].shape[1:])
    q4 = q.unsqueeze(1)
    times = {}
    for splits in FA3_SPLITS:
        try:
            times[splits] = cuda_graph_bench(
                lambda: fa3.flash_attn_with_kvcache(q4, k, v, cache_seqlens=seq, causal=True, num_splits=splits)
            )
        except Exception as e:  # a split count the build refuses
            print(f"  fa3 num_splits={splits}: {type(e).__name__}: {e}", file=sys.stderr)
    return times


def stage2_study(shape, batch, length, group):
    """Stage-2 time alone at num_warps 1..8 vs the whole decode (default config)."""
    hq, hk, d = SHAPES[shape]
    cfg = flash_decode.default_config(d)
    splits = flash_decode.num_splits(batch, hk, length, cfg["BLOCK_N"], cfg["WAVES"], torch.device("cuda"))
    mid_o = torch.randn(batch, hq, splits, d, device="cuda")
    mid_lse = torch.randn(batch, hq, splits, device="cuda")
    seq = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    out = torch.empty(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    res = {"shape": shape, "B": batch, "L": length, "splits": splits, "stage2_ms": {}}
    for warps in (1, 2, 4, 8):
        res["stage2_ms"][warps] = cuda_graph_bench(
            lambda: flash_decode.launch_stage2(mid_o, mid_lse, seq, out, cfg["BLOCK_N"], num_warps=warps)
        )
    return res


def run(args):
    fa3 = None
    if not args.no_fa3:
        try:
            import fa3_fwd_interface as fa3
        except ImportError as e:
            print(f"FA3 not available ({e}); FA3 columns left empty", file=sys.stderr)
    bw = copy_gbs()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    graph_max = max(args.lens)
    ladder = [n for n in decode_attn_autotune_seq_lens() if n in args.lens]
    results = {"device": torch.cuda.get_device_name(), "copy_GBs": bw, "graph_max_len": graph_max,
               "ladder": ladder, "quant_group": args.group, "passes": args.passes,
               "stage2_tile": stage2._split_tile, "cells": [], "stage2": []}  # fmt: skip
    for shape in args.shapes:
        for batch in (1, 16, 64):
            if batch in args.batches:
                results["stage2"].append(stage2_study(shape, batch, max(args.lens), args.group))
    for kind, shape, batch, (pool, r2t, idx, q, out) in _setups(args):
        hk, d = SHAPES[shape][1:]
        configs = candidate_configs(kind, q)
        for length in args.lens:
            seq = torch.full((batch,), length, device="cuda", dtype=torch.int32)
            cell = {"shape": shape, "B": batch, "L": length, "kind": kind,
                    "bytes": kv_bytes(kind, batch, length, hk, d, args.group)}  # fmt: skip
            cell["default_ms"], cell["configs"] = time_configs(kind, q, pool, r2t, idx, seq, graph_max, out,
                                                               args.group, configs, args.passes)  # fmt: skip
            if kind == "none" and fa3 is not None:
                cell["fa3_ms"] = fa3_times(fa3, q, pool, batch, graph_max, seq)
            results["cells"].append(cell)
            print(f"{shape} B={batch:3d} L={length:6d} {kind:4s} default {cell['default_ms'] * 1e3:8.1f} us, "
                  f"best {min(ms for _, ms in cell['configs']) * 1e3:8.1f} us", flush=True)  # fmt: skip
        del pool, r2t  # before the next setup allocates its own
        save_json(results, args.out)  # partial results survive a time limit
    return results


def _setups(args):
    """Per KV type (bf16 first: partial results stay useful under a time limit), shape and batch within
    ``--max-gb``: random KV for every request at the longest L, its token table, slots, q and out. Freed after
    (the caller drops its references first)."""
    graph_max = max(args.lens)
    for kind in args.kinds:
        for shape, batch in [(s, b) for s in args.shapes for b in args.batches]:
            hq, hk, d = SHAPES[shape]
            tokens = batch * graph_max
            if kv_bytes(kind, batch, graph_max, hk, d, args.group) > args.max_gb * 1e9:
                print(f"skip {shape} B={batch} {kind}: pool over {args.max_gb} GB", file=sys.stderr)
                continue
            pool = make_pool(kind, tokens, hk, d, args.group)
            r2t = torch.arange(tokens, device="cuda", dtype=torch.int32).view(batch, graph_max)
            idx = torch.arange(batch, device="cuda", dtype=torch.int32)
            q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
            yield kind, shape, batch, (pool, r2t, idx, q, torch.empty_like(q))
            del pool, r2t
            torch.cuda.empty_cache()


def run_buckets(args):
    """Every candidate and the default at the (KV length, launch length) points the bucket analysis needs."""
    lens = sorted(args.lens)
    buckets = graph_lens(args.buckets, lens)
    sets = bucket_sets(buckets, args.also_buckets, lens)
    ladders = {set_name(s): bucket_ladders(s) for s in sets}
    points = timing_points(lens, sets, ladders)
    results = {"device": torch.cuda.get_device_name(), "mode": "buckets", "buckets": buckets, "lens": lens,
               "sets": sets, "ladders": {k: {str(b): ladder for b, ladder in v.items()} for k, v in ladders.items()},
               "quant_group": args.group, "passes": args.passes, "stage2_tile": stage2._split_tile,
               "points": []}  # fmt: skip
    print(
        f"buckets {buckets}: {len(points)} (length, launch) points per shape, batch and KV type: {points}", flush=True
    )
    start, launches = time.perf_counter(), 0
    for kind, shape, batch, (pool, r2t, idx, q, out) in _setups(args):
        configs = candidate_configs(kind, q)
        for length, launch in points:
            seq = torch.full((batch,), length, device="cuda", dtype=torch.int32)
            point = {"shape": shape, "B": batch, "kind": kind, "L": length, "launch": launch, "configs": []}
            point["default_ms"], point["configs"] = time_configs(kind, q, pool, r2t, idx, seq, launch, out,
                                                                 args.group, configs, args.passes)  # fmt: skip
            results["points"].append(point)
            launches += 1 + len(configs)
        del pool, r2t  # before the next setup allocates its own
        print(f"{shape} B={batch:3d} {kind:4s}: {launches} timings, {time.perf_counter() - start:.0f} s", flush=True)
        save_json(results, args.out)  # partial results survive a time limit
    results["seconds"] = time.perf_counter() - start
    return results


# ---- analysis -------------------------------------------------------------------------------------------


def freeze_by_rules(default, candidates, lens, ladder):
    """Per choice rule, the candidate it freezes from the ladder's timings, applied at every L.

    ``default``: ms at each of ``lens``; ``candidates``: name -> ms at each of ``lens``. Returns name -> {"pick"
    (None: the default), "ms", "loss_pct" vs that L's best of all, "vs_default_pct" (negative: faster)}."""
    order = [lens.index(n) for n in ladder]
    names = list(candidates)
    best = per_scenario_best([default, *candidates.values()])
    on_ladder = {i: [candidates[name][j] for j in order] for i, name in enumerate(names)}
    out = {}
    for rule in RULES:
        w = choose([default[j] for j in order], on_ladder, rule)
        times = default if w < 0 else candidates[names[w]]
        out[rule] = {"pick": None if w < 0 else names[w], "ms": times,
                     "loss_pct": [(t / b - 1) * 100 for t, b in zip(times, best)],
                     "vs_default_pct": [(t / d - 1) * 100 for t, d in zip(times, default)]}  # fmt: skip
    return out


def geo_mean_gain_pct(base_ms, ms):
    """Geometric mean of ``base / ms`` over paired cells, as % (positive: ``ms`` is faster)."""
    return (math.exp(sum(math.log(b / t) for b, t in zip(base_ms, ms)) / len(ms)) - 1) * 100


def analyze(results):
    cells = {(c["shape"], c["B"], c["L"], c["kind"]): c for c in results["cells"]}
    ladder = results["ladder"]
    lens = sorted({c["L"] for c in results["cells"]})
    rows, frozen = [], []
    for (shape, batch, length, kind), c in sorted(cells.items()):
        best_cfg, best = min(c["configs"], key=lambda x: x[1])
        row = {"shape": shape, "B": batch, "L": length, "kind": kind, "default_ms": c["default_ms"],
               "tuned_ms": min(best, c["default_ms"]), "tuned_cfg": best_cfg}  # fmt: skip
        row["TBps"] = c["bytes"] / (row["tuned_ms"] * 1e-3) / 1e12
        row["bw_pct"] = row["TBps"] * 1e3 / results["copy_GBs"] * 100
        if c.get("fa3_ms"):
            row["fa3_best_ms"] = min(c["fa3_ms"].values())
            row["fa3_heuristic_ms"] = c["fa3_ms"].get("0", c["fa3_ms"].get(0))
        if kind != "none" and (shape, batch, length, "none") in cells:
            base = cells[(shape, batch, length, "none")]
            row["speedup_vs_bf16"] = min(x[1] for x in base["configs"] + [[None, base["default_ms"]]]) / row["tuned_ms"]
        rows.append(row)
    for shape, batch, kind in sorted({(k[0], k[1], k[3]) for k in cells}):
        if not all((shape, batch, n, kind) in cells for n in lens):
            continue
        per_len = [cells[(shape, batch, n, kind)] for n in lens]
        table = {json.dumps(cfg, sort_keys=True): [] for cfg, _ in per_len[0]["configs"]}
        for c in per_len:
            for cfg, ms in c["configs"]:
                table[json.dumps(cfg, sort_keys=True)].append(ms)
        rules = freeze_by_rules([c["default_ms"] for c in per_len], table, lens, ladder)
        entry = {"shape": shape, "B": batch, "kind": kind, "lens": lens, "rules": {}}
        for rule, v in rules.items():
            entry["rules"][rule] = {"config": v.pop("pick"), **v, "worst_loss_pct": max(v["loss_pct"])}
        frozen.append(entry)
    return rows, frozen


def analyze_fa3(results):
    """FA3's split count frozen by each rule (or FA3's own heuristic, 0), applied at every L, against that L's best
    fixed split and against the heuristic."""
    cells = {(c["shape"], c["B"], c["L"]): c["fa3_ms"] for c in results["cells"] if c.get("fa3_ms")}
    out = []
    for shape, batch in sorted({(k[0], k[1]) for k in cells}):
        lens = sorted(k[2] for k in cells if k[:2] == (shape, batch))
        # FA3's own ladder (it times 1/4 of the tuning length too), at the lengths this run measured
        ladder = [n for n in seq_len_ladder(results["ladder"][0], FA3_LADDER_DIVISORS) if n in lens]
        if not ladder:
            continue
        splits = sorted({int(sp) for n in lens for sp in cells[(shape, batch, n)]})
        times = {sp: [cells[(shape, batch, n)].get(str(sp), cells[(shape, batch, n)].get(sp, math.inf)) for n in lens]
                 for sp in splits}  # fmt: skip
        best = per_scenario_best(times.values())
        rules = freeze_by_rules(times[0], {sp: times[sp] for sp in splits if sp != 0}, lens, ladder)
        entry = {"shape": shape, "B": batch, "lens": lens, "splits": {str(k): v for k, v in times.items()},
                 "best_ms": best, "rules": {}}  # fmt: skip
        heuristic = {"pick": 0, "ms": times[0], "loss_pct": [(t / b - 1) * 100 for t, b in zip(times[0], best)],
                     "vs_default_pct": [0.0] * len(lens)}  # fmt: skip
        for rule, v in {"heuristic": heuristic, **rules}.items():
            entry["rules"][rule] = {"num_splits": v.pop("pick") or 0, **v}
        out.append(entry)
    return out


def compare_runs(runs, rule="minimax_loss"):
    """Triton's frozen config against FA3's best ``num_splits`` over repeated saved runs (each a process of its own
    that tuned again), per (shape, B, L) every run measured: each run's ratio, their median, and the median tuned
    time over the best of FA3's per-split medians (one run's best split is the fastest of several noisy timings, so
    it is biased low)."""
    cells = {}
    for run in runs:
        fa3 = {(f["shape"], f["B"]): f for f in run.get("fa3_frozen", [])}
        for frozen in run["frozen"]:
            f = fa3.get((frozen["shape"], frozen["B"]))
            if frozen["kind"] != "none" or f is None:
                continue
            for i, n in enumerate(frozen["lens"]):
                if n not in f["lens"]:
                    continue  # FA3 not timed at this length
                j = f["lens"].index(n)
                cell = cells.setdefault((frozen["shape"], frozen["B"], n), {"tuned": [], "fa3": []})
                cell["tuned"].append(frozen["rules"][rule]["ms"][i])
                cell["fa3"].append({sp: ms[j] for sp, ms in f["splits"].items()})
    out = []
    for (shape, batch, n), cell in sorted(cells.items()):
        if len(cell["tuned"]) < len(runs):
            continue  # not in every run
        best = [min(times.values()) for times in cell["fa3"]]
        medians = {sp: statistics.median(times[sp] for times in cell["fa3"]) for sp in cell["fa3"][0]}
        split = min(medians, key=medians.get)
        ratios = [t / b for t, b in zip(cell["tuned"], best)]
        out.append({"shape": shape, "B": batch, "L": n, "rule": rule, "tuned_ms": cell["tuned"], "fa3_best_ms": best,
                    "ratio": ratios, "ratio_median": statistics.median(ratios), "fa3_split_of_best_median": int(split),
                    "ratio_of_medians": statistics.median(cell["tuned"]) / medians[split]})  # fmt: skip
    return out


def print_runs(entries, runs):
    print(f"Triton (frozen, {entries[0]['rule'] if entries else '-'}) over FA3's best num_splits, {runs} runs")
    print(f"{'shape':15} {'B':>4} {'L':>6} | {'each run':{7 * runs}} | median | medians' ratio (FA3 split)")
    for e in entries:
        each = " ".join(f"{r:6.3f}" for r in e["ratio"])
        print(f"{e['shape']:15} {e['B']:4} {e['L']:6} | {each} | {e['ratio_median']:6.3f} | "
              f"{e['ratio_of_medians']:6.3f} ({e['fa3_split_of_best_median']})")  # fmt: skip


def fa3_gains(fa3_frozen, min_batch=16):
    """Geo-mean % gain over FA3's heuristic of every cell at B >= ``min_batch`` (every L), per shape and over
    all: of the per-cell best split ("best") and of each rule's frozen split."""
    picked = [f for f in fa3_frozen if f["B"] >= min_batch]
    if not picked:
        return {}
    out = {}
    for shape in sorted({f["shape"] for f in picked}) + ["all"]:
        mine = [f for f in picked if shape in ("all", f["shape"])]
        heuristic = [t for f in mine for t in f["splits"]["0"]]
        gains = {"best": geo_mean_gain_pct(heuristic, [t for f in mine for t in f["best_ms"]])}
        for rule in RULES:
            gains[rule] = geo_mean_gain_pct(heuristic, [t for f in mine for t in f["rules"][rule]["ms"]])
        out[shape] = gains
    return out


def _rule_line(label, lens, v):
    """``label``, worst % vs best / vs default, then both per L."""
    per_len = " ".join(
        f"{n // 1024:3d}K:{a:5.1f}/{b:+5.1f}" for n, a, b in zip(lens, v["loss_pct"], v["vs_default_pct"])
    )
    return f"{label} worst {max(v['loss_pct']):5.1f}/{max(v['vs_default_pct']):+5.1f}  {per_len}"


def print_tables(results, rows, frozen):
    print(f"\n{results['device']}: copy {results['copy_GBs']:.0f} GB/s; graph max len {results['graph_max_len']}; "
          f"rule ladder {results['ladder']}; quant group {results['quant_group']}")  # fmt: skip
    print(
        "\nshape          B      L kind  default us  tuned us  tuned/def  TB/s  %copy  fa3 best  fa3 heur  tuned/fa3"
        "  x bf16"
    )
    for r in rows:
        fa3 = r.get("fa3_best_ms")
        print(
            f"{r['shape']:13s} {r['B']:3d} {r['L']:6d} {r['kind']:4s} {r['default_ms'] * 1e3:10.1f} "
            f"{r['tuned_ms'] * 1e3:9.1f} {r['tuned_ms'] / r['default_ms']:9.2f} {r['TBps']:5.2f} {r['bw_pct']:6.1f} "
            + (f"{fa3 * 1e3:9.1f} {r['fa3_heuristic_ms'] * 1e3:9.1f} {r['tuned_ms'] / fa3:9.2f}" if fa3 else " " * 29)
            + (f" {r['speedup_vs_bf16']:7.2f}" if "speedup_vs_bf16" in r else "")
        )
    print(
        "\nfrozen config (chosen from the ladder, applied at every L): % slower than that L's best / than the default"
    )
    for f in frozen:
        for rule, v in f["rules"].items():
            print(_rule_line(f"{f['shape']:13s} B={f['B']:3d} {f['kind']:4s} {rule:25s}", f["lens"], v))
    print("\nper rule, over the (shape, B, kind) rows: worst % slower than the default at some L, rows > 2 % slower;")
    print("worst % slower than some L's best")
    for rule in RULES:
        vs_default = [max(f["rules"][rule]["vs_default_pct"]) for f in frozen]
        worst = [f["rules"][rule]["worst_loss_pct"] for f in frozen]
        print(f"  {rule:25s} vs default {max(vs_default):+5.1f} ({sum(x > 2 for x in vs_default)} of "
              f"{len(frozen)} rows > 2 %), vs best {max(worst):5.1f}")  # fmt: skip
    fa3_frozen = results.get("fa3_frozen", [])
    print("\nFA3 num_splits frozen by each rule from FA3's ladder, applied at every L: % slower than that L's best")
    print("fixed split / than FA3's heuristic (num_splits=0; negative: faster)")
    for f in fa3_frozen:
        for rule, v in f["rules"].items():
            print(_rule_line(f"{f['shape']:13s} B={f['B']:3d} {rule:25s} splits={v['num_splits']:2d}", f["lens"], v))
    if fa3_frozen:
        print("\nFA3 geo-mean gain over its heuristic at B >= 16 (every L): per-cell best split, then each rule")
        for shape, gains in fa3_gains(fa3_frozen).items():
            print(f"  {shape:13s} " + "  ".join(f"{k} {v:+.2f} %" for k, v in gains.items()))
    for s in results["stage2"]:
        st = " ".join(f"w{w}:{ms * 1e3:.1f}" for w, ms in s["stage2_ms"].items())
        print(f"stage2 {s['shape']} B={s['B']} L={s['L']} splits={s['splits']}: {st} us")


def analyze_tuned_lens(args, results: dict) -> None:
    """``--nearest`` / ``--level0`` on a saved bucket run: the table printed, the entries saved to ``--out``."""
    nearest = args.nearest is not None
    flag, wanted = ("--nearest", args.nearest) if nearest else ("--level0", args.level0)
    if results.get("mode") != "buckets":
        sys.exit(f"{flag} expected a bucket run (--buckets), and {args.analyze} is not one")
    entries = (analyze_nearest if nearest else analyze_level0)(results, wanted, args.tuned_lens)
    if not entries:
        sys.exit(f"{flag}: {args.analyze} timed no graphs of {wanted} with configs tuned at {args.tuned_lens}")
    save_json({"device": results.get("device"), "source": args.analyze, "graphs" if nearest else "sets": wanted,
               "tuned": args.tuned_lens, "analysis": entries}, args.out)  # fmt: skip
    if nearest:
        print_nearest_table(results, entries)
    else:
        print_level0_table(results, entries, args.tuned_lens)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 16, 32, 64, 128])
    p.add_argument("--lens", nargs="+", type=int, default=[1024, 4096, 8192, 16384, 32768, 65536])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--analyze", metavar="JSON", help="print the tables of a saved run (no GPU needed)")
    p.add_argument("--group", type=int, default=8, help="INT8/INT4 quant group size")
    p.add_argument("--max-gb", type=float, default=60.0, help="skip cells whose KV pool is larger")
    p.add_argument("--no-fa3", action="store_true")
    p.add_argument(
        "--passes",
        type=int,
        default=2,
        help="time the default and each candidate this many times, alternating the order, and keep each one's "
        "fastest (1: as runs before 2026-12-05)",
    )
    p.add_argument("--stage2-tile", type=int, default=None, metavar="N",
                   help="stage 2 merges N splits a step for requests using at least 2N (a power of two; 1: one "
                   "split a step everywhere; default 16, stage2.split_tile)")  # fmt: skip
    p.add_argument("--buckets", nargs="+", type=int, default=None, metavar="LEN",
                   help="decode graphs per KV length bucket (these, below the longest --lens, and the longest): the "
                   "bucket analysis instead of the frozen-config one")  # fmt: skip
    p.add_argument("--also-buckets", nargs="+", default=[], metavar="SET", type=parse_set,
                   help="more bucket sets to compare, each comma-separated (e.g. 2048,8192); the points they need "
                   "are timed in the same run")  # fmt: skip
    p.add_argument("--nearest", nargs="+", type=int, default=None, metavar="LEN",
                   help="with --analyze of a bucket run: graphs of these lengths replaying configs tuned for "
                   "others")  # fmt: skip
    p.add_argument("--level0", nargs="+", default=None, metavar="SET", type=parse_set,
                   help="with --analyze of a bucket run: these bucket sets (comma-separated, the largest the graph "
                   "maximum) at level 0 with configs tuned only at --tuned-lens")  # fmt: skip
    p.add_argument(
        "--tuned-lens",
        nargs="+",
        type=int,
        default=[4096, 32768],
        metavar="LEN",
        help="--nearest / --level0: the graph lengths tuned configs exist for (default: what ships)",
    )
    p.add_argument("--runs", nargs="+", metavar="JSON", help="saved runs of the same cells (each its own "
                   "process): Triton's frozen config over FA3's best split per run and over the runs (no GPU "
                   "needed)")  # fmt: skip
    p.add_argument("--out", default="benchmarks/results/decode_attention.json")
    args = p.parse_args()
    if args.runs:
        runs = read_saved_runs(p, "--runs", args.runs)
        try:
            entries = compare_runs(runs)
        except (KeyError, TypeError, AttributeError) as e:
            p.error(f"--runs: not a saved decode_attention.py run ({e!r} missing)")
        if not entries:
            sys.exit(f"--runs: no cell has Triton's frozen config and FA3's splits in every one of {args.runs}")
        save_json({"device": runs[0].get("device"), "sources": args.runs, "cells": entries}, args.out)
        print_runs(entries, len(runs))
        return
    if args.passes < 1:
        p.error(f"--passes expected a positive count, got {args.passes}")
    if args.buckets is not None and any(b <= 0 for b in args.buckets):
        p.error(f"--buckets expected positive KV lengths, got {args.buckets}")
    if args.also_buckets and args.buckets is None:
        p.error("--also-buckets expected --buckets too")
    for flag in ("nearest", "level0"):
        if getattr(args, flag) is not None and not args.analyze:
            p.error(f"--{flag} expected --analyze too (a saved bucket run)")
    if args.nearest is not None and args.level0 is not None:
        p.error("--nearest and --level0 expected one at a time")
    for flag, lens in (("--nearest", args.nearest or []), ("--tuned-lens", args.tuned_lens)):
        if any(n <= 0 for n in lens):
            p.error(f"{flag} expected positive KV lengths, got {lens}")
    if args.stage2_tile is not None:
        try:
            stage2.set_split_tile(args.stage2_tile)
        except ValueError as e:
            p.error(f"--stage2-tile: {e}")
    if args.analyze:
        with open(args.analyze) as f:
            results = json.load(f)
    elif not torch.cuda.is_available():
        sys.exit("decode_attention.py needs a CUDA GPU")
    elif args.buckets is not None:
        results = run_buckets(args)
    else:
        results = run(args)
    if args.nearest is not None or args.level0 is not None:
        analyze_tuned_lens(args, results)
        return
    if results.get("mode") == "buckets":
        results["analysis"] = analyze_buckets(results)
        if not args.analyze:
            save_json(results, args.out)
        print_bucket_table(results, results["analysis"])
        print(f"triton {triton.__version__}, torch {torch.__version__}")
        return
    rows, frozen = analyze(results)
    results["rows"], results["frozen"], results["fa3_frozen"] = rows, frozen, analyze_fa3(results)
    if not args.analyze:
        save_json(results, args.out)
    print_tables(results, rows, frozen)
    print(f"triton {triton.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
