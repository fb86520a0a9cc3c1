"""Prefetch of a weight into the GPU's L2 cache ahead of the kernel that reads it (sm_90's bulk L2 prefetch).

At decode batch sizes a layer alternates between kernels that stream weights at the HBM's rate (the GEMVs) and
kernels that leave most of it idle (attention over a short context at batch 1, norms, rotary). A bulk prefetch
issued before such a stretch lets the HBM fill L2 with the next GEMV's weight while those kernels run; the GEMV then
reads from L2. One thread issues one ``cp.async.bulk.prefetch.L2`` per ``CHUNK`` bytes and moves on: the copy
engine does the rest, after the prefetch kernel has exited, with no registers, shared memory or SMs held. A
prefetch is a hint: it never changes a result, only where a later read finds its bytes.

On a GPU before sm_90 and under the interpreter nothing is issued (:func:`can_prefetch`). The chunking is shared
with the interpreter through ``RECORD``: the kernel then writes each chunk's ``(offset, size)`` instead of
prefetching it, which is what the CPU tests check against :func:`chunk_ranges`.
"""

from functools import lru_cache
from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl
from triton import knobs

from lightllm.kernels.direct_launch import DirectLaunch
from lightllm.kernels.launch_math import cdiv

CHUNK_BYTES = 64 << 10  # per prefetch instruction; a multiple of 16 (the instruction's size granule)
CHUNKS_PER_PROGRAM = 32  # one per thread of a one-warp program: a 32 MiB prefetch takes 16 programs

_PREFETCH_ASM = tl.constexpr("""{
.reg .pred p;
setp.gt.s32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}""")
_PREFETCH_EVICT_LAST_ASM = tl.constexpr("""{
.reg .pred p;
.reg .b64 policy;
setp.gt.s32 p, $2, 0;
createpolicy.fractional.L2::evict_last.b64 policy, 1.0;
@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, policy;
mov.u32 $0, 0;
}""")


@triton.jit
def _l2_prefetch_kernel(addr, nbytes, Record, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr,
                        EVICT_LAST: tl.constexpr, RECORD: tl.constexpr):  # fmt: skip
    idx = tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    start = idx.to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)  # <= 0: past the end, nothing issued
    if RECORD:
        tl.store(Record + 2 * idx, start, mask=size > 0)
        tl.store(Record + 2 * idx + 1, size.to(tl.int64), mask=size > 0)
    else:
        if EVICT_LAST:
            tl.inline_asm_elementwise(_PREFETCH_EVICT_LAST_ASM, "=r,l,r", [addr + start, size], dtype=tl.int32,
                                      is_pure=False, pack=1)  # fmt: skip
        else:
            tl.inline_asm_elementwise(_PREFETCH_ASM, "=r,l,r", [addr + start, size], dtype=tl.int32, is_pure=False,
                                      pack=1)  # fmt: skip


_PREFETCH = DirectLaunch(_l2_prefetch_kernel)


def chunk_ranges(nbytes: int, chunk: int = CHUNK_BYTES) -> List[Tuple[int, int]]:
    """``[(offset, size), ...]``: the chunks a prefetch of ``nbytes`` bytes issues, in order (the tests' oracle)."""
    return [(start, min(chunk, nbytes - start)) for start in range(0, nbytes, chunk)]


def prefetch_bytes(t: torch.Tensor, budget: int) -> int:
    """Bytes of ``t`` (contiguous) a prefetch of at most ``budget`` bytes covers from its start: the smaller of the
    two, rounded down to the instruction's 16-byte granule."""
    return min(t.numel() * t.element_size(), max(0, int(budget))) & ~15


@lru_cache(maxsize=None)
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def can_prefetch(device: torch.device) -> bool:
    """Whether :func:`l2_prefetch` issues anything on ``device``: a CUDA GPU of compute capability 9.0 or later,
    outside the interpreter."""
    if device.type != "cuda" or knobs.runtime.interpret:
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def l2_prefetch(t: torch.Tensor, budget: int, evict_last: bool = False, record: Optional[torch.Tensor] = None):
    """Ask L2 for the first ``min(budget, t's bytes)`` bytes of ``t`` (contiguous, 16-byte aligned), on the current
    stream; returns at once. ``evict_last``: mark the prefetched lines to be evicted after others (so that a stream
    of data read once between the prefetch and its use, e.g. a long KV cache, does not push them out).

    ``record`` (an int64 tensor of at least ``2 * len(chunk_ranges(n))`` elements, for tests): write the chunks'
    ``(offset, size)`` pairs into it instead of prefetching (runs under the interpreter too)."""
    if not t.is_contiguous() or t.data_ptr() & 15:
        raise ValueError(f"l2_prefetch: expected a contiguous tensor at a 16-byte aligned address, got strides "
                         f"{tuple(t.stride())} at {t.data_ptr():#x}")  # fmt: skip
    n = prefetch_bytes(t, budget)
    if n == 0 or (record is None and not can_prefetch(t.device)):
        return
    grid = (cdiv(cdiv(n, CHUNK_BYTES), CHUNKS_PER_PROGRAM),)
    _PREFETCH.launch(grid, t.data_ptr(), n, record if record is not None else t, CHUNK_BYTES, CHUNKS_PER_PROGRAM,
                     bool(evict_last), record is not None, num_warps=1)  # fmt: skip


# What a decode forward prefetches ahead of each layer's attention (the layer's o_proj weight, up to this many bytes),
# read when a forward is planned: 0 turns it off. Set before a CUDA graph is captured: a captured step keeps it.
_decode_budget = 0
_decode_evict_last = False


def set_decode_prefetch(budget: int, evict_last: bool = False) -> Tuple[int, bool]:
    """Prefetch up to ``budget`` bytes of each decode layer's o_proj weight into L2 ahead of its attention (0: off);
    returns the previous ``(budget, evict_last)``."""
    global _decode_budget, _decode_evict_last
    if type(budget) is not int or budget < 0:
        raise ValueError(f"set_decode_prefetch: budget expected bytes, an int >= 0, got {budget!r}")
    previous = (_decode_budget, _decode_evict_last)
    _decode_budget, _decode_evict_last = budget, bool(evict_last)
    return previous


def decode_prefetch() -> Tuple[int, bool]:
    return _decode_budget, _decode_evict_last
