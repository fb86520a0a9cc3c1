"""Time to first token of a repeated long prompt with the prefix cache on and off.

In-process engine (the server's scheduler and runner, no HTTP), a Qwen3-shaped random-weight model (8B widths,
``--layers`` layers). Per mode: one unrelated ``--prompt``-token request first (warm-up: kernels compiled and
tuned), then ``--repeats`` times: a fresh random prompt, then the same prompt again, each alone, each for one
token. Reports the median first and second time to first token and second / first (issue 19's target with the
cache on: <= 0.15 at 8K on the H200), and the prompt tokens the second one read from the cache. Writes JSON.

    python benchmarks/prefix_cache_ttft.py --out benchmarks/results/prefix_cache_ttft_h200.json
    python benchmarks/prefix_cache_ttft.py --tiny --prompt 512 --out /tmp/prefix.json   # the method on a CPU
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from lightllm.engine.args import EngineArgs
from lightllm.engine.engine import Engine
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_bench import random_qwen3, write_rows  # noqa: E402


def time_to_first_token(engine: Engine, ids) -> tuple:
    """(seconds from submit to the first token, prompt tokens read from the prefix cache) of one request alone."""
    got = []

    def emit(ev):
        if ev.kind == "token":
            got.append((time.perf_counter(), ev.cached_tokens))

    engine.submit(Request(f"r{time.perf_counter_ns()}", ids, SamplingParams(max_new_tokens=1, ignore_eos=True), emit))
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return got[0][0] - t0, got[0][1]


def measure(engine: Engine, prompt: int, repeats: int, vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    time_to_first_token(engine, torch.randint(0, vocab, (prompt,), generator=g).tolist())  # warm-up
    firsts, seconds, cached = [], [], []
    for _ in range(repeats):
        ids = torch.randint(0, vocab, (prompt,), generator=g).tolist()
        firsts.append(time_to_first_token(engine, ids)[0])
        t, hit = time_to_first_token(engine, ids)
        seconds.append(t)
        cached.append(hit)
    first, second = statistics.median(firsts), statistics.median(seconds)
    return {"first_ttft_ms": first * 1e3, "second_ttft_ms": second * 1e3, "second_over_first": second / first,
            "second_cached_tokens": cached, "firsts_ms": [x * 1e3 for x in firsts],
            "seconds_ms": [x * 1e3 for x in seconds]}  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/prefix_cache_ttft.json")
    p.add_argument("--tiny", action="store_true", help="the built-in tiny model on the CPU (a check of the method)")
    args = p.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory() as root:
        model, common = random_qwen3(root, args.tiny, args.layers, args.prompt + 8, tiny_tokens=4 * (args.prompt + 8))
        for cache in (True, False):
            engine_args = EngineArgs(model_dir=model, running_max_req_size=4, graph_max_batch_size=4,
                                     max_req_total_len=args.prompt + 8, disable_dynamic_prompt_cache=not cache,
                                     **common)  # fmt: skip
            runner = ModelRunner(engine_args)
            vocab = runner.config.vocab_size if args.tiny else 512  # the tokenizer's ids; the lm_head is padded
            row = {"mode": "cache on" if cache else "cache off", "prompt": args.prompt}
            row.update(measure(Engine(runner, eos_ids=[]), args.prompt, args.repeats, vocab, seed=0))
            rows.append(row)
            print(f"{row['mode']:>9}: {args.prompt}-token prompt, TTFT first {row['first_ttft_ms']:.1f} ms, second "
                  f"{row['second_ttft_ms']:.1f} ms (second / first {row['second_over_first']:.3f}), second read "
                  f"{row['second_cached_tokens'][0]} tokens from the cache", flush=True)  # fmt: skip
            del runner
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    write_rows(args.out, args, rows)
    return rows


if __name__ == "__main__":
    main()
