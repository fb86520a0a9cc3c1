"""The server's host cost per decode step, with the model taken out: the real server (scheduler, KV
bookkeeping, sampling, events, detokenization, HTTP) over a runner whose forward returns ready logits at
once (a small vocabulary, so sampling is cheap too). What is left is what a GPU step cannot hide when the
GPU work is short: short prompts, small models, large batches.

    python benchmarks/host_overhead.py --repeats 2 --out host_overhead.json
    python benchmarks/host_overhead.py --layout thread   # the engine on a thread of the HTTP process (before)
    # the HTTP process's CPU per streamed token at a GPU's pace (a 1.2 ms step: one token per stream per wake-up),
    # the server's HTTP stack (httptools on uvloop) against uvicorn's h11 on asyncio (before), in turns
    python benchmarks/host_overhead.py --stream --step-ms 1.2 --concurrency 16 --output 256 --http server h11 \
        --repeats 3 --out benchmarks/results/host_overhead_http_stack_cpu.json
    # the same through OpenAI's /v1/completions (benchmarks/results/host_overhead_stream_cost_cpu.json has both routes)
    python benchmarks/host_overhead.py --stream --step-ms 1.2 --concurrency 16 --output 256 --api completions \
        --repeats 3

Besides the engine's own step time (``lightllm_step_seconds``: forward, sampling and emitting the tokens of one
step) it reports the CPU time each process spent per step over the load (from /proc: every thread, the messages
between the processes included), which a busy machine does not inflate as it inflates wall-clock time, and the HTTP
process's per output token.
"""

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from load_client import load  # noqa: E402

from lightllm.common import proc as procs  # noqa: E402
from lightllm.common.net import free_port, wait_healthy  # noqa: E402

MAX_LEN = 4096  # max_req_total_len: prompt + output must stay below it


def free_forward_runner(model_dir: str, batch: int, torch_threads: int = 1, step_s: float = 0.0):
    """A ModelRunner whose model forward is free: every other part of a step runs as in production. Its process
    runs torch with ``torch_threads`` intra-op threads (0: torch's default): 1 is what the engine process uses on
    a GPU, where no math runs on the host. ``step_s`` > 0: the forward sleeps that long first, as the host waits on
    a GPU step (the GIL released), so the HTTP process gets each stream's tokens one step apart, as in serving."""
    import torch

    if torch_threads:
        torch.set_num_threads(torch_threads)

    from lightllm.engine.args import EngineArgs
    from lightllm.engine.model_runner import ModelRunner

    args = EngineArgs(model_dir=model_dir, data_type="fp32", device="cpu", running_max_req_size=batch,
                      max_req_total_len=MAX_LEN, batch_max_tokens=8192,
                      max_total_token_num=batch * MAX_LEN + 64)  # fmt: skip
    runner = ModelRunner(args)
    logits = torch.randn(max(batch, 8192), runner.config.vocab_size)

    def forward(ids, state, *rest):
        if step_s > 0:
            time.sleep(step_s)
        return logits[: state.b_seq_len.shape[0]]

    runner.model.forward = forward
    return runner


