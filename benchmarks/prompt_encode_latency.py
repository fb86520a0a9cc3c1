"""A text prompt's tokenization on a busy event loop: encoded on the loop, or sent to the tokenizer thread and awaited
(``PromptEncoder``'s two paths, ``lightllm/server/prompts.py``), at several prompt lengths and loop loads.

Under a streaming load the HTTP process's loop runs a step's token writes in slices of work between its waits; a
coroutine that awaits the tokenizer thread resumes only after the slice in progress and the callbacks queued before
its own, so the trip costs it whole turns of the loop, and all of them are in that request's time to first token. The
loop's load here is one coroutine that burns ``--slices-ms`` of CPU and then waits as long (a loop half busy, as the
server's was at about 14 K streamed tokens/s). Per (length, slice): the median and p90 latency of each path.

    python benchmarks/prompt_encode_latency.py --out benchmarks/results/prompt_encode_latency_cpu.json
"""

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

WORDS = ["hello", "world", "model", "token", "the", "cat", "1234", "code", "serving", "latency"]


def prompt(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(chars // 4))[:chars]


async def _busy(stop: asyncio.Event, slice_s: float) -> None:
    """Half the loop's time: ``slice_s`` of Python, then as long waiting in its selector, as a server's loop waits
    between the steps it writes."""
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < slice_s:
            pass
        await asyncio.sleep(slice_s)


async def measure(tokenizer, text: str, slice_ms: float, reps: int) -> dict:
    """Seconds per call of each path, alternating, with the loop busy in ``slice_ms`` slices (0: idle)."""
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=1)
    stop = asyncio.Event()
    load = asyncio.create_task(_busy(stop, slice_ms / 1e3)) if slice_ms else None
    inline, thread = [], []
    try:
        for _ in range(reps):
            t = time.perf_counter()
            tokenizer.encode(text)
            inline.append(time.perf_counter() - t)
            await asyncio.sleep(0)
            t = time.perf_counter()
            await loop.run_in_executor(pool, tokenizer.encode, text)
            thread.append(time.perf_counter() - t)
            await asyncio.sleep(0)
    finally:
        stop.set()
        if load is not None:
            await load
        pool.shutdown()
    p90 = lambda xs: sorted(xs)[int(0.9 * len(xs))]  # noqa: E731
    return {"inline_p50_us": statistics.median(inline) * 1e6, "inline_p90_us": p90(inline) * 1e6,
            "thread_p50_us": statistics.median(thread) * 1e6, "thread_p90_us": p90(thread) * 1e6}  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chars", nargs="+", type=int, default=[256, 1024, 4096])
    p.add_argument("--slices-ms", nargs="+", type=float, default=[0.0, 0.5, 1.0], help="busy slices (0: an idle loop)")
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--model", help="a model folder whose tokenizer to use (default: the built-in tiny model's)")
    p.add_argument("--out", default="benchmarks/results/prompt_encode_latency.json")
    args = p.parse_args()
    if min(args.chars) < 1 or args.reps < 1:
        p.error(f"--chars and --reps expected positive counts, got {args.chars} and {args.reps}")
    if min(args.slices_ms) < 0:
        p.error(f"--slices-ms expected milliseconds >= 0, got {args.slices_ms}")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from lightllm.server.prompts import INLINE_CHARS, load_tokenizer

    if args.model:
        tokenizer = load_tokenizer(args.model)
    else:
        from lightllm.tools.make_tiny_model import make_tiny_qwen3

        with tempfile.TemporaryDirectory(prefix="lightllm-tiny-") as tmp:  # the tokenizer is in memory once loaded
            tokenizer = load_tokenizer(str(make_tiny_qwen3(tmp)))
    rows = []
    for chars in args.chars:
        text = prompt(chars)
        for slice_ms in args.slices_ms:
            r = asyncio.run(measure(tokenizer, text, slice_ms, args.reps))
            rows.append({"chars": chars, "tokens": len(tokenizer.encode(text)), "slice_ms": slice_ms, **r})
    print(f"inline: encoded on the loop; thread: sent to a tokenizer thread and awaited (us); the server encodes up to "
          f"{INLINE_CHARS} characters inline")  # fmt: skip
    print(
        f"{'chars':>6s} {'tokens':>6s} {'busy slice':>10s} {'inline p50':>10s} {'thread p50':>10s} {'thread p90':>10s}"
    )
    for r in rows:
        busy = f"{r['slice_ms']:.1f} ms" if r["slice_ms"] else "idle"
        print(f"{r['chars']:6d} {r['tokens']:6d} {busy:>10s} {r['inline_p50_us']:10.0f} {r['thread_p50_us']:10.0f} "
              f"{r['thread_p90_us']:10.0f}")  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                   "tokenizer": args.model or "built-in tiny model", "inline_chars": INLINE_CHARS,
                   "loop": "busy slice_ms of Python, then as long waiting", "rows": rows},
                  f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
