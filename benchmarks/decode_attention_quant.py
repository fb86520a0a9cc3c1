"""Quantized KV decode against bf16 at long lengths: per cell, the fastest of the tuner's own candidates for each KV
type (``split_kv_configs`` for bf16, ``quant_split_kv_configs`` for INT8/INT4), graph-timed, launched for a graph whose
maximum is the longest L (as a captured decode graph is), at quant groups 8 and 32. Reports the speed-up over bf16
and the rate at which each kernel reads its bytes (codes + scales) relative to bf16's rate (issue 17's goal: >= 0.85).

    python benchmarks/decode_attention_quant.py --out benchmarks/results/decode_attention_quant_h200.json

``--block-n-128`` also times every INT8/INT4 candidate of ``BLOCK_N`` 64 at 128 (twice the bytes a tile loads); each
row then records the best of the plain space and of that variant apart (``variants``), and ``ms`` is the best of
both. ``--element-path`` likewise times every INT8/INT4 candidate with the per-element dequantization that the
PTX word helpers replaced (stage1.py), in the same run, ``--more-stages`` the candidates of 2 and 4 warps with one
more pipeline stage (one tile more in flight per program), and ``--peel-all`` the candidates with stage 1's first
block peeled (the queries kept in registers) also at head_dim 256, where the launcher does not peel.
``--head-major`` lays every KV type's pool out head-major (each head's tokens contiguous) instead of the engine's
token-major layout: a probe of how much the access pattern costs.

``--configs`` times INT8/INT4 at the given stage-1 configs only (bf16 keeps its tuned best as the baseline) and
prints every config's time: run it before and after a kernel change (e.g. ``git apply benchmarks/patches/...``) for
an A/B at fixed configs, where the tuned best alone can hide that a change helps one config and hurts another.
``--kinds`` limits the quantized KV types; the JSON is rewritten after every row, so a run cut short keeps its rows.
"""

import argparse
import json
import os
import time

import torch

from decode_attention import SHAPES, check_cells, kv_bytes, make_pool, time_configs
from lightllm.kernels.attention.decode import flash_decode

DEFAULT_CELLS = ["hq32-hk8-d128:64", "hq24-hk4-d256:16", "hq32-hk8-d128:16", "hq24-hk4-d256:64"]


def variant_spaces(kind, q, extras=(), configs=None) -> dict:
    """The kernel's own candidates (``"tuned space"``) and, for INT8/INT4, each extra variant of them; with
    ``configs``, INT8/INT4 time only those (``"configs"``: an A/B of kernel versions at fixed configs)."""
    space = flash_decode.quant_split_kv_configs(q) if kind != "none" else flash_decode.split_kv_configs(q)
    if configs and kind != "none":
        return {"configs": list(configs)}
    spaces = {"tuned space": space}
    if kind != "none":
        if "block_n_128" in extras:
            spaces["block_n_128"] = [{**c, "BLOCK_N": 128} for c in space if c["BLOCK_N"] == 64]
        if "more_stages" in extras:
            spaces["more_stages"] = [{**c, "num_stages": c["num_stages"] + 1} for c in space if c["num_warps"] < 8]
        if "element_path" in extras:
            spaces["element_path"] = space
        if "peel_all" in extras:
            spaces["peel_all"] = space
    return spaces


def best_of_space(kind, q, pool, r2t, idx, seq, graph_max, out, group, extras=(), configs=None):
    """Each variant space's fastest candidate and every candidate's time:
    ``{variant: {"ms", "cfg" (JSON), "timed": [[config, ms], ...]}}``."""
    best = {}
    for name, space in variant_spaces(kind, q, extras, configs).items():
        previous = flash_decode.set_ptx_dequant(name != "element_path")
        peel_bound = flash_decode.set_peel_max_head_dim(max(flash_decode.HEAD_DIMS)) if name == "peel_all" else None
        try:
            _, timed = time_configs(kind, q, pool, r2t, idx, seq, graph_max, out, group, space)
        finally:
            flash_decode.set_ptx_dequant(previous)
            if peel_bound is not None:
                flash_decode.set_peel_max_head_dim(peel_bound)
        ms, cfg = min((ms, json.dumps(cfg)) for cfg, ms in timed)
        best[name] = {"ms": ms, "cfg": cfg, "timed": timed}
    return best


