"""Triton programs that live prompts of ordinary lengths meet for the first time after start-up: what the start-up's
warm-up left to compile in a request's time to first token.

Triton compiles one program per specialization of a kernel's integer arguments (1, a multiple of 16, any other) and
of its pointers' 16-byte alignment. A hook on its JIT cache (``triton.knobs.runtime.jit_cache_hook`` before a
program is loaded or compiled, ``jit_post_compile_hook`` after) records every program a process gets, with its
seconds: on an empty Triton cache they are compiles, on a filled one loads from disk. Arms, each in its own process
(a process gets each program once), run one after another in the order given and share one Triton cache, so the
first arm's seconds are compiles where the machine's cache was empty:

- ``aligned``: the warm-up ladder alone (prompts of multiples of 16; ``model_runner.UNALIGNED_WARMUP_BATCHES``
  emptied), as before the unaligned batches;
- ``unaligned``: the default start-up.

In-process engine (no HTTP), a random-weight model (``--model``, ``--layers``). After start-up the same traffic runs
twice, each item alone on an idle engine, one decode step each (``TRAFFIC``: single prompts of 1, 7, 100 and 1000
tokens, three together, one longer than a chunk, one prompt sent three times for the prefix cache, and two prompts
sharing a head), fresh random tokens each pass. Per item: the time to first token of both passes, and the programs the
item met first, with their seconds. ``--tiny`` (CPU: the torch references, nothing compiles) checks the method.

    python benchmarks/warmup_compiles.py --model qwen3.5 --out benchmarks/results/warmup_compiles_qwen3_5.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from lightllm.common import proc as procs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_bench import add_model_args, random_model, write_rows  # noqa: E402

ARMS = ("aligned", "unaligned")
CHUNK = 1024  # the engine's chunked_prefill_size here: "long" is two chunks, the second 37 tokens
# item: (name, prompts: a list of (head, tail) lengths submitted together, sends in a row)
TRAFFIC = (
    ("1", [(0, 1)], 1),
    ("7", [(0, 7)], 1),
    ("100", [(0, 100)], 1),
    ("1000", [(0, 1000)], 1),
    ("5+50+333", [(0, 5), (0, 50), (0, 333)], 1),
    (f"{CHUNK + 37} (two chunks)", [(0, CHUNK + 37)], 1),
    ("777 x3 (prefix cache)", [(0, 777)], 3),
    ("300 head + 41 / 59", [(300, 41), (300, 59)], 1),
)


class ProgramLog:
    """Every Triton program this process loads or compiles, with its seconds, from Triton's JIT hooks."""

    def __init__(self):
        self.got, self._t0 = [], {}

    def install(self) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, *, key, repr, fn, **_):
        self._t0[str(key)] = time.perf_counter()
        return False  # False: compile as usual

    def _after(self, *, key, repr, fn, **_):
        t0 = self._t0.pop(str(key), None)
        seconds = None if t0 is None else time.perf_counter() - t0
        # the key names the specialization (each argument's type and divisibility, the constexprs): what was new
        self.got.append({"kernel": fn.name, "program": repr, "key": str(key), "s": seconds})
        return False

    def since(self, n: int) -> list:
        return self.got[n:]


def run_item(engine, fresh, prompts, sends: int) -> tuple:
    """Per send, the seconds from submission to the last first token of ``prompts`` (``(head, tail)`` lengths, one
    shared head) and the prompt tokens they read from the prefix cache."""
    from lightllm.engine.request import Request
    from lightllm.engine.sampler import SamplingParams

    head = fresh(max(h for h, _ in prompts))
    ids = [head[:h] + fresh(t) for h, t in prompts]
    seconds, cached = [], []
    for _ in range(sends):
        firsts, hits = {}, {}
        t0 = time.perf_counter()
        for i, p in enumerate(ids):

            def emit(ev, i=i):
                if ev.kind == "token" and i not in firsts:
                    firsts[i], hits[i] = time.perf_counter(), ev.cached_tokens

            engine.submit(
                Request(f"w{time.perf_counter_ns()}-{i}", p, SamplingParams(max_new_tokens=2, ignore_eos=True), emit)
            )
        while engine.has_unfinished():
            engine.step()
        seconds.append(max(firsts.values()) - t0)
        cached.append(sum(hits.values()))
    return seconds, cached


