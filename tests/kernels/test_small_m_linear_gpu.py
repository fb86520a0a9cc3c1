"""The small-M linear on the GPU in bf16 at Qwen3-8B shapes: every candidate against a float64 reference, CUDA-graph
replay equal to eager bit for bit, the default equal to cuBLAS, and a real search never slower than cuBLAS."""

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup
from lightllm.kernels.linear.reference import linear_ref
from lightllm.kernels.linear.small_m_linear import SmallMLinearPlan, _configs, _launch_small_m_linear

pytestmark = pytest.mark.gpu

BF16, F32 = torch.bfloat16, torch.float32
QWEN3_8B = {"qkv": (6144, 4096, BF16), "o": (4096, 4096, BF16), "gate_up": (24576, 4096, BF16),
            "down": (4096, 12288, BF16), "lm_head": (151936, 4096, F32)}  # fmt: skip


@pytest.fixture(autouse=True)
def fresh_tuner_state():
    _launch_small_m_linear.clear_cache()
    yield
    _launch_small_m_linear.clear_cache()


def _inputs(m, n, k, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device="cuda").to(BF16)
    w = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(BF16)
    return x, w


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("proj", list(QWEN3_8B))
def test_every_candidate_matches_float64_and_replays_bit_for_bit(proj, m):
    n, k, out_dtype = QWEN3_8B[proj]
    x, w = _inputs(m, n, k, seed=m)
    ref = linear_ref(x, w, torch.float64)
    tol = 1e-4 if out_dtype == F32 else 1e-2  # float32: written from the accumulator; bf16: one rounding
    configs = _configs(x, w)
    assert len(configs) == 24
    for config in configs:
        plan = SmallMLinearPlan(m, n, k, BF16, out_dtype, run_config=config)
        out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
        plan.run(x, w, out=out)
        torch.cuda.synchronize()
        assert not out.isnan().any(), config
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol, msg=lambda e: f"{config}: {e}")
        eager = out.clone()
        assert torch.equal(plan.run(x, w, out=out), eager), config  # two runs: the same bits
        graph = torch.cuda.CUDAGraph()
        out.fill_(float("nan"))
        with torch.cuda.graph(graph):
            plan.run(x, w, out=out)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), config


@pytest.mark.parametrize("proj", ["qkv", "lm_head"])
def test_default_is_cublas_bit_for_bit(proj):
    n, k, out_dtype = QWEN3_8B[proj]
    x, w = _inputs(4, n, k, seed=3)
    w_t = w.t()
    expected = torch.mm(x, w_t, out_dtype=out_dtype) if out_dtype == F32 else torch.mm(x, w_t)
    assert torch.equal(SmallMLinearPlan(4, n, k, BF16, out_dtype).run(x, w, w_t), expected)


def test_a_real_search_never_picks_slower_than_cublas(monkeypatch):
    """Level 1 in the GENERAL warm-up with the CUDA-graph timer at Qwen3-8B's o_proj: the winner's time is at most
    the default's (cuBLAS); the result matches the reference whichever wins."""
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    n, k, _ = QWEN3_8B["o"]
    x, w = _inputs(1, n, k, seed=4)
    with autotune_warmup(AutotuneKernelType.GENERAL):
        out = SmallMLinearPlan(1, n, k, BF16).run(x, w)
    record = _launch_small_m_linear.last_search
    assert record is not None and record.run_key == 16
    assert record.chosen_ms[0] <= record.default_ms[0]
    torch.testing.assert_close(out.double(), linear_ref(x, w, torch.float64), rtol=1e-2, atol=1e-2)
