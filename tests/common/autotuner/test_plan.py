"""Plan/run: a tuned launch resolved once (keys, config, search) and run by many calls that share its keys."""

import contextlib
import shutil

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, tuner

GENERAL = AutotuneKernelType.GENERAL
DECODE = AutotuneKernelType.DECODE_ATTENTION


@pytest.fixture
def level(monkeypatch):
    return lambda n: monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", str(n))


def scope(phase):
    return autotune_warmup(phase) if phase is not None else contextlib.nullcontext()


def inputs(n):
    x = torch.randn(n, 3)
    return x, torch.full_like(x, float("nan"))


def _stored(t, level):
    """Files holding {"ms": 0.2} for run keys 4 and 16 (searched in the kernel's phase), then a restart."""
    level(1)
    tuner.clear_all_caches()
    t.configs = [{"ms": 0.5}, {"ms": 0.2}, {"ms": 0.9}]
    with autotune_warmup(t.kernel.kernel_type):
        t(n=4)
        t.configs = [{"ms": 0.3}, {"ms": 0.1}]
        t(n=16)
    t.configs = [{"ms": 0.5}, {"ms": 0.2}, {"ms": 0.9}, {"ms": 0.3}, {"ms": 0.1}]
    tuner.clear_all_caches()
    t.reset_log()


@pytest.mark.parametrize("kind", [GENERAL, DECODE], ids=["general", "decode"])
@pytest.mark.parametrize("phase", [None, GENERAL, DECODE], ids=["no-scope", "general-scope", "decode-scope"])
@pytest.mark.parametrize("lvl", [0, 1, 2, 3])
@pytest.mark.parametrize("n", [4, 9], ids=["cached-key", "missing-key"])
@pytest.mark.parametrize("planned_on", ["arguments", "first-run"])
def test_plan_launches_what_a_call_launches(toy, level, isolated_autotune, kind, phase, lvl, n, planned_on):
    """Every level x phase, a cached run key and a missing one (nearest at level 0, searched at level 1/2 in
    the kernel's phase), planned on arguments or (made from shapes) settled by its first run: a fresh process's
    plan + run launches the config a fresh process's call launches."""
    t = toy(kind)
    _stored(t, level)
    level(lvl)
    x, out = inputs(n)
    with scope(phase):
        plan = t.kernel.plan(x, out) if planned_on == "arguments" else t.kernel.plan()
        plan.run(x, out)
    by_plan, timed_by_plan = t.configs_used()[-1], list(t.bench.timed)
    assert plan.config == by_plan
    torch.testing.assert_close(out, 2.0 * x, rtol=0, atol=0)
    shutil.rmtree(isolated_autotune)  # forget what the plan's search wrote: the call starts from the same files
    _stored(t, level)
    level(lvl)
    with scope(phase):
        t.kernel(x, out)
    assert t.configs_used()[-1] == by_plan and t.bench.timed == timed_by_plan


def test_run_keys_nothing_again(toy, level):
    level(0)
    keyed = []
    t = toy(static_key_func=lambda x, alpha: keyed.append(x.shape) or {"alpha": alpha})
    x, out = inputs(4)
    plan = t.kernel.plan(x, out)
    for _ in range(3):  # three layers
        plan.run(x, out)
    assert keyed == [(4, 3)] and t.configs_used() == [None] * 3
    t.kernel(x, out)
    assert len(keyed) == 2  # a plain call keys every time


def test_plan_in_own_phase_searches_on_rebuilt_inputs(toy, level):
    level(1)
    t = toy(DECODE, rebuild_input_func=lambda named: {**named, "x": torch.randn(64, 3), "out": torch.empty(64, 3)})
    x, out = inputs(2)
    with autotune_warmup(DECODE):
        plan = t.kernel.plan(x, out)
        assert {inp.shape[0] for inp in t.bench.inputs} == {64} and plan.config == {"ms": 0.2}
        t.bench.timed.clear()
        for _ in range(3):
            plan.run(x, out)
    assert t.bench.timed == [] and t.configs_used()[-3:] == [{"ms": 0.2}] * 3
    torch.testing.assert_close(out, 2.0 * x, rtol=0, atol=0)


