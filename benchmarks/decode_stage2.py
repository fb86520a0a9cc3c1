"""Decode attention's stage 2 alone: the split merge at each ``--tiles`` setting (``stage2.set_split_tile``).

Stage 2 merges each (request, query head)'s split partials by their log-sum-exp (``stage2.merge_splits``): one split
a step, or, where a request uses at least twice the tile, a tile a step in two passes. At B=1 a graph of 32K gives a
request up to a few hundred splits (docs/decode_attention.md, "Stage 2 at B=1"). This times stage 2 alone,
graph-replayed, for the split counts the tuner's candidates give (``WAVES`` x ``BLOCK_N`` at a 32K graph) at each
batch, with the splits a request of each ``--lens`` length uses, at each tile setting (a launch too small for the
tile runs one split a step, as the launcher would); every output is checked against the float64 merge first.

    python benchmarks/decode_stage2.py --out benchmarks/results/decode_stage2_h200.json
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling modules, however it is loaded
from bench_io import save_json  # noqa: E402
from decode_attention import SHAPES  # noqa: E402

from lightllm.common.autotuner import cuda_graph_bench  # noqa: E402
from lightllm.kernels.attention.decode import flash_decode, stage2  # noqa: E402
from lightllm.kernels.attention.decode.reference import merge_splits_ref  # noqa: E402
from lightllm.kernels.attention.decode.splits import num_splits, split_token_ranges  # noqa: E402

TILES = (1, 2, 4, 8, 16, 32)


def launch_splits(shape, batch, graph_len, length, block_n, waves, device="cuda"):
    """``(splits, used)``: the launch's splits and those a request of ``length`` tokens uses."""
    splits = num_splits(batch, SHAPES[shape][1], graph_len, block_n, waves, torch.device(device))
    return splits, sum(1 for start, end in split_token_ranges(length, splits, block_n) if end > start)


def time_tiles(shape, batch, graph_len, length, block_n, waves, tiles, device="cuda"):
    """Stage 2 alone for one launch: ``{tile: ms}``, each output checked against :func:`merge_splits_ref` first."""
    hq, hk, d = SHAPES[shape]
    splits, used = launch_splits(shape, batch, graph_len, length, block_n, waves, device)
    mid_o = torch.randn(batch, hq, splits, d, device=device)
    mid_lse = torch.randn(batch, hq, splits, device=device) * 4
    seq = torch.full((batch,), length, device=device, dtype=torch.int32)
    out = torch.empty(batch, hq, d, device=device, dtype=torch.bfloat16)
    want = merge_splits_ref(mid_o, mid_lse, [used] * batch)
    times = {}
    for tile in tiles:
        previous = stage2.set_split_tile(tile)
        try:
            out.fill_(float("nan"))
            flash_decode.launch_stage2(mid_o, mid_lse, seq, out, block_n)
            torch.testing.assert_close(out.cpu().double(), want, rtol=1e-2, atol=1e-2)
            run = lambda: flash_decode.launch_stage2(mid_o, mid_lse, seq, out, block_n)  # noqa: E731
            times[tile] = cuda_graph_bench(run) if device == "cuda" else 0.0
        finally:
            stage2.set_split_tile(previous)
    return {"shape": shape, "B": batch, "L": length, "BLOCK_N": block_n, "WAVES": waves, "splits": splits,
            "used": used, "ms": times}  # fmt: skip


def run(args) -> dict:
    results = {"device": torch.cuda.get_device_name(), "graph_len": args.graph_len, "tiles": args.tiles, "rows": []}
    for shape in args.shapes:
        for batch in args.batches:
            seen = set()
            for block_n in (32, 64):
                for waves in (1, 2, 4, 8):
                    for length in args.lens:
                        launch = launch_splits(shape, batch, args.graph_len, length, block_n, waves)
                        if launch in seen:
                            continue  # another config gave this launch already
                        seen.add(launch)
                        row = time_tiles(shape, batch, args.graph_len, length, block_n, waves, args.tiles)
                        results["rows"].append(row)
                        print_row(row, args.tiles)
            save_json(results, args.out)
    return results


def print_row(row, tiles):
    base = row["ms"][tiles[0]]
    cells = " ".join(f"{row['ms'][t] * 1e3:7.2f}" for t in tiles)
    best = min(tiles, key=lambda t: row["ms"][t])
    print(f"{row['shape']:14} {row['B']:>4} {row['L']:>6} {row['splits']:>6} {row['used']:>5} {cells}   best {best:>2} "
          f"({row['ms'][best] / base:.2f}x tile {tiles[0]})", flush=True)  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    p.add_argument("--lens", nargs="+", type=int, default=[1024, 4096, 32768], help="request lengths")
    p.add_argument("--graph-len", type=int, default=32768, help="the graph's maximum KV length (sizes the grid)")
    p.add_argument("--tiles", nargs="+", type=int, default=list(TILES), help="powers of two; the first is the base")
    p.add_argument("--out", default="benchmarks/results/decode_stage2.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("decode_stage2.py needs a CUDA GPU")
    bad = [t for t in args.tiles if t < 1 or t & (t - 1)]
    if bad or min(args.batches) < 1 or min(args.lens) < 1 or max(args.lens) > args.graph_len:
        p.error(f"--tiles must be powers of two (got {bad}); --batches and --lens positive, --lens <= --graph-len")
    tiles = " ".join(f"{'t' + str(t):>7}" for t in args.tiles)
    print(f"{'shape':14} {'B':>4} {'L':>6} {'splits':>6} {'used':>5} {tiles}   (µs)")
    run(args)


if __name__ == "__main__":
    main()
