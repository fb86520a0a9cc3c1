"""What the benchmarks' tests share: the repo root, a benchmark script loaded as a module or run as a child process,
and the lines its ``--analyze`` prints."""

import importlib.util
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_benchmark(name):
    """``benchmarks/<name>.py`` loaded from its path (benchmarks/ is no package, so it goes on sys.path while the
    script imports its siblings)."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", os.path.join(REPO, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return module


def run_benchmark(name, *args):
    """``python benchmarks/<name>.py ARGS`` in a child process (the repo importable), stopped with its children if it
    hangs."""
    from lightllm.common import proc

    return proc.run([sys.executable, os.path.join(REPO, "benchmarks", f"{name}.py"), *args],
                    env={**os.environ, "PYTHONPATH": REPO}, timeout=proc.HANG_TIMEOUT_S)  # fmt: skip


def analyzed_lines(bench, saved, tmp_path, capsys):
    """What ``--analyze`` prints for the saved run ``saved``, line by line."""
    path = tmp_path / "run.json"
    path.write_text(json.dumps(saved))
    bench.main(["--analyze", str(path)])
    return capsys.readouterr().out.splitlines()
