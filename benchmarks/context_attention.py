"""Prefill attention of one chunk over its cached prefix (chunked prefill): every candidate config, unpacked and
GQA-packed, against the default and FlashAttention-3.

Per shape, chunk (new tokens) and prefix (cached tokens), one request: the kernel the engine runs there
(``context_attention_prefix``; with prefix 0 ``context_attention``, timed with the prefix kernel's candidates too,
to show whether packing should be offered to it), timed at the default config, at every candidate of
``context_attention_prefix`` (``PACK_GQA`` marks the packed ones) and at each packed candidate's unpacked twin
(same tiles, warps and stages; not a candidate), each a CUDA-graph replay median through a step plan (split
partials made once, as in the engine). FA3 (``flash_attn_interface``'s ``flash_attn_with_kvcache``, paged with
page size 1 over the same pool and token table, causal; else ``fa3_fwd_interface`` over a contiguous cache;
skipped when neither imports) is the anchor. Reports per cell ms and achieved TFLOP/s of the best unpacked and
best packed candidate, the default and FA3, and the best packed one against its twin; FLOPs count the visible
(query, key) pairs only: ``4 * D * q_heads * chunk * (prefix + (chunk + 1) / 2)``.

    python benchmarks/context_attention.py --out benchmarks/results/context_attention_h200.json
    python benchmarks/context_attention.py --analyze benchmarks/results/context_attention_h200.json
    python benchmarks/context_attention.py --dry-run --out /tmp/ctx.json   # the method on a CPU (interpreter)

``--explore`` also times unpacked configs outside the tuned space (bigger tiles, deeper pipelines: ``EXPLORE``),
never tuned, to show whether the space is what limits a cell; the table adds their best.
"""

import argparse
import importlib
import math
import sys

import torch

from bench_io import measure_or_analyze, save_json
from lightllm.common.autotuner import cuda_graph_bench, wall_clock_bench

SHAPES = {"hq32-hk8-d128": (32, 8, 128), "hq24-hk4-d256": (24, 4, 256)}  # Qwen3-8B; Qwen3.5-27B full attention
DRY_SHAPE = {"hq6-hk1-d64": (6, 1, 64)}  # a group of 6, tiny, for the interpreter
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head_dim class: what FA2-style Triton kernels reach their best with on
# Hopper, outside the tuned space (64x64 and 128x128 at 3 stages joined it after the first H200 run)
EXPLORE = {
    "small": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 128, 4, 3), (128, 32, 4, 3)],
    "d256": [(64, 64, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 3)],
}  # fmt: skip


def explore_configs(head_dim: int) -> list:
    tiles = EXPLORE["d256" if head_dim == 256 else "small"]
    return [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s} for m, n, w, s in tiles]


def attention_flops(q_heads: int, head_dim: int, chunk: int, prefix: int) -> float:
    """QK^T and PV over the visible pairs: every prefix key, and the causal half of the chunk's own."""
    return 4.0 * head_dim * q_heads * chunk * (prefix + (chunk + 1) / 2)


def _kernels():
    """The kernel module, imported late: ``--dry-run`` selects the interpreter before any kernel is defined."""
    return importlib.import_module("lightllm.kernels.attention.prefill.context_attention")


def _fa3():
    """``(module, paged)`` of the first FA3 build that imports, or None."""
    for name, paged in (("flash_attn_interface", True), ("fa3_fwd_interface", False)):
        try:
            module = importlib.import_module(name)
        except Exception as e:  # ImportError, or a build whose extension fails to load
            print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        if hasattr(module, "flash_attn_with_kvcache"):
            return module, paged
    return None


