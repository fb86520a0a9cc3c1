"""Small host values onto a device without stalling the host.

A copy from pageable host memory to a GPU waits for the stream's earlier work before it starts, so every
``torch.tensor(values, device="cuda")`` or ``cpu_tensor.to("cuda")`` in a step is a sync: the host stops queueing
kernels until the GPU has caught up. These helpers stage through pinned memory and copy ``non_blocking`` (ordered on
the current stream; PyTorch's pinned-memory cache keeps each block until its copy is done).
"""

from typing import Optional, Sequence

import numpy as np
import torch

# numpy twins of the dtypes a step's small host lists take (numpy builds them ~3x faster than torch.tensor)
_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.float64: np.float64,
                 torch.bool: np.bool_}  # fmt: skip


def host_tensor(values: Sequence, dtype: torch.dtype) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on the CPU, built through numpy when it has the dtype: 1.7 instead of
    4.5 us for a step's 64 values, a few of which every step makes."""
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        return torch.tensor(values, dtype=dtype)
    return torch.from_numpy(np.array(values, dtype=np_dtype))


def host_to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on ``device`` without stalling the host: on a GPU it is pinned and copied
    ``non_blocking`` (ordered on the current stream; the pinned block is kept until the copy is done), where
    ``torch.tensor(values, device=...)`` copies from pageable memory and synchronizes the stream."""
    if device.type == "cpu":
        return host_tensor(values, dtype)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    # via host_tensor: torch.tensor(..., pin_memory=True) refuses a numpy array, which some callers pass
    return host_tensor(values, dtype).pin_memory().to(device, non_blocking=True)


def tensor_to_device(tensor: torch.Tensor, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``tensor.to(device, dtype)`` without stalling the host: a CPU tensor bound for a GPU goes through pinned
    memory, ``non_blocking`` (``.to`` from pageable memory waits for the stream, as ``host_to_device`` explains)."""
    if tensor.device.type == "cpu" and torch.device(device).type == "cuda":
        return tensor.to(dtype or tensor.dtype).pin_memory().to(device, non_blocking=True)
    return tensor.to(device=device, dtype=dtype or tensor.dtype)


class HostCopy:
    """Device tensors on their way to the host, read later: the copies are queued ``non_blocking`` into pinned
    memory behind the work that produces them, so the host can queue more work before it waits (:meth:`lists`).
    On the CPU the tensors are already host ones and nothing is copied."""

    def __init__(self, *tensors: torch.Tensor):
        self._event = None
        if tensors and tensors[0].device.type == "cuda":
            # a non_blocking copy from a GPU to the CPU lands in pinned memory, so it does not wait for the stream
            tensors = tuple(t.to("cpu", non_blocking=True) for t in tensors)
            self._event = torch.cuda.Event()
            self._event.record()
        self._tensors = tensors

    def lists(self) -> list:
        """Each tensor as a (nested) list, once its copy is done (waits for the work queued before it)."""
        if self._event is not None:
            self._event.synchronize()
        return [t.tolist() for t in self._tensors]
