"""What the tuner's second timing of its finalists changes at start-up (the decode-attention searches).

A search times the launcher default first, then every candidate; the default and the three leading candidates are
then timed once more and keep their faster time (``Autotuner._retime``, docs/autotune.md "How a search runs"). This
runs the real DECODE_ATTENTION search of the Triton GQA decode, as a decode graph's warm-up does it (fresh config
folder, shipped configs ignored, level 1, a graph of ``--graph-len`` over a pool that holds every request at that
length), for each cell, ``--repeats`` times, and reports from each search's record:

- ``default 1st``: how much slower the default's first timing was than its faster one (worst scenario);
- ``finalists 1st``: the same for the slowest of the re-timed candidates;
- ``one-pass pick`` / ``pick``: what the rule chose on the first timings alone, and with the re-timings;
- ``one-pass loss``: the one-pass pick's worst-case loss against the final timings' per-scenario best, beside the
  final pick's (what a single pass would have cost the frozen config);
- ``search s`` and ``retime s``: the whole search and its re-timings.

``--arms R:F ...`` runs each search once per arm, with ``R`` replays in the first pass over every candidate
(``bench.SCREEN_REPLAYS``) and ``F`` finalists re-timed at the full count (``tuner.FINALISTS``), in the order given.
The first arm is the judge: ``judged loss`` is each arm's pick's worst-case loss on the judge's final timings of the
same cell and repeat, so an arm that repeats the judge's (an A/A pair) shows what the method's noise alone costs.

    python benchmarks/autotune_retime.py --out benchmarks/results/autotune_retime_h200.json
    python benchmarks/autotune_retime.py --arms 15:3 5:3 15:3 --out F
"""

import argparse
import math
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling modules, however it is loaded
from bench_io import save_json  # noqa: E402
from decode_attention import KINDS, SHAPES, decode_fn, kv_bytes, make_pool  # noqa: E402

from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, bench, tuner  # noqa: E402
from lightllm.common.autotuner.choice import choose, per_scenario_best, worst_case_loss  # noqa: E402
from lightllm.common.autotuner.keys import key_to_json  # noqa: E402
from lightllm.kernels.attention.decode import flash_decode  # noqa: E402


def summarize(record) -> dict:
    """One search's row: the first pass against the kept times, and what a single pass would have chosen."""
    kept = {-1: record.default_ms, **{i: ms for i, (_, ms) in enumerate(record.timings)}}
    first = {**kept, **record.first_pass}
    configs = {-1: None, **{i: c for i, (c, _) in enumerate(record.timings)}}

    def pick(times):
        return choose(times[-1], {i: t for i, t in times.items() if i >= 0}, record.rule)

    def slow(i):  # the first timing over the kept one, worst scenario, in percent
        return max(100.0 * (a / b - 1) for a, b in zip(first[i], kept[i]))

    best = per_scenario_best(t for t in kept.values() if all(map(math.isfinite, t)))
    one_pass, final = pick(first), pick(kept)
    retimed = [i for i in record.first_pass if i >= 0]
    return {
        "default_first_pct": slow(-1) if -1 in record.first_pass else None,
        "finalists_first_pct": max((slow(i) for i in retimed), default=None),
        "one_pass_pick": key_to_json(configs[one_pass]) if one_pass >= 0 else "default",
        "pick": key_to_json(configs[final]) if final >= 0 else "default",
        "one_pass_loss_pct": 100.0 * (worst_case_loss(kept[one_pass], best) - 1),
        "loss_pct": 100.0 * (worst_case_loss(kept[final], best) - 1),
        "search_s": record.seconds,
        "retime_s": record.retime_seconds,
    }


def _kept(record) -> dict:
    return {-1: record.default_ms, **{i: ms for i, (_, ms) in enumerate(record.timings)}}


def _pick(record):
    """(index, config) the rule chooses on the record's final timings; index -1 is the default."""
    times = _kept(record)
    i = choose(times[-1], {j: t for j, t in times.items() if j >= 0}, record.rule)
    return i, (None if i < 0 else record.timings[i][0])


