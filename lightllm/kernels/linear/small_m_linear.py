"""The tuned small-M linear (decode GEMV): ``y = x @ W^T`` whose untuned default is cuBLAS.

A GENERAL kernel (``small_m_linear``): the launcher default (``run_config=None``) is ``torch.mm`` on the weight's
``[in, out]`` view, exactly what the models call without it, so with nothing tuned nothing changes; a search adopts
a Triton config (``small_m_kernel.py``) only where it measures one faster than cuBLAS. Static key: N, K, dtype, out
dtype and whether M <= 16 (no candidates above: cuBLAS always); run key: one bucket for every M <= 16 (the kernel
pads x to 16 rows, so its time barely depends on M), tuned by the GENERAL warm-up's 16-token prefill, each launch
of the search reading the next of several copies of the weight (``cold_weights.py``: from HBM, as in a decode step).
"""

from typing import Optional

import torch

from lightllm.common.autotuner import AutotuneKernelType, PlannedInputs, autotune
from lightllm.kernels.linear.cold_weights import cold_weight_inputs
from lightllm.kernels.linear.reference import cublas_linear, mm_on_view
from lightllm.kernels.launch_math import SM90_MAX_SHARED_BYTES
from lightllm.kernels.linear.small_m_kernel import MAX_ROWS, launch_small_m_linear, pipeline_shared_bytes

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TILES = ((32, 256), (64, 128), (64, 256))  # (BLOCK_N, BLOCK_K): rows of W per program x K per step
_SPLITS = (1, 2, 4, 8)
_WARPS_STAGES = ((4, 4), (8, 3))
CANDIDATES = tuple({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": s, "num_warps": w, "num_stages": st}
                   for bn, bk in _TILES for s in _SPLITS for w, st in _WARPS_STAGES)  # fmt: skip


def _configs(x, w):
    if x.shape[0] > MAX_ROWS:
        return []  # cuBLAS, never searched: the kernel serves M <= 16 only
    return [dict(c) for c in CANDIDATES if _fits(c, w.shape[1], x.element_size())]


def _fits(config: dict, k: int, itemsize: int) -> bool:
    """No split slice shorter than a K block, and tiles that fit an sm_90 block's shared memory (float32 at
    BLOCK_N=64, BLOCK_K=256 and 4 stages needs 240 KiB)."""
    whole_slices = config["SPLIT_K"] == 1 or k >= config["SPLIT_K"] * config["BLOCK_K"]
    return whole_slices and pipeline_shared_bytes(config, itemsize) <= SM90_MAX_SHARED_BYTES


def _static_key(x, w, out_dtype):
    return {"N": w.shape[0], "K": w.shape[1], "dtype": str(x.dtype), "out_dtype": str(out_dtype)}


def _run_key(x):
    return MAX_ROWS  # only plans of at most 16 rows reach the tuner, and they share one entry


@autotune(
    kernel_name="small_m_linear",
    configs_gen_func=_configs,
    static_key_func=_static_key,
    run_key_func=_run_key,
    kernel_type=AutotuneKernelType.GENERAL,
    rebuild_input_func=cold_weight_inputs,
)
def _launch_small_m_linear(x, w, w_t, out_dtype, out, scratch, w_ring=None, run_config=None):
    if w_ring is not None:  # a search's timing inputs: the next copy of the weight
        w, w_t = w_ring.next()
    if run_config is None:
        return cublas_linear(x, w_t, out_dtype, out)
    if out is None:
        out = torch.empty((x.shape[0], w.shape[0]), dtype=out_dtype, device=x.device)
    return launch_small_m_linear(x, w, out, run_config, scratch)


class SmallMLinearPlan:
    """``x [m, k] @ w [n, k]^T`` of one step's shapes (a projection of every layer): checked once here, the tuned
    config (or cuBLAS) resolved at the first :meth:`run`.

    Args: ``m`` rows (tokens), ``n`` outputs, ``k`` inputs, ``dtype`` of x and w; ``out_dtype``: x's dtype (None) or
    float32 (the lm_head's logits, written from the float32 accumulators); ``run_config`` bypasses tuning (m <= 16).
    Above 16 rows every run is cuBLAS, without keys or a search.
    """

    def __init__(self, m: int, n: int, k: int, dtype: torch.dtype, out_dtype: Optional[torch.dtype] = None,
                 run_config: Optional[dict] = None):  # fmt: skip
        out_dtype = out_dtype or dtype
        if dtype not in _DTYPES:
            raise ValueError(f"small_m_linear plan: dtype expected one of {_DTYPES}, got {dtype}")
        if out_dtype not in (dtype, torch.float32):
            raise ValueError(f"small_m_linear plan: out_dtype expected {dtype} (x's) or torch.float32, got {out_dtype}")
        if m < 0 or n < 1 or k < 1:
            raise ValueError(f"small_m_linear plan: expected m >= 0, n >= 1, k >= 1, got m {m}, n {n}, k {k}")
        if run_config is not None and not 0 < m <= MAX_ROWS:
            raise ValueError(f"small_m_linear plan: run_config needs 1 <= m <= {MAX_ROWS} (the kernel's row tile), "
                             f"got m {m}")  # fmt: skip
        self.out_dtype = out_dtype
        self.out_shape, self.w_t_shape = (m, n), (k, n)
        self.inputs = PlannedInputs("small_m_linear", x=(torch.Size((m, k)), dtype), w=(torch.Size((n, k)), dtype))
        self._tuned = _launch_small_m_linear.plan(run_config=run_config) if 0 < m <= MAX_ROWS else None
        self._scratch = {}  # split partials, made once for every layer's run

    def run(self, x: torch.Tensor, w: torch.Tensor, w_t: Optional[torch.Tensor] = None, out=None) -> torch.Tensor:
        """``x @ w^T``. ``w_t``: w's ``[k, n]`` transposed view, made once at load (cuBLAS runs on it; default
        ``w.t()``). ``out``: optional ``[m, n]`` tensor of ``out_dtype`` with a contiguous last dim.

        Once the plan has settled on cuBLAS (nothing tuned for its key, the usual case at level 0), later runs go
        straight to ``torch.mm``, which checks its own arguments: the other layers of the step pay no more host time
        than the plain call the models made before this kernel."""
        t = self._tuned
        if t is not None and t.config is None and t.settled():
            return cublas_linear(x, w.t() if w_t is None else w_t, self.out_dtype, out)
        self.inputs.check((x.shape, x.dtype), (w.shape, w.dtype))
        if x.stride(-1) != 1 or w.stride(-1) != 1 or x.device != w.device:
            raise ValueError(f"small_m_linear: x and w expected contiguous last dims on one device, got x strides "
                             f"{x.stride()} on {x.device}, w strides {w.stride()} on {w.device}")  # fmt: skip
        if w_t is None:
            w_t = w.t()
        elif w_t.data_ptr() != w.data_ptr() or w_t.shape != self.w_t_shape:  # cuBLAS must read the same weight
            raise ValueError(f"small_m_linear: w_t expected w's transposed view {self.w_t_shape}, got "
                             f"{tuple(w_t.shape)} at another address or of another shape")  # fmt: skip
        if out is not None and (out.shape != self.out_shape or out.dtype != self.out_dtype or out.stride(-1) != 1):
            raise ValueError(f"small_m_linear: out expected a {self.out_shape} {self.out_dtype} tensor with a "
                             f"contiguous last dim, got {tuple(out.shape)} {out.dtype} "
                             f"strides {out.stride()}")  # fmt: skip
        if self._tuned is None:
            return cublas_linear(x, w_t, self.out_dtype, out)
        return self._tuned.run(x, w, w_t, self.out_dtype, out, self._scratch)


def small_m_linear(x: torch.Tensor, w: torch.Tensor, out_dtype: Optional[torch.dtype] = None, out=None,
                   run_config: Optional[dict] = None) -> torch.Tensor:  # fmt: skip
    """``x @ w^T``, tuned for M <= 16 (cuBLAS above, and wherever no Triton config measured faster).

    Args:
        x: ``[M, K]`` float16/bfloat16/float32, last dim contiguous.
        w: ``[N, K]`` of x's dtype and device (``nn.Linear`` layout), last dim contiguous.
        out_dtype: x's dtype (None) or float32.
        out: optional ``[M, N]`` tensor of ``out_dtype``.
    Returns:
        ``out`` or a new tensor. Every layer of a step: :class:`SmallMLinearPlan` checks and resolves once.
    """
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"small_m_linear: expected x [M, K] and w [N, K], got x {tuple(x.shape)}, w {tuple(w.shape)}")
    m, k = x.shape
    return SmallMLinearPlan(m, w.shape[0], k, x.dtype, out_dtype, run_config).run(x, w, out=out)


def linear_op(m: int, n: int, k: int, dtype: torch.dtype):
    """A model's projection of one forward, ``(x, w, w_t) -> x @ w^T``: the plan's run at m <= 16, else the very
    ``torch.mm(x, w_t)`` the models called before this kernel (nothing keyed or checked per layer)."""
    if m > MAX_ROWS:
        return mm_on_view
    return SmallMLinearPlan(m, n, k, dtype).run
