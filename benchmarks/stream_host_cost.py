"""The HTTP process's per-token costs of a stream, one at a time, on the built-in tiny model's tokenizer (CPU):

- decoding a few ids through transformers' ``decode`` against the Rust backend directly (``detokenize.decoder``);
- a ``/generate_stream`` token event as dicts through ``json.dumps`` against ``http_server._token_event``;
- incremental detokenization per token for streams that hold text back (random ids of a 151936-id model over the
  512-id tokenizer, as the benchmarks' random-weight models emit; one stray byte repeated; a skipped special token
  repeated), with the held-back window bounded (now) and unbounded (``MAX_HELD_TOKENS`` set out of reach: the
  code before).

    python benchmarks/stream_host_cost.py --out benchmarks/results/stream_host_cost_cpu.json
"""

import argparse
import json
import os
import platform
import random
import tempfile
import time


def per_call_us(fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def detok_us_per_token(tokenizer, ids, bounded):
    from lightllm.engine import detokenize

    held = detokenize.MAX_HELD_TOKENS
    detokenize.MAX_HELD_TOKENS = held if bounded else 10**9
    try:
        d = detokenize.IncrementalDetokenizer(tokenizer)
        t0 = time.perf_counter()
        for t in ids:
            d.add(t)
        d.finish()
        return (time.perf_counter() - t0) / len(ids) * 1e6
    finally:
        detokenize.MAX_HELD_TOKENS = held


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=100000)
    p.add_argument("--out", default="stream_host_cost.json")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from lightllm.engine.detokenize import decoder
    from lightllm.server.http_server import _token_event
    from lightllm.tools.make_tiny_model import make_tiny_qwen3

    with tempfile.TemporaryDirectory() as root:
        tokenizer = AutoTokenizer.from_pretrained(make_tiny_qwen3(os.path.join(root, "m")))
    ids = [100, 200]
    direct = decoder(tokenizer, True)
    rows = {
        "decode_transformers_us": per_call_us(lambda: tokenizer.decode(ids, skip_special_tokens=True), args.calls),
        "decode_direct_us": per_call_us(lambda: direct(ids), args.calls),
    }

    def as_dicts():
        token = {"id": 5, "text": "ab", "logprob": -1.2345, "special": False}
        token.update(count_output_tokens=10, prompt_tokens=128)
        event = {"token": token, "generated_text": None, "finished": False, "finish_reason": None, "details": None}
        return f"data: {json.dumps(event)}\n\n"

    rows["event_json_dumps_us"] = per_call_us(as_dicts, args.calls)
    rows["event_direct_us"] = per_call_us(lambda: _token_event(5, "ab", -1.2345, False, 10, 128), args.calls)
    rng = random.Random(0)
    stray = next(i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd")
    streams = {"random ids of a 151936-id model": lambda n: [rng.randrange(151936) for _ in range(n)],
               "one stray byte repeated": lambda n: [stray] * n,
               "a skipped special token repeated": lambda n: [tokenizer.all_special_ids[0]] * n}  # fmt: skip
    detok = []
    for name, make in streams.items():
        for n in (256, 3072):
            seq = make(n)
            detok.append({"stream": name, "tokens": n, "bounded_us": detok_us_per_token(tokenizer, seq, True),
                          "unbounded_us": detok_us_per_token(tokenizer, seq, False)})  # fmt: skip
    print(f"{'per call':36s} {'us':>8s}")
    for k, v in rows.items():
        print(f"{k:36s} {v:8.2f}")
    print(f"\n{'detokenization per token (us)':36s} {'tokens':>6s} {'bounded':>8s} {'unbounded':>10s}")
    for r in detok:
        print(f"{r['stream']:36s} {r['tokens']:6d} {r['bounded_us']:8.2f} {r['unbounded_us']:10.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": platform.machine(), "python": platform.python_version(), "calls": args.calls,
                   **rows, "detokenize": detok}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
