"""How many tokens the KV pool gets: the arithmetic, and the memory APIs it reads (injectable for tests).

GPU: after the weights load, the runner runs a profiling prefill and decode over a tiny scratch pool and
measures the peak; the pool gets what is left of ``mem_fraction`` of the device (:func:`gpu_kv_bytes`).
CPU: ``mem_fraction`` of the RAM available after the weights load, capped at what the requests can use.
"""

import os
from dataclasses import dataclass
from typing import Optional

import torch

GIB = 2**30


class CudaMemory:
    """The real device-memory API of one CUDA device."""

    profiles = True  # the runner measures a profiling forward before sizing

    def __init__(self, device):
        self.device = torch.device(device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def used_and_total(self) -> tuple:
        """Bytes in use on the device by anyone (weights, CUDA context, other processes) and its size; torch's
        cached free blocks are released first so they do not count as used."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free, total


class HostMemory:
    """The real host-memory API: RAM available to new allocations."""

    profiles = False

    def __init__(self, meminfo_path: str = "/proc/meminfo"):
        self.meminfo_path = meminfo_path

    def available(self) -> int:
        """``MemAvailable`` (Linux: free plus reclaimable cache), else free pages from ``os.sysconf``."""
        try:
            with open(self.meminfo_path) as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024  # the file counts kB
        except OSError:
            pass
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class GpuProfile:
    """What the profiling forward measured, in bytes.

    ``used``: in use on the device after the weights loaded and the scratch pool was freed (weights, CUDA
    context, NCCL buffers, other processes); ``torch_allocated``: torch's share of it (weights);
    ``activation_peak``: the profile's peak allocation above what was allocated before it; ``graph_estimate``:
    the decode forward's peak, which the decode graphs' private pool keeps (0 without graphs);
    ``prefill_graph_estimate``: what the prefill graphs add to that pool (0 without them).
    """

    total: int
    used: int
    torch_allocated: int
    activation_peak: int
    graph_estimate: int
    prefill_graph_estimate: int = 0


def gpu_kv_bytes(p: GpuProfile, mem_fraction: float) -> int:
    """KV bytes = total * mem_fraction - (in use after load + activation peak + decode and prefill graphs)."""
    return int(p.total * mem_fraction) - p.used - p.activation_peak - p.graph_estimate - p.prefill_graph_estimate


def describe_gpu_sizing(p: GpuProfile, mem_fraction: float, bytes_per_token: int, num_tokens: int) -> str:
    """One log line with every term in GiB."""

    def g(n: int) -> str:
        return f"{n / GIB:.2f}"

    prefill = f", prefill graphs (estimate) {g(p.prefill_graph_estimate)} GiB" if p.prefill_graph_estimate else ""
    return (
        f"KV cache sizing: {g(p.total)} GiB total x --mem_fraction {mem_fraction} = {g(int(p.total * mem_fraction))}"
        f" GiB, minus in use after load {g(p.used)} GiB (torch {g(p.torch_allocated)}, other "
        f"{g(p.used - p.torch_allocated)}), activation peak {g(p.activation_peak)} GiB, decode graphs (estimate) "
        f"{g(p.graph_estimate)} GiB{prefill} = KV {g(gpu_kv_bytes(p, mem_fraction))} GiB; pool {num_tokens} tokens x "
        f"{bytes_per_token} B = {g(num_tokens * bytes_per_token)} GiB"
    )


def gpu_pool_tokens(p: GpuProfile, mem_fraction: float, bytes_per_token: int, requested: Optional[int]) -> int:
    """The GPU pool size: what fits in :func:`gpu_kv_bytes`, or ``requested`` (``--max_total_token_num``) when
    given, checked against the whole device (an explicit size overrides the fraction, not the memory)."""
    if requested is None:
        return max(gpu_kv_bytes(p, mem_fraction), 0) // bytes_per_token
    fits = max(gpu_kv_bytes(p, 1.0), 0) // bytes_per_token
    if requested > fits:
        raise ValueError(f"--max_total_token_num {requested} does not fit on the GPU: at most {fits} tokens of "
                         f"{bytes_per_token} B fit in its {p.total / GIB:.2f} GiB after the weights and the "
                         "profiled activations; lower --max_total_token_num")  # fmt: skip
    return requested


def check_table_fits(available: int, max_reqs: int, row_len: int) -> None:
    """On the CPU, before anything per request is allocated: the int32 ``[max_reqs, row_len]`` req_to_token table
    fits in the available RAM. Past it, a --running_max_req_size ends in a MemoryError or the OOM killer."""
    table = max_reqs * row_len * 4
    if table > available:
        raise ValueError(f"--running_max_req_size {max_reqs - 1} does not fit in RAM: its req_to_token table, "
                         f"{max_reqs} slots x {row_len} tokens x 4 B = {table / GIB:.2f} GiB, is more than the "
                         f"{available / GIB:.2f} GiB available; lower --running_max_req_size or "
                         "--max_req_total_len")  # fmt: skip


def cpu_pool_tokens(available: int, mem_fraction: float, bytes_per_token: int, cap: int,
                    requested: Optional[int], table_bytes: int = 0) -> int:  # fmt: skip
    """The CPU pool size: ``requested`` when given, checked against the available RAM less the req_to_token table
    (``table_bytes``, allocated beside it), else ``mem_fraction`` of the available RAM, at most ``cap`` tokens
    (every request slot full: more could never be used)."""
    if requested is not None:
        fits = max(available - table_bytes, 0) // bytes_per_token
        if requested > fits:  # allocating it would be a MemoryError, or the OOM killer as the pages are touched
            raise ValueError(f"--max_total_token_num {requested} does not fit in RAM: at most {fits} tokens of "
                             f"{bytes_per_token} B fit in the {available / GIB:.2f} GiB available after the weights "
                             "and the req_to_token table; lower --max_total_token_num")  # fmt: skip
        return requested
    return min(int(available * mem_fraction) // bytes_per_token, cap)


def default_memory_api(device: torch.device):
    return CudaMemory(device) if device.type == "cuda" else HostMemory()
