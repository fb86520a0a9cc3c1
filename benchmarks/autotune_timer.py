"""How long a search takes per candidate on the GPU, and whether two runs of one search agree.

Runs the same RMSNorm search twice from an empty config dir for several row counts (hidden 4096, bf16),
with the real CUDA-graph timer. Prints a table; writes JSON. "%copy" is achieved bandwidth over the
device-to-device copy's: above 100 % the replays are served from L2 (inputs up to ~60 MB stay there).

    python benchmarks/autotune_timer.py --out benchmarks/results/autotune_timer_h200.json
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch

from bandwidth import copy_gbs
from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, cuda_graph_bench
from lightllm.kernels.norm.rmsnorm import rmsnorm, rmsnorm_ref


def search_once(rows: int, hidden: int):
    rmsnorm.clear_cache()
    with tempfile.TemporaryDirectory() as root:
        os.environ["LIGHTLLM_AUTOTUNE_CONFIG_DIR"] = root
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(hidden, device="cuda", dtype=torch.bfloat16)
        with autotune_warmup(AutotuneKernelType.GENERAL):
            out = rmsnorm(x, w)
        err = ((out.float() - rmsnorm_ref(x, w).float()).norm() / rmsnorm_ref(x, w).float().norm()).item()
        rec = rmsnorm.last_search
        ref_ms = cuda_graph_bench(lambda: rmsnorm_ref(x, w))
    return rec, err, ref_ms


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/autotune_timer.json")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256, 4096, 16384])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("autotune_timer.py needs a CUDA GPU")
    os.environ["LIGHTLLM_TRITON_AUTOTUNE_LEVEL"] = "1"
    bw = copy_gbs()
    rows_out = []
    for rows in args.rows:
        runs = [search_once(rows, args.hidden) for _ in range(2)]
        (r1, err1, ref_ms), (r2, _, _) = runs
        diffs = [abs(a[1][0] - b[1][0]) / min(a[1][0], b[1][0]) * 100 for a, b in zip(r1.timings, r2.timings)]
        nbytes = 2 * rows * args.hidden * 2 + args.hidden * 2
        rows_out.append(
            {
                "rows": rows,
                "hidden": args.hidden,
                "candidates": len(r1.timings),
                "search_s": [r1.seconds, r2.seconds],
                "s_per_candidate": [r1.seconds / (len(r1.timings) + 1), r2.seconds / (len(r2.timings) + 1)],
                "chosen": [r1.chosen, r2.chosen],
                "chosen_ms": [r1.chosen_ms[0], r2.chosen_ms[0]],
                "default_ms": [r1.default_ms[0], r2.default_ms[0]],
                "torch_ref_ms": ref_ms,
                "candidate_ms": [[c, a[0], b[1][0]] for (c, a), b in zip(r1.timings, r2.timings)],
                "run_to_run_diff_pct_median": statistics.median(diffs),
                "run_to_run_diff_pct_max": max(diffs),
                "bandwidth_pct_of_copy": nbytes / (r1.chosen_ms[0] * 1e-3) / 1e9 / bw * 100,
                "rel_err_vs_ref": err1,
            }
        )
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBs": bw, "rows": rows_out}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"device {result['device']}, copy bandwidth {bw:.0f} GB/s (read+write)")
    hdr = "rows  cands  search s (1/2)  ms/cand  chosen (run 1 | run 2)                  best us (1/2)  default us  "
    print(hdr + "speedup  torch us  diff med/max %  %copy")
    for r in rows_out:
        chosen = " | ".join("default" if c is None else f"B{c['BLOCK_N']}w{c['num_warps']}" for c in r["chosen"])
        print(
            f"{r['rows']:5d} {r['candidates']:5d}  {r['search_s'][0]:5.2f}/{r['search_s'][1]:5.2f}    "
            f"{r['s_per_candidate'][0] * 1e3:6.1f}  {chosen:38s}  {r['chosen_ms'][0] * 1e3:6.2f}/"
            f"{r['chosen_ms'][1] * 1e3:6.2f}  {r['default_ms'][0] * 1e3:9.2f}  "
            f"{r['default_ms'][0] / r['chosen_ms'][0]:6.2f}x  {r['torch_ref_ms'] * 1e3:7.2f}  "
            f"{r['run_to_run_diff_pct_median']:5.1f}/{r['run_to_run_diff_pct_max']:5.1f}  "
            f"{r['bandwidth_pct_of_copy']:5.1f}"
        )


if __name__ == "__main__":
    main()
