"""Time to first token of short Qwen3.5 prefills: the gated delta rule chunked vs token by token, eager vs replayed
from prefill graphs, in one process.

In-process engine (no HTTP), a random-weight Qwen3.5-27B-shaped model of ``--layers`` layers. Per round, each
mode in turn (the order alternates): ``chunked`` (fla-core's chunked kernels for every prefill,
``RECURRENT_MAX_TOKENS`` 0, no prefill graphs), ``recurrent`` (fla-core's fused recurrent kernel when no request
brings more than ``RECURRENT_MAX_TOKENS`` new tokens, no prefill graphs) and ``graphs`` (the default: as
``recurrent``, and one request of at most that many new tokens replays a prefill graph). Each times fresh prompts
of ``--lens`` tokens (the median of ``--sends``) and one ``--prompt``-token prompt sent three times: its third send
reads all but the last token from the prefix cache and prefills one (docs/engine.md, "Prefix cache"). Prints the
medians over the rounds per mode; writes JSON. On a GPU only the modes differ; ``--tiny`` (CPU: the torch
references in every mode, no graphs) checks the method.
``--chunked-graph-max-tokens N`` sets ``linear_attention.CHUNKED_GRAPH_MAX_TOKENS`` (default 512: prefill graphs past
``RECURRENT_MAX_TOKENS`` run fla's chunked kernels) for the run; 0 stops ``graphs`` at ``RECURRENT_MAX_TOKENS``. The
start-up's prefill graphs, their memory and the seconds of each start-up part are printed and kept (``startup``).
``--profile MODE`` then runs ``torch.profiler`` over one more such cache hit in that mode and keeps its host and
device totals and its ``--top`` operators by host time (where a short prefill's time goes).

    python benchmarks/short_prefill.py --out benchmarks/results/short_prefill_h200.json
    python benchmarks/short_prefill.py --rounds 1 --profile chunked --out F
"""

import argparse
import os
import statistics
import sys
import tempfile

import torch

from lightllm.engine.args import EngineArgs
from lightllm.engine.engine import Engine
from lightllm.engine.model_runner import ModelRunner
from lightllm.layers import linear_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_bench import random_model, write_rows  # noqa: E402
from prefix_cache_ttft import time_to_first_token  # noqa: E402

# mode: (RECURRENT_MAX_TOKENS, prefill graphs on)
MODES = {"chunked": (0, False), "recurrent": (linear_attention.RECURRENT_MAX_TOKENS, False),
         "graphs": (linear_attention.RECURRENT_MAX_TOKENS, True)}  # fmt: skip


def set_mode(runner: ModelRunner, captured, mode: str) -> None:
    """``mode``'s kernel choice, and the prefill graphs captured at start-up on or off."""
    cap, graphs = MODES[mode]
    linear_attention.RECURRENT_MAX_TOKENS = cap
    runner.prefill_graphs = captured if graphs else None


def one_round(engine: Engine, fresh, lens, sends: int, prompt: int) -> dict:
    """The current mode's times (ms): fresh prompts of each length, then a repeated prompt's three sends."""
    row = {f"fresh_{n}_ms": statistics.median(time_to_first_token(engine, fresh(n))[0] * 1e3 for _ in range(sends))
           for n in lens}  # fmt: skip
    ids = fresh(prompt)
    repeated = [time_to_first_token(engine, ids) for _ in range(3)]
    row["repeated_ms"] = [t * 1e3 for t, _ in repeated]
    row["repeated_cached_tokens"] = [hit for _, hit in repeated]
    return row


def profile_cache_hit(engine: Engine, fresh, prompt: int, top: int) -> dict:
    """``torch.profiler`` over the third send of a ``prompt``-token prompt (a one-token prefill after a cache hit):
    its host and device totals (ms, self times summed over operators) and the ``top`` operators by host time."""
    ids = fresh(prompt)
    for _ in range(2):
        time_to_first_token(engine, ids)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        seconds, cached = time_to_first_token(engine, ids)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = prof.key_averages()
    ops = sorted(events, key=lambda e: e.cpu_time_total, reverse=True)[:top]
    return {"ttft_ms": seconds * 1e3, "cached_tokens": cached,
            "host_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
            "device_ms": sum(e.self_device_time_total for e in events) / 1e3,
            "top_ops": [{"name": e.key, "calls": e.count, "host_total_ms": e.cpu_time_total / 1e3,
                         "host_self_ms": e.self_cpu_time_total / 1e3, "device_ms": e.device_time_total / 1e3}
                        for e in ops]}  # fmt: skip


def summarize(rounds: list, lens) -> dict:
    """Per mode, the median over its rounds of each fresh length and of the repeated prompt's third send."""
    out = {}
    for mode in MODES:
        mine = [r for r in rounds if r["mode"] == mode]
        out[mode] = {f"fresh_{n}_ms": statistics.median(r[f"fresh_{n}_ms"] for r in mine) for n in lens}
        out[mode]["cache_hit_ms"] = statistics.median(r["repeated_ms"][2] for r in mine)
    return out


