"""Configs for fla-core's own autotuned kernels (Qwen3.5's chunked prefill), shipped so a first start does not search.

fla-core tunes its chunked gated-delta-rule kernels with Triton's autotuner the first time each key runs in a process
(Triton keeps the result on disk: later starts on the machine read it). On a fresh H200 that was 7 searches and 65.5 s
of a Qwen3.5-27B-shaped start-up (benchmarks/results/fla_autotune_qwen3_5_27b_h200.json). fla-core 0.6 reads
configs from ``$FLA_CONFIG_DIR/<kernel>.json`` when ``FLA_CACHE_MODE`` asks it to (the mode read once, when fla-core
is imported; the folder at each lookup); ``strict`` takes a config only for the exact key it was tuned for, and any
other key is searched as before. :func:`use_shipped_configs` points fla-core at this package's configs for the GPU
and Triton version, unless the user set either variable.

The files come from the output of a start with ``TRITON_PRINT_AUTOTUNING=1``, ``FLA_CACHE_MODE=disabled`` and an
empty Triton cache (a result read from the cache prints nothing): its "Triton autotuning for function" lines::

    python -m lightllm.layers.fla_tuning LOG DIR   # DIR: fla_configs/triton_<version>/<gpu>
"""

import ast
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional

logger = logging.getLogger(__name__)

SHIPPED_ROOT = Path(__file__).with_name("fla_configs")
_done = False


def shipped_dir() -> Path:
    """This GPU's and Triton version's folder of fla-core configs (the autotuner store's names for both)."""
    from lightllm.common.autotuner import store

    return SHIPPED_ROOT / store.triton_dir_name() / store.device_dir_name()


def use_shipped_configs() -> Optional[Path]:
    """Once per process, before fla-core's first kernel runs: ``FLA_CONFIG_DIR`` = :func:`shipped_dir` and
    ``FLA_CACHE_MODE`` = ``strict`` where configs ship for this GPU and neither variable is set (and the mode fla-core
    read, where it is imported already). The folder used, else None."""
    global _done
    if _done:
        return None
    _done = True
    folder = shipped_dir()
    if "FLA_CONFIG_DIR" in os.environ or "FLA_CACHE_MODE" in os.environ or not folder.is_dir():
        return None
    os.environ["FLA_CONFIG_DIR"], os.environ["FLA_CACHE_MODE"] = str(folder), "strict"  # the folder: read per lookup
    modes = getattr(sys.modules.get("fla.ops.utils.cache"), "FlaCacheMode", None)
    if modes is not None:  # imported already (transformers' Qwen3.5 model imports fla-core), the mode read then
        sys.modules["fla.ops.utils.cache"].FLA_CACHE_MODE = modes.STRICT
    logger.info("fla-core: configs for its autotuned kernels from %s (FLA_CACHE_MODE=strict)", folder)
    return folder


_AUTOTUNED = re.compile(
    r"Triton autotuning for function (\w+),\s*with key as (\(.*?\)),\s*finished after [0-9.]+s,\s*"
    r"best config selected: (.*?);"
)
_LAUNCH_OPTIONS = ("num_warps", "num_ctas", "num_stages", "maxnreg")


def parse_autotune_log(text: str) -> Dict[str, List[dict]]:
    """Kernel name -> ``[{"autotune_key", "config"}]`` from Triton's ``TRITON_PRINT_AUTOTUNING`` lines, in fla-core's
    entry format. A line whose key or config cannot be read is a ValueError naming it."""
    out: Dict[str, List[dict]] = {}
    for name, key_text, config_text in _AUTOTUNED.findall(text):
        try:
            key = list(ast.literal_eval(key_text))
            parts = dict(part.split(": ", 1) for part in config_text.split(", "))
            config = {"kwargs": {k: ast.literal_eval(v) for k, v in parts.items() if k not in _LAUNCH_OPTIONS}}
            config.update({k: ast.literal_eval(parts[k]) for k in _LAUNCH_OPTIONS})
        except (ValueError, SyntaxError, KeyError) as e:
            raise ValueError(f"autotune line of {name} expected a tuple key and 'name: value' options, got key "
                             f"{key_text!r} and config {config_text!r} ({e!r})") from None  # fmt: skip
        out.setdefault(name, []).append({"autotune_key": key, "config": config})
    return out


def write_configs(entries: Dict[str, List[dict]], folder: Path) -> List[Path]:
    """One ``<kernel>.json`` per kernel in ``folder``, merged with the entries a file there holds (each named by
    fla-core's own hash of its key). A file there that is not such JSON is a ValueError naming it."""
    from fla.ops.utils.cache import AutotuneKey

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, rows in sorted(entries.items()):
        path = folder / f"{name}.json"
        data = {"kernel_name": name, "autotune_entries": {}}
        if path.exists():
            try:
                data = json.loads(path.read_text())
            except ValueError as e:
                raise ValueError(f"{path} expected fla-core's config JSON to merge into, got invalid JSON ({e}); "
                                 "fix or remove it") from None  # fmt: skip
            if not isinstance(data, dict) or not isinstance(data.get("autotune_entries"), dict):
                raise ValueError(f"{path} expected fla-core's config JSON with 'autotune_entries' to merge into, "
                                 f"got {data!r:.200}; fix or remove it")  # fmt: skip
        for row in rows:
            data["autotune_entries"][AutotuneKey.key_hash(row["autotune_key"])] = row
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        written.append(path)
    return written


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m lightllm.layers.fla_tuning", description=__doc__.splitlines()[0])
    p.add_argument("log", type=Path, help="a start's output with TRITON_PRINT_AUTOTUNING=1")
    p.add_argument("dir", type=Path, help="the folder to write <kernel>.json into")
    args = p.parse_args(argv)
    try:
        entries = parse_autotune_log(args.log.read_text(errors="replace"))
        if not entries:
            raise ValueError(f"{args.log} holds no 'Triton autotuning for function' line")
        written = write_configs(entries, args.dir)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
