"""The length-bucket analysis of ``benchmarks/decode_attention.py --buckets`` (the engine's ``--graph_len_buckets``).

A decode graph is captured per KV length bucket, each launched for its bucket and tuned, as the engine does, on the
ladder of lengths it serves (``set_decode_graph_lens``, then ``decode_attn_autotune_seq_lens(bucket)``). A cell (B, L)
replays the graph of the smallest bucket >= L: the config each choice rule picks from that bucket's ladder timings,
launched for the bucket, at L. Its loss is measured against the cell's best eager launch (every candidate and the
default launched for L itself) and against the default eager launch. The same is reported for one bucket (the
default: one graph up to the largest L) to show what the buckets buy.

``analyze_nearest`` reads the same run for a graph whose own length was never tuned (level 0 with configs shipped
for other graph lengths): the config each tuned length's one-graph search picks, replayed in that graph.
``analyze_level0`` does so for bucket sets: each bucket replays what the tuner's nearest-key rule takes for it.
"""

import argparse
import json
import math
from typing import Dict, List, Sequence

from lightllm.common.autotuner.choice import choose
from lightllm.common.envs import AUTOTUNE_CHOICE_RULES
from lightllm.kernels.attention.decode.tuning import (
    decode_attn_autotune_seq_lens,
    decode_attn_run_key_distance,
    decode_attn_run_key_lens,
    set_decode_graph_lens,
)

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


def nearest_tuned_len(batch: int, bucket: int, buckets: Sequence[int], tuned: Sequence[int]) -> int:
    """The graph length whose one-graph configs the tuner's nearest-key rule (``decode_attn_run_key_distance``) takes
    at level 0 for the graph of ``bucket`` among ``buckets`` (its run key as the engine makes it, served floor
    included), where only ``tuned`` lengths were tuned (the shipped configs, say)."""
    previous = set_decode_graph_lens(buckets)
    try:
        run_key = (batch, *decode_attn_run_key_lens(bucket))
    finally:
        set_decode_graph_lens(previous)
    return min(tuned, key=lambda t: decode_attn_run_key_distance(run_key, (batch, t)))


def _one_graph_pick(at: dict, candidates_count: int, tuned: int, rule: str) -> int:
    """Index into ``_times`` of the config a one-graph search at ``tuned`` picks (its ladder, launched for it)."""
    ladder = [at[(m, tuned)] for m in bucket_ladders([tuned])[tuned]]
    candidates = {i: [x[i + 1] for x in ladder] for i in range(candidates_count)}
    return choose([x[0] for x in ladder], candidates, rule) + 1


def _cells(results: dict):
    """Per (shape, B, KV type) of a saved run: ``(shape, B, kind, at, names)``, ``at`` each timed (L, launch) point's
    ``_times`` and ``names`` their config names in that order (None: the default, then each candidate's JSON)."""
    points = {(p["shape"], p["B"], p["kind"], p["L"], p["launch"]): p for p in results["points"]}
    for cell in sorted({k[:3] for k in points}):
        at = {k[3:]: _times(p) for k, p in points.items() if k[:3] == cell}
        first = next(p for k, p in points.items() if k[:3] == cell)
        yield (*cell, at, [None] + [json.dumps(c, sort_keys=True) for c, _ in first["configs"]])


def _has_ladder(at: dict, tuned: int) -> bool:
    return all((m, tuned) in at for m in bucket_ladders([tuned])[tuned])


def analyze_level0(results: dict, sets: Sequence[Sequence[int]], tuned: Sequence[int], rule: str = "minimax_loss"):
    """Bucket sets at level 0 with configs tuned only at the ``tuned`` graph lengths: each bucket's graph replays the
    config of the tuned length the nearest-key rule takes for its run key (``nearest_tuned_len``). Per (shape, B, KV
    type) and set (its largest bucket is the graph maximum; the run's L up to it): the loss % at every L against L's
    best and default eager launches, as ``analyze_buckets`` reports them."""
    out = []
    for shape, batch, kind, at, names in _cells(results):
        for buckets in sets:
            buckets = sorted(buckets)
            lens = [n for n in results["lens"] if n <= buckets[-1]]
            from_len = {b: nearest_tuned_len(batch, b, buckets, tuned) for b in buckets}
            serving = {n: serving_bucket(buckets, n) for n in lens}
            if any((n, serving[n]) not in at or (n, n) not in at for n in lens) or not all(
                _has_ladder(at, t) for t in from_len.values()
            ):
                continue  # the run did not time what this set needs
            picks = {b: _one_graph_pick(at, len(names) - 1, t, rule) for b, t in from_len.items()}
            vs_best = [_loss_pct(at[(n, serving[n])][picks[serving[n]]], min(at[(n, n)])) for n in lens]
            vs_default = [_loss_pct(at[(n, serving[n])][picks[serving[n]]], at[(n, n)][0]) for n in lens]
            out.append({"shape": shape, "B": batch, "kind": kind, "buckets": buckets, "rule": rule, "lens": lens,
                        "tuned_at": {str(b): t for b, t in from_len.items()},
                        "configs": {str(b): names[i] for b, i in picks.items()}, "vs_best_pct": vs_best,
                        "vs_default_pct": vs_default, "worst_vs_best_pct": max(vs_best),
                        "worst_vs_default_pct": max(vs_default)})  # fmt: skip
    return out


