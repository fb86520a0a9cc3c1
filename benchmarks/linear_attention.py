"""Linear-attention decode on the GPU: the Triton gated delta rule (``gated_delta_decode``) against fla-core's
``fused_recurrent_gated_delta_rule`` (the anchor), and the conv1d update, per batch size.

Every time is a CUDA-graph replay median (the tuner's timer). Each captured launch reads and writes another
state pool, cycling through pools of at least 1 GiB together, so the state comes from HBM as in a real step
(every layer has its own pool) rather than from L2. Per batch size B and shape (key heads, value heads, head
dims), float32 state and bf16 activations:

- ``default``: the launcher default; ``tuner``: the config the autotuner picks (level 1, DECODE_ATTENTION scope,
  a fresh config folder; it times on one dummy pool, so L2-hot at small B); ``best``: the fastest candidate here;
- ``fla``: fla-core's fused recurrent kernel, gates and sigmoid in its kernel, reading the same pools as initial
  states and writing float32 final states (it has no slot indices; same bytes);
- state rate: ``B * Hv * Dk * Dv * 4 * 2`` bytes (read + write) over the time, and as % of a device copy
  measured in the same run;
- conv1d update (bf16, K = 4) at a few ``BLOCK_C``: it is not tuned (docs/decode_attention.md).

    python benchmarks/linear_attention.py --out benchmarks/results/linear_attention_h200.json
    python benchmarks/linear_attention.py --analyze benchmarks/results/linear_attention_h200.json
"""

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # also when loaded from its path (the tests)
    sys.path.insert(0, HERE)
from recurrent_bench import Cycle, check_batches, pools_needed, run_or_analyze, save, tuner_pick  # noqa: E402

# (key heads, value heads, head_k_dim, head_v_dim): Qwen3.5-27B's linear attention at tp 1, and Qwen3-Next-80B's.
SHAPES = {"hk16-hv48-d128": (16, 48, 128, 128), "hk16-hv32-d128": (16, 32, 128, 128)}
BATCHES = (1, 8, 16, 64, 128)
CONV_TAPS = 4
CONV_BLOCKS = (256, 512, 1024, 2048)


def state_bytes(batch: int, v_heads: int, head_k_dim: int, head_v_dim: int, elem: int = 4) -> int:
    """Bytes one decode step moves for the recurrent state: every slot read and written once."""
    return 2 * batch * v_heads * head_k_dim * head_v_dim * elem


