"""Qwen3.5's prefill conv on the GPU: the Triton kernels (``conv1d_prefill``) against the torch shifted
multiply-adds they replaced (the anchor, kept here), per prompt length, fresh and continuing a request.

Qwen3.5-27B's conv at tp 1 (10240 channels, K = 4, bf16), one request of ``--lens`` new tokens (continued: from its
slot's window, as a chunk after the first or a prefix-cache hit). Per cell:

- ``graph us``: the CUDA-graph replay median of one conv (the tuner's timer): the GPU's time;
- ``host us``: the median wall time of one eager call with the GPU idle beforehand, launches included (what a
  host-bound short prefill pays per layer);
- ``GB/s``: x read plus y written over the graph time (the bytes a conv must move; the windows are noise).

    python benchmarks/conv_prefill.py --out benchmarks/results/conv_prefill_h200.json
    python benchmarks/conv_prefill.py --dry-run --lens 16 --channels 64 --out F   # the method, on the CPU
"""

import argparse
import statistics
import time

import torch

from bench_io import measure_or_analyze
from lightllm.common.autotuner.bench import cuda_graph_bench

LENS = (16, 64, 512, 2048, 8192)
CHANNELS, TAPS = 10240, 4


def shifted_adds(x, weight, pool, state_idx, cu, offsets, continues):
    """The torch path this kernel replaced: a continued request's inputs packed after its ``K - 1`` previous ones,
    ``K`` shifted multiply-adds over the packed batch in float32, SiLU, the windows gathered and written back."""
    n, km1 = state_idx.shape[0], pool.shape[1]
    if continues is not None:
        zero = torch.zeros((), dtype=pool.dtype, device=pool.device)
        init = torch.where(continues[:, None, None], pool[state_idx.long()], zero)
        lens = cu[1:] - cu[:-1]
        tokens = x.shape[0]
        own = torch.repeat_interleave(torch.arange(n, device=x.device), lens, output_size=tokens)
        at = torch.arange(tokens, device=x.device) + (own + 1) * km1
        prev = (cu[:-1] + torch.arange(n, device=x.device) * km1)[:, None] + torch.arange(km1, device=x.device)
        ext = x.new_empty(tokens + n * km1, x.shape[1])
        ext[at] = x
        ext[prev.flatten()] = init.reshape(-1, x.shape[1]).to(x.dtype)
        cu_ext = cu + torch.arange(n + 1, device=x.device) * km1
        ext_offsets = torch.arange(ext.shape[0], device=x.device) - torch.repeat_interleave(
            cu_ext[:-1], lens + km1, output_size=ext.shape[0])  # fmt: skip
        out, states = _packed(ext, weight, cu_ext, ext_offsets)
        out = out[at]
    else:
        out, states = _packed(x, weight, cu, offsets)
    pool[state_idx.long()] = states.to(pool.dtype)
    return out


def _packed(x, weight, cu, offsets):
    K = weight.shape[1]
    xf, w = x.float(), weight.float()
    y = xf * w[:, K - 1]
    for s in range(1, K):
        shifted = torch.zeros_like(xf)
        shifted[s:] = xf[:-s]
        y += shifted * (offsets >= s).unsqueeze(1) * w[:, K - 1 - s]
    idx = cu[1:, None] - (K - 1) + torch.arange(K - 1, device=x.device)
    states = x[idx.clamp(min=0)] * (idx >= cu[:-1, None]).unsqueeze(-1)
    return torch.nn.functional.silu(y).to(x.dtype), states


def make(tokens, channels, continued, device):
    g = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, channels, generator=g, device=device, dtype=torch.bfloat16)
    weight = torch.randn(channels, TAPS, generator=g, device=device, dtype=torch.bfloat16)
    pool = torch.randn(4, TAPS - 1, channels, generator=g, device=device, dtype=torch.bfloat16)
    cu = torch.tensor([0, tokens], device=device)
    state_idx = torch.tensor([2], dtype=torch.int32, device=device)
    seq_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
    offsets = torch.arange(tokens, device=device)
    continues = torch.tensor([True], device=device) if continued else None
    return x, weight, pool, state_idx, cu, seq_ids, offsets, continues


