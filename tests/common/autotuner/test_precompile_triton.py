"""The compile pass with real Triton kernels, on a machine without a GPU (``precompile_child.py``): RMSNorm's
candidates through the tuner's own ``_compile_ahead``, decode attention's stage 1 and stage 2 through
``compile_ahead``. Every config's kernels compile to a cubin in their kernel's cache, and a second pass with the same
arguments sends nothing: the launches that follow a pass find what it compiled."""

import json
import os
import sys
import tempfile

from lightllm.common import proc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_real_kernels_compile_ahead_into_their_caches():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # JITFunctions, not the interpreter
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
        env.update(TRITON_CACHE_DIR=cache, LIGHTLLM_AUTOTUNE_COMPILE_THREADS="2")
        done = proc.run([sys.executable, "-m", "tests.common.autotuner.precompile_child"], timeout=proc.HANG_TIMEOUT_S,
                        cwd=ROOT, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])

    norm = report["rmsnorm"]
    # the default is one of the 14 candidates, each a compile of its own
    assert (norm["configs"], norm["kernels"], norm["failed"], norm["again"]) == (15, 14, 0, 0)
    assert norm["cubins"] == [True] * 14

    decode = report["decode"]
    assert decode["failed"] == 0 and decode["again"] == 0 and decode["block_ns"] == [32, 64]
    # stage 1 per (BLOCK_N, warps and stages, MIN_BLOCKS) and split-count class, stage 2 per split tile
    assert decode["kernels"] == len(decode["stage1"]) + len(decode["stage2"])
    assert len(decode["stage1"]) >= 8 and len(decode["stage2"]) >= 1
    assert all(decode["stage1"]) and all(decode["stage2"])
