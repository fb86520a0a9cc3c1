import json

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, get_autotune_stats, set_bench_func, store
from lightllm.kernels.norm.rmsnorm import _launch_rmsnorm, rmsnorm, rmsnorm_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def fresh_tuner_state():
    _launch_rmsnorm.clear_cache()
    yield
    _launch_rmsnorm.clear_cache()


def _check(x, w, out, eps=1e-6):
    ref = rmsnorm_ref(x.double().to(x.dtype), w, eps)
    assert not out.isnan().any(), "some output elements were never written"
    tol = 1e-5 if x.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "shape, config",
    [
        ((1, 64), None),
        ((5, 100), None),
        ((3, 300), {"BLOCK_N": 512, "num_warps": 4}),  # one pass, masked tail
        ((3, 300), {"BLOCK_N": 64, "num_warps": 1}),  # two chunked passes, ragged last chunk
        ((2, 3, 128), {"BLOCK_N": 128, "num_warps": 2}),  # leading dims flattened
    ],
    ids=["row1", "rows5-N100", "onepass", "twopass", "3d"],
)
def test_matches_reference(dtype, shape, config):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, device=DEVICE) * 3
    w = torch.rand(shape[-1], dtype=dtype, device=DEVICE) + 0.5
    out = torch.full_like(x, float("nan"))
    rmsnorm(x, w, 1e-6, out=out, run_config=config)
    _check(x, w, out)