def serve(model_dir: str, port: int, batch: int, layout: str, torch_threads: int, step_s: float, http: str) -> None:
    """The server over ``free_forward_runner``: the engine in its own process (the server's layout) or on a thread
    of the HTTP process (``thread``: the layout before the split, kept for tests). ``http``: "server", the server's
    own HTTP stack (``serving``: httptools on uvloop, with its read deadline), or "h11", uvicorn's h11 on asyncio's
    loop (the server's stack before 2026-12-06)."""
    import functools

    import uvicorn
    from transformers import AutoTokenizer

    from lightllm.server.http_server import Server
    from lightllm.server.engine_proc import EngineProcess
    from lightllm.server.serving import http_stack

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if layout == "thread":
        engine = free_forward_runner(model_dir, batch, torch_threads, step_s)
    else:
        engine = EngineProcess(
            functools.partial(free_forward_runner, model_dir, batch, torch_threads, step_s), tokenizer.eos_token_id
        )
        engine.wait_ready()
    stack = http_stack(read_timeout_s=30.0) if http == "server" else {"http": "h11", "loop": "asyncio"}
    try:
        server = Server(engine, tokenizer, model_name="host-overhead")
        uvicorn.run(server.app, host="127.0.0.1", port=port, log_level="warning", **stack)
    finally:
        if layout != "thread":
            engine.stop()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[16, 64],
        help="the engine's batch (running_max_req_size); clients keep twice as many requests in flight",
    )
    p.add_argument("--requests", type=int, default=None, help="per batch (default 4 x the batch)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument(
        "--output",
        type=int,
        default=3072,
        help="long enough that the clients' ramp-up is a small part of a request's life",
    )
    p.add_argument("--repeats", type=int, default=2, help="server starts per batch (medians are reported)")
    p.add_argument(
        "--layout",
        choices=["process", "thread"],
        default="process",
        help="the engine in its own process (the server's), or on a thread of the HTTP process (before)",
    )
    p.add_argument("--out", default="host_overhead.json")
    p.add_argument(
        "--stream",
        action="store_true",
        help="/generate_stream (an event per token, as serve_load sends) instead of /generate (one answer each)",
    )
    p.add_argument(
        "--api",
        choices=["native", "completions"],
        default="native",
        help="the route: LightLLM's /generate(_stream) with logprobs, or OpenAI's /v1/completions (the prompt's token "
        "ids, no logprobs), the path OpenAI clients stream through",
    )
    p.add_argument(
        "--torch_threads",
        type=int,
        default=1,
        help="torch intra-op threads of the engine's process (0: torch's default, the server's before)",
    )
    p.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="each forward sleeps this long first, as a GPU step holds the host (0: steps back to back, so the HTTP "
        "process gets several of a stream's tokens per wake-up whenever it falls behind)",
    )
    p.add_argument(
        "--http",
        nargs="+",
        choices=["server", "h11"],
        default=["server"],
        help="the HTTP stack: the server's (httptools on uvloop) and/or uvicorn's h11 on asyncio (the stack before); "
        "with both, each repeat serves with each in turn",
    )
    p.add_argument("--serve", nargs=7, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        model_dir, port, batch, layout, threads, step_ms, http = args.serve
        return serve(model_dir, int(port), int(batch), layout, int(threads), float(step_ms) / 1e3, http)
    procs.exit_on_sigterm()  # stopped from outside: still stop the server and remove the model folder
    runs = []
    with tempfile.TemporaryDirectory() as root:
        model, vocab = tiny_model(root)
        env = server_env()
        for rep in range(args.repeats):
            for conc in args.concurrency:
                for http in args.http:  # in turn within a repeat: a drift of the machine reaches every stack alike
                    res = measure(model, vocab, conc, args, env, http)
                    runs.append({"repeat": rep, "concurrency": conc, "http": http, "layout": args.layout,
                                 "torch_threads": args.torch_threads, "stream": args.stream, "api": args.api,
                                 **res})  # fmt: skip
    keys = (
        "tokens_per_s",
        "decode_step_ms",
        "decode_batch",
        "engine_cpu_ms_per_step",
        "http_cpu_ms_per_step",
        "engine_cpu_ms_per_request",
        "http_cpu_ms_per_request",
        "http_cpu_us_per_token",
    )
    median = [{"concurrency": c, "http": h, **{k: statistics.median(r[k] for r in runs
                                                                    if (r["concurrency"], r["http"]) == (c, h))
                                               for k in keys}}
              for c in args.concurrency for h in args.http]  # fmt: skip
    print(
        f"median of {args.repeats} server starts, layout {args.layout}, torch threads {args.torch_threads}, "
        f"{'/v1/completions' if args.api == 'completions' else '/generate_stream' if args.stream else '/generate'}; "
        "CPU per step (all steps of the load): the engine's process"
        + (" (= the server's: one process)" if args.layout == "thread" else "")
        + ", HTTP's"
    )
    print(f"{'conc':>5} {'http':>6} {'tok/s':>8} {'decode step ms':>15} {'decode batch':>13} {'engine CPU ms':>14} "
          f"{'HTTP CPU ms':>12} {'per request: engine':>20} {'HTTP':>6} {'HTTP us/token':>14} "
          f"{'all ok':>7}")  # fmt: skip
    for m in median:
        ok = all(
            r["all_complete_finite"] for r in runs if (r["concurrency"], r["http"]) == (m["concurrency"], m["http"])
        )
        print(f"{m['concurrency']:5d} {m['http']:>6} {m['tokens_per_s']:8.0f} {m['decode_step_ms']:15.3f} "
              f"{m['decode_batch']:13.1f} {m['engine_cpu_ms_per_step']:14.3f} {m['http_cpu_ms_per_step']:12.3f} "
              f"{m['engine_cpu_ms_per_request']:20.3f} {m['http_cpu_ms_per_request']:6.3f} "
              f"{m['http_cpu_us_per_token']:14.1f} {str(ok):>7}")  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                   "layout": args.layout, "torch_threads": args.torch_threads, "stream": args.stream,
                   "api": args.api, "step_ms": args.step_ms, "http": args.http,
                   "prompt": args.prompt, "output": args.output, "repeats": args.repeats, "runs": runs,
                   "median": median}, f, indent=1)  # fmt: skip