def test_a_search_in_a_later_scope_makes_an_earlier_plan_stale(toy, level):
    level(1)
    t = toy()
    x, out = inputs(4)
    plan = t.kernel.plan(x, out)  # outside any scope: nothing cached, the default
    plan.run(x, out)
    with autotune_warmup(GENERAL):
        t(n=4)  # searches run key 4
    plan.run(x, out)
    assert t.configs_used()[0] is None and t.configs_used()[-1] == {"ms": 0.2}


def test_a_search_in_the_same_scope_makes_a_plan_stale(toy, level):
    level(0)
    t = toy()
    x, out = inputs(4)
    with autotune_warmup(GENERAL):
        plan = t.kernel.plan(x, out)  # nothing cached: the default
        plan.run(x, out)
        level(1)
        t(n=4)  # another caller searches run key 4 in the same scope
        plan.run(x, out)
    assert t.configs_used()[0] is None and t.configs_used()[-1] == {"ms": 0.2} and plan.config == {"ms": 0.2}


def test_clear_all_caches_makes_plans_stale(toy, level, isolated_autotune):
    level(1)
    t = toy()
    with autotune_warmup(GENERAL):
        t(n=4)
    level(0)
    x, out = inputs(4)
    plan = t.kernel.plan(x, out)
    plan.run(x, out)
    shutil.rmtree(isolated_autotune)
    tuner.clear_all_caches()  # a restart without the files: the default
    plan.run(x, out)
    assert t.configs_used()[-2:] == [{"ms": 0.2}, None] and plan.config is None


def test_first_run_of_a_config_that_raises_drops_it_like_a_call(toy, level, caplog):
    level(1)
    t = toy()
    with autotune_warmup(GENERAL):
        t(n=4)
    tuner.clear_all_caches()
    level(0)
    t.fail.add(0.2)
    t.reset_log()
    x, out = inputs(4)
    plan = t.kernel.plan(x, out)
    assert plan.config == {"ms": 0.2}
    plan.run(x, out)  # fails, the default runs instead and the config is dropped
    plan.run(x, out)
    assert t.configs_used() == [{"ms": 0.2}, None, None] and plan.config is None
    torch.testing.assert_close(out, 2.0 * x, rtol=0, atol=0)
    assert any("dropped cached config" in r.getMessage() for r in caplog.records)


def test_level_off_plans_the_default(toy, level):
    level(1)
    t = toy()
    with autotune_warmup(GENERAL):
        t(n=4)
    level(3)
    x, out = inputs(4)
    plan = t.kernel.plan(x, out)
    plan(x, out)
    assert plan.config is None and t.configs_used()[-1] is None


def test_a_plan_without_arguments_settles_on_its_first_run(toy, level):
    level(0)
    keyed = []
    t = toy(static_key_func=lambda x, alpha: keyed.append(x.shape) or {"alpha": alpha})
    plan = t.kernel.plan()
    assert keyed == [] and plan.config is None and t.configs_used() == []
    x, out = inputs(4)
    for _ in range(3):
        plan.run(x, out)
    assert keyed == [(4, 3)] and t.configs_used() == [None] * 3


def test_a_plan_of_an_explicit_run_config_launches_it_untuned(toy, level):
    level(1)
    keyed = []
    t = toy(static_key_func=lambda x, alpha: keyed.append(x.shape) or {"alpha": alpha})
    plan = t.kernel.plan(run_config={"ms": 0.9})
    x, out = inputs(4)
    with autotune_warmup(GENERAL):  # even in its own phase at level 1: no keys, no search
        plan.run(x, out)
    assert keyed == [] and t.bench.timed == [] and t.configs_used() == [{"ms": 0.9}]
