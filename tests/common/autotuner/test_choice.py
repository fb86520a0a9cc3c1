"""Choice rules on synthetic timings: ``choose(default, {index: times}, rule)``, -1 being the launcher default."""

import random

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, autotune, autotune_warmup
from lightllm.common.autotuner.choice import NOISE_MARGIN, choose, per_scenario_best, worst_case_loss

GUARD = "never_slower_than_default"
INF = float("inf")


def test_guard_keeps_the_default_when_every_candidate_loses_somewhere():
    default = [1.0, 1.0, 1.0]
    timings = {0: [0.5, 0.5, 1.05], 1: [0.7, 1.1, 0.6], 2: [0.4, INF, 0.4]}
    assert choose(default, timings, "minimax_loss") != -1  # the old rule takes a loss for the gains
    assert choose(default, timings, GUARD) == -1


def test_guard_picks_the_least_worst_case_loss_among_candidates_that_never_lose():
    default = [1.0, 1.0]
    timings = {0: [0.8, 1.05], 1: [0.9, 0.99], 2: [0.95, 0.95]}
    # losses against the best of all (0.8, 0.95): 0 is 1.105 but loses to the default at the second input;
    # 1 is 1.125 and 2 is 1.1875, both never slower than the default
    assert choose(default, timings, "minimax_loss") == 0
    assert choose(default, timings, GUARD) == 1


def test_guard_ties_go_to_the_faster_at_the_tuning_point_and_exact_ties_to_the_default():
    # 2 loses to the default at the tuning point but sets the best at the second input: 0 and 1 both lose 2x there
    assert choose([1.0, 1.0], {0: [0.9, 0.6], 1: [0.8, 0.6], 2: [2.0, 0.3]}, GUARD) == 1
    assert choose([1.0, 1.0], {0: [1.0, 1.0]}, GUARD) == -1
    assert choose([1.0], {0: [0.9], 1: [0.8], 2: [1.005]}, GUARD) == 1  # one input: the fastest


@pytest.mark.parametrize("slower, admitted", [(NOISE_MARGIN / 2, True), (NOISE_MARGIN * 2, False)])
def test_guard_forgives_timing_noise_only_up_to_the_margin(slower, admitted):
    default = [1.0, 2.0]
    timings = {0: [0.6, 2.0 * (1 + slower)]}
    assert choose(default, timings, GUARD) == (0 if admitted else -1)


def test_guard_winner_is_never_slower_than_the_default_beyond_the_margin():
    rng = random.Random(0)
    chose_a_candidate = 0
    for _ in range(300):
        default = [rng.uniform(0.5, 2) for _ in range(4)]
        timings = {i: [d * rng.uniform(0.8, 1.1) for d in default] for i in range(6)}
        w = choose(default, timings, GUARD)
        chosen = default if w < 0 else timings[w]
        assert all(c <= d * (1 + NOISE_MARGIN) for c, d in zip(chosen, default))
        fair = [t for t in [default, *timings.values()] if all(x <= d * (1 + NOISE_MARGIN) for x, d in zip(t, default))]
        best = per_scenario_best([default, *timings.values()])
        assert worst_case_loss(chosen, best) == min(worst_case_loss(t, best) for t in fair)
        chose_a_candidate += w >= 0
    assert 0 < chose_a_candidate < 300  # both outcomes were exercised


def test_unknown_rule_names_the_value_and_the_choices():
    with pytest.raises(
        ValueError, match="rule='fastest' is not a choice rule; use one of minimax_loss, tuning_len, never"
    ):
        choose([1.0], {}, "fastest")


def test_a_kernel_declares_its_rule_and_a_bad_one_is_refused():
    with pytest.raises(
        ValueError, match="autotune kernel 'bad_rule': choice_rule='safest' is not a choice rule; use one of"
    ):
        autotune("bad_rule", lambda: [], lambda x: 0, lambda x: 0, choice_rule="safest")(lambda x, run_config=None: x)


def _searched(toy, monkeypatch, **autotune_kwargs):
    """A decode toy timed at 64 and 8 rows: "fast" wins at 64 rows but is 5 % slower than the default at 8."""
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    table = {None: {64: 1.0, 8: 1.0}, "fast": {64: 0.6, 8: 1.05}}
    t = toy(AutotuneKernelType.DECODE_ATTENTION, configs=[{"ms": 1, "name": "fast"}],
            rebuild_input_func=lambda named: [{**named, "x": torch.randn(n, 3), "out": torch.empty(n, 3)}
                                              for n in (64, 8)], **autotune_kwargs)  # fmt: skip
    t.bench.ms_at = lambda cfg, rows: table[None if cfg is None else cfg["name"]][rows]
    with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
        t(n=4)
    return t.kernel.last_search


def test_the_declared_rule_decides_the_search(toy, monkeypatch):
    assert _searched(toy, monkeypatch).chosen == {"ms": 1, "name": "fast"}  # minimax_loss, the default rule
    record = _searched(toy, monkeypatch, choice_rule=GUARD)
    assert record.rule == GUARD and record.chosen is None


def test_the_environment_overrides_every_kernels_rule(toy, monkeypatch):
    monkeypatch.setenv("LIGHTLLM_AUTOTUNE_CHOICE_RULE", "minimax_loss")
    record = _searched(toy, monkeypatch, choice_rule=GUARD)
    assert record.rule == "minimax_loss" and record.chosen == {"ms": 1, "name": "fast"}
