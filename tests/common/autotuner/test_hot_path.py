"""The tuned call at a launched key: keyed once, positionally, and resolved with one dict look-up."""

import json

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup
from lightllm.common.autotuner.keys import ParamPicker, freeze, key_caller


@pytest.fixture
def level(monkeypatch):
    return lambda n: monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", str(n))


def launcher(x, out, alpha=2.0, beta=None, *, gamma=1, run_config=None):
    return out


@pytest.mark.parametrize(
    "args, kwargs",
    [
        (("X", "O"), {}),  # defaults filled
        (("X", "O", 3.0), {}),
        (("X", "O", 3.0, "b"), {}),
        (("X",), {"out": "O", "alpha": 4.0}),
        ((), {"x": "X", "out": "O", "beta": "b", "gamma": 5}),
    ],
)
@pytest.mark.parametrize("names", [("x",), ("alpha",), ("x", "alpha", "beta"), ("beta", "x"), ("gamma", "x")])
def test_key_caller_passes_what_pick_picks(args, kwargs, names):
    picker = ParamPicker("k", launcher, names)
    namespace = {}  # a key function naming exactly these launcher parameters, returning them in its order
    exec(f"def key_func({', '.join(names)}):\n    return ({', '.join(names)},)", namespace)
    key_func = namespace["key_func"]
    assert key_caller(picker, key_func)(args, kwargs) == tuple(picker.pick(args, kwargs).values())


@pytest.mark.parametrize(
    "key",
    [
        {"b": 1, "a": 2.5, "c": "s", "d": None, "e": True},
        {"a": [1, 2], "b": {"y": 1, "x": 2}},
        {"dtype": torch.float16, "n": 3},
        {2: "int key", "a": 1},
        {},
    ],
)
def test_freeze_of_a_dict_is_sorted_json_round_trippable(key):
    frozen = freeze(key)
    assert frozen == tuple(sorted((str(k), freeze(v)) for k, v in key.items()))
    assert freeze(json.loads(json.dumps(dict(frozen), default=str))) == frozen
    hash(frozen)


def test_call_at_a_launched_key_keys_once_and_skips_the_resolver(toy, level, monkeypatch):
    """Serving (no warmup scope): the call keys once and launches the memoized config without the resolver."""
    level(0)
    keyed = []
    t = toy(static_key_func=lambda x, alpha: keyed.append(1) or {"alpha": alpha})
    t()  # first launch at run key 4: resolved and memoized
    resolver_calls = []
    real = t.kernel._resolve
    monkeypatch.setattr(t.kernel, "_resolve", lambda *a: resolver_calls.append(a) or real(*a))
    keyed.clear()
    for _ in range(3):
        t()
    assert keyed == [1, 1, 1] and resolver_calls == [] and t.configs_used() == [None] * 4


def test_alternating_static_keys_each_launch_their_own_config(toy, level, isolated_autotune):
    """Consecutive calls reuse the last static key's frozen form only when the key is equal: calls that alternate
    between two static keys (and a key whose value changes) each launch the config searched for their own key."""
    level(1)
    t = toy(static_key_func=lambda x, alpha: {"width": x.shape[1], "alpha": alpha})
    narrow, wide = (torch.randn(4, 3), torch.empty(4, 3)), (torch.randn(4, 5), torch.empty(4, 5))
    with autotune_warmup(AutotuneKernelType.GENERAL):
        t.kernel(*narrow)  # searched: {"ms": 0.2} is fastest
        t.configs = [{"ms": 0.3}, {"ms": 0.1}]
        t.kernel(*wide)  # searched: {"ms": 0.1}
    level(0)
    t.reset_log()
    for _ in range(2):
        t.kernel(*narrow)
        t.kernel(*wide)
        t.kernel(*narrow, 3.0)  # alpha 3.0: a static key with no config, the default
    assert t.configs_used() == [{"ms": 0.2}, {"ms": 0.1}, None] * 2
