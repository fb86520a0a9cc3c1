"""What the GPU benchmarks share around their measurement: writing results as JSON (partial results too, so a
time limit keeps what finished) and the entry that either measures (a GPU, or Triton's interpreter with
``--dry-run``) or re-prints a saved run (``--analyze``)."""

import json
import os
import sys
from typing import Callable

import torch


def save_json(results, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, default=str)


def measure_or_analyze(args, name: str, run: Callable, analyze: Callable, print_table: Callable) -> None:
    """``run(args)`` (or the saved run of ``--analyze``), then its ``analyze`` rows saved beside it and printed."""
    if args.analyze:
        with open(args.analyze) as f:
            results = json.load(f)
    else:
        if args.dry_run and not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module defines its kernels
        elif not torch.cuda.is_available():
            sys.exit(f"{name} needs a CUDA GPU (or --dry-run)")
        results = run(args)
    results["rows"] = analyze(results)
    if not args.analyze:
        save_json(results, args.out)
    print_table(results, results["rows"])
