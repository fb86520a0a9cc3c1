"""Decode stage 1 under Nsight Compute: the profiled target, and a summary of ncu's CSV exports as JSON.

The target launches stage 1 at d128 32/8, B=64, L=32K for bf16 / INT8 group 8 / INT4 group 8, each with the config
given below (the fastest of the quantized table before the PTX dequantization), three warm launches then the
profiled one:

    ncu --clock-control none --kernel-name regex:decode_stage1 --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section SourceCounters --section WarpStateStats --section LaunchStats \\
        -o /tmp/int8 python benchmarks/decode_stage1_ncu.py int8
    ncu --import /tmp/int8.ncu-rep --page raw --csv > int8_raw.csv
    ncu --import /tmp/int8.ncu-rep --page source --print-source sass --csv > int8_sass.csv
    python benchmarks/decode_stage1_ncu.py --summarize before:int8=int8_raw.csv,int8_sass.csv ... --out FILE

(the run before the PTX dequantization exported ``--page details`` instead of ``--page raw``; both are read).
``--rung dequant`` or ``--rung dots`` launches that rung of ``decode_stage1_ladder.py`` instead of the real stage 1,
at the same config, so the stall reasons of each rung's work can be set side by side (its kernel is
``stage1_ladder_kernel``: profile it with ``--kernel-name regex:stage1``). ``--batch`` and ``--config
BLOCK_N/WARPS/STAGES/WAVES`` profile another batch or config. The summary keeps, per kernel: duration, registers,
warps active per SM, warp instructions issued, the cycles per issued instruction a warp spends in each stall state
(from a raw page with WarpStateStats), the blocks per SM that registers and shared memory allow (with LaunchStats and
Occupancy), and each SASS opcode's share of the executed instructions and of the
warp-stall samples (``IMAD.MOV``, a register move, apart from ``IMAD``).
"""

import argparse
import collections
import csv
import json
import re
import sys
from functools import partial

# (BLOCK_N, num_warps, num_stages, WAVES) per KV type, from benchmarks/results/decode_attention_quant_h200.json
CONFIGS = {"none": (64, 8, 3, 4), "int8": (64, 2, 2, 8), "int4": (64, 2, 2, 8)}
BATCH, LENGTH, Q_HEADS, KV_HEADS, HEAD_DIM, GROUP = 64, 32768, 32, 8, 128, 8


def profile_target(kinds, rung="kernel", batch=BATCH, config=None) -> None:
    import torch

    from decode_attention import decode_fn, make_pool
    from decode_stage1_ladder import launch_rung

    r2t = torch.arange(batch * LENGTH, device="cuda", dtype=torch.int32).view(batch, LENGTH)
    idx = torch.arange(batch, device="cuda", dtype=torch.int32)
    seq = torch.full((batch,), LENGTH, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    for kind in kinds:
        block_n, warps, stages, waves = config or CONFIGS[kind]
        cfg = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages, "WAVES": waves}
        pool = make_pool(kind, batch * LENGTH, KV_HEADS, HEAD_DIM, GROUP)
        if rung == "kernel":
            fn = decode_fn(kind, q, pool, r2t, idx, seq, LENGTH, out, GROUP, cfg)
        else:
            fn = partial(launch_rung, rung == "dots", kind, q, pool, r2t, seq, LENGTH, GROUP, cfg)
        for _ in range(4):
            fn()
        torch.cuda.synchronize()
        del pool
        torch.cuda.empty_cache()


_STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio")


