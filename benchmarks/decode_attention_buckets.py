"""The length-bucket analysis of ``benchmarks/decode_attention.py --buckets`` (the engine's ``--graph_len_buckets``).

A decode graph is captured per KV length bucket, each launched for its bucket and tuned, as the engine does, on the
ladder of lengths it serves (``set_decode_graph_lens``, then ``decode_attn_autotune_seq_lens(bucket)``). A cell (B, L)
replays the graph of the smallest bucket >= L: the config each choice rule picks from that bucket's ladder timings,
launched for the bucket, at L. Its loss is measured against the cell's best eager launch (every candidate and the
default launched for L itself) and against the default eager launch. The same is reported for one bucket (the
default: one graph up to the largest L) to show what the buckets buy.
"""

import argparse
import json
import math
from typing import Dict, List, Sequence

from lightllm.common.autotuner.choice import choose
from lightllm.common.envs import AUTOTUNE_CHOICE_RULES
from lightllm.kernels.attention.decode.tuning import decode_attn_autotune_seq_lens, set_decode_graph_lens

RULES = ("tuning_len", *(r for r in AUTOTUNE_CHOICE_RULES if r != "tuning_len"))
GOAL_VS_BEST_PCT, GOAL_VS_DEFAULT_PCT = 3.0, 2.0  # issue 17: within 3 % of the best, never 2 % slower than default


def graph_lens(buckets: Sequence[int], lens: Sequence[int]) -> List[int]:
    """The graphs' KV length buckets: the given ones below the longest L, then the longest L (the graph maximum)."""
    top = max(lens)
    return sorted({b for b in buckets if b < top} | {top})


def serving_bucket(buckets: Sequence[int], length: int) -> int:
    """The bucket whose graph serves a batch of KV length ``length``: the smallest that holds it."""
    return min(b for b in buckets if b >= length)


def parse_set(text: str) -> List[int]:
    """``--also-buckets`` item: comma-separated positive KV lengths."""
    try:
        lens = [int(x) for x in text.split(",")]
    except ValueError:
        lens = []
    if not lens or any(n <= 0 for n in lens):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive KV lengths, got {text!r}")
    return lens


def bucket_sets(buckets: Sequence[int], also: Sequence[Sequence[int]], lens: Sequence[int]) -> List[List[int]]:
    """The bucket sets a run compares: ``buckets``, each of ``also`` (as graph lengths), then one bucket (the
    default: one graph up to the longest L); each once, in that order."""
    sets = []
    for s in [list(buckets), *(graph_lens(a, lens) for a in also), [max(lens)]]:
        if s not in sets:
            sets.append(s)
    return sets


def set_name(buckets: Sequence[int]) -> str:
    return ",".join(map(str, buckets))


def bucket_ladders(buckets: Sequence[int]) -> Dict[int, List[int]]:
    """Each bucket's tuning ladder as the engine times it with these buckets: down to the bucket below."""
    previous = set_decode_graph_lens(buckets)
    try:
        return {b: decode_attn_autotune_seq_lens(b) for b in buckets}
    finally:
        set_decode_graph_lens(previous)


def set_ladders(results: dict, buckets: Sequence[int]) -> Dict[int, List[int]]:
    """A saved run's ladders for one bucket set. Runs before per-set ladders kept one ladder per bucket."""
    saved = results["ladders"]
    per_set = saved.get(set_name(buckets))
    if isinstance(per_set, dict):
        return {int(b): lens for b, lens in per_set.items()}
    return {int(b): lens for b, lens in saved.items()}


def timing_points(lens: Sequence[int], bucket_sets: Sequence[Sequence[int]], ladders) -> list:
    """The (KV length, launch length) pairs the analysis needs, each timed once for every candidate: every L eagerly
    (launched for L), every L in the graph that serves it and every serving bucket's ladder (launched for the
    bucket), for each set of buckets. ``ladders``: per set name, bucket -> ladder."""
    points = {(n, n) for n in lens}
    for buckets in bucket_sets:
        ladder = ladders[set_name(buckets)]
        for n in lens:
            b = serving_bucket(buckets, n)
            points |= {(n, b)} | {(m, b) for m in ladder[b]}
    return sorted(points)


def _times(point) -> list:
    """A timed point's milliseconds: the default first, then each candidate in its order."""
    return [point["default_ms"]] + [ms for _, ms in point["configs"]]


def _loss_pct(t: float, ref: float) -> float:
    return (t / ref - 1) * 100 if ref > 0 and math.isfinite(t) else math.inf


