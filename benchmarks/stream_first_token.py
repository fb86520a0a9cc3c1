"""A streamed request's time to its response headers and to its first token while the server streams to others.

The server of ``host_overhead.py`` (the real HTTP process and engine process, the model's forward taken out, so a
step is the host's work alone) streams ``--background`` long requests from a client process of their own, which
keeps that many streams in flight. A second client sends ``--probes`` streamed requests one at a time and times
each: to its response headers, and to its first token. With the model's forward free, what these measure is the
HTTP side's queue and the hops between the processes, the part of a first token's time that no GPU hides (on the
H200 it was two thirds of it under load: docs/server.md, "Where a first token's time goes").

    python benchmarks/stream_first_token.py --background 32 --probes 200 --out stream_first_token.json
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from host_overhead import server_env, tiny_model  # noqa: E402
from load_client import percentile, sse_events  # noqa: E402

from lightllm.common import proc as procs  # noqa: E402
from lightllm.common.net import free_port, wait_healthy  # noqa: E402

PROMPT = 128  # tokens of every request
BACKGROUND_OUTPUT = 3000  # a background stream's tokens: it is re-sent as it ends, so the load never stops


def _body(ids, out_len):
    return {"inputs": ids, "parameters": {"max_new_tokens": out_len, "ignore_eos": True, "logprobs": True}}


def _background(base: str, streams: int, vocab: int, ready) -> None:
    """``streams`` streamed requests in flight until this process is stopped (each re-sent as it ends)."""
    import httpx

    async def one_stream(client, i):
        ids = [(7 * i + j) % (vocab - 1) + 1 for j in range(PROMPT)]
        while True:
            async with client.stream("POST", base + "/generate_stream", json=_body(ids, BACKGROUND_OUTPUT)) as r:
                async for _ in r.aiter_bytes():
                    pass

    async def main():
        limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
        async with httpx.AsyncClient(timeout=procs.HANG_TIMEOUT_S, limits=limits) as client:
            tasks = [asyncio.ensure_future(one_stream(client, i)) for i in range(streams)]
            ready.set()
            await asyncio.gather(*tasks)

    asyncio.run(main())


async def _probes(base: str, n: int, vocab: int, gap_s: float) -> list:
    """``n`` streamed requests one after another: (seconds to the headers, seconds to the first token) each."""
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=procs.HANG_TIMEOUT_S) as client:
        (await client.get(base + "/health")).raise_for_status()  # the connection and the HTTP stack's first use
        for i in range(n):
            ids = [(11 * i + j) % (vocab - 1) + 1 for j in range(PROMPT)]
            t0 = time.perf_counter()
            async with client.stream("POST", base + "/generate_stream", json=_body(ids, 2)) as r:
                headers = time.perf_counter() - t0
                r.raise_for_status()
                first = None
                async for now, _ in sse_events(r):
                    first = now - t0 if first is None else first
            out.append((headers, first))
            await asyncio.sleep(gap_s)
    return out


def measure(model: str, vocab: int, args, env) -> dict:
    port = free_port()
    batch = args.background + 1
    # the forward free (no step time), the server's own HTTP stack
    cmd = [sys.executable, os.path.join(HERE, "host_overhead.py"), "--serve", model, str(port), str(batch), "process",
           "1", "0", "server"]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    with procs.running(cmd, env=env) as proc:
        wait_healthy(proc, base)
        asyncio.run(_probes(base, 4, vocab, 0.0))  # warm the paths once
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Event()
        load = ctx.Process(target=_background, args=(base, args.background, vocab, ready), daemon=True)
        load.start()
        try:
            while not ready.wait(0.1):  # a background client that died before it started is an error, not a wait
                if not load.is_alive():
                    raise RuntimeError(f"the background client exited with code {load.exitcode} before it started")
            time.sleep(args.settle_s)  # every background stream admitted and streaming
            timings = asyncio.run(_probes(base, args.probes, vocab, args.gap_s))
        finally:
            load.terminate()
            load.join()
    headers = [h * 1e3 for h, _ in timings]
    first = [f * 1e3 for _, f in timings if f is not None]
    return {"probes": len(timings), "with_first_token": len(first),
            "headers_ms": {"p50": statistics.median(headers), "mean": statistics.fmean(headers),
                           "p99": percentile(headers, 99)},
            "first_token_ms": {"p50": statistics.median(first), "mean": statistics.fmean(first),
                               "p99": percentile(first, 99)}}  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--background", type=int, default=32, help="streams kept in flight meanwhile (0: none)")
    p.add_argument("--probes", type=int, default=200, help="timed streamed requests, one at a time")
    p.add_argument("--gap-s", type=float, default=0.02, help="pause between two probes")
    p.add_argument("--settle-s", type=float, default=2.0, help="wait after the background load starts")
    p.add_argument("--repeats", type=int, default=1, help="server starts (medians are reported)")
    p.add_argument("--out", default="stream_first_token.json")
    args = p.parse_args()
    for name in ("background", "probes", "repeats"):
        if getattr(args, name) < (0 if name == "background" else 1):
            p.error(f"--{name} expected a {'non-negative' if name == 'background' else 'positive'} count, got "
                    f"{getattr(args, name)}")  # fmt: skip
    procs.exit_on_sigterm()  # stopped from outside: still stop the server and remove the model folder
    runs = []
    with tempfile.TemporaryDirectory() as root:
        model, vocab = tiny_model(root)
        env = server_env()
        for rep in range(args.repeats):
            runs.append({"repeat": rep, **measure(model, vocab, args, env)})
            r = runs[-1]
            print(f"start {rep}: headers p50 {r['headers_ms']['p50']:.2f} mean {r['headers_ms']['mean']:.2f} ms, "
                  f"first token p50 {r['first_token_ms']['p50']:.2f} mean {r['first_token_ms']['mean']:.2f} ms",
                  flush=True)  # fmt: skip
    median = {k: {q: statistics.median(r[k][q] for r in runs) for q in ("p50", "mean", "p99")}
              for k in ("headers_ms", "first_token_ms")}  # fmt: skip
    print(f"\n{args.background} background streams, {args.probes} probes, median of {args.repeats} starts (ms)")
    print(f"{'':14s} {'p50':>7s} {'mean':>7s} {'p99':>7s}")
    for k, label in (("headers_ms", "headers"), ("first_token_ms", "first token")):
        print(f"{label:14s} {median[k]['p50']:7.2f} {median[k]['mean']:7.2f} {median[k]['p99']:7.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                   "background": args.background, "probes": args.probes, "gap_s": args.gap_s, "prompt": PROMPT,
                   "runs": runs, "median": median}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
