"""Inter-token latency of running streams while a long prompt prefills: chunked prefill on (per chunk size) vs off.

In-process engine (the server's scheduler and runner, no HTTP), a Qwen3-shaped random-weight model (8B widths,
``--layers`` layers). Per mode: ``--streams`` requests with short prompts decode until warm, their inter-token
gaps over ``--baseline`` more tokens are the unloaded reference; then one ``--prompt``-token request arrives and
every stream's gaps are recorded until that request's first token. Reports per mode the unloaded median, the
loaded p50/p99/max gap, p99 / unloaded median (issue 19's target: <= 3 with chunking), the long prompt's time to
first token and how many prefill steps it took. Writes JSON with every gap.

    python benchmarks/chunked_prefill_itl.py --out benchmarks/results/chunked_prefill_itl_h200.json
    python benchmarks/chunked_prefill_itl.py --tiny --out /tmp/itl.json   # the method on a CPU

``--mixed`` runs every chunk size a second time with ``enable_mixed_chunk`` (the chunk and the streams' tokens in one
forward); ``--no-off`` leaves out the unchunked run; ``--prefill-backends triton fa3`` runs every mode per prefill
attention backend (``--llm_prefill_att_backend``; FA3 without paged KV takes the slots layout).
"""

import argparse
import itertools
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
from engine_bench import random_model, write_rows  # noqa: E402


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(engine: Engine, streams: int, prompt: int, warmup: int, baseline: int, vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    times = {i: [] for i in range(streams)}
    first = []
    for i in range(streams):
        ids = torch.randint(0, vocab, (16,), generator=g).tolist()
        params = SamplingParams(max_new_tokens=1 << 30, ignore_eos=True)
        engine.submit(Request(f"s{i}", ids, params, lambda ev, i=i: ev.kind == "token" and times[i].append(
            time.perf_counter())))  # fmt: skip
    while min(len(t) for t in times.values()) < warmup + baseline:
        engine.step()
    unloaded = [b - a for t in times.values() for a, b in zip(t[warmup:-1], t[warmup + 1 :])]
    marks = {i: len(t) for i, t in times.items()}
    long_ids = torch.randint(0, vocab, (prompt,), generator=g).tolist()
    t0 = time.perf_counter()
    engine.submit(Request("long", long_ids, SamplingParams(max_new_tokens=1, ignore_eos=True),
                          lambda ev: ev.kind == "token" and first.append(time.perf_counter())))  # fmt: skip
    prefill_steps = 0
    while not first:
        engine.step()
        prefill_steps += engine.scheduler.last_step in ("prefill", "mixed")
    ends = {i: len(t) + 1 for i, t in times.items()}  # through each stream's first token after the long one's
    while any(len(t) < ends[i] for i, t in times.items()):
        engine.step()
    loaded = [b - a for i, t in times.items() for a, b in zip(t[marks[i] - 1 : ends[i] - 1], t[marks[i] : ends[i]])]
    engine.abort_all()
    while engine.has_unfinished():
        engine.step()
    median = statistics.median(unloaded)
    return {
        "unloaded_median_ms": median * 1e3,
        "loaded_p50_ms": percentile(loaded, 0.5) * 1e3,
        "loaded_p99_ms": percentile(loaded, 0.99) * 1e3,
        "loaded_max_ms": max(loaded) * 1e3,
        "p99_over_unloaded_median": percentile(loaded, 0.99) / median,
        "long_ttft_s": first[0] - t0,
        "prefill_steps": prefill_steps,
        "loaded_tokens": len(loaded),
        "unloaded_gaps_ms": [x * 1e3 for x in unloaded],
        "loaded_gaps_ms": [x * 1e3 for x in loaded],
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32768)
    p.add_argument("--chunks", type=int, nargs="+", default=[4096, 2048], help="chunk sizes; 'off' is always run")
    p.add_argument("--warmup", type=int, default=8, help="tokens per stream before the unloaded gaps count")
    p.add_argument("--baseline", type=int, default=32, help="tokens per stream of unloaded gaps")
    p.add_argument("--out", default="benchmarks/results/chunked_prefill_itl.json")
    p.add_argument("--tiny", action="store_true", help="the built-in tiny model on the CPU (a check of the method)")
    p.add_argument("--mixed", action="store_true", help="also run each chunk size with --enable_mixed_chunk")
    p.add_argument("--no-off", action="store_true", help="leave out the unchunked run")
    p.add_argument("--prefill-backends", nargs="+", default=["triton"], choices=["triton", "fa3"],
                   help="run every mode with each --llm_prefill_att_backend")  # fmt: skip
    args = p.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory() as root:
        model, common = random_model(root, args.tiny, args.layers, args.prompt + 64,
                                     tiny_tokens=args.prompt + 64 * (args.streams + 2))  # fmt: skip
        modes = [(c, False) for c in args.chunks] + [(c, True) for c in args.chunks if args.mixed]
        modes += [] if args.no_off else [(None, False)]
        for backend, (chunk, mixed) in itertools.product(args.prefill_backends, modes):
            engine_args = EngineArgs(model_dir=model, running_max_req_size=args.streams + 1,
                                     graph_max_batch_size=args.streams, max_req_total_len=args.prompt + 64,
                                     chunked_prefill_size=chunk or 4096, disable_chunked_prefill=chunk is None,
                                     enable_mixed_chunk=mixed, llm_prefill_att_backend=backend, **common)  # fmt: skip
            runner = ModelRunner(engine_args)
            vocab = runner.config.vocab_size if args.tiny else 512  # the tokenizer's ids; the lm_head is padded
            mode = (f"chunk {chunk}" + (" mixed" if mixed else "")) if chunk else "off"
            mode += f" {backend}" if len(args.prefill_backends) > 1 else ""
            row = {"mode": mode, "chunked_prefill_size": chunk, "mixed": mixed, "prefill_backend": backend}
            row.update(measure(Engine(runner, eos_ids=[]), args.streams, args.prompt, args.warmup, args.baseline,
                               vocab, seed=0))  # fmt: skip
            rows.append(row)
            print(f"{row['mode']:>24}: unloaded median {row['unloaded_median_ms']:.2f} ms, loaded p50 "
                  f"{row['loaded_p50_ms']:.2f} p99 {row['loaded_p99_ms']:.2f} max {row['loaded_max_ms']:.2f} ms "
                  f"(p99 / unloaded median {row['p99_over_unloaded_median']:.1f}), long TTFT "
                  f"{row['long_ttft_s']:.2f} s in {row['prefill_steps']} prefill steps", flush=True)  # fmt: skip
            del runner
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    write_rows(args.out, args, rows)
    return rows


if __name__ == "__main__":
    main()
