"""Choosing the winner of a search from its timings.

A search may time each candidate on several inputs ("scenarios"), the first being the tuning point: a
kernel whose config is frozen (e.g. into a CUDA graph) may serve other inputs later. Rules:

- ``tuning_len``: fastest on the first scenario (the tuning point) alone;
- ``minimax_loss`` (default): least worst-case loss, ``max over scenarios of time / best time there``,
  so the frozen config is never much worse than each length's own best. Ties go to the faster config at
  the tuning point.
- ``never_slower_than_default``: ``minimax_loss`` among the candidates no slower than the default on every
  scenario (within ``NOISE_MARGIN``); the default when none is. For a default that is already good
  everywhere (FA3's own split heuristic), so tuning can only gain.

The launcher default is index -1, is always a contender and wins ties: under ``minimax_loss`` the winner's
worst-case loss is never above the default's; under ``never_slower_than_default`` the winner is nowhere slower
than the default by more than the margin. A kernel declares its rule (``autotune(choice_rule=...)``). The guard
is not everyone's rule: a poor default would pin the frozen config to it (docs/decode_attention.md).
"""

import math
from typing import Dict, List, Sequence

from lightllm.common.envs import AUTOTUNE_CHOICE_RULES as RULES

# Timing noise between two measurements of one config (on an H200, FA3's heuristic and the fixed split it picks
# differ by 0.0-0.3 % in most cells of decode_attention_h200.json): this much slower still counts as no slower.
NOISE_MARGIN = 0.005


def worst_case_loss(times: Sequence[float], best: Sequence[float]) -> float:
    """``max_s times[s] / best[s]`` (1.0 = best everywhere); inf if any time is inf."""
    return max((t / b if b > 0 else (1.0 if t <= b else math.inf)) for t, b in zip(times, best))


def no_slower(times: Sequence[float], default: Sequence[float], margin: float = NOISE_MARGIN) -> bool:
    """``times`` is within ``margin`` of ``default`` (or faster) on every scenario."""
    return all(t <= d * (1 + margin) for t, d in zip(times, default))


def check_rule(rule: str, name: str = "rule") -> str:
    """``rule`` when it is one of ``RULES``, else a ``ValueError`` naming ``name``, the value and the rules."""
    if rule not in RULES:
        raise ValueError(f"{name}={rule!r} is not a choice rule; use one of {', '.join(RULES)}")
    return rule


def choose(default: Sequence[float], timings: Dict[int, Sequence[float]], rule: str) -> int:
    """Index of the winning candidate in ``timings``, or -1 for the launcher default."""
    return ranking(default, timings, rule)[0]


def ranking(default: Sequence[float], timings: Dict[int, Sequence[float]], rule: str) -> List[int]:
    """The contenders under ``rule``, best first (``choose`` takes the first): indices into ``timings``, -1 for the
    launcher default, which is always among them and ahead of every candidate it ties."""
    check_rule(rule)
    everyone: Dict[int, Sequence[float]] = {-1: default, **timings}
    if rule == "tuning_len" or len(default) == 1:  # one scenario: every rule picks the fastest
        score = {i: t[0] for i, t in everyone.items()}
    else:
        best = per_scenario_best(everyone.values())  # losses are against the true best, admitted or not
        if rule == "never_slower_than_default":
            everyone = {i: t for i, t in everyone.items() if no_slower(t, default)}
        score = {i: worst_case_loss(t, best) for i, t in everyone.items()}
    # Sorted by score, then by the time at the tuning point; the default wins exact ties (Python's sort is stable).
    return sorted(score, key=lambda i: (score[i], everyone[i][0], i != -1))


def per_scenario_best(all_times) -> List[float]:
    all_times = list(all_times)
    return [min(t[s] for t in all_times) for s in range(len(all_times[0]))]