def analyze_nearest(results: dict, graphs: Sequence[int], tuned: Sequence[int], rule: str = "minimax_loss") -> list:
    """A graph whose own length was never tuned (level 0, with configs shipped for other graph lengths) replays the
    config of the nearest tuned run key. Per (shape, B, KV type), graph length G and tuned length T: the config T's
    one-graph search picks by ``rule`` (T's ladder, launched for T), replayed in G's graph at every L <= G of the run,
    and its loss % vs L's best and default eager launches; ``nearest`` marks the T the tuner's nearest-key rule
    (``decode_attn_run_key_distance``) takes for G, ``l1`` the one plain L1 distance would take."""
    out = []
    for shape, batch, kind, at, names in _cells(results):
        for graph in graphs:
            lens = [n for n in results["lens"] if n <= graph]
            if any((n, graph) not in at or (n, n) not in at for n in lens):
                continue  # the run did not time this graph
            nearest = nearest_tuned_len(batch, graph, [graph], tuned)
            l1 = min(tuned, key=lambda t: abs(t - graph))
            for t in tuned:
                if not _has_ladder(at, t):
                    continue
                ladder_lens = bucket_ladders([t])[t]
                pick = _one_graph_pick(at, len(names) - 1, t, rule)
                vs_best = [_loss_pct(at[(n, graph)][pick], min(at[(n, n)])) for n in lens]
                vs_default = [_loss_pct(at[(n, graph)][pick], at[(n, n)][0]) for n in lens]
                out.append({"shape": shape, "B": batch, "kind": kind, "graph": graph, "tuned_at": t, "rule": rule,
                            "ladder": ladder_lens, "lens": lens, "config": names[pick], "vs_best_pct": vs_best,
                            "vs_default_pct": vs_default, "worst_vs_best_pct": max(vs_best),
                            "worst_vs_default_pct": max(vs_default), "nearest": t == nearest,
                            "l1": t == l1})  # fmt: skip
    return out


def print_nearest_table(results: dict, entries: list) -> None:
    print(f"\n{results.get('device', '')}: a decode graph replaying the config tuned for another graph length (its "
          "own never tuned), rule " + (entries[0]["rule"] if entries else "-"))  # fmt: skip
    print("loss % at L vs L's best eager launch / vs its default eager launch; N: the tuned length the nearest-key "
          "rule takes, L1: the one plain L1 distance would")  # fmt: skip
    print(f"{'shape':13s} {'B':>4s} kind {'graph':>6s} {'tuned':>6s}  pick  {'worst':>14s}  {'mean vs best':>12s}")
    for e in entries:
        mark = ("N" if e["nearest"] else "-") + ("/L1" if e["l1"] else "   ")
        mean = sum(e["vs_best_pct"]) / len(e["vs_best_pct"])
        print(f"{e['shape']:13s} {e['B']:4d} {e['kind']:4s} {e['graph']:6d} {e['tuned_at']:6d}  {mark:4s}  "
              f"{e['worst_vs_best_pct']:6.1f}/{e['worst_vs_default_pct']:6.1f}  {mean:12.2f}")  # fmt: skip
    print("\nper graph length and choice (nearest-key rule / plain L1), over the rows: worst % vs best, worst % vs "
          "default, mean % vs best")  # fmt: skip
    for graph in sorted({e["graph"] for e in entries}):
        for flag in ("nearest", "l1"):
            sel = [e for e in entries if e["graph"] == graph and e[flag]]
            if sel:
                mean = sum(sum(e["vs_best_pct"]) / len(e["vs_best_pct"]) for e in sel) / len(sel)
                worst_best = max(e["worst_vs_best_pct"] for e in sel)
                worst_default = max(e["worst_vs_default_pct"] for e in sel)
                print(f"  graph {graph:6d} {flag:8s} {len(sel):3d} rows   {worst_best:6.1f} / {worst_default:6.1f} / "
                      f"{mean:5.2f}")  # fmt: skip


def print_level0_table(results: dict, entries: list, tuned: Sequence[int]) -> None:
    print(f"\n{results.get('device', '')}: decode graphs per KV length bucket at level 0, with configs tuned only for "
          f"graphs of {list(tuned)} (each bucket replays the one the nearest-key rule takes)")  # fmt: skip
    print(f"loss % at L vs L's best eager launch / vs L's default eager launch; goal <= {GOAL_VS_BEST_PCT:g} / <= "
          f"{GOAL_VS_DEFAULT_PCT:g}")  # fmt: skip
    for buckets in sorted({tuple(e["buckets"]) for e in entries}, key=lambda b: (b[-1], len(b), b)):
        sel = [e for e in entries if tuple(e["buckets"]) == buckets]
        head = "".join(f"{_len_name(n):>14s}" for n in sel[0]["lens"])
        tuned_at = ", ".join(f"{_len_name(int(b))}<-{_len_name(t)}" for b, t in sel[0]["tuned_at"].items())
        print(f"\ngraphs <={set_name(buckets)} (configs {tuned_at})")
        print(f"{'shape':13s} {'B':>4s} kind{head}{'worst':>14s}  goal")
        for e in sel:
            cells = "".join(f"{b:7.1f}/{d:6.1f}" for b, d in zip(e["vs_best_pct"], e["vs_default_pct"]))
            print(f"{e['shape']:13s} {e['B']:4d} {e['kind']:4s}{cells}{e['worst_vs_best_pct']:7.1f}/"
                  f"{e['worst_vs_default_pct']:6.1f}  {'ok' if meets_goal(e) else 'MISS'}")  # fmt: skip
    print("\nper bucket set, over the (shape, B, kind) rows: rows meeting the goal, worst % vs best / vs default")
    for (name, _), s in summarize(entries).items():
        print(f"  <={name:24s} {s['rows_ok']:3d} of {s['rows']:3d}   {s['worst_vs_best_pct']:5.1f} / "
              f"{s['worst_vs_default_pct']:5.1f}")  # fmt: skip