def make_decode(shape, batch):
    hk, hv, dk, dv = shape
    conv_out = torch.randn(batch, 2 * hk * dk + hv * dv, device="cuda", dtype=torch.bfloat16)
    q = conv_out[:, : hk * dk].view(batch, hk, dk)
    k = conv_out[:, hk * dk : 2 * hk * dk].view(batch, hk, dk)
    v = conv_out[:, 2 * hk * dk :].view(batch, hv, dv)
    a, b = (torch.randn(batch, hv, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    A_log, dt_bias = torch.randn(hv, device="cuda"), torch.randn(hv, device="cuda")
    pools = [
        torch.randn(batch, hv, dk, dv, device="cuda").mul_(0.1)
        for _ in range(pools_needed(state_bytes(batch, hv, dk, dv) // 2))
    ]
    idx = torch.randperm(batch, device="cuda").int()
    return dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, pools=pools, idx=idx)


def time_ours(t, cfg):
    from lightllm.common.autotuner import cuda_graph_bench
    from lightllm.kernels.linear_attention.gated_delta_decode import gated_delta_decode

    out = torch.empty(t["v"].shape, dtype=t["q"].dtype, device="cuda")
    args = t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"], t["dt_bias"]
    return cuda_graph_bench(
        Cycle(lambda pool: gated_delta_decode(*args, pool, t["idx"], out=out, run_config=cfg), t["pools"])
    )


def time_fla(t, fla):
    from lightllm.common.autotuner import cuda_graph_bench

    q, k, v = (t[n].contiguous()[:, None] for n in ("q", "k", "v"))
    a, b = t["a"][:, None], t["b"][:, None]

    def launch(pool):
        return fla.fused_recurrent_gated_delta_rule(
            q, k, v, g=a, beta=b, initial_state=pool, output_final_state=True, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, A_log=t["A_log"], dt_bias=t["dt_bias"], use_beta_sigmoid_in_kernel=True,
        )  # fmt: skip

    return cuda_graph_bench(Cycle(launch, t["pools"]))


def decode_tuner_pick(t):
    """The config the autotuner stores for this batch size (its own search, in a fresh config folder)."""
    from lightllm.kernels.linear_attention import gated_delta_decode as gdd

    args = t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"], t["dt_bias"], t["pools"][0], t["idx"]
    return tuner_pick(gdd._launch_gated_delta_decode, lambda: gdd.gated_delta_decode(*args))


def time_conv(batch, channels, block):
    from lightllm.common.autotuner import cuda_graph_bench
    from lightllm.kernels.linear_attention.conv1d_update import causal_conv1d_update

    x = torch.randn(batch, channels, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(channels, CONV_TAPS, device="cuda", dtype=torch.bfloat16)
    per_pool = batch * (CONV_TAPS - 1) * channels * 2
    pools = [
        torch.randn(batch, CONV_TAPS - 1, channels, device="cuda", dtype=torch.bfloat16)
        for _ in range(pools_needed(per_pool))
    ]
    idx, out = torch.arange(batch, device="cuda", dtype=torch.int32), torch.empty_like(x)
    cfg = {"BLOCK_C": block, "num_warps": 4}
    return cuda_graph_bench(Cycle(lambda pool: causal_conv1d_update(x, pool, weight, idx, out, cfg), pools))


def run(args):
    from bandwidth import copy_gbs
    from lightllm.kernels.linear_attention import gated_delta_decode as gdd
    from lightllm.kernels.linear_attention.conv1d_update import DEFAULT_CONFIG

    try:
        import fla.ops.gated_delta_rule as fla
    except ImportError as e:
        fla = None
        print(f"fla-core not available ({e}); fla columns left empty", file=sys.stderr)
    copy, copy_ways = copy_gbs(detail=True)
    results = {
        "device": torch.cuda.get_device_name(),
        "copy_GBs": copy,
        "copy_ways_GBs": copy_ways,  # memcpy and kernel copy: which one sets the reference
        "state_dtype": "torch.float32",
        "dtype": "torch.bfloat16",
        "rows": [],
        "conv": [],
    }
    print(f"copy bandwidth {results['copy_GBs']:.0f} GB/s", flush=True)
    for name in args.shapes:
        shape = SHAPES[name]
        for batch in args.batches:
            t = make_decode(shape, batch)
            default = gdd.default_config(shape[3])
            candidates = {json.dumps(c, sort_keys=True): time_ours(t, c) for c in gdd._configs(t["q"], t["v"])}
            picked = decode_tuner_pick(t)
            row = {
                "shape": name,
                "B": batch,
                "state_bytes": state_bytes(batch, *shape[1:]),
                "default": default,
                "default_ms": time_ours(t, default),
                "tuner": picked,
                "tuner_ms": time_ours(t, picked or default),  # None: the default won (never a cached config)
                "candidates_ms": candidates,
                "fla_ms": time_fla(t, fla) if fla is not None else None,
            }
            results["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "candidates_ms"}), flush=True)
            del t
            torch.cuda.empty_cache()
            save(results, args.out)
    channels = 2 * 16 * 128 + 48 * 128
    for batch in args.batches:
        times = {str(block): time_conv(batch, channels, block) for block in CONV_BLOCKS}
        results["conv"].append({"B": batch, "C": channels, "default_block": DEFAULT_CONFIG["BLOCK_C"], "ms": times})
    save(results, args.out)
    return results


def print_tables(results):
    copy = results["copy_GBs"]
    print(
        f"\n{results['device']}: copy {copy:.0f} GB/s; state {results['state_dtype']}, activations {results['dtype']}"
    )
    print("\nshape             B  default us  tuner us  best us  fla us  fla/tuner  fla/best  tuner TB/s  %copy  tuner")
    for r in results["rows"]:
        best = min(r["candidates_ms"].values())
        fla = r.get("fla_ms")
        rate = r["state_bytes"] / r["tuner_ms"] / 1e9  # bytes per ms -> TB/s
        print(
            f"{r['shape']:15s} {r['B']:3d} {r['default_ms'] * 1e3:11.1f} {r['tuner_ms'] * 1e3:9.1f} {best * 1e3:8.1f} "
            f"{_cell(fla and fla * 1e3, 7, 1)} {_cell(fla and fla / r['tuner_ms'], 10, 2)} "
            f"{_cell(fla and fla / best, 9, 2)} {rate:11.2f} {rate * 1e3 / copy * 100:6.1f}  {r['tuner'] or 'default'}"
        )
    if results.get("conv"):
        blocks = sorted({int(b) for c in results["conv"] for b in c["ms"]})
        print("\nconv1d update (bf16, K=4), us per BLOCK_C (* = default): " + "  ".join(map(str, blocks)))
        for c in results["conv"]:
            cells = [f"{c['ms'][str(b)] * 1e3:6.1f}" + ("*" if b == c["default_block"] else " ") for b in blocks]
            print(f"  B={c['B']:3d} C={c['C']}: " + "  ".join(cells))


def _cell(value, width, digits):
    return "-".rjust(width) if value is None else f"{value:{width}.{digits}f}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    p.add_argument("--analyze", metavar="JSON", help="print the tables of a saved run (no GPU needed)")
    p.add_argument("--out", default="benchmarks/results/linear_attention.json")
    args = p.parse_args(argv)
    check_batches(p, args)
    return args


def main(argv=None):
    run_or_analyze(parse_args(argv), run, print_tables)


if __name__ == "__main__":
    main()