def test_bad_inputs_are_value_errors():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="x must be one of"):
        rmsnorm(x.to(torch.int32), torch.ones(8, device=DEVICE))
    with pytest.raises(ValueError, match=r"weight must be \[8\]"):
        rmsnorm(x, torch.ones(9, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous last dim"):
        rmsnorm(torch.randn(8, 2, device=DEVICE).t(), torch.ones(8, device=DEVICE))
    with pytest.raises(
        ValueError, match=r"out expected a \(2, 8\) torch.float32 tensor, .* got \(2, 8\) torch.float16"
    ):
        rmsnorm(x, torch.ones(8, device=DEVICE), out=torch.empty(2, 8, dtype=torch.float16, device=DEVICE))
    # the function takes what a plan's run takes: 2-D rows with a contiguous last dim, here half of wider rows
    wide = torch.full((2, 16), float("nan"), device=DEVICE)
    w = torch.rand(8, device=DEVICE) + 0.5
    rmsnorm(x, w, out=wide[:, 8:])
    torch.testing.assert_close(wide[:, 8:], rmsnorm_ref(x, w))
    assert wide[:, :8].isnan().all()  # the other half untouched


def test_real_triton_kernel_through_the_tuner(monkeypatch, isolated_autotune):
    """Level 1, GENERAL warmup: every candidate compiles and runs through the real kernel; a timer that makes one
    candidate (not the launcher's pick for N=300) fastest decides the stored winner, which level 0 then reuses."""
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    fastest = {"BLOCK_N": 256, "num_warps": 2}
    launched = []
    launcher = _launch_rmsnorm.fn

    def recording_launcher(*args, run_config=None, **kwargs):
        launched.append(run_config)
        return launcher(*args, run_config=run_config, **kwargs)

    def timer(run):
        run()
        return 0.3 if launched[-1] == fastest else (1.0 if launched[-1] is None else 0.5)

    monkeypatch.setattr(_launch_rmsnorm, "fn", recording_launcher)
    set_bench_func(timer)
    torch.manual_seed(1)
    x = torch.randn(4, 300, device=DEVICE)
    w = torch.rand(300, device=DEVICE)
    before = get_autotune_stats()
    with autotune_warmup(AutotuneKernelType.GENERAL):
        out = rmsnorm(x, w)
    done = get_autotune_stats() - before
    _check(x, w, out)
    assert done.searches == 1 and done.candidates_timed == 10 and done.candidates_rejected == 0  # default + 9
    (path,) = store.iter_config_files(isolated_autotune, "rmsnorm")
    data = json.loads(path.read_text())
    assert data["configs"] == {"4": fastest}
    assert {k: data["timings"]["4"][k] for k in ("best_ms", "default_ms", "candidates")} == {
        "best_ms": 0.3,
        "default_ms": 1.0,
        "candidates": 9,
    }
    _launch_rmsnorm.clear_cache()
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "0")
    launched.clear()
    out2 = torch.full_like(x, float("nan"))
    rmsnorm(x, w, out=out2)
    _check(x, w, out2)
    assert launched == [fastest]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_plan_writes_a_column_block_of_a_wider_buffer(dtype):
    """A 2-D ``out`` with strided rows (Qwen3.5's MTP head: each norm into its half of the fc input): the block holds
    the norm, bit for bit a contiguous run's, and the buffer's other columns are untouched (still NaN)."""
    from lightllm.kernels.norm.rmsnorm import RMSNormPlan

    torch.manual_seed(3)
    x, h = torch.randn(5, 48, dtype=dtype, device=DEVICE) * 2, torch.randn(5, 48, dtype=dtype, device=DEVICE)
    w = 1 + torch.randn(48, device=DEVICE) * 0.3  # a zero-centred norm's float32 scale
    plan = RMSNormPlan(x.shape, dtype, weight_dtype=torch.float32)
    buf = torch.full((5, 96), float("nan"), dtype=dtype, device=DEVICE)
    plan.run(x, w, out=buf[:, :48])
    assert buf[:, 48:].isnan().all()
    plan.run(h, w, out=buf[:, 48:])
    assert torch.equal(buf[:, :48], plan.run(x, w)) and torch.equal(buf[:, 48:], plan.run(h, w))
    torch.testing.assert_close(buf, torch.cat([rmsnorm_ref(x, w), rmsnorm_ref(h, w)], dim=-1), rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match=r"rmsnorm: out expected a \(5, 1, 48\) .* got \(5, 1, 48\) .* strides "
                                         r"\(96, 96, 1\)"):  # fmt: skip
        RMSNormPlan((5, 1, 48), dtype, weight_dtype=torch.float32).run(x[:, None], w, out=buf[:, None, :48])


def test_plan_checks_and_resolves_once_for_every_call_of_its_shape(monkeypatch):
    from lightllm.kernels.norm import rmsnorm as module
    from lightllm.kernels.norm.rmsnorm import RMSNormPlan

    planned, checked = [], []
    real_plan, real_check = _launch_rmsnorm.plan, module._check
    monkeypatch.setattr(_launch_rmsnorm, "plan", lambda *a, **k: planned.append(a) or real_plan(*a, **k))
    monkeypatch.setattr(module, "_check", lambda *a: checked.append(a) or real_check(*a))
    x = torch.randn(4, 64, device=DEVICE)
    plan = RMSNormPlan(x.shape, x.dtype)
    for layer in range(3):
        w = torch.rand(64, device=DEVICE) + 0.5
        y = torch.randn(4, 64, device=DEVICE)
        _check(y, w, plan.run(y, w))
    assert len(planned) == 1 and not checked  # planned from the shape; runs check only what a layer can change
    with pytest.raises(ValueError, match=r"rmsnorm plan: x expected the planned \(4, 64\) torch.float32"):
        plan.run(torch.randn(5, 64, device=DEVICE), w)
    with pytest.raises(ValueError, match="contiguous last dim"):
        plan.run(torch.randn(64, 4, device=DEVICE).t(), w)
    with pytest.raises(
        ValueError,
        match=r"rmsnorm: out expected a \(4, 64\) torch.float32 tensor, contiguous \(2-D: "
        r"its last dim only\), got \(4, 64\) torch.float32 strides \(1, 4\)",
    ):
        plan.run(x, w, out=torch.empty(64, 4, device=DEVICE).t())
    with pytest.raises(
        ValueError, match=r"rmsnorm plan: weight expected the planned \(64,\) torch.float32, got \(9,\)"
    ):
        plan.run(x, torch.ones(9, device=DEVICE))
    with pytest.raises(
        ValueError, match=r"weight expected the planned \(64,\) torch.float32, got \(64,\) torch.float16"
    ):
        plan.run(x, torch.ones(64, device=DEVICE, dtype=torch.float16))  # its dtype is part of the tuning key
    with pytest.raises(
        ValueError, match=r"rmsnorm plan: x expected a \[..., N\] tensor of .*, got \(4, 64\) torch.int32"
    ):
        RMSNormPlan((4, 64), torch.int32)
