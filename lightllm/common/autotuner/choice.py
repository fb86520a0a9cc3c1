"""Choosing the winner of a search from its timings.

A search may time each candidate on several inputs ("scenarios"), e.g. a decode batch at several KV
lengths: a captured CUDA graph freezes one config for every length it later serves. Rules:

- ``tuning_len``: fastest on the first scenario (the tuning point) alone;
- ``minimax_loss`` (default): least worst-case loss, ``max over scenarios of time / best time there``,
  so the frozen config is never much worse than each length's own best. Ties go to the faster config at
  the tuning point.

The launcher default is index -1, is always a contender and wins ties: under ``minimax_loss`` the winner's
worst-case loss is never above the default's. (A hard "never slower than the default at any length" guard
was measured and rejected: at hq32/hk8/d128, B=8, no config beats the default at 1K, so the guard froze a
default that is 27 % slower than the best at 4K-64K; see docs/decode_attention.md.)
"""

import math
from typing import Dict, List, Sequence

RULES = ("minimax_loss", "tuning_len")


def worst_case_loss(times: Sequence[float], best: Sequence[float]) -> float:
    """``max_s times[s] / best[s]`` (1.0 = best everywhere); inf if any time is inf."""
    return max((t / b if b > 0 else (1.0 if t <= b else math.inf)) for t, b in zip(times, best))


def choose(default: Sequence[float], timings: Dict[int, Sequence[float]], rule: str) -> int:
    """Index of the winning candidate in ``timings``, or -1 for the launcher default."""
    if rule not in RULES:
        raise ValueError(f"unknown choice rule {rule!r}; use one of {RULES}")
    everyone: Dict[int, Sequence[float]] = {-1: default, **timings}
    if rule == "tuning_len" or len(default) == 1:
        score = {i: t[0] for i, t in everyone.items()}
    else:
        best = per_scenario_best(everyone.values())
        score = {i: worst_case_loss(t, best) for i, t in everyone.items()}
    winner = -1
    for i, s in score.items():
        better = s < score[winner] or (s == score[winner] and everyone[i][0] < everyone[winner][0])
        if i != -1 and better:
            winner = i
    return winner


def per_scenario_best(all_times) -> List[float]:
    all_times = list(all_times)
    return [min(t[s] for t in all_times) for s in range(len(all_times[0]))]
