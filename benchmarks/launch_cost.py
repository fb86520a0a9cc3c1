"""Host time per launch on a GPU's host, by path: a tiny torch op, a torch GEMM, a Triton ``kernel[grid](...)``,
the compiled kernel's launcher called directly (what ``lightllm.kernels.direct_launch`` does after the first
launch of a specialization) and ``DirectLaunch.launch`` itself. Back-to-back launches of a kernel too small to
keep the GPU busy, so the host is the bottleneck; mean over ``--number`` calls.

    python benchmarks/launch_cost.py --out benchmarks/results/launch_cost_h200.json
"""

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


def per_call_us(fn, number: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    us = (time.perf_counter() - t0) / number * 1e6
    torch.cuda.synchronize()
    return us


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--number", type=int, default=20000)
    p.add_argument("--out", default="benchmarks/results/launch_cost.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("launch_cost.py needs a CUDA GPU")
    from triton.runtime import driver

    from lightllm.kernels.direct_launch import DirectLaunch

    x = torch.randn(4096, device="cuda")
    y = torch.empty_like(x)
    w = torch.randn(4096, 4096, device="cuda")
    n, grid = x.numel(), (4,)
    compiled = _add_one[grid](x, y, n, BLOCK=1024)
    stream = driver.active.get_current_stream(torch.cuda.current_device())
    direct = DirectLaunch(_add_one)

    def raw_launch():
        meta = compiled.launch_metadata((4, 1, 1), stream, x, y, n, 1024)
        compiled.run(4, 1, 1, stream, compiled.function, compiled.packed_metadata, meta, None, None, x, y, n, 1024)

    rows = {
        "torch add_ (tiny)": lambda: y.add_(1),
        "torch mm 1x4096x4096": lambda: torch.mm(x.view(1, -1), w),
        "triton kernel[grid]()": lambda: _add_one[grid](x, y, n, BLOCK=1024),
        "compiled kernel's launcher": raw_launch,
        "DirectLaunch.launch": lambda: direct.launch(grid, x, y, n, BLOCK=1024),
    }
    result = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "number": args.number, "rows": {}}
    for name, fn in rows.items():
        result["rows"][name] = round(per_call_us(fn, args.number), 2)
        print(f"{name:28s} {result['rows'][name]:8.2f} us")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