def host_us(run, repeats=50):
    """Median wall time of one eager call, the GPU idle before each (its launches, not a queue, are timed)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e6)
    sync()
    return statistics.median(times)


def run(args):
    from lightllm.kernels.linear_attention.conv1d_prefill import causal_conv1d_prefill

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cells = []
    for tokens in args.lens:
        for continued in (False, True):
            x, weight, pool, state_idx, cu, seq_ids, offsets, continues = make(tokens, args.channels, continued,
                                                                               device)  # fmt: skip
            impls = {
                "triton": lambda: causal_conv1d_prefill(x, weight, pool, state_idx, cu, seq_ids, offsets, continues),
                "torch": lambda: shifted_adds(x, weight, pool, state_idx, cu, offsets, continues),
            }
            want = impls["torch"]()
            pool_after = pool.clone()
            pool.copy_(make(tokens, args.channels, continued, device)[2])
            got = impls["triton"]()
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
            assert torch.equal(pool, pool_after), "the windows differ"
            for name, fn in impls.items():
                gpu_ms = cuda_graph_bench(fn) if device == "cuda" else float("nan")
                cells.append({"tokens": tokens, "continued": continued, "impl": name, "graph_us": gpu_ms * 1e3,
                              "host_us": host_us(fn, args.repeats),
                              "bytes": 2 * tokens * args.channels * x.element_size()})  # fmt: skip
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "channels": args.channels,
            "taps": TAPS, "cells": cells}  # fmt: skip


def analyze(results):
    rows = []
    by = {(c["tokens"], c["continued"], c["impl"]): c for c in results["cells"]}
    for (tokens, continued, impl), c in by.items():
        if impl != "triton":
            continue
        t = by[(tokens, continued, "torch")]
        rows.append({"tokens": tokens, "continued": continued, "triton_graph_us": c["graph_us"],
                     "torch_graph_us": t["graph_us"], "triton_host_us": c["host_us"], "torch_host_us": t["host_us"],
                     "triton_gb_s": c["bytes"] / c["graph_us"] / 1e3,
                     "torch_over_triton": t["graph_us"] / c["graph_us"]})  # fmt: skip
    return rows


def print_table(results, rows):
    print(f"{results['device']}, {results['channels']} channels, K = {results['taps']}, bf16")
    print(f"{'tokens':>7} {'continued':>9} {'graph us triton / torch':>24} {'x':>6} {'triton GB/s':>11} "
          f"{'host us triton / torch':>23}")  # fmt: skip
    for r in rows:
        print(f"{r['tokens']:>7} {str(r['continued']):>9} {r['triton_graph_us']:>11.1f} / {r['torch_graph_us']:>10.1f} "
              f"{r['torch_over_triton']:>6.1f} {r['triton_gb_s']:>11.0f} {r['triton_host_us']:>10.1f} / "
              f"{r['torch_host_us']:>10.1f}")  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lens", nargs="+", type=int, default=list(LENS))
    p.add_argument("--channels", type=int, default=CHANNELS)
    p.add_argument("--repeats", type=int, default=50, help="eager calls timed for the host time")
    p.add_argument("--dry-run", action="store_true", help="no GPU: the method under Triton's interpreter")
    p.add_argument("--analyze", metavar="JSON", help="print the table of a saved run (no GPU needed)")
    p.add_argument("--out", default="benchmarks/results/conv_prefill.json")
    args = p.parse_args(argv)
    if min(args.lens) < 1 or args.channels < 1 or args.repeats < 1:
        p.error("--lens, --channels and --repeats expected positive integers")
    return args


def main(argv=None):
    args = parse_args(argv)
    measure_or_analyze(args, "conv_prefill.py", run, analyze, print_table)


if __name__ == "__main__":
    main()
