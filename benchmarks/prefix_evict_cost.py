"""Host cost of a request's KV bookkeeping once the prefix cache fills the pool: the steady state of a server that
has run for a while, where every finished request's tokens stay cached until an admission needs their slots, so
each new request evicts about one old one.

A pool of ``--pools`` tokens is first filled with finished requests of fresh random prompts (``--prompt`` tokens,
``--decode`` decode tokens, published as the engine does); then each of ``--repeats`` more such requests is timed from
admission to its free (``prefix_publish_cost.request_us``: match, add_request, its prompt's chunks, decode tokens,
free_request). Reports the median and 90th percentile in microseconds per pool size, and how many cached requests the
tree held. CPU, no model. Writes JSON.

    python benchmarks/prefix_evict_cost.py --out benchmarks/results/prefix_evict_cost_cpu.json
"""

import argparse
import json
import os
import platform
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prefix_publish_cost import request_us  # noqa: E402

from lightllm.common.kv_cache import KVCacheManager  # noqa: E402


def measure(pool: int, prompt: int, decode: int, repeats: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    kv = KVCacheManager(pool, 4, prompt + decode, "cpu", prefix_cache=True)
    fresh = lambda: [rng.randrange(50000) for _ in range(prompt)]  # noqa: E731
    cached = 0
    while kv.tokens.num_free >= prompt + decode:  # fill: nothing is evicted yet
        request_us(kv, fresh(), decode, publish=True)
        cached += 1
    times = sorted(request_us(kv, fresh(), decode, publish=True) for _ in range(repeats))
    return {"pool_tokens": pool, "prompt": prompt, "decode": decode, "cached_requests": cached,
            "tree_tokens": kv.prefix.num_tokens, "median_us": statistics.median(times),
            "p90_us": times[int(0.9 * (len(times) - 1))]}  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pools", type=int, nargs="+", default=[16384, 131072, 1048576], help="KV pool sizes, tokens")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--decode", type=int, default=16, help="decode tokens per request")
    p.add_argument("--repeats", type=int, default=200, help="timed requests per pool, after the fill")
    p.add_argument("--out", default="benchmarks/results/prefix_evict_cost_cpu.json")
    args = p.parse_args(argv)
    if args.prompt < 2 or args.decode < 0:
        p.error(f"--prompt expected >= 2 and --decode >= 0, got {args.prompt} and {args.decode}")
    small = [n for n in args.pools if n < 2 * (args.prompt + args.decode)]
    if small:
        p.error(f"--pools expected each >= 2 x (prompt + decode) = {2 * (args.prompt + args.decode)}, got {small}")
    if args.repeats < 1:
        p.error(f"--repeats expected a positive integer, got {args.repeats}")
    rows = [measure(n, args.prompt, args.decode, args.repeats) for n in args.pools]
    print(f"{'pool tokens':>12} {'cached requests':>16} {'median us':>10} {'p90 us':>9}")
    for r in rows:
        print(f"{r['pool_tokens']:>12} {r['cached_requests']:>16} {r['median_us']:>10.1f} {r['p90_us']:>9.1f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                   "python": platform.python_version(), "args": vars(args), "rows": rows}, f, indent=1)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
