"""Host cost of the prefix cache's bookkeeping per request: what publishing a prompt while its request runs adds.

A request's life in the KV manager (CPU, no model): admission (``match_prefix_with_branch`` over its context,
``add_request``), its prompt's prefill in ``--chunk``-token chunks (``extend`` and ``computed``), ``--decode`` decode
tokens, ``free_request``. Timed with and without ``publish`` after each chunk (what ``runner.prefill`` runs), for fresh
random prompts (the tree takes every token) and for prompts sharing all but their last 16 tokens with one the tree
holds (a system prompt: admitted with that prefix, they publish 16 tokens). Medians over ``--repeats`` requests,
microseconds. Writes JSON.

    python benchmarks/prefix_publish_cost.py --out benchmarks/results/prefix_publish_cost_cpu.json
"""

import argparse
import json
import os
import platform
import random
import statistics
import time

from lightllm.common.kv_cache import KVCacheManager


def request_us(kv: KVCacheManager, prompt, decode: int, publish: bool, chunk: int = 4096) -> float:
    """One request's bookkeeping, admission to free, in microseconds."""
    t0 = time.perf_counter()
    cached, _, _ = kv.match_prefix_with_branch(prompt[:-1])
    slot = kv.add_request(prompt[:cached])
    for start in range(cached, len(prompt), chunk):
        end = min(start + chunk, len(prompt))
        kv.extend(slot, end - start)
        kv.computed(slot, prompt[start:end])
        if publish:
            kv.publish(slot, lasting=end == len(prompt))
    for token in range(decode):
        kv.extend_each([slot])
        kv.computed_each([slot], [token])
    kv.free_request(slot)
    return (time.perf_counter() - t0) * 1e6


def measure(length: int, shared: bool, decode: int, repeats: int, chunk: int = 4096, seed: int = 0) -> dict:
    rng = random.Random(seed)
    row = {"prompt": length, "shared": shared, "decode": decode, "chunk": chunk}
    for publish in (False, True):
        kv = KVCacheManager(8 * (length + decode), 4, length + decode, "cpu", prefix_cache=True)
        head = [rng.randrange(50000) for _ in range(length - 16)]
        if shared:  # the tree holds the shared part before the timed requests
            request_us(kv, head + [1] * 16, 0, publish, chunk)
        times = []
        for _ in range(repeats):
            body = head if shared else [rng.randrange(50000) for _ in range(length - 16)]
            prompt = body + [rng.randrange(50000) for _ in range(16)]
            times.append(request_us(kv, prompt, decode, publish, chunk))
            if not shared:
                kv.prefix.clear()  # each fresh prompt alone in the tree, as the first of its kind
        row["publish_us" if publish else "plain_us"] = statistics.median(times)
    row["added_us"] = row["publish_us"] - row["plain_us"]
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 2048, 8192, 32768])
    p.add_argument("--decode", type=int, default=16, help="decode tokens per request")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--chunk", type=int, default=4096, help="prefill chunk (--chunked_prefill_size's default)")
    p.add_argument("--out", default="benchmarks/results/prefix_publish_cost_cpu.json")
    args = p.parse_args(argv)
    if min(args.lengths) <= 16:
        p.error(f"--lengths expected each > 16 (16 tokens of each prompt are its own), got {min(args.lengths)}")
    if args.chunk < 1:
        p.error(f"--chunk expected a positive integer, got {args.chunk}")
    rows = [measure(n, shared, args.decode, args.repeats, args.chunk) for n in args.lengths for shared in (False, True)]
    print(f"{'prompt':>7} {'kind':>7} {'plain us':>9} {'publish us':>11} {'added us':>9}")
    for r in rows:
        kind = "shared" if r["shared"] else "fresh"
        print(f"{r['prompt']:>7} {kind:>7} {r['plain_us']:>9.1f} {r['publish_us']:>11.1f} {r['added_us']:>9.1f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "args": vars(args),
                   "rows": rows}, f, indent=1)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
