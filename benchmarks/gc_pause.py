"""How long one full garbage-collector pass stops the engine process, with its start-up heap frozen (the server, since
2026-12-07) and without (before): the engine's runner is built as the server builds it (weights, KV pool, tuning and
graphs on a GPU), then ``--requests`` requests are served through the engine (their KV stays in the prefix cache, as a
warm server's does), then full passes (``gc.collect()``) are timed over that same heap, frozen and then whole.

    python benchmarks/gc_pause.py --out benchmarks/results/gc_pause_cpu.json            # the built-in tiny model
    python benchmarks/gc_pause.py --model-dir DIR --device cuda --batch 64 --out F.json  # a model on a GPU

A full pass runs when enough objects have outlived the younger generations (CPython's thresholds); in the engine
process it holds the running streams' next decode step for its whole length. The server reports the passes of its
processes as ``lightllm_gc_pause_seconds`` (``benchmarks/serve_load.py``'s garbage-collector table).
"""

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from lightllm.common.gc_heap import freeze_startup_heap
from lightllm.engine.args import EngineArgs
from lightllm.engine.engine import Engine
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))


def serve_requests(runner, n: int, prompt_len: int, out_len: int, seed: int = 0) -> int:
    """``n`` requests of distinct random prompts through an engine over ``runner`` (as many at a time as it runs); the
    tokens made."""
    import random

    rng = random.Random(seed)
    vocab = runner.config.vocab_size
    engine, made = Engine(runner, ()), [0]

    def emit(ev):
        made[0] += ev.kind == "token"

    params = SamplingParams(max_new_tokens=out_len, ignore_eos=True)
    for i in range(n):
        engine.submit(Request(f"r{i}", [rng.randrange(vocab) for _ in range(prompt_len)], params, emit))
    while engine.step() or engine.has_unfinished():
        pass
    return made[0]


def timed_passes(passes: int) -> list:
    """Seconds of each of ``passes`` full passes, back to back."""
    out = []
    for _ in range(passes):
        t = time.perf_counter()
        gc.collect()
        out.append(time.perf_counter() - t)
    return out


def measure(args) -> dict:
    engine_args = EngineArgs(model_dir=args.model_dir, device=args.device, running_max_req_size=args.batch,
                             max_req_total_len=args.prompt + args.output + 8)  # fmt: skip
    t = time.perf_counter()
    runner = ModelRunner(engine_args)
    built_s = time.perf_counter() - t
    frozen = freeze_startup_heap()  # where the engine process freezes: built, not yet serving
    tokens = serve_requests(runner, args.requests, args.prompt, args.output)
    walked_frozen = len(gc.get_objects())  # what a pass walks now: serving's objects
    with_freeze = timed_passes(args.passes)
    gc.unfreeze()  # the same heap, walked whole: the server before
    walked_whole = len(gc.get_objects())
    without = timed_passes(args.passes)
    return {"device": str(runner.device), "model_dir": args.model_dir, "build_s": built_s, "requests": args.requests,
            "tokens": tokens, "frozen_objects": frozen, "walked_frozen": walked_frozen, "walked_whole": walked_whole,
            "pass_ms_frozen": [s * 1e3 for s in with_freeze], "pass_ms_whole": [s * 1e3 for s in without],
            "median_ms_frozen": statistics.median(with_freeze) * 1e3,
            "median_ms_whole": statistics.median(without) * 1e3}  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None, help="a Qwen3 or Qwen3.5 folder (default: the built-in tiny model)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda where there is one)")
    p.add_argument("--batch", type=int, default=8, help="running_max_req_size (on a GPU: the decode graphs' batches)")
    p.add_argument("--requests", type=int, default=256, help="served before the passes are timed")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--output", type=int, default=16)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--out", default="gc_pause.json")
    args = p.parse_args()
    if args.requests < 0 or args.passes < 1 or args.batch < 1:
        p.error(f"--requests expected >= 0, --passes and --batch >= 1, got {args.requests}, {args.passes} and "
                f"{args.batch}")  # fmt: skip
    res = measure(args)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
    res.update({"commit": commit.stdout.strip() or None, "machine": platform.node(), "cpu": platform.processor(),
                "command": "python benchmarks/gc_pause.py " + " ".join(sys.argv[1:])})  # fmt: skip
    print(f"{res['device']}: built in {res['build_s']:.1f}s, {res['requests']} requests served ({res['tokens']} "
          f"tokens), {res['frozen_objects']} start-up objects frozen")  # fmt: skip
    print("heap            objects walked  full pass ms (median of %d)" % args.passes)
    print(f"frozen (now)    {res['walked_frozen']:14d}  {res['median_ms_frozen']:10.2f}")
    print(f"whole (before)  {res['walked_whole']:14d}  {res['median_ms_whole']:10.2f}")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
