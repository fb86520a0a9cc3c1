"""GPU time of an engine step, from two CUDA events: what the served step's wall time is made of, GPU and host.

``start`` is recorded by the runner right before it launches the step's forward (its inputs staged) and ``stop``
by the engine after the step's last launch (sampling, top logprobs, penalty counts), before the host reads the
tokens; once it has, ``seconds`` is the GPU timeline between the two markers: the GPU's work and any wait for the
host's next launch (between a replayed graph and the sampling's launches, between an eager forward's kernels, and
under tensor parallelism for the other ranks, whose all-reduces it waits for). Nothing in between is meant to wait
for the GPU (a re-admitted penalised request's first draw does, in ``torch.bincount``). The rest of the step's
wall time is the host's: scheduling, staging the inputs, and the bookkeeping after the tokens arrive. An MTP decode
step (``spec_decode.py``) starts the timer before its draft and stops it before the acceptance's one read.
"""

from typing import Optional, Union

import torch


class StepGpuTimer:
    def __init__(self, device: torch.device):
        self._device = device
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._state = "idle"  # -> "started" -> "stopped" -> read by seconds(), back to "idle"

    def start(self) -> None:
        """Again before a later launch of the same step (the last one counts)."""
        self._start.record(torch.cuda.current_stream(self._device))
        self._state = "started"

    def stop(self) -> None:
        """After the step's last launch; again after a later launch of the same step (the last one counts)."""
        if self._state != "idle":
            self._end.record(torch.cuda.current_stream(self._device))
            self._state = "stopped"

    def seconds(self) -> Optional[float]:
        """The started and stopped step's GPU seconds (None when it was not both), and back to idle."""
        stopped, self._state = self._state == "stopped", "idle"
        if not stopped:
            return None
        self._end.synchronize()  # done already when the host has read the step's tokens
        return self._start.elapsed_time(self._end) / 1e3


def step_gpu_timer(device: Union[str, torch.device]) -> Optional[StepGpuTimer]:
    """A timer on a CUDA device, None elsewhere (the CPU's steps are all host time)."""
    device = torch.device(device)
    return StepGpuTimer(device) if device.type == "cuda" else None
