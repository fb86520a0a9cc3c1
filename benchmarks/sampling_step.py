"""Cost of one step's sampling with and without penalties / logit bias (``lightllm/engine/logits_processor.py``),
per batch size, at a real vocabulary: the engine's own draw (``Engine._draw``) on ready float32 logits, so the
numbers include the host work per request as well as the device work.

    python benchmarks/sampling_step.py --device cuda --out benchmarks/results/sampling_step_h200.json
"""

import argparse
import json
import platform
import time
from types import SimpleNamespace

import torch

from lightllm.engine.args import EngineArgs
from lightllm.engine.engine import Engine
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams

# Greedy, so that the draw itself (a sort over the vocabulary for top-k / top-p) does not hide what penalties cost.
_PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.05)
CASES = {
    "plain": SamplingParams(max_new_tokens=4096),
    "penalties": SamplingParams(max_new_tokens=4096, **_PENALTIES),
    "penalties+bias+min_tokens": SamplingParams(max_new_tokens=4096, logit_bias={5: -100, 7: 5}, min_tokens=2048,
                                                **_PENALTIES),  # fmt: skip
}


class _Runner:  # what Engine's constructor reads (its scheduler: the engine's own options); the draw needs nothing else
    def __init__(self, vocab, device):
        self.args = EngineArgs(batch_max_tokens=1, max_req_total_len=1)
        self.config = SimpleNamespace(vocab_size=vocab, eos_token_ids=(0,))
        self.device = torch.device(device)


def time_step(engine, reqs, logits, steps, device) -> float:
    engine._draw(reqs, logits)  # first draw: rows handed out, tables made
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine._draw(reqs, logits)  # tolist() inside synchronizes every step, as the engine does
    return (time.perf_counter() - t0) / steps * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vocab", type=int, default=151936)  # Qwen3's
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--prompt_len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--threads", type=int, help="torch intra-op threads (on a busy CPU, 1 avoids thread contention)")
    p.add_argument("--out")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for batch in args.batches:
        logits = torch.randn(batch, args.vocab, device=device) * 3
        row = {"batch": batch}
        for name, params in CASES.items():
            engine = Engine(_Runner(args.vocab, device), eos_ids=[0])
            reqs = [Request(str(i), list(range(i, i + args.prompt_len)), params, lambda ev: None) for i in range(batch)]
            row[name + "_ms"] = round(time_step(engine, reqs, logits, args.steps, device), 3)
        rows.append(row)
        print(" ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    result = {"device": name, "vocab": args.vocab, "prompt_len": args.prompt_len, "steps": args.steps,
              "threads": torch.get_num_threads(), "rows": rows}  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