def judged(record, judge) -> dict:
    """``record``'s pick judged on ``judge``'s final timings (another search of the same key and candidates): its
    worst-case loss there, whether it is the judge's pick, and whether the judge's pick was among ``record``'s
    re-timed finalists."""
    times = _kept(judge)
    index = {key_to_json(c): i for i, (c, _) in enumerate(judge.timings)}
    _, config = _pick(record)
    mine = -1 if config is None else index[key_to_json(config)]
    best = per_scenario_best(t for t in times.values() if all(map(math.isfinite, t)))
    theirs, _ = _pick(judge)
    finalists = {-1 if c is None else index[key_to_json(c)] for c in
                 (None if i < 0 else record.timings[i][0] for i in record.first_pass)}  # fmt: skip
    return {"judged_loss_pct": 100.0 * (worst_case_loss(times[mine], best) - 1), "same_pick": mine == theirs,
            "judge_pick_retimed": theirs in finalists or mine == theirs}  # fmt: skip


def parse_arm(text: str) -> tuple:
    """``"R:F"`` -> (first-pass replays R >= 1, finalists F >= 0)."""
    try:
        replays, finalists = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"an arm expected REPLAYS:FINALISTS (e.g. 5:3), got {text!r}") from None
    if replays < 1 or finalists < 0:
        raise argparse.ArgumentTypeError(f"an arm expected REPLAYS >= 1 and FINALISTS >= 0, got {text!r}")
    return replays, finalists


def search_once(kind, q, pool, r2t, idx, seq, graph_len, out, group):
    """One DECODE_ATTENTION search of this kernel's key, from an empty config folder: its record."""
    launcher = flash_decode._LAUNCHERS[kind]
    launcher.clear_cache()
    launcher.last_search = None
    with tempfile.TemporaryDirectory() as root:
        os.environ["LIGHTLLM_AUTOTUNE_CONFIG_DIR"] = root
        with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
            decode_fn(kind, q, pool, r2t, idx, seq, graph_len, out, group, None)()
        torch.cuda.synchronize()
    if launcher.last_search is None:
        raise RuntimeError(f"{launcher.kernel_name}: the warm-up searched nothing (a config was found)")
    return launcher.last_search


def run(args) -> dict:
    os.environ["LIGHTLLM_TRITON_AUTOTUNE_LEVEL"] = "1"
    os.environ["LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN"] = str(args.graph_len)
    os.environ["LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED"] = "all"  # search as on a GPU with nothing shipped
    results = {"device": torch.cuda.get_device_name(), "graph_len": args.graph_len, "quant_group": args.group,
               "arms": [arm_label(j, *arm) for j, arm in enumerate(args.arms)], "rows": []}  # fmt: skip
    for kind in args.kinds:
        for shape in args.shapes:
            hq, hk, d = SHAPES[shape]
            for batch in args.batches:
                if kv_bytes(kind, batch, args.graph_len, hk, d, args.group) > args.max_gb * 1e9:
                    print(f"skip {shape} B={batch} {kind}: pool over {args.max_gb} GB", file=sys.stderr)
                    continue
                tokens = batch * args.graph_len
                pool = make_pool(kind, tokens, hk, d, args.group)
                r2t = torch.arange(tokens, device="cuda", dtype=torch.int32).view(batch, args.graph_len)
                idx = torch.arange(batch, device="cuda", dtype=torch.int32)
                seq = torch.full((batch,), args.graph_len, device="cuda", dtype=torch.int32)
                q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
                for repeat in range(args.repeats):
                    judge = None
                    for j, (replays, finalists) in enumerate(args.arms):
                        bench.SCREEN_REPLAYS, tuner.FINALISTS = replays, finalists
                        record = search_once(kind, q, pool, r2t, idx, seq, args.graph_len, torch.empty_like(q),
                                             args.group)  # fmt: skip
                        judge = record if judge is None else judge
                        row = {
                            "kind": kind,
                            "shape": shape,
                            "B": batch,
                            "repeat": repeat,
                            "arm": arm_label(j, replays, finalists),
                        }
                        row.update(summarize(record), **judged(record, judge))
                        results["rows"].append(row)
                        print_row(row)
                        save_json(results, args.out)  # partial results survive a time limit
                del pool, r2t
                torch.cuda.empty_cache()
    results["arm_summary"] = arm_summary(results["rows"])
    save_json(results, args.out)
    print_arms(results["rows"])
    return results


