"""What compiling a search's candidates ahead on a thread pool saves a first start (autotuner/precompile.py).

Each cell is one fresh process with an empty Triton cache (on disk and in memory), so every candidate's kernels
compile as on a GPU that never ran them. It runs the real DECODE_ATTENTION search of the Triton GQA decode, as a
decode graph's warm-up does (empty config folder, shipped configs ignored, level 1, a graph of ``--graph-len``),
with ``LIGHTLLM_AUTOTUNE_COMPILE_THREADS`` set to each of ``--threads``, then searches the same key once more in
that process (its kernels compiled: what is left is timing). The search budget is raised to ``--budget`` so the
cold search times every candidate; at the default 30 s a cold search is cut short (``timed`` < ``candidates``).

    python benchmarks/autotune_compile.py --out benchmarks/results/autotune_compile_h200.json

Columns: ``cold s`` the first search, ``ahead s`` its compile pass and ``kernels`` the compiles the pass sent to
the pool, ``warm s`` the second search, ``timed`` of ``candidates`` in the cold search, ``pick`` its choice.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling modules, however it is loaded
from autotune_retime import add_cell_args, search_once  # noqa: E402
from bench_io import save_json  # noqa: E402
from decode_attention import SHAPES, make_pool  # noqa: E402

from lightllm.common.autotuner.keys import key_to_json  # noqa: E402


def child(kind: str, shape: str, batch: int, graph_len: int, group: int) -> dict:
    """One cell in this (fresh) process: a cold search, then a warm one of the same key."""
    hq, hk, d = SHAPES[shape]
    tokens = batch * graph_len
    pool = make_pool(kind, tokens, hk, d, group)
    r2t = torch.arange(tokens, device="cuda", dtype=torch.int32).view(batch, graph_len)
    idx = torch.arange(batch, device="cuda", dtype=torch.int32)
    seq = torch.full((batch,), graph_len, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    rows = []
    for search in ("cold", "warm"):
        record = search_once(kind, q, pool, r2t, idx, seq, graph_len, torch.empty_like(q), group)
        timed = sum(all(map(math.isfinite, ms)) for _, ms in record.timings)
        rows.append({"search": search, "seconds": record.seconds, "compile_seconds": record.compile_seconds,
                     "kernels": record.kernels_compiled, "timed": timed, "candidates": len(record.timings),
                     "pick": "default" if record.chosen is None else key_to_json(record.chosen),
                     "pick_ms": record.chosen_ms[0], "default_ms": record.default_ms[0]})  # fmt: skip
    return {"cold": rows[0], "warm": rows[1]}


def run_cell(kind: str, shape: str, batch: int, threads: int, args) -> dict:
    """``child`` in a fresh process with an empty Triton cache and this many compile threads."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "LIGHTLLM_AUTOTUNE_COMPILE_THREADS": str(threads),
               "LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH": str(args.budget)}  # fmt: skip
        cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, shape, str(batch), str(args.graph_len),
               str(args.group)]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.cell_timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} {shape} B={batch} threads={threads} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


HEADER = (
    f"{'kind':5} {'shape':14} {'B':>4} {'threads':>7} {'cold s':>7} {'ahead s':>7} {'kernels':>7} {'warm s':>7} "
    f"{'timed':>9}  pick (cold search)"
)


def print_row(row: dict) -> None:
    cold, warm = row["cold"], row["warm"]
    print(
        f"{row['kind']:5} {row['shape']:14} {row['B']:>4} {row['threads']:>7} {cold['seconds']:>7.2f} "
        f"{cold['compile_seconds']:>7.2f} {cold['kernels']:>7} {warm['seconds']:>7.2f} "
        f"{cold['timed']:>4}/{cold['candidates']:<4}  {cold['pick']}",
        flush=True,
    )


def main(argv=None):
    if argv is None and sys.argv[1:2] == ["--child"]:
        kind, shape, batch, graph_len, group = sys.argv[2:7]
        os.environ.update(LIGHTLLM_TRITON_AUTOTUNE_LEVEL="1", LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN=graph_len,
                          LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED="all")  # fmt: skip
        print(json.dumps(child(kind, shape, int(batch), int(graph_len), int(group))))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cell_args(p, ["hq32-hk8-d128"], [8])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 8], help="LIGHTLLM_AUTOTUNE_COMPILE_THREADS values")
    p.add_argument("--budget", type=float, default=300.0, help="search budget in seconds (the default is 30)")
    p.add_argument("--cell-timeout", type=float, default=400.0, help="seconds before a cell's process is stopped")
    p.add_argument("--out", default="benchmarks/results/autotune_compile.json")
    args = p.parse_args(argv)
    if min(args.threads) < 1 or min(args.batches) < 1 or args.graph_len < 1 or args.budget <= 0:
        p.error("--threads, --batches, --graph-len and --budget must be positive")
    if not torch.cuda.is_available():
        sys.exit("autotune_compile.py needs a CUDA GPU")
    results = {"device": torch.cuda.get_device_name(), "cpus": len(os.sched_getaffinity(0)),
               "graph_len": args.graph_len, "quant_group": args.group, "budget_s": args.budget, "rows": []}  # fmt: skip
    print(HEADER, flush=True)
    for kind in args.kinds:
        for shape in args.shapes:
            for batch in args.batches:
                for threads in args.threads:
                    row = {"kind": kind, "shape": shape, "B": batch, "threads": threads,
                           **run_cell(kind, shape, batch, threads, args)}  # fmt: skip
                    results["rows"].append(row)
                    print_row(row)
                    save_json(results, args.out)  # a cut-short run keeps what finished


if __name__ == "__main__":
    main()
