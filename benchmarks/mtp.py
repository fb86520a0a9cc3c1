"""MTP verify-step kernels on the GPU, graph-timed (CUDA-graph replay medians, the tuner's timer), random data.

``--parts recurrent``: the fused recurrent verify kernel (``benchmarks/mtp_recurrent.py``, run here with
``--mtp-step`` and ``--batches``; its table and JSON under ``"recurrent"``).

``--parts e2e`` (not in the default parts): end-to-end decode tokens/s with MTP step 1/2/3 vs off at acceptance
about 0 %, 50 % and 100 % on a Qwen3.5-27B-shaped model with a few layers (``benchmarks/mtp_e2e.py``; its table
and JSON under ``"e2e"``).

``--parts attention``: MTP diverse attention (``mtp_diverse_decode_attention``: the ``N + 1`` tokens of each request
in one launch pair, each KV split read once) against

- ``plain xN+1``: the plain GQA decode kernel run once per query token (``N + 1`` launches, token ``t`` at length
  ``L - N + t``);
- ``plain rows``: the plain kernel once over ``B * (N + 1)`` rows with per-row lengths (each row re-reads the KV);
- FA3 (``fa3_fwd_interface``, when installed) with ``q_len = N + 1``, causal, at each ``num_splits`` and its best.

Triton columns are the per-cell best of each kernel's 16 tuning candidates (what a tuned start-up can reach) and
the launcher default. Launches are sized for a graph serving the largest L, as a captured decode graph is.
Qwen3.5's full attention: 24 q heads, 4 KV heads, head_dim 256, bf16.

    python benchmarks/mtp.py --out benchmarks/results/mtp_h200.json   # both parts
    python benchmarks/mtp.py --parts attention --out benchmarks/results/mtp_h200.json
    python benchmarks/mtp.py --parts e2e --out benchmarks/results/mtp_e2e_h200.json
    # the same in two shorter runs (11 engine starts take ~14 min on the H200)
    python benchmarks/mtp.py --parts e2e --e2e-heads agree --out /tmp/e2e_off_agree.json
    python benchmarks/mtp.py --parts e2e --e2e-heads half random --e2e-no-off --out /tmp/e2e_half_random.json
    python benchmarks/mtp.py --analyze benchmarks/results/mtp_h200.json
"""

import argparse
import importlib
import json
import math
import os
import sys

import torch
import triton

from bench_io import save_json

PARTS = ("attention", "recurrent", "e2e")
DEFAULT_PARTS = ("attention", "recurrent")  # the kernel parts; e2e builds three large models
ATTN_SHAPE = (24, 4, 256)  # q heads, KV heads, head_dim
FA3_SPLITS = (0, 1, 2, 4, 8, 16, 32)


# ---- attention ---------------------------------------------------------------------------------------------


