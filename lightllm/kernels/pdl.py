"""Programmatic dependent launch (PDL, sm_90 and later): a kernel's programs may start while the kernel before it in
the stream is still finishing, and wait for it in the kernel, not on the launch.

At decode batch sizes a layer is a chain of short kernels (norms, GEMVs, attention), many of them a few
microseconds long and most of the GPU idle between them. A kernel that supports PDL declares ``USE_PDL:
tl.constexpr = False`` as its last parameter, calls :func:`pdl_wait` first and :func:`pdl_release` once its main
work is done; ``DirectLaunch`` launches it with ``USE_PDL=True`` and Triton's ``launch_pdl`` while
``direct_launch.set_pdl(True)`` (a GPU of compute capability 9.0 or later; off by default). Then:

- ``gdc_wait`` blocks until the previous kernel has completed and its writes are visible, before this kernel reads
  or writes anything, so it is correct after any kernel (a cuBLAS GEMM, a torch op, another PDL kernel);
- ``gdc_launch_dependents`` lets the next kernel's programs be scheduled once every program of this one has called
  it (or exited): their launch and set-up overlap this kernel's stores and drain, and they wait for its completion in
  their own ``gdc_wait``. Called after the main loop, not at entry: released at entry, the next kernel's programs
  would sit on SMs waiting for the whole of this one (a 10 % slower batch-1 step on the H200, 8B widths).

Inside a CUDA graph the launch attribute becomes a programmatic edge; captured and replayed alike. Without the
launch attribute both instructions return at once, and the interpreter never reaches them (``USE_PDL`` is False).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """The first statement of a kernel that may be launched with PDL: wait for the kernel before it."""
    if USE_PDL:
        gdc_wait()


@triton.jit
def pdl_release(USE_PDL: tl.constexpr):
    """Let the next kernel launch: after this kernel's main loop, before its final stores (see the module's doc)."""
    if USE_PDL:
        gdc_launch_dependents()