def _rows(path: str) -> list:
    return list(csv.reader(line for line in open(path) if line.startswith('"')))


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def metrics(path: str) -> dict:
    """Duration (µs), registers, warps active per SM, warp instructions, from a ``--page raw`` or ``details`` CSV."""
    rows = _rows(path)
    head = rows[0]
    if "Metric Name" in head:  # --page details: one metric per row
        name, unit, value = (head.index(k) for k in ("Metric Name", "Metric Unit", "Metric Value"))
        got = {r[name]: (r[unit], r[value]) for r in rows[1:]}
        scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3}[got["Duration"][0]]
        return {"duration_us": _number(got["Duration"][1]) * scale,
                "registers": _number(got["Registers Per Thread"][1]),
                "warps_active_per_sm": _number(got["Achieved Active Warps Per SM"][1]),
                "warp_instructions": _number(got["Executed Instructions"][1]),
                "dram_throughput_pct": _number(got["DRAM Throughput"][1])}  # fmt: skip
    units, values = rows[1], rows[2]  # --page raw: one column per metric
    col = {k: i for i, k in enumerate(head)}
    scale = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[units[col["gpu__time_duration.sum"]]]
    out = {"duration_us": _number(values[col["gpu__time_duration.sum"]]) * scale,
           "registers": _number(values[col["launch__registers_per_thread"]]),
           "warps_active_per_sm": _number(values[col["sm__warps_active.avg.per_cycle_active"]]),
           "warp_instructions": _number(values[col["smsp__inst_executed.sum"]])}  # fmt: skip
    stalls = {m.group(1): round(_number(values[i]), 2) for i, k in enumerate(head)
              if (m := _STALL.fullmatch(k)) and values[i] and _number(values[i]) >= 0.01}  # fmt: skip
    if stalls:  # WarpStateStats was collected: cycles per issued instruction a warp spends in each state
        out["stalls_per_issue"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
    for name in ("registers", "shared_mem"):  # LaunchStats / Occupancy: blocks per SM each resource allows
        metric = f"launch__occupancy_limit_{name}"
        if metric in col and values[col[metric]]:
            out[f"blocks_per_sm_by_{name}"] = _number(values[col[metric]])
    return out


def opcodes(path: str, top: int = 20) -> dict:
    """Each SASS opcode's share (%) of executed warp instructions and of warp-stall samples, the ``top`` most
    executed, from a ``--page source --print-source sass`` CSV."""
    rows = _rows(path)
    start = next(i for i, r in enumerate(rows) if "Source" in r)  # after a "Kernel Name" line
    head, rows = rows[start], rows[start + 1 :]
    src, stalls, executed = (head.index(k) for k in ("Source", "Warp Stall Sampling (All Samples)",
                                                     "Instructions Executed"))  # fmt: skip
    ex, st = collections.Counter(), collections.Counter()
    for r in rows:
        words = r[src].split()
        if not words:
            continue
        op = words[1] if words[0].startswith("@") else words[0]
        op = "IMAD.MOV" if op.startswith("IMAD.MOV") else op.split(".")[0]  # a register move, not a multiply-add
        ex[op] += int(r[executed])
        st[op] += int(r[stalls])
    total_ex, total_st = sum(ex.values()), sum(st.values())
    return {op: {"executed_pct": round(100 * n / total_ex, 1), "stall_samples_pct": round(100 * st[op] / total_st, 1)}
            for op, n in ex.most_common(top)}  # fmt: skip


def summarize(specs) -> dict:
    """``specs``: ``RUN:KIND=METRICS_CSV[,SASS_CSV]`` each."""
    out = {}
    for spec in specs:
        run, _, rest = spec.partition(":")
        kind, _, files = rest.partition("=")
        paths = files.split(",")
        entry = metrics(paths[0])
        if len(paths) > 1:
            entry["opcodes"] = opcodes(paths[1])
        out.setdefault(run, {})[kind] = entry
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kinds", nargs="*", help=f"KV types to launch, of {list(CONFIGS)} (default all)")
    p.add_argument(
        "--rung",
        choices=("kernel", "dequant", "dots"),
        default="kernel",
        help="the real stage 1 (default) or a rung of decode_stage1_ladder.py at the same config",
    )
    p.add_argument("--batch", type=int, default=BATCH, help=f"requests of {LENGTH} tokens (default {BATCH})")
    p.add_argument("--config", metavar="BLOCK_N/WARPS/STAGES/WAVES", help="the config to launch instead of CONFIGS")
    p.add_argument("--summarize", nargs="+", metavar="RUN:KIND=CSV[,SASS_CSV]", help="summarize ncu exports")
    p.add_argument("--out", default="benchmarks/results/decode_stage1_ncu.json")
    args = p.parse_args(argv)
    if args.summarize:
        results = summarize(args.summarize)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        json.dump(results, sys.stdout, indent=1)
        return
    bad = [k for k in args.kinds if k not in CONFIGS]
    if bad:
        p.error(f"kinds expected some of {list(CONFIGS)}, got {bad}")
    config = None
    if args.config is not None:
        parts = args.config.split("/")
        if len(parts) != 4 or not all(x.isdigit() and int(x) > 0 for x in parts):
            p.error(f"--config expected BLOCK_N/WARPS/STAGES/WAVES as four positive integers, got {args.config!r}")
        config = tuple(map(int, parts))
    if args.batch < 1:
        p.error(f"--batch expected a positive integer, got {args.batch}")
    profile_target(args.kinds or list(CONFIGS), args.rung, args.batch, config)


if __name__ == "__main__":
    main()
