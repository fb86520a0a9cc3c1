"""Host cost of turning generated ids into text, per token: decoding everything so far at every step (what
the server did before) vs :class:`IncrementalDetokenizer`. It runs on the thread that serves HTTP, so at
64 running requests the server pays it 64 times per decode step.

    python benchmarks/detokenize.py [--tokenizer DIR] --out benchmarks/results/detokenize_cpu.json
"""

import argparse
import json
import os
import platform
import random
import tempfile
import time

from lightllm.engine.detokenize import IncrementalDetokenizer


def per_token_us(fn, ids, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(ids)
        best = min(best, time.perf_counter() - t0)
    return best / len(ids) * 1e6


def full(tokenizer):
    def run(ids):
        for n in range(1, len(ids) + 1):
            tokenizer.decode(ids[:n], skip_special_tokens=True)

    return run


def incremental(tokenizer):
    def run(ids):
        detok = IncrementalDetokenizer(tokenizer)
        for t in ids:
            detok.add(t)
        detok.finish()

    return run


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", help="a model folder with a tokenizer (default: the built-in tiny model's)")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/detokenize_cpu.json")
    args = p.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as root:
        if args.tokenizer:
            path = args.tokenizer
        else:
            from lightllm.tools.make_tiny_model import make_tiny_qwen3

            path = make_tiny_qwen3(os.path.join(root, "m"))
        tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.model_max_length = 1 << 30  # a long text to cut samples from, never a model input
    rng = random.Random(0)
    corpus = "The quick brown fox jumps over the lazy dog; naïve café, 你好, def f(x): return x * 42\n"
    ids = tokenizer.encode(corpus * (max(args.lengths) // 8 + 1))
    rows = []
    print(f"{'tokens':>7} {'full us/token':>14} {'incremental us/token':>21} {'speed-up':>9}")
    for n in args.lengths:
        start = rng.randrange(0, len(ids) - n)
        sample = ids[start : start + n]
        f = per_token_us(full(tokenizer), sample, max(1, args.repeats if n <= 1024 else 1))
        i = per_token_us(incremental(tokenizer), sample, args.repeats)
        rows.append({"tokens": n, "full_us_per_token": f, "incremental_us_per_token": i})
        print(f"{n:7d} {f:14.1f} {i:21.1f} {f / i:8.1f}x")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"tokenizer": args.tokenizer or "built-in tiny byte-level BPE", "cpu": platform.processor()
                   or platform.machine(), "python": platform.python_version(), "rows": rows}, fh, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
