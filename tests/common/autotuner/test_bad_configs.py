"""Cached configs that cannot run: not among the kernel's candidates (caught at load) or failing to launch.
Either is dropped with one warning and the run key falls back to the default (level 0, or outside the
kernel's phase) or to a fresh search (level 1/2 in its phase); the call's output is right either way."""

import json
import logging

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, store
from lightllm.common.autotuner.space import CandidateSpace

GENERAL = AutotuneKernelType.GENERAL
GOOD = [{"BLOCK_N": 32, "ms": 0.5}, {"BLOCK_N": 64, "ms": 0.2}, {"BLOCK_N": 64, "ms": 0.9}]
BAD = {
    "missing key": ({"BLOCK_N": 64}, "missing keys ['ms']"),
    "wrong value": ({"BLOCK_N": 100, "ms": 0.2}, "BLOCK_N=100 is not one of [32, 64]"),
    "wrong type": ({"BLOCK_N": "64", "ms": 0.2}, "BLOCK_N='64' is not one of [32, 64]"),
    "unknown key": ({"BLOCK_N": 64, "ms": 0.2, "BLOCK_M": 16}, "unknown keys ['BLOCK_M']"),
}


def write_configs(toy_kernel, root, configs):
    path = store.ConfigStore(toy_kernel.name).path(root, (("alpha", 2.0), ("dtype", "torch.float32")))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": 1, "configs": configs}))
    return path


def warnings_of(caplog, kernel_name):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and kernel_name in r.getMessage()]


@pytest.mark.parametrize("bad", BAD, ids=list(BAD))
@pytest.mark.parametrize("key", ["exact", "nearest"])
@pytest.mark.parametrize("level", [0, 1])
def test_config_outside_the_candidates_is_dropped_at_load(toy, monkeypatch, caplog, isolated_autotune, bad, key, level):
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", str(level))
    t = toy(configs=GOOD)
    config, why = BAD[bad]
    path = write_configs(t, isolated_autotune, {"8" if key == "exact" else "6": config})
    with caplog.at_level(logging.WARNING, logger="lightllm.common.autotuner"):
        with autotune_warmup(GENERAL):
            t(n=8)  # Toy checks the output
        t(n=8)
    (warning,) = warnings_of(caplog, t.name)
    assert json.dumps(config, separators=(",", ":"), sort_keys=True) in warning
    assert str(path) in warning and why in warning and "not among the kernel's candidates" in warning
    expected = {"BLOCK_N": 64, "ms": 0.2} if level == 1 else None  # a fresh search, or the default
    assert t.configs_used()[-2:] == [expected, expected]
    assert all(cfg is None or cfg in GOOD for cfg in t.configs_used())  # the bad config never launched


def test_valid_entries_beside_a_bad_one_stay_and_candidates_are_asked_once(toy, caplog, isolated_autotune):
    t = toy(configs=GOOD)
    asked = []
    t.kernel.configs_gen_func = lambda: asked.append(1) or GOOD
    write_configs(t, isolated_autotune, {"8": GOOD[1], "16": {"BLOCK_N": 100, "ms": 0.2}, "32": None})
    with caplog.at_level(logging.WARNING, logger="lightllm.common.autotuner"):
        for n in (8, 16, 32, 8, 16, 32):
            t(n=n)
    assert t.configs_used() == [GOOD[1], GOOD[1], None] * 2  # 16: nearest valid key is 8
    assert len(warnings_of(caplog, t.name)) == 1 and asked == [1]  # checked once, at load


@pytest.mark.parametrize("level", [0, 1])
def test_a_stale_user_config_leaves_the_shipped_config_of_its_key_in_place(toy, monkeypatch, caplog,
                                                                           isolated_autotune, level):  # fmt: skip
    """The user's cache holds a config the kernel no longer offers (an upgrade changed its candidates) for a run key
    the package ships: the shipped config is used, as when the cache had no entry, not the default."""
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", str(level))
    t = toy(configs=GOOD)
    write_configs(t, store.SHIPPED_ROOT, {"8": GOOD[0]})
    path = write_configs(t, isolated_autotune, {"8": BAD["wrong value"][0]})
    with caplog.at_level(logging.WARNING, logger="lightllm.common.autotuner"):
        with autotune_warmup(GENERAL):
            t(n=8)
        t(n=8)
    (warning,) = warnings_of(caplog, t.name)
    assert str(path) in warning and "BLOCK_N=100 is not one of [32, 64]" in warning
    assert t.configs_used() == [GOOD[0]] * 3  # the warm-up's compile run, then both calls; no search
    assert t.bench.timed == []


def test_no_file_asks_no_candidates(toy):
    t = toy(configs=GOOD)
    t.kernel.configs_gen_func = lambda: pytest.fail("configs_gen_func called without configs to check")
    t(n=8)
    t(n=8)
    assert t.configs_used() == [None, None]


