"""Time to first token of ``n`` samples of one prompt submitted together, with the prefix cache on and off.

In-process engine (the server's scheduler and runner, no HTTP), a random-weight model of ``--layers`` layers:
Qwen3-8B-shaped, or Qwen3.5-27B-shaped with ``--model qwen3.5`` (``--mtp_step N``: with its MTP head). Per mode:
one unrelated ``--prompt``-token request first (warm-up), then ``--repeats`` times ``--samples`` requests of one
fresh ``--prompt``-token prompt submitted at once (as the server submits ``n``), each for one token. With the cache
the first is prefilled and the others wait for it and read the prompt (docs/engine.md, "Prefix cache"); without it
every sample computes the prompt. Reports the median time from the submit to the last sample's first token, the
prompt tokens the prefills computed per round, and what the samples read from the cache. Writes JSON.

    python benchmarks/parallel_samples.py --samples 8 --out benchmarks/results/parallel_samples_h200.json
    python benchmarks/parallel_samples.py --tiny --prompt 1024 --out /tmp/samples.json   # the method on a CPU
"""

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

import torch

from lightllm.engine.args import EngineArgs
from lightllm.engine.engine import Engine
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_bench import add_model_args, mtp_options, random_model, write_rows  # noqa: E402


def one_round(engine: Engine, prompts, computed: list) -> tuple:
    """(seconds from submit to the last first token, prompt tokens the prefills computed, per request what it
    read from the cache) of ``prompts`` submitted at once, one token each."""
    firsts, cached = {}, {}

    def emitter(i):
        def emit(ev):
            if ev.kind == "token" and i not in firsts:
                firsts[i], cached[i] = time.perf_counter(), ev.cached_tokens

        return emit

    before = sum(computed)
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.submit(Request(f"s{time.perf_counter_ns()}-{i}", ids, SamplingParams(max_new_tokens=1, ignore_eos=True),
                              emitter(i)))  # fmt: skip
    while engine.has_unfinished():
        engine.step()
    return max(firsts.values()) - t0, sum(computed) - before, [cached[i] for i in range(len(prompts))]


def run_mode(args, model: str, common: dict, mtp: dict, cache: bool) -> dict:
    """One mode's engine, warm-up and rounds; its row. Everything that holds the runner is local here, so it is
    freed when this returns (the second mode's KV sizing reads the free memory)."""
    engine_args = EngineArgs(model_dir=model, running_max_req_size=args.samples, max_req_total_len=args.prompt + 8,
                             graph_max_batch_size=args.samples, disable_dynamic_prompt_cache=not cache, **common,
                             **mtp)  # fmt: skip
    runner = ModelRunner(engine_args)
    computed, prefill = [], runner.prefill

    def counted(slots, prompts, *rest):
        computed.append(sum(len(q) for q in prompts))
        return prefill(slots, prompts, *rest)

    runner.prefill = counted
    engine = Engine(runner, eos_ids=[])
    vocab = runner.config.vocab_size if args.tiny else 512  # the tokenizer's ids; the lm_head is padded
    g = torch.Generator().manual_seed(0)
    one_round(engine, [torch.randint(0, vocab, (args.prompt,), generator=g).tolist()], computed)  # warm-up
    times, tokens, reads = [], [], []
    for _ in range(args.repeats):
        prompt = torch.randint(0, vocab, (args.prompt,), generator=g).tolist()
        t, n, hits = one_round(engine, [prompt] * args.samples, computed)
        times.append(t)
        tokens.append(n)
        reads.append(hits)
    row = {"mode": "cache on" if cache else "cache off", "model": args.model, "mtp_step": args.mtp_step,
           "prompt": args.prompt, "samples": args.samples, "last_first_token_ms": statistics.median(times) * 1e3,
           "rounds_ms": [t * 1e3 for t in times], "computed_tokens": tokens, "cached_tokens": reads}  # fmt: skip
    print(f"{row['mode']:>9}: {args.samples} samples of a {args.prompt}-token prompt, last first token "
          f"{row['last_first_token_ms']:.1f} ms, prompt tokens computed {tokens[0]}", flush=True)  # fmt: skip
    runner.prefill = prefill  # the counting wrapper refers to the runner: a cycle to break before returning
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/parallel_samples.json")
    args = p.parse_args(argv)
    if args.samples < 2 or args.prompt < 2:
        p.error(f"--samples and --prompt expected at least 2, got {args.samples} and {args.prompt}")
    mtp = mtp_options(p, args)

    rows = []
    with tempfile.TemporaryDirectory() as root:
        model, common = random_model(root, args.tiny, args.layers, args.prompt + 8,
                                     tiny_tokens=(args.samples + 2) * (args.prompt + 8), model=args.model,
                                     mtp=bool(mtp))  # fmt: skip
        for cache in (True, False):
            rows.append(run_mode(args, model, common, mtp, cache))
            gc.collect()  # the runner and its KV pool go before the next mode sizes its own from the free memory
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    on, off = rows
    print(
        f"cache on / off: {on['last_first_token_ms'] / off['last_first_token_ms']:.3f}x the time, "
        f"{on['computed_tokens'][0] / off['computed_tokens'][0]:.3f}x the prompt tokens computed"
    )
    write_rows(args.out, args, rows)
    return rows


if __name__ == "__main__":
    main()
