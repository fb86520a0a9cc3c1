"""Serving load: output tokens/s with decode-attention tuning on vs off, per concurrency and prompt length.

Starts the real server (a Qwen3-shaped random-weight model, 8B widths, fewer layers) twice per case:
tuning on (level 1, empty config dir) and off (level 3), sends N requests at a fixed concurrency to
/generate with logprobs, checks every request completed with finite logprobs, and reports output tokens/s
and the server's start-up time.

    python benchmarks/serve_load.py --tp 1 --out benchmarks/results/serve_load_tp1_h200.json
"""

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time

import httpx

WORKLOADS = {"short": (128, 256), "long": (8192, 128)}  # prompt tokens, output tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, tp, level, config_dir, concurrency, max_len):
    port = free_port()
    env = {**os.environ, "LIGHTLLM_TRITON_AUTOTUNE_LEVEL": str(level), "LIGHTLLM_AUTOTUNE_CONFIG_DIR": config_dir}
    cmd = [sys.executable, "-m", "lightllm.server.api_server", "--model_dir", model_dir, "--port", str(port),
           "--tp", str(tp), "--running_max_req_size", str(concurrency), "--graph_max_batch_size", str(concurrency),
           "--max_req_total_len", str(max_len), "--graph_max_len_in_batch", str(max_len),
           "--batch_max_tokens", "16384"]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base, time.perf_counter() - t0
        except httpx.HTTPError:
            time.sleep(0.5)


async def load(base, n, concurrency, prompt_len, out_len, vocab):
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, vocab) for _ in range(prompt_len)] for _ in range(n)]
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(p):
            async with sem:
                body = {"inputs": p, "parameters": {"max_new_tokens": out_len, "ignore_eos": True, "logprobs": True}}
                r = await client.post(base + "/generate", json=body)
                r.raise_for_status()
                return r.json()

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - t0
    tokens = sum(len(r["token_ids"]) for r in results)
    ok = all(len(r["token_ids"]) == out_len and all(math.isfinite(x) for x in r["logprobs"]) for r in results)
    return {"output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "all_complete_finite": ok}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--out", default="benchmarks/results/serve_load.json")
    args = p.parse_args()
    from lightllm.tools.make_tiny_model import make_tiny_qwen3

    rows = []
    with tempfile.TemporaryDirectory() as root:
        model = str(make_tiny_qwen3(os.path.join(root, "model"), padded_vocab_size=151936, hidden_size=4096,
                                    intermediate_size=12288, num_hidden_layers=args.layers, num_attention_heads=32,
                                    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                                    dtype="bfloat16", initializer_range=0.02))  # fmt: skip
        for workload in args.workloads:
            prompt_len, out_len = WORKLOADS[workload]
            for conc in args.concurrency:
                row = {"workload": workload, "concurrency": conc, "tp": args.tp}
                for mode, level in (("on", 1), ("off", 3)):
                    with tempfile.TemporaryDirectory() as cfg:
                        proc, base, startup = start_server(model, args.tp, level, cfg, conc, prompt_len + out_len + 64)
                        try:
                            res = asyncio.run(load(base, args.requests, conc, prompt_len, out_len, 151936))
                        finally:
                            proc.terminate()
                            proc.wait(timeout=60)
                    row[mode] = {**res, "startup_s": startup}
                row["on_vs_off_pct"] = (row["on"]["tokens_per_s"] / row["off"]["tokens_per_s"] - 1) * 100
                rows.append(row)
                print(json.dumps(row), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"tp": args.tp, "layers": args.layers, "rows": rows}, f, indent=1)
    print("\nworkload conc  on tok/s  off tok/s  on vs off  start on/off s  all ok")
    for r in rows:
        on, off = r["on"], r["off"]
        print(f"{r['workload']:8s} {r['concurrency']:4d} {on['tokens_per_s']:9.0f} {off['tokens_per_s']:10.0f} "
              f"{r['on_vs_off_pct']:+9.1f}% {on['startup_s']:6.1f}/{off['startup_s']:5.1f} "
              f"{on['all_complete_finite'] and off['all_complete_finite']}")  # fmt: skip


if __name__ == "__main__":
    main()
