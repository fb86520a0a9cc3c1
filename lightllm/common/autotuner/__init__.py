"""The phase-aware kernel autotuner; see docs/autotune.md."""

from lightllm.common.autotuner.bench import cuda_graph_bench, get_bench_func, set_bench_func, wall_clock_bench
from lightllm.common.autotuner.phase import (
    AutotuneKernelType,
    AutotuneLevel,
    AutotuneStats,
    autotune_warmup,
    current_warmup_kernel_type,
    get_autotune_stats,
    is_autotune_warmup,
    is_tuning,
)
from lightllm.common.autotuner.plan import FixedPlan, Plan, PlannedInputs
from lightllm.common.autotuner.tuner import Autotuner, autotune, check_rank_agreement, configs_in_use
from lightllm.common.envs import get_decode_attn_autotune_seq_len

__all__ = [
    "AutotuneKernelType",
    "AutotuneLevel",
    "AutotuneStats",
    "Autotuner",
    "FixedPlan",
    "Plan",
    "PlannedInputs",
    "autotune",
    "autotune_warmup",
    "check_rank_agreement",
    "configs_in_use",
    "cuda_graph_bench",
    "current_warmup_kernel_type",
    "get_autotune_stats",
    "get_bench_func",
    "get_decode_attn_autotune_seq_len",
    "is_autotune_warmup",
    "is_tuning",
    "set_bench_func",
    "wall_clock_bench",
]
