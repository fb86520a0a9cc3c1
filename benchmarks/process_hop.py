"""Where incremental detokenization runs: on the HTTP process (as now) or in a process of its own. A process of
its own does the same decoding work and adds one more hop per step: the step's tokens pickled and sent to it,
and its text deltas pickled and sent on to HTTP. This measures, per step of ``--batch`` requests, that hop
(the engine's real step message over a ``multiprocessing`` pipe: sender CPU, receiver CPU, one-way latency)
beside the detokenization itself (``IncrementalDetokenizer`` over the built-in tokenizer).

    python benchmarks/process_hop.py --batch 64 --out benchmarks/results/process_hop_cpu.json
"""

import argparse
import json
import multiprocessing as mp
import os
import pickle
import platform
import random
import statistics
import time


def _echo(conn) -> None:
    """The far side: receive a step message, answer with a one-byte ack (for the round trip)."""
    while True:
        message = conn.recv()
        if message is None:
            return
        conn.send_bytes(b"k")


def step_message(batch: int, rng: random.Random) -> tuple:
    """What the engine process sends per decode step (engine_proc._EngineSide._send_step): the step's tokens as one
    record of columns, its token latencies in one ``on_tokens`` call."""
    tokens = ("tokens", [f"{i:032x}" for i in range(batch)], [rng.randrange(50000) for _ in range(batch)],
              [-rng.random() for _ in range(batch)], None, [0] * batch)  # fmt: skip
    calls = [("on_tokens", ([], [0.01] * batch)), ("on_step", ("decode", batch, 0.001))]
    return ("step", [tokens], calls)


def hop_us(batch: int, steps: int) -> dict:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(there,), daemon=True)
    proc.start()
    rng = random.Random(0)
    messages = [step_message(batch, rng) for _ in range(steps)]
    send, rtt = [], []
    try:
        for message in messages:
            t0 = time.perf_counter()
            here.send(message)
            t1 = time.perf_counter()
            here.recv_bytes()
            send.append(t1 - t0)
            rtt.append(time.perf_counter() - t0)
    finally:
        here.send(None)
        proc.join()
    blobs = [pickle.dumps(m) for m in messages]
    t0 = time.perf_counter()
    for b in blobs:
        pickle.loads(b)
    receive = (time.perf_counter() - t0) / len(blobs)
    return {"send_us": statistics.median(send) * 1e6, "receive_unpickle_us": receive * 1e6,
            "one_way_latency_us": statistics.median(rtt) / 2 * 1e6, "bytes": len(blobs[0])}  # fmt: skip


def detokenize_us(batch: int, steps: int) -> float:
    """Per step: ``batch`` requests each adding one token to its IncrementalDetokenizer."""
    from transformers import AutoTokenizer

    from lightllm.engine.detokenize import IncrementalDetokenizer
    from lightllm.tools.make_tiny_model import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    rng = random.Random(0)
    vocab = tokenizer.vocab_size
    streams = [IncrementalDetokenizer(tokenizer) for _ in range(batch)]
    ids = [[rng.randrange(vocab) for _ in range(steps)] for _ in range(batch)]
    t0 = time.perf_counter()
    for step in range(steps):
        for s, row in zip(streams, ids):
            s.add(row[step])
    return (time.perf_counter() - t0) / steps * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--out", default="process_hop.json")
    args = p.parse_args()
    hop = hop_us(args.batch, args.steps)
    detok = detokenize_us(args.batch, min(args.steps, 256))
    print(f"per step of {args.batch} requests: detokenization {detok:.0f} us; one more process hop: send "
          f"{hop['send_us']:.0f} us + receive {hop['receive_unpickle_us']:.0f} us of CPU ({hop['bytes']} bytes), "
          f"{hop['one_way_latency_us']:.0f} us one-way latency")  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                   "batch": args.batch, "detokenize_us_per_step": detok, "hop": hop}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