def arm_label(index: int, replays: int, finalists: int) -> str:
    """``#0 15:3``: the arm's place (the judge is #0; two arms of one setting stay apart) and its setting."""
    return f"#{index} {replays}:{finalists}"


def arm_summary(rows: list) -> dict:
    """Per arm: searches, median search and re-timing seconds, mean and worst judged loss, picks equal to the
    judge's and judge's picks the arm re-timed."""
    out = {}
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        losses = [r["judged_loss_pct"] for r in mine]
        out[arm] = {"searches": len(mine), "search_s": statistics.median(r["search_s"] for r in mine),
                    "retime_s": statistics.median(r["retime_s"] for r in mine),
                    "judged_loss_mean_pct": statistics.fmean(losses), "judged_loss_max_pct": max(losses),
                    "same_pick": sum(r["same_pick"] for r in mine),
                    "judge_pick_retimed": sum(r["judge_pick_retimed"] for r in mine)}  # fmt: skip
    return out


def print_arms(rows: list) -> None:
    print(f"{'arm':>8} {'searches':>8} {'search s':>8} {'retime s':>8} {'judged loss mean/max':>20} "
          f"{'same pick':>9} {'judge pick re-timed':>19}")  # fmt: skip
    for arm, a in arm_summary(rows).items():
        loss = f"{a['judged_loss_mean_pct']:.2f}/{a['judged_loss_max_pct']:.2f}%"
        print(f"{arm:>8} {a['searches']:>8} {a['search_s']:>8.2f} {a['retime_s']:>8.2f} {loss:>20} "
              f"{a['same_pick']:>9} {a['judge_pick_retimed']:>19}")  # fmt: skip


HEADER = (
    f"{'kind':5} {'shape':14} {'B':>4} {'rep':>3} {'arm':>8} {'default 1st':>11} {'finalists 1st':>13} "
    f"{'1-pass loss':>11} {'loss':>6} {'judged':>7} {'search s':>8} {'retime s':>8}  picks (one pass -> re-timed)"
)


def print_row(row: dict) -> None:
    def pct(v):
        return "-" if v is None else f"{v:+.1f}%"

    picks = row["pick"] if row["pick"] == row["one_pass_pick"] else f"{row['one_pass_pick']} -> {row['pick']}"
    print(
        f"{row['kind']:5} {row['shape']:14} {row['B']:>4} {row['repeat']:>3} {row.get('arm', '-'):>8} "
        f"{pct(row['default_first_pct']):>11} {pct(row['finalists_first_pct']):>13} "
        f"{pct(row['one_pass_loss_pct']):>11} {pct(row['loss_pct']):>6} {pct(row.get('judged_loss_pct')):>7} "
        f"{row['search_s']:>8.2f} {row['retime_s']:>8.2f}  {picks}",
        flush=True,
    )


def add_cell_args(p, shapes, batches) -> None:
    """The cells of a decode-attention search benchmark: KV types, shapes, batches, graph length, quant group."""
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--shapes", nargs="+", default=list(shapes), choices=list(SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=list(batches))
    p.add_argument("--graph-len", type=int, default=32768, help="the decode graph's maximum KV length")
    p.add_argument("--group", type=int, default=8, choices=(8, 16, 32), help="quant group of INT8/INT4 KV")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cell_args(p, SHAPES, [1, 8, 16, 64, 128])
    p.add_argument("--repeats", type=int, default=2, help="searches per cell, each from an empty config folder")
    p.add_argument("--max-gb", type=float, default=60.0, help="skip cells whose KV pool is larger")
    p.add_argument(
        "--arms",
        nargs="+",
        type=parse_arm,
        default=[(bench.SCREEN_REPLAYS, tuner.FINALISTS)],
        help="REPLAYS:FINALISTS per search of a cell, the first the judge (default: the tuner's own)",
    )
    p.add_argument("--out", default="benchmarks/results/autotune_retime.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("autotune_retime.py needs a CUDA GPU")
    if args.graph_len < 1 or args.repeats < 1 or min(args.batches) < 1:
        p.error("--graph-len, --repeats and --batches must be positive")
    print(HEADER, flush=True)
    run(args)


if __name__ == "__main__":
    main()
