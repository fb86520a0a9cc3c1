"""Overlapped against synchronous decode, in one process on one engine: ``Engine.overlap`` is switched between
rounds (the order alternating), every round the same prompts. Per batch size and mode: output tokens per second of
the decode steps, the median decode step (time between two steps' reads, as the engine reports it), the median GPU
time of a step (the engine's step GPU timer, every 8th step) and what of the step the GPU did not cover; and whether
greedy outputs were identical in both modes.

    python benchmarks/overlap_decode.py --layers 4 --batches 1 16 64 --out benchmarks/results/overlap_decode_h200.json
    python benchmarks/overlap_decode.py --tiny --batches 2 4 --output 16 --rounds 2   # CPU smoke run
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

from lightllm.engine.args import EngineArgs
from lightllm.engine.engine import Engine
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_bench import random_model, write_rows  # noqa: E402


class StepTimes:
    """The engine's observer: decode step seconds and GPU seconds as it reports them."""

    def __init__(self):
        self.steps, self.gpu = [], []

    def on_queues(self, waiting, running, kv_usage): ...

    def on_token(self, first, seconds): ...

    def on_step(self, kind, batch_size, seconds):
        if kind == "decode":
            self.steps.append(seconds)

    def on_spec(self, drafts, accepted): ...

    def on_step_gpu(self, kind, seconds):
        if kind == "decode":
            self.gpu.append(seconds)


def one_round(engine: Engine, prompts, output: int) -> tuple:
    """(seconds from the first decode token to the last, every request's tokens) for ``prompts`` to ``output``
    tokens each, greedy. The clock starts as the first decode step ends, so it times ``output - 2`` decode steps."""
    outs, first_decode = {}, []

    def emitter(i):
        def emit(ev):
            if ev.kind == "token":
                outs.setdefault(i, []).append(ev.token_id)
                if len(outs[i]) == 2 and not first_decode:  # the prefill gave each its first token
                    first_decode.append(time.perf_counter())

        return emit

    params = SamplingParams(max_new_tokens=output, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.submit(Request(f"r{i}", p, params, emitter(i)))
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - first_decode[0]
    while engine.step():  # a step still in flight holds only ended requests
        pass
    return seconds, [outs[i] for i in range(len(prompts))]


def measure(engine: Engine, observer: StepTimes, batch: int, args, vocab: int) -> list:
    """Rows for overlap on and off at ``batch``: medians over ``args.rounds`` rounds per mode, modes alternating."""
    prompts = [[(7 * i + 3 * j) % vocab + 1 for j in range(args.prompt)] for i in range(batch)]
    samples = {True: [], False: []}
    outputs = {}
    for mode in (True, False):  # warm-up: graphs, allocator
        engine.overlap = mode
        one_round(engine, prompts, args.output)
    for r in range(args.rounds):
        for mode in (True, False) if r % 2 == 0 else (False, True):
            engine.overlap = mode
            observer.steps.clear()
            observer.gpu.clear()
            seconds, outs = one_round(engine, prompts, args.output)
            outputs.setdefault(mode, outs)
            samples[mode].append((seconds, statistics.median(observer.steps), list(observer.gpu)))
    rows = []
    for mode in (True, False):
        secs = [s for s, _, _ in samples[mode]]
        steps = [m for _, m, _ in samples[mode]]
        gpu = [g for _, _, gs in samples[mode] for g in gs]
        tok_s = [batch * (args.output - 2) / s for s in secs]  # the tokens of the steps one_round times
        row = {
            "batch": batch,
            "overlap": mode,
            "decode_tok_s": statistics.median(tok_s),
            "decode_tok_s_rounds": tok_s,
            "step_ms": 1e3 * statistics.median(steps),
            "gpu_step_ms": 1e3 * statistics.median(gpu) if gpu else None,
        }
        row["uncovered_ms"] = None if not gpu else row["step_ms"] - row["gpu_step_ms"]
        rows.append(row)
    rows[0]["speedup"] = rows[0]["decode_tok_s"] / rows[1]["decode_tok_s"]
    rows[0]["outputs_equal"] = rows[1]["outputs_equal"] = outputs[True] == outputs[False]
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the built-in model on the CPU (a smoke run)")
    p.add_argument("--layers", type=int, default=4, help="layers of the Qwen3-8B-shaped model (GPU)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output", type=int, default=256, help="output tokens per request")
    p.add_argument("--rounds", type=int, default=6, help="measured rounds per mode (modes alternate)")
    p.add_argument("--out", default="benchmarks/results/overlap_decode.json")
    args = p.parse_args(argv)
    bad = {k: v for k, v in (("--prompt", args.prompt), ("--rounds", args.rounds)) if v < 1}
    if bad or args.output < 3 or min(args.batches) < 1:  # --output 3: one timed decode step
        p.error(f"expected --prompt, --rounds and --batches >= 1 and --output >= 3, got {vars(args)}")
    total = args.prompt + args.output
    rows = []
    with tempfile.TemporaryDirectory() as root:
        model, common = random_model(root, args.tiny, args.layers, total, tiny_tokens=max(args.batches) * total + 1)
        most = max(args.batches)
        engine_args = EngineArgs(model_dir=model, running_max_req_size=most, graph_max_batch_size=most,
                                 max_req_total_len=total, **common)  # fmt: skip
        runner = ModelRunner(engine_args)
        observer = StepTimes()
        engine = Engine(runner, eos_ids=[], observer=observer)
        vocab = runner.config.vocab_size if args.tiny else 512  # the tokenizer's ids; the lm_head is padded
        for batch in args.batches:
            rows += measure(engine, observer, batch, args, vocab)
    print(f"{'batch':>5} {'overlap':>7} {'tok/s':>9} {'step ms':>8} {'GPU ms':>7} {'uncovered':>9} {'speedup':>7} same")
    for r in rows:
        gpu = "-" if r["gpu_step_ms"] is None else f"{r['gpu_step_ms']:.3f}"
        unc = "-" if r["uncovered_ms"] is None else f"{r['uncovered_ms']:.3f}"
        speed = f"{r['speedup']:.3f}" if "speedup" in r else ""
        print(f"{r['batch']:5d} {str(r['overlap']):>7} {r['decode_tok_s']:9.0f} {r['step_ms']:8.3f} {gpu:>7} "
              f"{unc:>9} {speed:>7} {r['outputs_equal']}")  # fmt: skip
    write_rows(args.out, args, rows)
    return 0 if all(r["outputs_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
