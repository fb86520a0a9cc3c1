"""GPU time of an engine step, from two CUDA events: what the served step's wall time is made of, GPU and host.

``start`` is recorded before the step's first launch and ``stop`` after its last (the sampling, before the host
waits for the tokens); once the host has waited, ``seconds`` is the GPU timeline between the two markers: the
forward and sampling, gaps between launches included (none within a replayed graph). The rest of the step's wall
time is the host's: scheduling, input staging, launching, and the bookkeeping after the tokens arrive.
"""

from typing import Optional

import torch


class StepGpuTimer:
    def __init__(self):
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._state = "idle"  # -> "started" -> "stopped" -> read by seconds(), back to "idle"

    def start(self) -> None:
        self._start.record()
        self._state = "started"

    def stop(self) -> None:
        """After the step's last launch; again after a later launch of the same step (the last one counts)."""
        if self._state != "idle":
            self._end.record()
            self._state = "stopped"

    def seconds(self) -> Optional[float]:
        """The started and stopped step's GPU seconds (None when it was not both), and back to idle."""
        stopped, self._state = self._state == "stopped", "idle"
        if not stopped:
            return None
        self._end.synchronize()  # done already when the host has read the step's tokens
        return self._start.elapsed_time(self._end) / 1e3


def step_gpu_timer(device: torch.device) -> Optional[StepGpuTimer]:
    """A timer on a CUDA device, None elsewhere (the CPU's steps are all host time)."""
    return StepGpuTimer() if device.type == "cuda" else None
