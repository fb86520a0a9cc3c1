"""Choosing the winner of a search from its timings.

A search may time each candidate on several inputs ("scenarios"), the first being the tuning point: a
kernel whose config is frozen (e.g. into a CUDA graph) may serve other inputs later. Rules:

- ``tuning_len``: fastest on the first scenario (the tuning point) alone;
- ``minimax_loss`` (default): least worst-case loss, ``max over scenarios of time / best time there``,
  so the frozen config is never much worse than each length's own best. Ties go to the faster config at
  the tuning point.

The launcher default is index -1, is always a contender and wins ties: under ``minimax_loss`` the winner's
worst-case loss is never above the default's. A stricter "never slower than the default on any input"
guard was measured and rejected (docs/decode_attention.md).
"""

import math
from typing import Dict, List, Sequence

from lightllm.common.envs import AUTOTUNE_CHOICE_RULES as RULES


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
