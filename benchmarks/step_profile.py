"""GPU time per kernel of one decode step, read with torch's profiler over graph replays (CUPTI reports the kernels a
replayed graph launches one by one): where a step's time goes against its floor.

Used by ``decode_step.py --profile-batch B``.
"""

import torch


def kernel_breakdown(step, steps: int = 5, top: int = 12) -> dict:
    """Run ``step`` (already warm) ``steps`` times under the profiler. Returns the summed GPU microseconds per step
    and the ``top`` kernels by time, each with its share of the step."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel = {}
    for event in prof.key_averages():
        us = event.device_time_total / steps
        if us > 0 and event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.key] = per_kernel.get(event.key, 0.0) + us
    total = sum(per_kernel.values())
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    return {
        "gpu_us_per_step": total,
        "kernels": [{"name": name[:90], "us": round(us, 1), "share": round(us / total, 3)} for name, us in ranked],
    }


def print_breakdown(batch: int, breakdown: dict) -> None:
    print(f"batch {batch}: {breakdown['gpu_us_per_step']:.0f} us of kernels per step")
    for k in breakdown["kernels"]:
        print(f"  {k['us']:8.1f} us {100 * k['share']:5.1f} %  {k['name']}")
