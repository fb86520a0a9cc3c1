import os

import pytest
import torch

# On a CPU-only machine Triton kernels run through the interpreter; set it before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models in tests are made locally; never reach for a hub

_LIGHTLLM_ENV = (
    "LIGHTLLM_TRITON_AUTOTUNE_LEVEL",
    "LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN",
    "LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH",
)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def isolated_autotune(tmp_path, monkeypatch):
    """Each test gets empty config roots, default env, the default timer and no open warmup scope."""
    from lightllm.common.autotuner import bench, phase, store

    for name in _LIGHTLLM_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LIGHTLLM_AUTOTUNE_CONFIG_DIR", str(tmp_path / "autotune"))
    monkeypatch.setattr(store, "SHIPPED_ROOT", tmp_path / "shipped")
    monkeypatch.setattr(store, "_warned_paths", set())
    bench.set_bench_func(None)
    yield tmp_path / "autotune"
    bench.set_bench_func(None)
    assert not phase._phase_stack, "a test left a warmup scope open"