def tiny_model(root: str):
    """(folder, vocabulary size) of the built-in tiny Qwen3 model, made under ``root``."""
    from lightllm.tools.make_tiny_model import make_tiny_qwen3

    model = str(make_tiny_qwen3(os.path.join(root, "m")))
    with open(os.path.join(model, "config.json")) as f:
        return model, json.load(f)["vocab_size"]


def server_env() -> dict:
    """This environment with the repository first on PYTHONPATH: the server runs the checkout these scripts are in."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}


def measure(model: str, vocab: int, batch: int, args, env, http: str = "server") -> dict:
    """One server whose engine runs at most ``batch`` requests, under twice as many clients: a queue always waits
    to be admitted, so the engine's batch stays at ``batch`` however fast clients come back with the next request."""
    port = free_port()
    cmd = [sys.executable, __file__, "--serve", model, str(port), str(batch), args.layout, str(args.torch_threads),
           str(args.step_ms), http]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    with procs.running(cmd, env=env) as proc:
        wait_healthy(proc, base)
        engine = engine_pid(proc.pid) if args.layout == "process" else proc.pid
        asyncio.run(load(base, 8, 8, args.prompt, 8, vocab, stream=args.stream, api=args.api))  # warm the paths once
        cpu = (cpu_seconds(engine), cpu_seconds(proc.pid))
        n = args.requests or 4 * batch
        res = asyncio.run(load(base, n, 2 * batch, args.prompt, args.output, vocab, stream=args.stream, api=args.api))
        steps = res["prefill_steps"] + res["decode_steps"]
        engine_cpu, http_cpu = cpu_seconds(engine) - cpu[0], cpu_seconds(proc.pid) - cpu[1]
    # per request as well: with short outputs (--output 2) admission, prefill and the HTTP request dominate
    return {
        **res,
        "engine_cpu_ms_per_step": engine_cpu / steps * 1e3,
        "http_cpu_ms_per_step": http_cpu / steps * 1e3,
        "engine_cpu_ms_per_request": engine_cpu / n * 1e3,
        "http_cpu_ms_per_request": http_cpu / n * 1e3,
        "http_cpu_us_per_token": http_cpu / res["output_tokens"] * 1e6,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_pid(server: int) -> int:
    """The engine process: the server's spawned child (not multiprocessing's resource tracker)."""
    for pid in procs._tree(server):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return pid
    raise RuntimeError(f"no engine process under the server (pid {server})")


if __name__ == "__main__":
    main()