def run(args, save=lambda rows: None):
    """The table's rows; ``save(rows)`` after each, so a run cut short keeps what it timed."""
    t0, rows = time.time(), []
    graph_max = max(args.lens)
    kinds = [("none", 8)] + [(k, g) for k in ("int8", "int4") if k in args.kinds for g in args.groups]
    for cell in args.cells:
        shape, batch = cell.split(":")
        batch = int(batch)
        hq, hk, d = SHAPES[shape]
        tokens = batch * graph_max
        r2t = torch.arange(tokens, device="cuda", dtype=torch.int32).view(batch, graph_max)
        idx = torch.arange(batch, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        for kind, group in kinds:
            if time.time() - t0 > args.budget_s:
                print(f"time budget {args.budget_s} s spent: stopping", flush=True)
                return rows
            pool = make_pool(kind, tokens, hk, d, group, args.head_major)
            for length in args.lens:
                seq = torch.full((batch,), length, device="cuda", dtype=torch.int32)
                variants = best_of_space(kind, q, pool, r2t, idx, seq, graph_max, out, group, args.extras,
                                         args.configs)  # fmt: skip
                best = min(variants.values(), key=lambda v: v["ms"])
                rows.append({"shape": shape, "B": batch, "L": length, "kind": kind,
                             "group": group if kind != "none" else 0, "ms": best["ms"], "cfg": best["cfg"],
                             "bytes": kv_bytes(kind, batch, length, hk, d, group), "variants": variants})  # fmt: skip
                print(f"{shape} B={batch} L={length} {kind} g{rows[-1]['group']}: {best['ms'] * 1e3:.1f} us "
                      f"{best['cfg']}", flush=True)  # fmt: skip
                save(rows)
            del pool
            torch.cuda.empty_cache()
    return rows


def print_table(rows):
    base = {(r["shape"], r["B"], r["L"]): r for r in rows if r["kind"] == "none"}
    print(f"\n{'shape':14s} {'B':>3s} {'L':>6s} kind group {'us':>8s} {'x bf16':>7s} {'rate/bf16':>9s}")
    for r in rows:
        b = base.get((r["shape"], r["B"], r["L"]))
        if r["kind"] == "none" or b is None:
            continue
        rate = (r["bytes"] / r["ms"]) / (b["bytes"] / b["ms"])
        print(f"{r['shape']:14s} {r['B']:3d} {r['L']:6d} {r['kind']:4s} {r['group']:5d} {r['ms'] * 1e3:8.1f} "
              f"{b['ms'] / r['ms']:7.2f} {rate:9.2f}", end="")  # fmt: skip
        variants = r.get("variants", {})
        if "configs" in variants:  # --configs: every config's time, in the order given
            print("  configs " + " ".join(f"{ms * 1e3:.1f}" for _, ms in variants["configs"]["timed"]))
        else:
            print("".join(f"  {name} {v['ms'] * 1e3:.1f}" for name, v in variants.items() if len(variants) > 1))


CONFIG_KEYS = {"BLOCK_N", "num_warps", "num_stages", "WAVES"}
OPTIONAL_KEYS = {"MIN_BLOCKS"}


def parse_config(p, text: str) -> dict:
    """One ``--configs`` value: a JSON object with the stage-1 config keys (``MIN_BLOCKS`` optional)."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError:
        cfg = None
    if not isinstance(cfg, dict) or not CONFIG_KEYS <= set(cfg) or not set(cfg) <= CONFIG_KEYS | OPTIONAL_KEYS:
        p.error(f"--configs expected JSON objects with keys {sorted(CONFIG_KEYS)} (optional: {sorted(OPTIONAL_KEYS)}), "
                f"got {text!r}")  # fmt: skip
    return cfg


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="+", default=DEFAULT_CELLS, help="SHAPE:BATCH, shapes of decode_attention.py")
    p.add_argument("--lens", nargs="+", type=int, default=[32768])
    p.add_argument("--groups", nargs="+", type=int, default=[8, 32], help="INT8/INT4 quant group sizes")
    p.add_argument(
        "--kinds",
        nargs="+",
        default=["int8", "int4"],
        choices=["int8", "int4"],
        help="quantized KV types to time beside bf16",
    )
    p.add_argument(
        "--configs",
        nargs="+",
        metavar="JSON",
        help='time INT8/INT4 at these stage-1 configs only, each like {"BLOCK_N": 64, "num_warps": 2, '
        '"num_stages": 3, "WAVES": 4}: an A/B of kernel versions',
    )
    p.add_argument("--budget-s", type=float, default=600.0, help="stop starting new KV types after this long")
    p.add_argument(
        "--block-n-128",
        dest="extras",
        action="append_const",
        const="block_n_128",
        help="also time the INT8/INT4 candidates of BLOCK_N 64 at 128",
    )
    p.add_argument(
        "--more-stages",
        dest="extras",
        action="append_const",
        const="more_stages",
        help="also time the INT8/INT4 candidates of 2 and 4 warps with one more pipeline stage",
    )
    p.add_argument(
        "--element-path",
        dest="extras",
        action="append_const",
        const="element_path",
        help="also time the INT8/INT4 candidates with per-element dequantization (set_ptx_dequant(False))",
    )
    p.add_argument(
        "--peel-all",
        dest="extras",
        action="append_const",
        const="peel_all",
        help="also time the INT8/INT4 candidates with stage 1's first block peeled at every head_dim (the launcher "
        "peels up to 128: flash_decode.peel_queries)",
    )
    p.add_argument("--head-major", action="store_true", help="every KV type's pool head-major: a program's tokens "
                   "contiguous (a probe of the access pattern; the engine's pool is token-major)")  # fmt: skip
    p.add_argument("--analyze", metavar="JSON", help="print the table of a saved run (no GPU needed)")
    p.add_argument("--out", default="benchmarks/results/decode_attention_quant.json")
    args = p.parse_args()
    args.extras = tuple(args.extras or ())
    if args.analyze:
        with open(args.analyze) as f:
            print_table(json.load(f)["rows"])
        return
    check_cells(p, args.cells)
    if args.configs:
        args.configs = [parse_config(p, text) for text in args.configs]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save(rows):
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "graph_max_len": max(args.lens),
                       "head_major": args.head_major, "rows": rows}, f)  # fmt: skip

    print_table(run(args, save))


if __name__ == "__main__":
    main()