def analyze_buckets(results: dict) -> list:
    """Per (shape, B, KV type), bucket set and rule: the config each serving bucket's graph replays and its loss % at
    every L against L's best and default eager launches (``vs_best_pct``, ``vs_default_pct``), and the worst of each."""
    points = {(p["shape"], p["B"], p["kind"], p["L"], p["launch"]): p for p in results["points"]}
    lens = results["lens"]
    sets = results.get("sets") or bucket_sets(results["buckets"], [], lens)
    out = []
    for shape, batch, kind in sorted({k[:3] for k in points}):
        at = {k[3:]: _times(p) for k, p in points.items() if k[:3] == (shape, batch, kind)}
        names = [None] + [json.dumps(c, sort_keys=True) for c, _ in points[(shape, batch, kind, lens[0], lens[0])]
                          ["configs"]]  # fmt: skip
        for buckets in sets:
            ladders = set_ladders(results, buckets)
            needed = timing_points(lens, [buckets], {set_name(buckets): ladders})
            if any(pt not in at for pt in needed):  # a run cut short
                continue
            for rule in RULES:
                picks = {}
                for b in {serving_bucket(buckets, n) for n in lens}:
                    ladder = [at[(m, b)] for m in ladders[b]]
                    candidates = {i: [t[i + 1] for t in ladder] for i in range(len(names) - 1)}
                    picks[b] = choose([t[0] for t in ladder], candidates, rule) + 1  # index into _times
                vs_best, vs_default = [], []
                for n in lens:
                    replayed = at[(n, serving_bucket(buckets, n))][picks[serving_bucket(buckets, n)]]
                    vs_best.append(_loss_pct(replayed, min(at[(n, n)])))
                    vs_default.append(_loss_pct(replayed, at[(n, n)][0]))
                out.append({"shape": shape, "B": batch, "kind": kind, "buckets": list(buckets), "rule": rule,
                            "lens": list(lens), "configs": {str(b): names[i] for b, i in sorted(picks.items())},
                            "vs_best_pct": vs_best, "vs_default_pct": vs_default, "worst_vs_best_pct": max(vs_best),
                            "worst_vs_default_pct": max(vs_default)})  # fmt: skip
    return out


def _len_name(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def print_bucket_table(results: dict, entries: list) -> None:
    lens = results["lens"]
    print(f"\n{results.get('device', '')}: decode graphs per KV length bucket {results['buckets']} (and one, up to "
          f"{max(lens)}); ladders {results['ladders']}")  # fmt: skip
    print(f"loss % of the config a graph replays at L (picked by the rule from its bucket's ladder, launched for the "
          f"bucket) vs L's best eager launch / vs L's default eager launch; goal <= {GOAL_VS_BEST_PCT:g} / <= "
          f"{GOAL_VS_DEFAULT_PCT:g}")  # fmt: skip
    head = "".join(f"{_len_name(n):>14s}" for n in lens)
    print(f"{'shape':13s} {'B':>4s} kind {'graphs':16s} {'rule':25s}{head}{'worst':>14s}  goal")
    for e in entries:
        cells = "".join(f"{b:7.1f}/{d:6.1f}" for b, d in zip(e["vs_best_pct"], e["vs_default_pct"]))
        wb, wd = e["worst_vs_best_pct"], e["worst_vs_default_pct"]
        ok = "ok" if meets_goal(e) else "MISS"
        graphs = "<=" + ",".join(map(str, e["buckets"]))
        print(f"{e['shape']:13s} {e['B']:4d} {e['kind']:4s} {graphs:16s} {e['rule']:25s}{cells}{wb:7.1f}/{wd:6.1f}"
              f"  {ok}")  # fmt: skip
    print(
        "\nper bucket set and rule, over the (shape, B, kind) rows: rows meeting the goal, worst % vs best / vs default"
    )
    for (buckets, rule), s in summarize(entries).items():
        print(f"  <={buckets:24s} {rule:25s} {s['rows_ok']:3d} of {s['rows']:3d}   {s['worst_vs_best_pct']:5.1f} / "
              f"{s['worst_vs_default_pct']:5.1f}")  # fmt: skip


def meets_goal(entry: dict) -> bool:
    return entry["worst_vs_best_pct"] <= GOAL_VS_BEST_PCT and entry["worst_vs_default_pct"] <= GOAL_VS_DEFAULT_PCT


def summarize(entries: list) -> dict:
    """Per (bucket set name, rule): how many (shape, B, kind) rows meet the goal, and the worst losses over them."""
    out = {}
    for e in entries:
        empty = {"rows": 0, "rows_ok": 0, "worst_vs_best_pct": -math.inf, "worst_vs_default_pct": -math.inf}
        s = out.setdefault((set_name(e["buckets"]), e["rule"]), empty)
        s["rows"] += 1
        s["rows_ok"] += meets_goal(e)
        s["worst_vs_best_pct"] = max(s["worst_vs_best_pct"], e["worst_vs_best_pct"])
        s["worst_vs_default_pct"] = max(s["worst_vs_default_pct"], e["worst_vs_default_pct"])
    return out
