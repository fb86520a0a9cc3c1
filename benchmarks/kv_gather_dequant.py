"""Reading a quantized pool's cached prefix for a prefill chunk, one layer: the Triton gather-and-dequantize kernel
(``lightllm/kernels/kv_cache_read.py``) against the torch reference it replaced (gather, float32 dequantization,
cast), graph-timed, per KV type and prefix length, K and V of 8 KV heads of 128 (Qwen3-8B) into bf16. The rate counts
the bytes that must move: codes and scales read, bf16 written.

    python benchmarks/kv_gather_dequant.py --out benchmarks/results/kv_gather_dequant_h200.json
"""

import argparse

import torch

from bench_io import save_json

from lightllm.common.autotuner.bench import cuda_graph_bench
from lightllm.kernels.kv_cache_read import gather_dequant_kv, gather_dequant_kv_ref


def run(args) -> dict:
    heads, head_dim, group = args.kv_heads, args.head_dim, args.group
    rows = []
    for quant in ("int8", "int4"):
        width = head_dim if quant == "int8" else head_dim // 2
        pool = max(args.lens) * 2
        dtype, lo, hi = (torch.int8, -127, 128) if quant == "int8" else (torch.uint8, 0, 256)
        codes = [torch.randint(lo, hi, (pool, heads, width), device="cuda", dtype=dtype) for _ in range(2)]
        scales = [torch.rand(pool, heads, head_dim // group, device="cuda").add_(0.5).half() for _ in range(2)]
        for n in args.lens:
            idx = torch.randperm(pool, device="cuda")[:n]
            layer = (codes[0], scales[0], codes[1], scales[1], idx, quant, group, torch.bfloat16)
            out = tuple(torch.empty(n, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            got, want = gather_dequant_kv(*layer, out=out), gather_dequant_kv_ref(*layer)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), "kernel and reference differ"
            kernel_ms = cuda_graph_bench(lambda: gather_dequant_kv(*layer, out=out))
            torch_ms = cuda_graph_bench(lambda: gather_dequant_kv_ref(*layer))
            moved = 2 * n * heads * (width + 2 * head_dim // group + 2 * head_dim)  # K and V: codes, scales, bf16
            rows.append({"quant": quant, "tokens": n, "kernel_ms": kernel_ms, "torch_ms": torch_ms,
                         "kernel_GBs": moved / kernel_ms / 1e6, "speedup": torch_ms / kernel_ms})  # fmt: skip
            print(rows[-1], flush=True)
    return {"device": torch.cuda.get_device_name(), "kv_heads": heads, "head_dim": head_dim, "group": group,
            "rows": rows}  # fmt: skip


def print_table(results: dict) -> None:
    print(f"\n{results['device']}: {results['kv_heads']} KV heads x {results['head_dim']}, group {results['group']}")
    print(f"{'kv':5s} {'tokens':>7s} {'kernel us':>10s} {'torch us':>9s} {'speed-up':>9s} {'kernel GB/s':>12s}")
    for r in results["rows"]:
        print(f"{r['quant']:5s} {r['tokens']:7d} {r['kernel_ms'] * 1e3:10.1f} {r['torch_ms'] * 1e3:9.1f} "
              f"{r['speedup']:9.2f} {r['kernel_GBs']:12.0f}")  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lens", nargs="+", type=int, default=[4096, 32768], help="prefix tokens read")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--out", default="benchmarks/results/kv_gather_dequant.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kv_gather_dequant.py needs a CUDA GPU")
    results = run(args)
    save_json(results, args.out)
    print_table(results)


if __name__ == "__main__":
    main()