class Cell:
    """One request: ``chunk`` new tokens after ``prefix`` cached ones in a pool of exactly those tokens, in order."""

    def __init__(self, shape, chunk, prefix, dtype, device, seed=0):
        hq, hk, d = shape
        g = torch.Generator().manual_seed(seed)

        def rand(*size):
            return torch.randn(*size, generator=g).to(dtype).to(device)

        self.q, self.k, self.v = rand(chunk, hq, d), rand(chunk, hk, d), rand(chunk, hk, d)
        # the pool holds the prefix then the chunk's own K/V (as the engine's KV write leaves it): FA3 reads both
        self.k_cache, self.v_cache = rand(prefix + chunk, hk, d), rand(prefix + chunk, hk, d)
        self.k_cache[prefix:], self.v_cache[prefix:] = self.k, self.v
        i32 = dict(dtype=torch.int32, device=device)
        self.table = torch.arange(prefix + chunk, **i32).unsqueeze(0)
        self.b_start, self.b_len = torch.zeros(1, **i32), torch.full((1,), chunk, **i32)
        self.seqlens = torch.full((1,), prefix + chunk, **i32)
        self.chunk, self.prefix = chunk, prefix
        self.out = torch.empty_like(self.q)

    def plan(self, cfg):
        ca = _kernels()
        prefix = None
        if self.prefix:
            i32 = dict(dtype=torch.int32, device=self.q.device)
            prefix = ca.CachedPrefix(self.table, torch.zeros(1, **i32), torch.full((1,), self.prefix, **i32))
        plan = ca.ContextAttentionPlan(self.q.shape, self.k.shape, self.q.dtype, self.b_start, self.b_len,
                                       self.chunk, run_config=cfg, prefix=prefix, reuse_outputs=True)  # fmt: skip
        kv = dict(k_cache=self.k_cache, v_cache=self.v_cache) if self.prefix else {}
        return lambda: plan.run(self.q, self.k, self.v, out=self.out, **kv)

    def fa3(self, module, paged):
        q = self.q.unsqueeze(0)
        if paged:  # page size 1: the pool as pages of one token, the token table as the page table
            k, v = self.k_cache.unsqueeze(1), self.v_cache.unsqueeze(1)
            return lambda: module.flash_attn_with_kvcache(q, k, v, cache_seqlens=self.seqlens, page_table=self.table,
                                                          causal=True)  # fmt: skip
        k, v = self.k_cache.unsqueeze(0), self.v_cache.unsqueeze(0)
        return lambda: module.flash_attn_with_kvcache(q, k, v, cache_seqlens=self.seqlens, causal=True)


def _time(fn, bench):
    try:
        return bench(fn)
    except Exception as e:  # out of resources at some shapes
        print(f"  {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return math.inf


def run(args) -> dict:
    dry = args.dry_run
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cpu" else torch.bfloat16  # the interpreter mishandles bf16
    bench = cuda_graph_bench if device == "cuda" else (lambda fn: wall_clock_bench(fn, repeats=1))
    fa3 = None if args.no_fa3 or device == "cpu" else _fa3()
    shapes = DRY_SHAPE if dry else {s: SHAPES[s] for s in args.shapes}
    ca = _kernels()
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
               "dtype": str(dtype), "fa3": None if fa3 is None else f"{fa3[0].__name__} paged={fa3[1]}",
               "cells": []}  # fmt: skip
    for name, shape in shapes.items():
        hq, hk, d = shape
        configs = ca._prefix_configs(torch.empty(1, hq, d))
        default = ca.default_config(torch.empty(1, hq, d, device=device))  # the untuned config on this GPU
        twins = unpacked_twins(configs)
        for chunk in args.chunks:
            for prefix in args.prefixes:
                cell = Cell(shape, chunk, prefix, dtype, device)
                row = {"shape": name, "chunk": chunk, "prefix": prefix,
                       "kernel": "context_attention_prefix" if prefix else "context_attention",
                       "flops": attention_flops(hq, d, chunk, prefix),
                       "default": default, "default_ms": _time(cell.plan(default), bench),
                       "configs": [[cfg, _time(cell.plan(cfg), bench)] for cfg in configs],
                       "twins": [[cfg, _time(cell.plan(cfg), bench)] for cfg in twins]}  # fmt: skip
                if args.explore:
                    row["explore"] = [[cfg, _time(cell.plan(cfg), bench)] for cfg in explore_configs(d)]
                if fa3 is not None:
                    row["fa3_ms"] = _time(cell.fa3(*fa3), bench)
                results["cells"].append(row)
                print(f"{name} chunk {chunk:5d} prefix {prefix:6d}: default {row['default_ms']:.3f} ms, best "
                      f"{min(ms for _, ms in row['configs']):.3f} ms", flush=True)  # fmt: skip
                del cell
        save_json(results, args.out)  # partial results survive a time limit
    return results


def unpacked_twins(configs) -> list:
    """Each packed candidate's tiles, warps and stages without packing, where no unpacked candidate has them: timed
    beside the candidates (never tuned) so a packed win can be told apart from a win of its tiles or stages."""
    unpacked = [c for c in configs if not c.get("PACK_GQA")]
    twins = []
    for c in configs:
        twin = {k: v for k, v in c.items() if k != "PACK_GQA"}
        if c.get("PACK_GQA") and twin not in unpacked and twin not in twins:
            twins.append(twin)
    return twins


def _twin_ms(cell, packed_cfg):
    """ms of ``packed_cfg`` without packing (a candidate or a twin), or None."""
    twin = {k: v for k, v in packed_cfg.items() if k != "PACK_GQA"}
    ms = [t for cfg, t in cell["configs"] + cell.get("twins", []) if cfg == twin]
    return ms[0] if ms and math.isfinite(ms[0]) else None


