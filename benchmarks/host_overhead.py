"""The server's host cost per decode step, with the model taken out: the real server (scheduler, KV
bookkeeping, sampling, events, detokenization, HTTP) over a runner whose forward returns ready logits at
once (a small vocabulary, so sampling is cheap too). What is left is what a GPU step cannot hide when the
GPU work is short: short prompts, small models, large batches.

    python benchmarks/host_overhead.py --repeats 2 --out host_overhead.json
"""

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from serve_load import load  # noqa: E402

from lightllm.common import proc as procs  # noqa: E402
from lightllm.common.net import free_port, wait_healthy  # noqa: E402


def serve(model_dir: str, port: int, batch: int) -> None:
    """A server whose model forward is free: every other part of a step runs as in production."""
    import torch
    import uvicorn
    from transformers import AutoTokenizer

    from lightllm.engine.args import EngineArgs
    from lightllm.engine.model_runner import ModelRunner
    from lightllm.server.api_server import Server

    args = EngineArgs(model_dir=model_dir, data_type="fp32", device="cpu", running_max_req_size=batch,
                      max_req_total_len=1024, batch_max_tokens=8192, max_total_token_num=batch * 1024 + 64)  # fmt: skip
    runner = ModelRunner(args)
    logits = torch.randn(max(batch, 8192), runner.config.vocab_size)
    runner.model.forward = lambda ids, state, *rest: logits[: state.b_seq_len.shape[0]]
    server = Server(runner, AutoTokenizer.from_pretrained(model_dir), model_name="host-overhead")
    uvicorn.run(server.app, host="127.0.0.1", port=port, log_level="warning")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="server starts (medians are reported)")
    p.add_argument("--out", default="host_overhead.json")
    p.add_argument("--serve", nargs=3, metavar=("MODEL_DIR", "PORT", "BATCH"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        return serve(args.serve[0], int(args.serve[1]), int(args.serve[2]))
    procs.exit_on_sigterm()  # stopped from outside: still stop the server and remove the model folder
    from lightllm.tools.make_tiny_model import make_tiny_qwen3

    runs = []
    with tempfile.TemporaryDirectory() as root:
        model = str(make_tiny_qwen3(os.path.join(root, "m")))
        with open(os.path.join(model, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
        for rep in range(args.repeats):
            port = free_port()
            cmd = [sys.executable, __file__, "--serve", model, str(port), str(max(args.concurrency))]
            base = f"http://127.0.0.1:{port}"
            with procs.running(cmd, env=env) as proc:
                wait_healthy(proc, base)
                asyncio.run(load(base, 8, 8, args.prompt, 8, vocab))  # warm the paths once
                for conc in args.concurrency:
                    res = asyncio.run(load(base, args.requests, conc, args.prompt, args.output, vocab))
                    runs.append({"repeat": rep, "concurrency": conc, **res})
    median = [{"concurrency": c, **{k: statistics.median(r[k] for r in runs if r["concurrency"] == c)
                                    for k in ("tokens_per_s", "decode_step_ms", "decode_batch")}}
              for c in args.concurrency]  # fmt: skip
    print(f"median of {args.repeats} server starts")
    print(f"{'conc':>5} {'tok/s':>8} {'decode step ms':>15} {'decode batch':>13} {'all ok':>7}")
    for m in median:
        ok = all(r["all_complete_finite"] for r in runs if r["concurrency"] == m["concurrency"])
        print(f"{m['concurrency']:5d} {m['tokens_per_s']:8.0f} {m['decode_step_ms']:15.3f} {m['decode_batch']:13.1f} "
              f"{str(ok):>7}")  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                   "prompt": args.prompt, "output": args.output, "repeats": args.repeats, "runs": runs,
                   "median": median}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