@pytest.mark.parametrize("key", ["exact", "nearest"])
@pytest.mark.parametrize("level, phase, warm_all", [(0, None, True), (0, GENERAL, True), (1, GENERAL, True),
                                                    (1, GENERAL, False), (1, None, True)])  # fmt: skip
def test_config_that_fails_to_launch_is_dropped(toy, monkeypatch, caplog, isolated_autotune, key, level, phase,
                                                warm_all):  # fmt: skip
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", str(level))
    t = toy(configs=GOOD, warmup_all_exist_config=warm_all)
    t.fail.add(0.2)  # a candidate, but it raises (say, out of shared memory on this GPU)
    path = write_configs(t, isolated_autotune, {"8" if key == "exact" else "6": GOOD[1], "1024": GOOD[2]})
    with caplog.at_level(logging.WARNING, logger="lightllm.common.autotuner"):
        for _ in range(3):
            if phase is None:
                t(n=8)
            else:
                with autotune_warmup(phase):
                    t(n=8)
    searched = level == 1 and phase is GENERAL
    launched = warm_all or not searched or key == "exact"  # else a search, not the nearest key, serves 8
    if launched:
        (warning,) = warnings_of(caplog, t.name)
        assert '{"BLOCK_N":64,"ms":0.2}' in warning and str(path) in warning
        assert "failed to launch (RuntimeError: out of resources)" in warning
    else:
        assert warnings_of(caplog, t.name) == []
    # a fresh search's best that runs, else the run key is a miss: the one entry left is the nearest
    expected = {"BLOCK_N": 32, "ms": 0.5} if searched else GOOD[2]
    assert t.configs_used()[-2:] == [expected, expected]
    # never retried; a search times it once more (it scores infinity)
    assert [cfg for cfg in t.configs_used() if cfg == GOOD[1]] == [GOOD[1]] * (launched + searched)
    if searched:
        assert json.loads(path.read_text())["configs"]["8"] == expected


def test_input_error_keeps_the_config(toy, isolated_autotune):
    """A launch that fails with the default too is the caller's fault: the error surfaces, the config stays."""
    t = toy(configs=GOOD)
    write_configs(t, isolated_autotune, {"8": GOOD[1]})
    with pytest.raises(RuntimeError, match="can't be cast"):
        t.kernel(torch.ones(8, 3), torch.empty(8, 3, dtype=torch.int64))  # an int `out`: every config fails
    t(n=8)
    assert t.configs_used()[-1] == GOOD[1]


@pytest.mark.parametrize(
    "config, why",
    [
        (None, None),
        ({"ms": 0.2, "BLOCK_N": 64}, None),  # key order does not matter
        ({"BLOCK_N": 64, "ms": 0.2, "x": None}, "unknown keys ['x']"),
        ({"BLOCK_N": 64.0, "ms": 0.2}, "BLOCK_N=64.0 is not one of [32, 64]"),
        ({"BLOCK_N": True, "ms": 0.2}, "BLOCK_N=True is not one of [32, 64]"),
        ({"BLOCK_N": 32, "ms": 0.9}, "not one of the 3 candidate combinations"),
        ([64], "expected an object, got [64]"),
    ],
)
def test_candidate_space_says_why(config, why):
    assert CandidateSpace("k", GOOD + [dict(GOOD[0])]).why_not(config) == why


def test_candidate_space_rejects_non_dict_candidates():
    with pytest.raises(TypeError, match="autotune kernel 'k': configs_gen_func yielded 3, not dict"):
        CandidateSpace("k", [{"a": 1}, 3])


@pytest.mark.parametrize("fails", [False, True], ids=["runs", "fails"])
def test_first_launch_never_clones_what_the_kernel_mutates(toy, monkeypatch, isolated_autotune, fails):
    """A live first launch of a cached config must not copy in-place arguments (a linear-attention kernel's
    real state pool is huge); a config that raises does so before its kernel writes anything."""
    from lightllm.common.autotuner import tuner

    t = toy(configs=GOOD, mutates_args=("out",), output_args=())
    if fails:
        t.fail.add(0.2)
    write_configs(t, isolated_autotune, {"8": GOOD[1]})
    monkeypatch.setattr(tuner, "_Snapshot", lambda *a: pytest.fail("cloned the mutated arguments"))
    t(n=8)
    t(n=8)
    assert t.configs_used()[-1] == (None if fails else GOOD[1])


def test_a_dropped_config_is_forgotten_by_run_keys_that_already_launched_it(toy, isolated_autotune):
    """Run key 9 (nearest: 8) finds the cached config failing to launch; run key 8, which had launched it, now
    counts as a miss too ("its run keys count as misses") and takes the nearest entry left, not its memo of the
    dropped config."""
    t = toy(configs=GOOD)
    write_configs(t, isolated_autotune, {"8": GOOD[1], "1024": GOOD[2]})
    t(n=8)
    t.fail.add(0.2)  # fails for the larger input only
    t(n=9)
    t.fail.discard(0.2)
    t(n=8)
    assert t.configs_used() == [GOOD[1], GOOD[1], None, GOOD[2]]
