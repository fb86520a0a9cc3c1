"""Kernels for tests/test_ttir_lowering.py: one with the bug class the TTIR check exists for, one without, one that
shows how each argument is typed, and two whose TTIR is fine but whose sm_90 cubin is not (too much shared memory at
large tiles, PTX that ptxas rejects). Importable by name, as the lowering child process needs."""

import triton
import triton.language as tl


@triton.jit
def _scaled_early_return(x, S, BLOCK: tl.constexpr, GROUP: tl.constexpr, QUANT: tl.constexpr):
    if QUANT == 0:
        return x  # the interpreter stops here; the compiler goes on to the division by GROUP = 0
    return x * tl.load(S + BLOCK // GROUP)


@triton.jit
def _scaled_one_return(x, S, BLOCK: tl.constexpr, GROUP: tl.constexpr, QUANT: tl.constexpr):
    if QUANT == 0:
        y = x
    else:
        y = x * tl.load(S + BLOCK // GROUP)
    return y


@triton.jit
def early_return_kernel(X, S, Out, BLOCK: tl.constexpr, GROUP: tl.constexpr, QUANT: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Out + offs, _scaled_early_return(tl.load(X + offs), S, BLOCK, GROUP, QUANT))


@triton.jit
def one_return_kernel(X, S, Out, BLOCK: tl.constexpr, GROUP: tl.constexpr, QUANT: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Out + offs, _scaled_one_return(tl.load(X + offs), S, BLOCK, GROUP, QUANT))


@triton.jit
def typed_args_kernel(X, Out, n, big, one, scale, Absent, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask) * scale + (big - big) + (one - 1)
    tl.store(Out + offs, x, mask=mask)


@triton.jit
def tiled_dot_kernel(A, B, C, K, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """C = A @ B for one BLOCK x BLOCK tile (A row-major [BLOCK, K], B [K, BLOCK]). Its TTIR is the same at any tile
    size; its cubin keeps num_stages copies of both input tiles in shared memory."""
    rows, ks = tl.arange(0, BLOCK), tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(A + rows[:, None] * K + (k + ks)[None, :])
        b = tl.load(B + (k + ks)[:, None] * BLOCK + rows[None, :])
        acc += tl.dot(a, b)
    tl.store(C + rows[:, None] * BLOCK + rows[None, :], acc)


@triton.jit
def bad_ptx_kernel(X, BLOCK: tl.constexpr):
    """Lowers to TTIR, TTGIR and PTX; ptxas rejects the inline assembly."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs)
    y = tl.inline_asm_elementwise("no.such.instruction $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
    tl.store(X + offs, y)
