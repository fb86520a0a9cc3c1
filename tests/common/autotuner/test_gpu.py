"""On a CUDA GPU: the real CUDA-graph timer, a real search, and the capture guard."""

import json
import math

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, cuda_graph_bench, store
from lightllm.kernels.norm.rmsnorm import _launch_rmsnorm, rmsnorm, rmsnorm_ref

pytestmark = pytest.mark.gpu
GENERAL = AutotuneKernelType.GENERAL


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    _launch_rmsnorm.clear_cache()
    yield
    _launch_rmsnorm.clear_cache()


def test_cuda_graph_bench_agrees_with_event_timing():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    graph_ms = cuda_graph_bench(lambda: torch.mm(a, b, out=c))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        torch.mm(a, b, out=c)
    start.record()
    for _ in range(50):
        torch.mm(a, b, out=c)
    end.record()
    torch.cuda.synchronize()
    eager_ms = start.elapsed_time(end) / 50
    assert 0.8 * eager_ms < graph_ms < 1.2 * eager_ms  # a 0.2 ms kernel: launch overhead is noise here


def test_search_with_graph_timer_stores_a_correct_config(isolated_autotune):
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16)
    with autotune_warmup(GENERAL):
        out = rmsnorm(x, w)
    record = _launch_rmsnorm.last_search
    assert record is not None and record.run_key == 4096
    assert all(ms[0] > 0 for _, ms in record.timings)
    # The winner is the fastest of everything measured, the default included (a rule that took, say, the first
    # or the last candidate fails here) ...
    measured = [record.default_ms[0]] + [ms[0] for _, ms in record.timings]
    assert record.chosen_ms[0] == min(measured)
    # ... every candidate compiled and ran on this GPU (a timer or launcher that failed would score inf) ...
    assert all(math.isfinite(ms[0]) for _, ms in record.timings) and len(record.timings) == 14
    torch.testing.assert_close(out.float(), rmsnorm_ref(x, w).float(), rtol=1e-2, atol=1e-2)
    (path,) = store.iter_config_files(isolated_autotune, "rmsnorm")
    # ... and the file holds what was chosen and measured (no speed is asserted here: benchmarks/ measure speed)
    data = json.loads(path.read_text())
    assert data["configs"]["4096"] == record.chosen
    timing = data["timings"]["4096"]
    assert (timing["best_ms"], timing["default_ms"]) == (round(record.chosen_ms[0], 6), round(record.default_ms[0], 6))


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_capture_uses_cache_and_refuses_to_search():
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    with autotune_warmup(GENERAL):
        rmsnorm(x, w, out=out)  # searches and compiles before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            rmsnorm(x, w, out=out)  # cache hit while capturing
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), rmsnorm_ref(x, w).float(), rtol=1e-2, atol=1e-2)
        y = torch.randn(96, 4096, device="cuda", dtype=torch.bfloat16)
        other = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="refusing to search while a CUDA graph is being captured"):
            with torch.cuda.graph(other):
                rmsnorm(y, w)


@pytest.mark.parametrize("threads", [1, 4])
def test_candidates_compile_ahead_on_the_pool_from_a_cold_cache(isolated_autotune, monkeypatch, tmp_path, threads):
    """A cold Triton cache (on disk and in process): with 4 threads every candidate's kernel compiles on the pool
    before the first timing and the timings find them compiled; with 1 each compiles as it is first timed. The
    search is as correct either way."""
    from lightllm.kernels import direct_launch
    from lightllm.kernels.norm.rmsnorm import _RMSNORM

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("LIGHTLLM_AUTOTUNE_COMPILE_THREADS", str(threads))
    monkeypatch.setattr(direct_launch, "_enabled", False)  # no binding from an earlier test launches uncompiled
    _RMSNORM.kernel.device_caches.clear()
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16)
    with autotune_warmup(GENERAL):
        out = rmsnorm(x, w)
    record = _launch_rmsnorm.last_search
    assert all(math.isfinite(ms[0]) for _, ms in record.timings) and len(record.timings) == 14
    assert record.chosen_ms[0] == min([record.default_ms[0]] + [ms[0] for _, ms in record.timings])
    torch.testing.assert_close(out.float(), rmsnorm_ref(x, w).float(), rtol=1e-2, atol=1e-2)
    compiled = len(_RMSNORM.kernel.device_caches[torch.cuda.current_device()][0])
    distinct = len({json.dumps(c, sort_keys=True) for c, _ in record.timings})  # every candidate differs in a constexpr
    if threads == 1:
        assert record.kernels_compiled == 0 and record.compile_seconds == 0
    else:  # the default's kernel and each candidate's, each sent to the pool once
        assert distinct <= record.kernels_compiled <= distinct + 1 and compiled >= record.kernels_compiled
        assert record.compile_seconds <= record.seconds  # both on the search clock (frozen by the fixture)
