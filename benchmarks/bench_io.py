"""What the GPU benchmarks share around their measurement: writing results as JSON (partial results too, so a
time limit keeps what finished), reading saved runs back, and the entry that either measures (a GPU, or Triton's
interpreter with ``--dry-run``) or re-prints a saved run (``--analyze``)."""

import json
import os
import sys
from typing import Callable, List


def save_json(results, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, default=str)


def read_saved_runs(parser, flag: str, paths: List[str]) -> list:
    """The JSON of each saved run in ``paths`` (a flag's files); one that cannot be read is ``parser``'s one-line
    error naming ``flag`` and the file."""
    runs = []
    for path in paths:
        try:
            with open(path) as f:
                runs.append(json.load(f))
        except (OSError, ValueError) as e:
            parser.error(f"{flag} {path}: cannot read a saved run: {e}")
    return runs


def measure_or_analyze(args, name: str, run: Callable, analyze: Callable, print_table: Callable) -> None:
    """``run(args)`` (or the saved run of ``--analyze``), then its ``analyze`` rows saved beside it and printed."""
    import torch  # here, not at import: scripts that only read saved runs do without it

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
