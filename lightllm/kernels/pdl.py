"""Programmatic dependent launch (PDL, sm_90 and later): a kernel's programs may start while the kernel before it in
the stream is still finishing, and wait for it in the kernel, not on the launch.

At decode batch sizes a layer is a chain of short kernels (norms, GEMVs, attention), many of them a few
microseconds long and most of the GPU idle between them. A kernel that supports PDL declares ``USE_PDL:
tl.constexpr = False`` as its last parameter and calls :func:`pdl_enter` first; ``DirectLaunch`` launches it with
``USE_PDL=True`` and Triton's ``launch_pdl`` while ``direct_launch.set_pdl(True)`` (a GPU of compute capability 9.0
or later; off by default). Then:

- ``gdc_wait`` blocks until the previous kernel has completed and its writes are visible, before this kernel reads
  or writes anything, so it is correct after any kernel (a cuBLAS GEMM, a torch op, another PDL kernel);
- ``gdc_launch_dependents`` lets the next kernel's programs be scheduled once every program of this one has started:
  they take SMs this kernel leaves idle and wait there, so the launch latency between the two is hidden.

Inside a CUDA graph the launch attribute becomes a programmatic edge; captured and replayed alike. Without the
launch attribute both instructions return at once, and the interpreter never reaches them (``USE_PDL`` is False).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """The first statement of a kernel that may be launched with PDL (see the module's doc)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