def _best(timed):
    """``[ms, config]`` of the fastest of ``[config, ms]`` pairs, or None."""
    return min(([ms, cfg] for cfg, ms in timed), key=lambda x: x[0], default=None)


def analyze(results) -> list:
    """Per cell: ms and TFLOP/s of the best unpacked and best packed candidate, the default and FA3."""
    rows = []
    for c in results["cells"]:
        row = {k: c[k] for k in ("shape", "chunk", "prefix", "kernel")}
        picks = {
            "unpacked": _best(cfg_ms for cfg_ms in c["configs"] if not cfg_ms[0].get("PACK_GQA")),
            "packed": _best(cfg_ms for cfg_ms in c["configs"] if cfg_ms[0].get("PACK_GQA")),
            "default": [c["default_ms"], c["default"]],
            "fa3": [c["fa3_ms"], None] if "fa3_ms" in c else None,
            "explore": _best(c["explore"]) if c.get("explore") else None,
        }
        for label, pick in picks.items():
            ms = None if pick is None or not math.isfinite(pick[0]) else pick[0]
            row[f"{label}_ms"] = ms
            row[f"{label}_tflops"] = None if ms is None else c["flops"] / (ms * 1e-3) / 1e12
            if label in ("unpacked", "packed", "explore"):
                row[f"{label}_cfg"] = None if pick is None else pick[1]
        row["packed_twin_ms"] = None if picks["packed"] is None else _twin_ms(c, picks["packed"][1])
        rows.append(row)
    return rows


def _cfg_text(cfg):
    return "-" if cfg is None else f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"


def print_table(results, rows):
    print(f"\n{results['device']}, {results['dtype']}; FA3: {results['fa3'] or 'absent'}")
    print("ms and TFLOP/s (visible pairs) per kernel; pk/unpk: best packed / best unpacked candidate; pk/twin: best")
    print("packed / the same config unpacked (< 1: packing itself is faster)")
    print(f"{'shape':14s} {'chunk':>5s} {'prefix':>6s}  {'unpacked':>16s}  {'packed':>16s}  {'default':>16s}  "
          f"{'fa3':>16s}  {'explore':>16s}  {'pk/unpk':>7s}  {'pk/twin':>7s}  best unpacked     best packed     "
          "best explored")  # fmt: skip
    for r in rows:
        cols = []
        for label in ("unpacked", "packed", "default", "fa3", "explore"):
            ms = r[f"{label}_ms"]
            cols.append(f"{'-':>16s}" if ms is None else f"{ms:8.3f} {r[f'{label}_tflops']:7.1f}")
        ratios = [r["packed_ms"] / r[key] if r["packed_ms"] and r[key] else None
                  for key in ("unpacked_ms", "packed_twin_ms")]  # fmt: skip
        ratios = "  ".join(f"{'-' if x is None else f'{x:.2f}':>7s}" for x in ratios)
        print(f"{r['shape']:14s} {r['chunk']:5d} {r['prefix']:6d}  " + "  ".join(cols)
              + f"  {ratios}  {_cfg_text(r['unpacked_cfg']):16s}  {_cfg_text(r['packed_cfg']):16s}"
              + _cfg_text(r["explore_cfg"]))  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--chunks", nargs="+", type=int, default=None, help="new tokens (default 256 512 2048)")
    p.add_argument("--prefixes", nargs="+", type=int, default=None, help="cached tokens (default 0 8192 32768)")
    p.add_argument("--no-fa3", action="store_true")
    p.add_argument("--explore", action="store_true", help="also time the unpacked configs of EXPLORE (never tuned)")
    p.add_argument("--dry-run", action="store_true",
                   help="a tiny shape (6 q heads over 1 KV head, D 64), chunk 8 after 0 and 20 cached tokens, "
                   "through Triton's interpreter on a CPU: the method, not a speed")  # fmt: skip
    p.add_argument("--analyze", metavar="JSON", help="print the table of a saved run (no GPU needed)")
    p.add_argument("--out", default="benchmarks/results/context_attention.json")
    args = p.parse_args(argv)
    args.chunks = args.chunks or ([8] if args.dry_run else [256, 512, 2048])
    args.prefixes = args.prefixes or ([0, 20] if args.dry_run else [0, 8192, 32768])
    if min(args.chunks) < 1 or min(args.prefixes) < 0:
        p.error(f"--chunks expected positive and --prefixes non-negative token counts, got {args.chunks} and "
                f"{args.prefixes}")  # fmt: skip
    return args


def main(argv=None):
    measure_or_analyze(parse_args(argv), "context_attention.py", run, analyze, print_table)


if __name__ == "__main__":
    main()
