import os
import sys
from pathlib import Path

import pytest
import torch

from lightllm.common import envs
from tests import ttir_lowering

# On a CPU-only machine Triton kernels run through the interpreter; set it before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # transformers binds Qwen3.5's delta rule to fla-core's kernels when its modeling module imports with fla
    # installed; the CPU oracle must take transformers' torch path, so fla is hidden for that one import (the
    # kernels' tests still use fla itself, through the interpreter, as a second oracle).
    sys.modules["fla"] = None
    try:
        import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401
    except ImportError:
        pass
    finally:
        del sys.modules["fla"]
# Every interpreted kernel launch of the session is recorded; tests/test_ttir_lowering.py lowers them for sm90 last.
SESSION_LAUNCHES = ttir_lowering.LaunchRecorder()
if ttir_lowering.interpreting():
    ttir_lowering.push(SESSION_LAUNCHES)
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models in tests are made locally; never reach for a hub

# Tests start from a clean environment. Cleared here too, not only per test, so that module- and session-scoped
# fixtures (and the servers they start) do not see the caller's LIGHTLLM_* settings either.
for _name in envs.ALL:
    os.environ.pop(_name, None)


def pytest_collection_modifyitems(config, items):
    # stable sort: the checks of the whole session's work go last
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_DESELECTED = pytest.StashKey[bool]()


def pytest_deselected(items):
    if items:
        items[0].config.stash[_DESELECTED] = True


@pytest.fixture(scope="session")
def session_launches():
    """The recorder of every interpreted kernel launch in this session (empty without the interpreter)."""
    return SESSION_LAUNCHES


@pytest.fixture(scope="session")
def whole_suite(request) -> bool:
    """Whether this session runs every test under tests/ (``pytest`` or ``pytest tests``, none deselected by
    ``-k``, ``-m``, ``--lf``, ... or left out by ``--ignore``)."""
    config = request.config
    base = config.rootpath if config.args_source == pytest.Config.ArgsSource.TESTPATHS else config.invocation_params.dir
    paths = {(base / arg).resolve() for arg in config.args}
    skipped = config.stash.get(_DESELECTED, False) or config.getoption("ignore") or config.getoption("ignore_glob")
    return paths == {Path(__file__).resolve().parent} and not skipped


@pytest.fixture(scope="session")
def tiny_model_home(tmp_path_factory):
    """Where a test that asks for the built-in tiny model gets it: built once per session, never in ~/.cache."""
    return tmp_path_factory.mktemp("tiny-model") / "tiny"


@pytest.fixture(autouse=True)
def isolated_autotune(tmp_path, monkeypatch, tiny_model_home):
    """Each test gets empty config roots, every LIGHTLLM_* variable at its default, the default timer, a search
    clock that never spends a budget (a busy machine must not cut a search short), no decode graph length buckets
    declared and no open warmup scope."""
    from lightllm.common.autotuner import bench, phase, store, tuner
    from lightllm.kernels.attention.decode import tuning as decode_tuning

    for name in envs.ALL:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(envs.AUTOTUNE_CONFIG_DIR, str(tmp_path / "autotune"))
    monkeypatch.setenv(envs.TINY_MODEL_DIR, str(tiny_model_home))
    monkeypatch.setattr(tuner, "search_clock", lambda: 0.0)
    monkeypatch.setattr(store, "SHIPPED_ROOT", tmp_path / "shipped")
    monkeypatch.setattr(store, "_warned_paths", set())
    bench.set_bench_func(None)
    monkeypatch.setattr(decode_tuning, "_graph_lens", ())  # a runner with length buckets declares them process-wide
    yield tmp_path / "autotune"
    bench.set_bench_func(None)
    assert not phase._phase_stack, "a test left a warmup scope open"
