"""Kernels for tests/test_ttir_lowering.py: one with the bug class the TTIR check exists for, one without, and one
that shows how each argument is typed. Importable by name, as the lowering child process needs."""

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
