"""Time to first token of a repeated long prompt with the prefix cache on and off.

In-process engine (the server's scheduler and runner, no HTTP), a random-weight model of ``--layers`` layers:
Qwen3-8B-shaped, or Qwen3.5-27B-shaped with ``--model qwen3.5``. Per mode: one unrelated ``--prompt``-token request
first (warm-up: kernels compiled and tuned), then ``--repeats`` times a fresh random prompt sent three times, each
alone, each for one token. Reports the median time to first token of each send, second / first (issue 19's target
with the cache on: <= 0.15 at 8K on the H200) and third / first, and the prompt tokens each read from the cache.

``--shared N``: the three sends share only their first ``N`` tokens (a system prompt) and each ends with its own
random tokens. Qwen3 reuses the shared KV from the second send on; Qwen3.5 reuses a prefix only from a state
checkpoint (docs/engine.md, "Prefix cache"): the second send starts from the first's last prefill-chunk boundary
inside the shared part (none below ``--chunked_prefill_size``, 4096) and leaves a checkpoint at the branch, so the
third is the first to reuse all of it (the same holds for an identical prompt). ``--mtp_step N`` (Qwen3.5): with its
MTP head and ``--mtp_mode eagle_with_att`` (slots keyed by their token and the next). Writes JSON.

    python benchmarks/prefix_cache_ttft.py --out benchmarks/results/prefix_cache_ttft_h200.json
    python benchmarks/prefix_cache_ttft.py --model qwen3.5 --shared 7168 --out F
    python benchmarks/prefix_cache_ttft.py --model qwen3.5 --mtp_step 2 --shared 7168 --out F
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
from engine_bench import add_model_args, mtp_options, random_model, write_rows  # noqa: E402


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


def measure(engine: Engine, prompt: int, repeats: int, vocab: int, seed: int, shared: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def fresh(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    time_to_first_token(engine, fresh(prompt))  # warm-up
    times, cached = [[], [], []], [[], [], []]  # per send
    for _ in range(repeats):
        if shared:
            head = fresh(shared)
            sends = [head + fresh(prompt - shared) for _ in range(3)]
        else:
            sends = [fresh(prompt)] * 3
        for i, ids in enumerate(sends):
            t, hit = time_to_first_token(engine, ids)
            times[i].append(t)
            cached[i].append(hit)
    first, second, third = (statistics.median(t) for t in times)
    return {"first_ttft_ms": first * 1e3, "second_ttft_ms": second * 1e3, "third_ttft_ms": third * 1e3,
            "second_over_first": second / first, "third_over_first": third / first,
            "second_cached_tokens": cached[1], "third_cached_tokens": cached[2],
            "firsts_ms": [x * 1e3 for x in times[0]], "seconds_ms": [x * 1e3 for x in times[1]],
            "thirds_ms": [x * 1e3 for x in times[2]]}  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--prompt", type=int, default=8192)
    p.add_argument("--shared", type=int, default=0, help="the sends share only their first N tokens (0: all)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/prefix_cache_ttft.json")
    args = p.parse_args(argv)
    if not 0 <= args.shared < args.prompt:
        p.error(f"--shared expected in [0, --prompt {args.prompt}), got {args.shared}")
    mtp = mtp_options(p, args)

    rows = []
    with tempfile.TemporaryDirectory() as root:
        model, common = random_model(root, args.tiny, args.layers, args.prompt + 8, tiny_tokens=4 * (args.prompt + 8),
                                     model=args.model, mtp=bool(mtp))  # fmt: skip
        for cache in (True, False):
            engine_args = EngineArgs(model_dir=model, running_max_req_size=4, graph_max_batch_size=4,
                                     max_req_total_len=args.prompt + 8, disable_dynamic_prompt_cache=not cache,
                                     **common, **mtp)  # fmt: skip
            runner = ModelRunner(engine_args)
            vocab = runner.config.vocab_size if args.tiny else 512  # the tokenizer's ids; the lm_head is padded
            row = {"mode": "cache on" if cache else "cache off", "model": args.model, "prompt": args.prompt,
                   "shared": args.shared or args.prompt, "mtp_step": args.mtp_step}  # fmt: skip
            row.update(measure(Engine(runner, eos_ids=[]), args.prompt, args.repeats, vocab, 0, args.shared))
            rows.append(row)
            print(f"{row['mode']:>9}: {args.prompt}-token prompts sharing {row['shared']}, TTFT first "
                  f"{row['first_ttft_ms']:.1f} ms, second {row['second_ttft_ms']:.1f} ms "
                  f"({row['second_over_first']:.3f}x, {row['second_cached_tokens'][0]} tokens from the cache), third "
                  f"{row['third_ttft_ms']:.1f} ms ({row['third_over_first']:.3f}x, {row['third_cached_tokens'][0]} "
                  f"cached)", flush=True)  # fmt: skip
            del runner
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    write_rows(args.out, args, rows)
    return rows


if __name__ == "__main__":
    main()