def kv_bytes(batch: int, length: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of bf16 K and V one request batch holds at ``length`` tokens: what a verify step must read once."""
    return 2 * batch * length * kv_heads * head_dim * 2


def row_lengths(seq: torch.Tensor, n: int) -> torch.Tensor:
    """Per-row KV lengths of the verify step run as ``B * (N + 1)`` plain decode rows: ``L - N .. L``."""
    steps = torch.arange(n + 1, device=seq.device, dtype=seq.dtype)
    return (seq[:, None] - n + steps[None, :]).reshape(-1)


def _best(times: dict):
    key = min(times, key=times.get)
    return key, times[key]


def _time_configs(make_fn, configs):
    from lightllm.common.autotuner import cuda_graph_bench

    times = {"default": cuda_graph_bench(make_fn(None))}
    for cfg in configs:
        try:
            times[json.dumps(cfg, sort_keys=True)] = cuda_graph_bench(make_fn(cfg))
        except Exception as e:  # out of resources at some shapes
            times[json.dumps(cfg, sort_keys=True)] = math.inf
            print(f"  {cfg}: {type(e).__name__}", file=sys.stderr)
    return times


def attention_cell(batch, length, n, graph_max, fa3):
    """Times of one (B, L) cell; the pool holds ``batch * graph_max`` tokens, request ``b`` owns one slot of them."""
    from lightllm.common.autotuner import cuda_graph_bench
    from lightllm.kernels.attention.decode import flash_decode, mtp_diverse

    hq, hk, d = ATTN_SHAPE
    k = torch.randn(batch * graph_max, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    r2t = torch.arange(batch * graph_max, device="cuda", dtype=torch.int32).view(batch, graph_max)
    idx = torch.arange(batch, device="cuda", dtype=torch.int32)
    seq = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, n + 1, hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    configs = flash_decode.split_kv_configs(None)
    cell = {"B": batch, "L": length, "N": n, "kv_bytes": kv_bytes(batch, length, hk, d)}

    cell["diverse_ms"] = _time_configs(
        lambda cfg: lambda: mtp_diverse.mtp_diverse_decode_attention(q, k, v, r2t, idx, seq, graph_max, out=out,
                                                                     run_config=cfg), configs)  # fmt: skip

    rows_q, rows_out = q.view(batch * (n + 1), hq, d), out.view(batch * (n + 1), hq, d)
    rows_idx, rows_len = idx.repeat_interleave(n + 1), row_lengths(seq, n)
    cell["plain_rows_ms"] = _time_configs(
        lambda cfg: lambda: flash_decode.gqa_decode_attention(rows_q, k, v, r2t, rows_idx, rows_len, graph_max,
                                                              out=rows_out, run_config=cfg), configs)  # fmt: skip

    per_token_q = [q[:, t].contiguous() for t in range(n + 1)]
    per_token_out = [torch.empty_like(x) for x in per_token_q]
    per_token_len = [seq - n + t for t in range(n + 1)]

    def per_token(cfg):
        def launch():
            for t in range(n + 1):
                flash_decode.gqa_decode_attention(per_token_q[t], k, v, r2t, idx, per_token_len[t], graph_max,
                                                  out=per_token_out[t], run_config=cfg)  # fmt: skip

        return launch

    cell["plain_loop_ms"] = _time_configs(per_token, configs)

    if fa3 is not None:
        k4, v4 = k.view(batch, graph_max, hk, d), v.view(batch, graph_max, hk, d)
        cell["fa3_ms"] = {}
        for splits in FA3_SPLITS:
            try:
                cell["fa3_ms"][str(splits)] = cuda_graph_bench(
                    lambda: fa3.flash_attn_with_kvcache(q, k4, v4, cache_seqlens=seq, causal=True, num_splits=splits)
                )
            except Exception as e:  # a split count the build refuses
                print(f"  fa3 num_splits={splits}: {type(e).__name__}: {e}", file=sys.stderr)
    return cell


def run_attention(args) -> dict:
    fa3 = None
    if not args.no_fa3:
        try:
            import fa3_fwd_interface as fa3
        except ImportError as e:
            print(f"FA3 not available ({e}); FA3 columns left empty", file=sys.stderr)
    graph_max = max(args.lens)
    results = {"shape": list(ATTN_SHAPE), "N": args.mtp_step, "graph_max_len": graph_max, "cells": []}
    for batch in args.batches:
        for length in args.lens:
            results["cells"].append(attention_cell(batch, length, args.mtp_step, graph_max, fa3))
            print(attention_row(results["cells"][-1]), flush=True)
            torch.cuda.empty_cache()
            save_json({"device": torch.cuda.get_device_name(), "attention": results}, args.out)  # partial results
    return results


def attention_row(cell: dict) -> str:
    _, diverse = _best(cell["diverse_ms"])
    _, rows = _best(cell["plain_rows_ms"])
    _, loop = _best(cell["plain_loop_ms"])
    fa3 = min(cell["fa3_ms"].values()) if cell.get("fa3_ms") else None
    tbps = cell["kv_bytes"] / diverse / 1e9  # bytes per ms -> TB/s
    fa3_cols = f"{fa3 * 1e3:8.1f} {fa3 / diverse:8.2f}" if fa3 else f"{'-':>8s} {'-':>8s}"
    return (
        f"{cell['B']:4d} {cell['L']:6d} {cell['diverse_ms']['default'] * 1e3:10.1f} {diverse * 1e3:10.1f} "
        f"{rows * 1e3:9.1f} {loop * 1e3:9.1f} {rows / diverse:8.2f} {loop / diverse:8.2f} {fa3_cols} {tbps:6.2f}"
    )


def print_attention(results: dict) -> None:
    hq, hk, d = results["shape"]
    print(f"\nMTP diverse attention, hq{hq}/hk{hk}/d{d} bf16, N={results['N']}, graph max len "
          f"{results['graph_max_len']}; us per verify step of one layer (Triton: best of the candidates)")  # fmt: skip
    print("   B      L  div. def  div. best  rows best  loop best  rows/div  loop/div  fa3 best  fa3/div  TB/s")
    for cell in results["cells"]:
        print(attention_row(cell))


# ---- driver ------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=list(DEFAULT_PARTS), choices=PARTS)
    p.add_argument("--mtp-step", type=int, default=3, help="N: draft tokens per request (1-4)")
    p.add_argument("--batches", nargs="+", type=int, default=[16, 64, 128])
    p.add_argument("--lens", nargs="+", type=int, default=[1024, 8192, 32768])
    p.add_argument("--no-fa3", action="store_true")
    p.add_argument("--e2e-layers", type=int, default=4, help="e2e: decoder layers of the 27B-shaped model")
    p.add_argument("--e2e-batches", nargs="+", type=int, default=[16, 64], help="e2e: requests decoding at once")
    p.add_argument("--e2e-steps", nargs="+", type=int, default=[1, 2, 3], help="e2e: --mtp_step values")
    p.add_argument("--e2e-heads", nargs="+", default=["agree", "half", "random"], choices=["agree", "half", "random"],
                   help="e2e: MTP heads, drafts accepted ~100 / ~50 / ~0 %% of the time")  # fmt: skip
    p.add_argument("--e2e-no-off", action="store_true", help="e2e: leave out the MTP-off rows (run them elsewhere)")
    p.add_argument("--e2e-prompt-len", type=int, default=64)
    p.add_argument("--e2e-new-tokens", type=int, default=128)
    p.add_argument("--analyze", metavar="JSON", help="print the tables of a saved run (no GPU needed)")
    p.add_argument("--out", default="benchmarks/results/mtp.json")
    args = p.parse_args(argv)
    if not 1 <= args.mtp_step <= 4:
        p.error(f"--mtp-step expected 1..4, got {args.mtp_step}")
    if any(b < 1 for b in args.batches):
        p.error(f"--batches expected positive integers, got {args.batches}")
    if any(not 1 <= n <= 4 for n in args.e2e_steps):
        p.error(f"--e2e-steps expected values in 1..4, got {args.e2e_steps}")
    for name in ("e2e_layers", "e2e_prompt_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} expected a positive integer, got {getattr(args, name)}")
    if args.e2e_new_tokens < 2 or any(b < 1 for b in args.e2e_batches):
        p.error(f"--e2e-new-tokens expected >= 2 and --e2e-batches positive integers, got {args.e2e_new_tokens} and "
                f"{args.e2e_batches}")  # fmt: skip
    if any(n < args.mtp_step + 1 for n in args.lens):
        p.error(f"--lens expected lengths of at least mtp_step + 1 = {args.mtp_step + 1}, got {args.lens}")
    return args


def _sibling(name: str):
    """``benchmarks/<name>.py`` (this script's sibling), importable however this script was loaded."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(name)


def _recurrent_module():
    return _sibling("mtp_recurrent")


def main(argv=None):
    args = parse_args(argv)
    if args.analyze:
        with open(args.analyze) as f:
            results = json.load(f)
    elif not torch.cuda.is_available():
        sys.exit("error: benchmarks/mtp.py needs a CUDA GPU (use --analyze JSON to print a saved run)")
    else:
        results = {"device": torch.cuda.get_device_name()}
        if "attention" in args.parts:
            results["attention"] = run_attention(args)
        if "recurrent" in args.parts:
            mtp_recurrent = _recurrent_module()
            results["recurrent"] = mtp_recurrent.run(mtp_recurrent.parse_args(
                ["--steps", str(args.mtp_step), "--batches", *map(str, args.batches)]))  # fmt: skip
        if "e2e" in args.parts:
            results["e2e"] = _sibling("mtp_e2e").run(args)
        results["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
        save_json(results, args.out)
    print(f"\n{results['device']}")
    if "attention" in results:
        print_attention(results["attention"])
    if "recurrent" in results:
        _recurrent_module().print_tables(results["recurrent"])
    if "e2e" in results:
        _sibling("mtp_e2e").print_e2e(results["e2e"])


if __name__ == "__main__":
    main()
