"""Device memory rates the benchmarks compare against (GB/s), timed with the tuner's CUDA-graph timer."""

import torch

from lightllm.common.autotuner import cuda_graph_bench


def copy_gbs(detail: bool = False):
    """Device copy rate, read + write bytes, 1 GiB of bf16 each way (far beyond L2): the better of ``copy_`` (a
    cudaMemcpy) and an elementwise kernel (``mul(src, 1)``). On the H200 the memcpy path measured only ~2.7 TB/s,
    below what the decode kernels themselves reach, so a kernel copy is the ceiling that means something.
    ``detail``: also return each way's rate."""
    src = torch.randn(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(200):  # ~150 ms of load first: an idle GPU starts at low clocks
        dst.copy_(src)
    moved = 2 * src.numel() * src.element_size()
    rates = {
        "memcpy": moved / cuda_graph_bench(lambda: dst.copy_(src)) / 1e6,
        "kernel": moved / cuda_graph_bench(lambda: torch.mul(src, 1, out=dst)) / 1e6,
    }
    return (max(rates.values()), rates) if detail else max(rates.values())


def gemv_gbs() -> float:
    """A 1 GiB bf16 GEMV, bytes of the matrix: the access pattern of a decode step's weights."""
    w = torch.randn(16384, 32768, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(32768, dtype=torch.bfloat16, device="cuda")
    return w.numel() * w.element_size() / cuda_graph_bench(lambda: torch.mv(w, x)) / 1e6


def matmul_tflops() -> float:
    """An 8192^3 bf16 matmul, TFLOP/s: the compute rate a prefill's GEMMs can reach."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    c = torch.empty_like(a)
    return 2 * 8192**3 / cuda_graph_bench(lambda: torch.mm(a, b, out=c)) / 1e9