def run_arm(args) -> dict:
    """One arm in this process: start-up, then the traffic twice."""
    from lightllm.engine import model_runner
    from lightllm.engine.args import EngineArgs
    from lightllm.engine.engine import Engine
    from lightllm.engine.model_runner import ModelRunner

    log = ProgramLog()
    if not args.tiny:
        log.install()
    if args.arm == "aligned":
        model_runner.UNALIGNED_WARMUP_BATCHES = ()
    longest = CHUNK + 64
    with tempfile.TemporaryDirectory() as root:
        model, common = random_model(root, args.tiny, args.layers, longest, tiny_tokens=8 * longest, model=args.model)
        t = time.perf_counter()
        runner = ModelRunner(EngineArgs(model_dir=model, running_max_req_size=8, graph_max_batch_size=8,
                                        max_req_total_len=longest, batch_max_tokens=CHUNK, chunked_prefill_size=CHUNK,
                                        **common))  # fmt: skip
        startup_s, at_ready = time.perf_counter() - t, len(log.got)
        engine = Engine(runner, eos_ids=[])
        vocab = runner.config.vocab_size if args.tiny else 512  # the tokenizer's ids; the lm_head is padded
        g = torch.Generator().manual_seed(0)

        def fresh(n):
            return torch.randint(0, vocab, (n,), generator=g).tolist()

        items = []
        for rnd in range(2):
            for name, prompts, sends in TRAFFIC:
                n = len(log.got)
                ttft, cached = run_item(engine, fresh, prompts, sends)
                met = log.since(n)
                items.append({"pass": rnd, "item": name, "ttft_ms": [x * 1e3 for x in ttft], "cached_tokens": cached,
                              "programs": met, "programs_s": sum(m["s"] or 0.0 for m in met)})  # fmt: skip
    return {"arm": args.arm, "startup_s": startup_s, "startup_programs": at_ready,
            "startup_seconds": dict(runner.startup_seconds), "items": items,
            "after_startup": len(log.got) - at_ready}  # fmt: skip


def _sends_ms(item: dict) -> str:
    return " / ".join(f"{x:.1f}" for x in item["ttft_ms"])


def table(rows: list) -> str:
    lines = ["| arm | programs at start-up | start-up s | programs after | their s | slowest first TTFT ms (item) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        firsts = [(max(i["ttft_ms"]), i["item"]) for i in r["items"] if i["pass"] == 0]
        worst = max(firsts)
        spent = sum(i["programs_s"] for i in r["items"])
        lines.append(f"| {r['arm']} | {r['startup_programs']} | {r['startup_s']:.1f} | {r['after_startup']} | "
                     f"{spent:.2f} | {worst[0]:.1f} ({worst[1]}) |")  # fmt: skip
    lines += ["", "| arm | item | TTFT ms pass 0 | pass 1 | programs met | their s |", "|---|---|---|---|---|---|"]
    for r in rows:
        by = {(i["pass"], i["item"]): i for i in r["items"]}
        for name, _, _ in TRAFFIC:
            a, b = by[(0, name)], by[(1, name)]
            met, spent = len(a["programs"]) + len(b["programs"]), a["programs_s"] + b["programs_s"]
            lines.append(f"| {r['arm']} | {name} | {_sends_ms(a)} | {_sends_ms(b)} | {met} | {spent:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="in this order, one process each")
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # a child process: run this arm, print JSON
    p.add_argument("--out", default="benchmarks/results/warmup_compiles.json")
    args = p.parse_args(argv)
    if args.mtp_step:
        p.error("--mtp_step expected 0: the MTP head is not part of this benchmark")
    if args.arm:
        print("ARM " + json.dumps(run_arm(args)), flush=True)
        return
    rows = []
    for arm in args.arms:
        cmd = [sys.executable, os.path.abspath(__file__), "--arm", arm, "--model", args.model, "--layers",
               str(args.layers)] + (["--tiny"] if args.tiny else [])  # fmt: skip
        with procs.running(cmd, stdout=subprocess.PIPE, text=True) as child:  # its tree stopped however we leave
            out, _ = child.communicate(timeout=procs.HANG_TIMEOUT_S)
        if child.returncode != 0:
            sys.exit(f"arm {arm} failed (exit {child.returncode}); its output is above")
        rows.append(json.loads(next(line[4:] for line in out.splitlines() if line.startswith("ARM "))))
    write_rows(args.out, args, rows)
    print(table(rows))


if __name__ == "__main__":
    main()