def measure(args, p) -> tuple:
    """The rounds, the profile (or None) and the start-up's cost of one engine built for ``args``."""
    longest = max(args.prompt, *args.lens)
    rounds, profile = [], None
    with tempfile.TemporaryDirectory() as root:
        model, common = random_model(root, args.tiny, args.layers, longest + 8, tiny_tokens=4 * (longest + 8),
                                     model="qwen3.5")  # fmt: skip
        runner = ModelRunner(EngineArgs(model_dir=model, running_max_req_size=4, graph_max_batch_size=4,
                                        max_req_total_len=longest + 8, **common))  # fmt: skip
        engine, captured = Engine(runner, eos_ids=[]), runner.prefill_graphs
        if captured is None and not args.tiny:
            p.error("expected prefill graphs captured at start-up (a GPU, bf16)")
        startup = {"seconds": dict(runner.startup_seconds), "prefill_graphs": 0, "prefill_buckets": [],
                   "prefill_graph_mib": 0.0}  # fmt: skip
        if captured is not None:
            startup.update(prefill_graphs=captured.num_graphs, prefill_buckets=list(captured.buckets),
                           prefill_graph_mib=captured.memory_bytes / 2**20)  # fmt: skip
        vocab = runner.config.vocab_size if args.tiny else 512  # the tokenizer's ids; the lm_head is padded
        g = torch.Generator().manual_seed(0)

        def fresh(n):
            return torch.randint(0, vocab, (n,), generator=g).tolist()

        time_to_first_token(engine, fresh(args.prompt))  # warm-up: kernels compiled
        try:
            for i in range(args.rounds):
                for mode in list(MODES)[:: 1 if i % 2 == 0 else -1]:
                    set_mode(runner, captured, mode)
                    rounds.append({"round": i, "mode": mode, **one_round(engine, fresh, args.lens, args.sends,
                                                                         args.prompt)})  # fmt: skip
            if args.profile:
                set_mode(runner, captured, args.profile)
                profile = {"mode": args.profile, **profile_cache_hit(engine, fresh, args.prompt, args.top)}
        finally:
            set_mode(runner, captured, "graphs")
    return rounds, profile, startup


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tiny", action="store_true", help="the built-in tiny Qwen3.5 on the CPU (a check of the method)")
    p.add_argument("--lens", type=int, nargs="+", default=[1, 16, 64, 512])
    p.add_argument(
        "--prompt",
        type=int,
        default=8192,
        help="the repeated prompt's tokens (over 64, so its second send leaves the checkpoint the third reads)",
    )
    p.add_argument("--sends", type=int, default=3, help="fresh prompts timed per length, mode and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", choices=list(MODES), help="profile one more cache hit in this mode")
    p.add_argument("--top", type=int, default=25, help="operators the profile keeps, by host time")
    p.add_argument(
        "--chunked-graph-max-tokens",
        type=int,
        default=linear_attention.CHUNKED_GRAPH_MAX_TOKENS,
        help="linear_attention.CHUNKED_GRAPH_MAX_TOKENS for this run: prefill graphs past RECURRENT_MAX_TOKENS",
    )
    p.add_argument("--out", default="benchmarks/results/short_prefill.json")
    args = p.parse_args(argv)
    if min(args.lens) < 1 or args.prompt < 2 or args.sends < 1 or args.rounds < 1 or args.top < 1:
        p.error("--lens, --sends, --rounds and --top expected positive integers and --prompt at least 2")
    if args.chunked_graph_max_tokens < 0:
        p.error("--chunked-graph-max-tokens expected a non-negative integer")
    previous = linear_attention.CHUNKED_GRAPH_MAX_TOKENS
    linear_attention.CHUNKED_GRAPH_MAX_TOKENS = args.chunked_graph_max_tokens  # read when the graphs are captured
    try:
        rounds, profile, startup = measure(args, p)
    finally:
        linear_attention.CHUNKED_GRAPH_MAX_TOKENS = previous
    summary = summarize(rounds, args.lens)
    print(f"start-up: {startup['prefill_graphs']} prefill graphs (buckets {startup['prefill_buckets']}), "
          f"{startup['prefill_graph_mib']:.1f} MiB; "
          + ", ".join(f"{k} {v:.1f} s" for k, v in startup["seconds"].items()))  # fmt: skip
    print(f"{'mode':>9} " + " ".join(f"{f'{n} tok ms':>10}" for n in args.lens) + f" {'cache hit ms':>12}")
    for mode, s in summary.items():
        print(f"{mode:>9} " + " ".join(f"{s[f'fresh_{n}_ms']:>10.2f}" for n in args.lens)
              + f" {s['cache_hit_ms']:>12.2f}")  # fmt: skip
    if profile:
        print(
            f"profile ({profile['mode']}): a cache hit's first token after {profile['ttft_ms']:.1f} ms, host "
            f"{profile['host_ms']:.1f} ms, device {profile['device_ms']:.1f} ms"
        )
        for op in profile["top_ops"]:
            print(f"  {op['name'][:60]:60} {op['calls']:>5} calls {op['host_total_ms']:>8.3f} ms host "
                  f"{op['device_ms']:>8.3f} ms device")  # fmt: skip
    write_rows(args.out, args, [{"summary": summary, "startup": startup, "rounds": rounds, "profile": profile}])
    return summary, rounds


if __name__ == "__main__":
    main()
