"""Decode GEMMs (M <= 16) on the GPU: cuBLAS against every candidate of the tuned small-M linear (``small_m_linear``).

Per shape, projection and M (rows: decode tokens): cuBLAS as the models call it (``torch.mm`` on the weight's
transposed view; ``out_dtype=torch.float32`` for the lm_head) and every candidate config of the Triton kernel, each
a CUDA-graph replay median (``cuda_graph_bench``). Weight bytes / time gives TB/s; a decode step streams every weight
once, so each launch of a timed graph reads the next of several weight copies (together over 512 MB, far beyond L2):
"cold", as in a step (the tuner's search does the same over 256 MB, ``kernels/linear/cold_weights.py``). ``--warm``
(default on) also times everything on one weight (Qwen3-8B's qkv and o_proj fit the H200's L2 there) and reports
what that ranking would pick and its cold loss against the cold best: what timing without the copies would cost.

    python benchmarks/gemv.py --out benchmarks/results/gemv_h200.json
    python benchmarks/gemv.py --analyze benchmarks/results/gemv_h200.json
    python benchmarks/gemv.py --dry-run --out /tmp/gemv.json   # the method on a CPU (interpreter, tiny shapes)

Per (shape, layer kind, M) the table ends with a layer's projections summed (lm_head apart): cuBLAS against the best
of cuBLAS and the candidates per projection, what a tuned start would reach at best. Qwen3.5-27B has two layer kinds,
full attention (``qkv``, ``o``) and linear attention (``in_proj``, ``out_proj``), each with the MLP.
"""

import argparse
import importlib
import math
import sys

import torch

from bench_io import measure_or_analyze, save_json
from lightllm.common.autotuner import cuda_graph_bench, wall_clock_bench

F32 = "float32"
# Projection -> (N, K, out dtype): Qwen3-8B and Qwen3.5-27B at tp 1 (lightllm/tools/tune_shipped.py's widths).
# Qwen3.5-27B: qkv = 24 gated q heads (query + gate) and 2 x 4 KV heads of 256; in_proj = the conv input
# (2 x 16 key heads + 48 value heads of 128), z (48 x 128), b and a (48 each); out_proj reads 48 x 128.
SHAPES = {
    "qwen3-8b": {"qkv": (6144, 4096, None), "o": (4096, 4096, None), "gate_up": (24576, 4096, None),
                 "down": (4096, 12288, None), "lm_head": (151936, 4096, F32)},
    "qwen3.5-27b": {"qkv": (14336, 5120, None), "o": (5120, 6144, None), "in_proj": (16480, 5120, None),
                    "out_proj": (5120, 6144, None), "gate_up": (34816, 5120, None), "down": (5120, 17408, None),
                    "mtp_fc": (5120, 10240, None), "lm_head": (248320, 5120, F32)},
}  # fmt: skip
DRY_SHAPES = {"tiny": {"qkv": (96, 64, None), "down": (64, 80, None), "lm_head": (200, 64, F32)}}
LAYER_EXCLUDES = ("lm_head", "mtp_fc")  # not per layer
# Per shape whose layers differ, each layer kind's own projections; the rest (the MLP) are in every layer. A layer
# runs one kind's projections, never two (Qwen3.5: 3 linear-attention layers to 1 full-attention layer).
LAYER_KINDS = {"qwen3.5-27b": {"full": ("qkv", "o"), "linear": ("in_proj", "out_proj")}}
COLD_BYTES = 512 << 20


def _kernels():
    """The kernel modules, imported late: ``--dry-run`` selects the interpreter before any kernel is defined."""
    return (importlib.import_module("lightllm.kernels.linear.small_m_linear"),
            importlib.import_module("lightllm.kernels.linear.small_m_kernel"),
            importlib.import_module("lightllm.kernels.linear.reference"))  # fmt: skip


def weight_ring(n: int, k: int, dtype: torch.dtype, device, cold: bool):
    """A random weight and, when cold, copies of it whose bytes together pass ``COLD_BYTES``: each ``next()`` of the
    ring gives the next copy and its transposed view."""
    from lightllm.kernels.linear.cold_weights import WeightRing

    w = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    return WeightRing(w, max(2, math.ceil(COLD_BYTES / (w.numel() * w.element_size()))) if cold else 1)


