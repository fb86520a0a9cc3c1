"""The small-M linear kernel: ``y[M, N] = x[M, K] @ W[N, K]^T`` for M <= 16, W row-major (``nn.Linear`` layout).

At decode batch sizes a linear is bound by streaming W once from HBM. Each program reads ``BLOCK_N`` rows of W (each
row contiguous) over one of ``SPLIT_K`` slices of K, with x's rows padded to a 16-row tile so the product is one
``tl.dot`` per K block: tensor cores sit idle at these sizes anyway, and the float32 accumulator is exact enough to
write float32 logits straight from it. With ``SPLIT_K > 1`` (too few column blocks to fill the GPU) each slice writes
float32 partials to a workspace and a second kernel sums them in slice order and casts: no atomics, so every run,
eager or replayed in a CUDA graph, gives the same bits.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from lightllm.kernels.direct_launch import DirectLaunch
from lightllm.kernels.launch_math import cdiv
from lightllm.kernels.pdl import pdl_release, pdl_wait

MAX_ROWS = 16  # x's rows are padded to this tile: the kernel serves M <= 16
_SUM_BLOCK = 1024


def pipeline_shared_bytes(config: dict, itemsize: int) -> int:
    """Shared memory the K loop needs at ``config`` for elements of ``itemsize`` bytes: Triton's pipeline keeps
    ``num_stages - 1`` copies of the x tile and the W tile (what an sm_90 build reports). A config above
    :data:`~lightllm.kernels.launch_math.SM90_MAX_SHARED_BYTES` compiles but fails at launch."""
    return (config["num_stages"] - 1) * (MAX_ROWS + config["BLOCK_N"]) * config["BLOCK_K"] * itemsize


@triton.jit
def _small_m_linear_kernel(X, W, Out, M, N, K, stride_xm, stride_wn, stride_om, stride_split, k_per_split,
                           ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           USE_PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(USE_PDL)
    split = tl.program_id(1)
    rows = tl.arange(0, ROWS)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_ptrs = X + rows[:, None] * stride_xm + ks[None, :]
    w_ptrs = W + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # a [BLOCK_K, BLOCK_N] tile of W^T
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):  # slices are whole K blocks: only K's tail is masked
        k_ok = k + ks < K
        x = tl.load(x_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if X.dtype.element_ty == tl.float32:  # compile-time: float32 models get float32 products, not tf32
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    pdl_release(USE_PDL)
    out_ptrs = Out + split * stride_split + rows[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_splits_kernel(P, Out, N, numel, stride_om, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                       USE_PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.load(P + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):  # always in slice order: the same sum every run
        acc += tl.load(P + s * numel + offs, mask=ok, other=0.0)
    pdl_release(USE_PDL)
    tl.store(Out + (offs // N) * stride_om + offs % N, acc.to(Out.dtype.element_ty), mask=ok)


_LINEAR = DirectLaunch(_small_m_linear_kernel)
_SUM_SPLITS = DirectLaunch(_sum_splits_kernel)


def launch_small_m_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: dict,
                          scratch: Optional[dict] = None) -> torch.Tensor:  # fmt: skip
    """Write ``x @ w^T`` into ``out [M, N]`` with ``config`` (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages).
    Unchecked: M <= 16, last dims contiguous. ``scratch``: a plan's dict that keeps the split partials, made once."""
    m, k = x.shape
    n = w.shape[0]
    block_n, block_k, splits = config["BLOCK_N"], config["BLOCK_K"], config["SPLIT_K"]
    k_per_split = cdiv(cdiv(k, splits), block_k) * block_k  # whole K blocks per slice; trailing ones may be empty
    options = dict(num_warps=config["num_warps"], num_stages=config["num_stages"])
    grid = (cdiv(n, block_n), splits)
    if splits == 1:
        _LINEAR.launch(grid, x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), 0, k_per_split,
                       MAX_ROWS, block_n, block_k, **options)  # fmt: skip
        return out
    partials = _partials(scratch, (splits, m, n), x.device)
    _LINEAR.launch(grid, x, w, partials, m, n, k, x.stride(0), w.stride(0), n, m * n, k_per_split,
                   MAX_ROWS, block_n, block_k, **options)  # fmt: skip
    _SUM_SPLITS.launch((cdiv(m * n, _SUM_BLOCK),), partials, out, n, m * n, out.stride(0), splits, _SUM_BLOCK,
                       num_warps=4)  # fmt: skip
    return out


def _partials(scratch: Optional[dict], shape: tuple, device) -> torch.Tensor:
    found = None if scratch is None else scratch.get(shape)
    if found is None:
        found = torch.empty(shape, dtype=torch.float32, device=device)
        if scratch is not None:
            scratch[shape] = found
    return found
