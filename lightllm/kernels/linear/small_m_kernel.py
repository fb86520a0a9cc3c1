"""The small-M linear kernel: ``y[M, N] = x[M, K] @ W[N, K]^T`` for M <= 16, W row-major (``nn.Linear`` layout).

At decode batch sizes a linear is bound by streaming W once from HBM. Each program reads ``BLOCK_N`` rows of W (each
row contiguous) over one of ``SPLIT_K`` slices of K, with x's rows padded to a 16-row tile so the product is one
``tl.dot`` per K block: tensor cores sit idle at these sizes anyway, and the float32 accumulator is exact enough to
write float32 logits straight from it.

With ``SPLIT_K > 1`` (too few column blocks to fill the GPU) each slice writes float32 partials to a workspace and
counts itself done on its column block's counter; the slice that counts last sums the block's partials in slice
order, casts, stores, and sets the counter back to 0 for the next launch. No float atomics: every run, eager or
replayed in a CUDA graph, gives the bits a separate sum kernel would, without that kernel's launch.

``SWIGLU``: x is a SwiGLU MLP's ``[M, 2K]`` gate/up projection and the kernel multiplies ``silu(gate) * up`` as it
loads each x tile (rounded as ``kernels/activation.py``'s kernel rounds it), so the down projection needs no
activation kernel before it. The prologue reads x twice over, a few KB against the weight's MB.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from lightllm.kernels.direct_launch import DirectLaunch
from lightllm.kernels.launch_math import cdiv
from lightllm.kernels.pdl import pdl_release, pdl_wait

MAX_ROWS = 16  # x's rows are padded to this tile: the kernel serves M <= 16


def pipeline_shared_bytes(config: dict, itemsize: int, x_tiles: int = 1) -> int:
    """Shared memory the K loop needs at ``config`` for elements of ``itemsize`` bytes: Triton's pipeline keeps
    ``num_stages - 1`` copies of the x tile(s) (``x_tiles``: 2 for SWIGLU's gate and up) and the W tile (what an
    sm_90 build reports). A config above :data:`~lightllm.kernels.launch_math.SM90_MAX_SHARED_BYTES` compiles but
    fails at launch."""
    return (config["num_stages"] - 1) * (x_tiles * MAX_ROWS + config["BLOCK_N"]) * config["BLOCK_K"] * itemsize


@triton.jit
def _small_m_linear_kernel(X, W, Out, Partials, Done, M, N, K, stride_xm, stride_wn, stride_om, k_per_split,
                           ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                           SWIGLU: tl.constexpr, USE_PDL: tl.constexpr = False):  # fmt: skip
    pdl_wait(USE_PDL)
    block = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, ROWS)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
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
        x_ok = row_ok[:, None] & k_ok[None, :]
        if SWIGLU:  # x is [gate | up]: silu in float32 rounded to x's dtype, then the product rounded
            gate = tl.load(x_ptrs + k, mask=x_ok, other=0.0).to(tl.float32)
            up = tl.load(x_ptrs + K + k, mask=x_ok, other=0.0)
            x = (gate / (1.0 + tl.exp(-gate))).to(X.dtype.element_ty) * up
        else:
            x = tl.load(x_ptrs + k, mask=x_ok, other=0.0)
        w = tl.load(w_ptrs + k, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if X.dtype.element_ty == tl.float32:  # compile-time: float32 models get float32 products, not tf32
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    pdl_release(USE_PDL)
    out_ok = row_ok[:, None] & col_ok[None, :]
    out_ptrs = Out + rows[:, None] * stride_om + cols[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=out_ok)
    else:
        tile = rows[:, None] * N + cols[None, :]  # partials [SPLIT_K, M, N]
        tl.store(Partials + split * M * N + tile, acc, mask=out_ok)
        tl.debug_barrier()  # every thread's partial is issued before the block's one release below
        done = tl.atomic_add(Done + block, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:  # the last slice of this column block: every partial is visible
            total = tl.load(Partials + tile, mask=out_ok, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):  # always in slice order: the same sum every run
                total += tl.load(Partials + s * M * N + tile, mask=out_ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(Out.dtype.element_ty), mask=out_ok)
            tl.store(Done + block, 0)  # ready for the next launch (the next one starts after this one ends)


_LINEAR = DirectLaunch(_small_m_linear_kernel)


def launch_small_m_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: dict,
                          scratch: Optional[dict] = None, swiglu: bool = False) -> torch.Tensor:  # fmt: skip
    """Write ``x @ w^T`` into ``out [M, N]`` with ``config`` (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages);
    ``swiglu``: ``silu(x[:, :K]) * x[:, K:]`` in x's place (x ``[M, 2K]``). Unchecked: M <= 16, last dims contiguous.
    ``scratch``: a plan's dict that keeps the split partials and counters, made once (a new set per launch without
    one)."""
    m = x.shape[0]
    n, k = w.shape
    block_n, block_k, splits = config["BLOCK_N"], config["BLOCK_K"], config["SPLIT_K"]
    k_per_split = cdiv(cdiv(k, splits), block_k) * block_k  # whole K blocks per slice; trailing ones may be empty
    grid = (cdiv(n, block_n), splits)
    partials, done = (out, out) if splits == 1 else _split_scratch(scratch, splits, m, n, grid[0], x.device)
    _LINEAR.launch(grid, x, w, out, partials, done, m, n, k, x.stride(0), w.stride(0), out.stride(0), k_per_split,
                   MAX_ROWS, block_n, block_k, splits, swiglu, num_warps=config["num_warps"],
                   num_stages=config["num_stages"])  # fmt: skip
    return out


def _split_scratch(scratch: Optional[dict], splits: int, m: int, n: int, blocks: int, device) -> tuple:
    """float32 partials ``[splits, m, n]`` and one int32 counter per column block, zeroed once: each launch leaves
    its counters at 0. Made in a graph capture, the zeroing is captured with them (a replay zeroes them first)."""
    key = (splits, m, n, blocks)
    found = None if scratch is None else scratch.get(key)
    if found is None:
        found = (torch.empty((splits, m, n), dtype=torch.float32, device=device),
                 torch.zeros(blocks, dtype=torch.int32, device=device))  # fmt: skip
        if scratch is not None:
            scratch[key] = found
    return found
