"""Host cost of putting a step's small host values on the GPU, per call: what ``transfer.host_to_device`` pays (a
fresh tensor pinned through PyTorch's pinned-memory cache, then a ``non_blocking`` copy) against persistent pinned
buffers filled in place and copied ``non_blocking`` into a persistent device tensor (what ``engine/staging.py`` does
once a step; a ring of ``RING``, each reused once its copy is done), and against the pageable copy
``torch.tensor(values, device=...)`` (which waits for the stream).

Each variant is timed with the GPU idle and with the GPU busy (a large elementwise kernel queued before every call,
as in a step, so a copy that waits for the stream shows that wait). Host microseconds per call, medians of
``--rounds``; the profiler once showed about 1 ms per pinned copy of a prefix-cache hit, which this measures without
it. ``--device cpu`` checks the method on a machine without a GPU (the pinned variants are then left out).

    python benchmarks/pinned_copy_cost.py --out benchmarks/results/pinned_copy_cost_h200.json
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightllm.common.transfer import host_to_device  # noqa: E402

RING = 8  # pinned buffers of the persistent variant


def variants(values: list, device: torch.device) -> dict:
    """name -> a call that puts ``values`` (int64) on ``device`` and returns them there (``pin_memory only``: in pinned
    host memory); the pinned ones only on a GPU."""
    n = len(values)
    out = {
        "host_to_device": lambda: host_to_device(values, torch.int64, device),
        "pageable torch.tensor": lambda: torch.tensor(values, dtype=torch.int64, device=device),
    }
    if device.type == "cuda":
        # a ring of pinned buffers, each written again only once its last copy is done (staging.py waits on an event
        # for its one buffer): the wait is part of what this variant costs
        ring = [(torch.empty(n, dtype=torch.int64, pin_memory=True), torch.cuda.Event()) for _ in range(RING)]
        dev = torch.empty(n, dtype=torch.int64, device=device)
        turn = [0]

        def staged():
            host, copied = ring[turn[0] % RING]
            turn[0] += 1
            copied.synchronize()
            host.numpy()[:] = values
            dev.copy_(host, non_blocking=True)
            copied.record()
            return dev

        out["persistent pinned buffer"] = staged
        out["pin_memory only"] = lambda: torch.tensor(values, dtype=torch.int64).pin_memory()
    return out


def per_call_us(fn, calls: int, busy=None, sync=lambda: None) -> float:
    """Host microseconds per call of ``fn`` (after ``busy()``, whose own launch is timed apart and taken off)."""
    for _ in range(10):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        if busy is not None:
            busy()
        fn()
    elapsed = time.perf_counter() - t0
    sync()
    return elapsed / calls * 1e6


def measure(sizes, calls: int, rounds: int, device: torch.device) -> list:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    big = torch.empty(2048 if device.type == "cuda" else 64, 4096, device=device)
    busy = lambda: big.mul_(1.0)  # noqa: E731
    launch = statistics.median(per_call_us(busy, calls, sync=sync) for _ in range(rounds))
    rows = []
    for n in sizes:
        values = list(range(n))
        for name, fn in variants(values, device).items():
            idle = [per_call_us(fn, calls, sync=sync) for _ in range(rounds)]
            loaded = [per_call_us(fn, calls, busy, sync) - launch for _ in range(rounds)]
            rows.append({"values": n, "variant": name, "idle_us": statistics.median(idle),
                         "busy_gpu_us": statistics.median(loaded)})  # fmt: skip
    return rows, launch


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 4096], help="int64 values per call")
    p.add_argument("--calls", type=int, default=2000, help="calls per timing")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default="benchmarks/results/pinned_copy_cost.json")
    args = p.parse_args(argv)
    if min(args.sizes) < 1 or args.calls < 1 or args.rounds < 1:
        p.error(f"--sizes, --calls and --rounds expected positive integers, got {args.sizes}, {args.calls}, "
                f"{args.rounds}")  # fmt: skip
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda expected a CUDA GPU, found none (--device cpu checks the method)")
    device = torch.device(args.device)
    rows, launch = measure(args.sizes, args.calls, args.rounds, device)
    print(f"host us per call; the busy GPU's kernel launch ({launch:.1f} us) taken off")
    print(f"{'values':>7} {'variant':>26} {'idle GPU':>9} {'busy GPU':>9}")
    for r in rows:
        print(f"{r['values']:>7} {r['variant']:>26} {r['idle_us']:>9.1f} {r['busy_gpu_us']:>9.1f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.machine(),
                   "torch": torch.__version__, "args": vars(args), "busy_launch_us": launch, "rows": rows}, f,
                  indent=1)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