def time_cell(bench, x, ring, out_dtype, configs) -> dict:
    _, kernel, reference = _kernels()
    out = torch.empty(x.shape[0], ring.weights[0].shape[0], dtype=out_dtype, device=x.device)

    def cublas():
        _, w_t = ring.next()
        return reference.cublas_linear(x, w_t, out_dtype)

    def triton(cfg, scratch):
        w, _ = ring.next()
        return kernel.launch_small_m_linear(x, w, out, cfg, scratch)

    cublas_ms = bench(cublas)
    timed = []
    for cfg in configs:
        scratch = {}
        try:
            ms = bench(lambda: triton(cfg, scratch))
        except Exception as e:  # out of resources on a smaller GPU
            ms = math.inf
            print(f"  {cfg}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        timed.append([cfg, ms])
    return {"cublas_ms": cublas_ms, "configs": timed}


def run(args) -> dict:
    from lightllm.kernels.linear.cold_weights import WeightRing

    tuned, _, _ = _kernels()
    dry = args.dry_run
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    bench = cuda_graph_bench if device == "cuda" else (lambda fn: wall_clock_bench(fn, repeats=1))
    shapes = DRY_SHAPES if dry else {s: SHAPES[s] for s in args.shapes}
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
               "dtype": str(dtype), "cold_bytes": 0 if dry else COLD_BYTES, "cells": []}  # fmt: skip
    if device == "cuda":
        from bandwidth import gemv_gbs

        results["gemv_GBs"] = gemv_gbs()
    gen = torch.Generator(device=device).manual_seed(0)
    for shape, projections in shapes.items():
        for proj, (n, k, out_name) in projections.items():
            out_dtype = torch.float32 if out_name == F32 else dtype
            configs = tuned._configs(
                torch.empty(1, k, dtype=dtype, device="meta"), torch.empty(n, k, dtype=dtype, device="meta")
            )
            cold = weight_ring(n, k, dtype, device, cold=not dry)
            for m in args.rows:
                x = torch.randn(m, k, generator=gen, device=device).to(dtype)
                cell = {"shape": shape, "proj": proj, "N": n, "K": k, "M": m, "out_dtype": str(out_dtype),
                        "weight_bytes": n * k * cold.weights[0].element_size(), "copies": len(cold.weights),
                        **time_cell(bench, x, cold, out_dtype, configs)}  # fmt: skip
                if args.warm:
                    cell["warm"] = time_cell(bench, x, WeightRing(cold.weights[0], 1), out_dtype, configs)
                results["cells"].append(cell)
                save_json(results, args.out)  # a run cut short keeps what finished
                print(f"{shape} {proj} M={m}: cuBLAS {cell['cublas_ms']:.4f} ms", file=sys.stderr)
            del cold
    return results


def _pick(cell: dict):
    """``(config or None for cuBLAS, ms)``: the fastest, cuBLAS winning ties (as the tuner's search)."""
    best, best_ms = None, cell["cublas_ms"]
    for cfg, ms in cell["configs"]:
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best, best_ms


def _cold_ms(cell: dict, cfg) -> float:
    if cfg is None:
        return cell["cublas_ms"]
    return next(ms for c, ms in cell["configs"] if c == cfg)


def analyze(results: dict) -> list:
    rows = []
    for cell in results["cells"]:
        finite = [[c, ms] for c, ms in cell["configs"] if math.isfinite(ms)]
        best_cfg, best_ms = min(finite, key=lambda t: t[1]) if finite else (None, math.inf)
        tbs = lambda ms: cell["weight_bytes"] / ms / 1e9 if ms > 0 and math.isfinite(ms) else 0.0  # noqa: E731
        row = {"shape": cell["shape"], "proj": cell["proj"], "M": cell["M"], "N": cell["N"], "K": cell["K"],
               "weight_bytes": cell["weight_bytes"],
               "cublas_ms": cell["cublas_ms"], "cublas_TBs": tbs(cell["cublas_ms"]), "best_cfg": best_cfg,
               "best_ms": best_ms, "best_TBs": tbs(best_ms), "speedup": cell["cublas_ms"] / best_ms,
               "warm_pick": None, "warm_pick_loss_pct": None}  # fmt: skip
        if "warm" in cell:
            pick, _ = _pick(cell["warm"])
            cold_best = min(best_ms, cell["cublas_ms"])
            row["warm_pick"] = pick if pick is not None else "cublas"
            row["warm_pick_loss_pct"] = (_cold_ms(cell, pick) / cold_best - 1) * 100
        rows.append(row)
    return rows


