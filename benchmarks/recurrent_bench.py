"""What the recurrent-state benchmarks (``linear_attention.py``, ``mtp_recurrent.py``) share: cold state pools cycled
through a captured graph, the tuner's own pick in a fresh config folder, and the run-or-analyze entry point."""

import json
import math
import os
import sys
import tempfile
from pathlib import Path

import torch

COLD_BYTES = 1 << 30  # pools cycled per graph: far beyond the H200's 60 MB of L2


def pools_needed(bytes_per_pool: int, cold_bytes: int = COLD_BYTES) -> int:
    """Pools to cycle through so that no launch finds the previous launches' state in L2."""
    return max(2, math.ceil(cold_bytes / max(1, bytes_per_pool)))


class Cycle:
    """A launch that takes the next of several inputs at every call, so each launch captured into a graph reads
    other memory."""

    def __init__(self, launch, inputs):
        self.launch, self.inputs, self.i = launch, inputs, 0

    def __call__(self):
        self.i = (self.i + 1) % len(self.inputs)
        return self.launch(self.inputs[self.i])


def tuner_pick(tuned, call):
    """The config ``tuned`` stores when ``call()`` runs it once at level 1 in the DECODE_ATTENTION scope, searched
    in a fresh config folder with the package's shipped configs hidden, so it searches even where a shipped file
    holds this key (None: the default won). The tuner's caches, the shipped root and the environment are left as
    found."""
    from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, store

    tuned.clear_cache()
    shipped = store.SHIPPED_ROOT
    with tempfile.TemporaryDirectory() as root:
        os.environ.update(LIGHTLLM_TRITON_AUTOTUNE_LEVEL="1", LIGHTLLM_AUTOTUNE_CONFIG_DIR=root)
        store.SHIPPED_ROOT = Path(root) / "no_shipped_configs"
        try:
            with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
                call()
        finally:
            store.SHIPPED_ROOT = shipped
            for name in ("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "LIGHTLLM_AUTOTUNE_CONFIG_DIR"):
                os.environ.pop(name, None)
            tuned.clear_cache()
    if tuned.last_search is None:
        raise RuntimeError(f"{tuned.kernel_name}: the tuner did not search (a config was found for this key)")
    return tuned.last_search.chosen


def save(results, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, default=str)


def check_batches(parser, args) -> None:
    if any(b < 1 for b in args.batches):
        parser.error(f"--batches expected positive integers, got {args.batches}")


def run_or_analyze(args, run, print_tables) -> None:
    """``--analyze JSON`` prints a saved run's tables (no GPU needed); otherwise ``run(args)`` on the GPU, then its
    tables."""
    if args.analyze:
        with open(args.analyze) as f:
            results = json.load(f)
    else:
        if not torch.cuda.is_available():
            sys.exit("error: this benchmark needs a CUDA GPU (use --analyze JSON to print a saved run)")
        results = run(args)
    print_tables(results)