def layer_sums(rows: list) -> list:
    """Per (shape, layer kind, M): one layer's projections summed, cuBLAS and the per-projection best of cuBLAS and
    candidates. ``layer``: the kind in ``LAYER_KINDS``, or "all" for a shape whose layers are alike."""
    sums = {}
    for r in rows:
        if r["proj"] in LAYER_EXCLUDES:
            continue
        kinds = LAYER_KINDS.get(r["shape"], {"all": ()})
        own = [kind for kind, projs in kinds.items() if r["proj"] in projs]
        for kind in own or kinds:  # a kind's own projection in that kind's layer, the others in every kind's
            empty = {"shape": r["shape"], "layer": kind, "M": r["M"], "cublas_ms": 0.0, "best_ms": 0.0, "bytes": 0}
            s = sums.setdefault((r["shape"], kind, r["M"]), empty)
            s["cublas_ms"] += r["cublas_ms"]
            s["best_ms"] += min(r["cublas_ms"], r["best_ms"])
            s["bytes"] += r["weight_bytes"]
    return list(sums.values())


def _short(cfg) -> str:
    if not isinstance(cfg, dict):
        return str(cfg)
    return f"{cfg['BLOCK_N']}x{cfg['BLOCK_K']} s{cfg['SPLIT_K']} w{cfg['num_warps']} st{cfg['num_stages']}"


def print_table(results: dict, rows: list) -> None:
    ceiling = results.get("gemv_GBs")
    cold = results["cold_bytes"] >> 20
    print(f"# {results['device']}, {results['dtype']}; "
          + (f"cold: weights rotated over {cold} MB" if cold else "one weight per cell")
          + (f"; torch.mv 1 GiB rate {ceiling / 1e3:.2f} TB/s" if ceiling else ""))  # fmt: skip
    head = f"{'shape':<12} {'proj':<9} {'M':>3} {'N':>7} {'K':>6} {'cuBLAS ms':>10} {'TB/s':>5} {'best ms':>9} "
    print(head + f"{'TB/s':>5} {'x cuBLAS':>8}  {'best config':<24} {'warm pick (cold loss)'}")
    for r in rows:
        warm = "" if r["warm_pick"] is None else f"{_short(r['warm_pick'])} ({r['warm_pick_loss_pct']:+.1f}%)"
        print(f"{r['shape']:<12} {r['proj']:<9} {r['M']:>3} {r['N']:>7} {r['K']:>6} {r['cublas_ms']:>10.4f} "
              f"{r['cublas_TBs']:>5.2f} {r['best_ms']:>9.4f} {r['best_TBs']:>5.2f} {r['speedup']:>8.2f}  "
              f"{_short(r['best_cfg']):<24} {warm}")  # fmt: skip
    print(f"{'layer sum':<12} {'layer':<6} {'M':>3} {'cuBLAS ms':>10} {'TB/s':>5} {'tuned ms':>9} {'TB/s':>5} "
          f"{'x cuBLAS':>8}")  # fmt: skip
    for s in layer_sums(rows):
        print(f"{s['shape']:<12} {s['layer']:<6} {s['M']:>3} {s['cublas_ms']:>10.4f} "
              f"{s['bytes'] / s['cublas_ms'] / 1e9:>5.2f} {s['best_ms']:>9.4f} {s['bytes'] / s['best_ms'] / 1e9:>5.2f} "
              f"{s['cublas_ms'] / s['best_ms']:>8.2f}")  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=None, help="M, decode tokens (default 1 4 8 16)")
    p.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True,
                   help="also time on one weight (no ring: warm in L2) and report its pick's cold loss")  # fmt: skip
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shapes through Triton's interpreter on a CPU, one weight: the method, not a speed",
    )
    p.add_argument("--analyze", metavar="JSON", help="print the table of a saved run (no GPU needed)")
    p.add_argument("--out", default="benchmarks/results/gemv.json")
    args = p.parse_args(argv)
    args.rows = args.rows or ([1, 3] if args.dry_run else [1, 4, 8, 16])
    if not all(1 <= m <= 16 for m in args.rows):
        p.error(f"--rows expected values in 1..16 (the kernel's row tile), got {args.rows}")
    return args


def main(argv=None):
    measure_or_analyze(parse_args(argv), "gemv.py", run, analyze, print_table)


if __name__ == "__main__":
    main()
