"""The small-M linear (decode GEMV): every candidate against a float64 reference under the interpreter, the
untuned default (cuBLAS's ``torch.mm``) bit for bit, the search, and bad inputs."""

import json

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, get_autotune_stats, set_bench_func, store
from lightllm.kernels.linear import small_m_linear as module
from lightllm.kernels.linear.reference import linear_ref
from lightllm.kernels.launch_math import SM90_MAX_SHARED_BYTES
from lightllm.kernels.linear.small_m_linear import (
    CANDIDATES,
    SmallMLinearPlan,
    _configs,
    _launch_small_m_linear,
    linear_op,
    pipeline_shared_bytes,
    small_m_linear,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, K = 100, 300  # multiples of no block: ragged column blocks and K tails; SPLIT_K 8 leaves trailing slices empty


@pytest.fixture(autouse=True)
def fresh_tuner_state():
    _launch_small_m_linear.clear_cache()
    yield
    _launch_small_m_linear.clear_cache()


def _inputs(m, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype).to(DEVICE)
    return x, w


def _assert_matches(out, x, w, out_dtype):
    assert not out.isnan().any(), "some output elements were never written"
    ref = linear_ref(x, w, torch.float64)
    if out_dtype == torch.float32:  # float32 products and sums (fp16 inputs: written from the float32 accumulator,
        tol = 1e-5  # never rounded to fp16, whose steps here are ~1e-3)
    else:
        tol = 2e-3
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["out-x-dtype", "out-fp32"])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_every_candidate_matches_float64(dtype, m, out_dtype):
    x, w = _inputs(m, dtype, seed=m)
    assert any(c["SPLIT_K"] > 1 for c in CANDIDATES) and len(CANDIDATES) == 24
    for config in _configs(x, torch.empty(N, 4096, dtype=dtype)):  # every block size and split, if it fits sm_90
        out = torch.full((m, N), float("nan"), dtype=out_dtype or dtype, device=DEVICE)
        returned = small_m_linear(x, w, out_dtype, out=out, run_config=config)
        assert returned is out
        _assert_matches(out, x, w, out_dtype or dtype)


def test_split_partials_are_reused_and_runs_agree_bit_for_bit():
    """One plan's runs share its split workspace (every layer of a step): a second input gets its own result, and
    the same input twice gives the same bits (slices summed in order, no atomics)."""
    config = {"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4, "num_stages": 4}
    plan = SmallMLinearPlan(3, N, K, torch.float16, run_config=config)
    (x1, w1), (x2, w2) = _inputs(3, torch.float16, seed=1), _inputs(3, torch.float16, seed=2)
    first = plan.run(x1, w1)
    second = plan.run(x2, w2)
    _assert_matches(first, x1, w1, torch.float16)
    _assert_matches(second, x2, w2, torch.float16)
    assert len(plan._scratch) == 1
    assert torch.equal(plan.run(x1, w1), first)


@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["out-x-dtype", "out-fp32"])
@pytest.mark.parametrize("m", [1, 16, 40])
def test_untuned_default_is_torch_mm_bit_for_bit(m, out_dtype):
    """Nothing tuned (level 0, empty config roots): every run is ``torch.mm`` on the weight's transposed view,
    what the models called before this kernel; float32 logits off the GPU are its result cast."""
    x, w = _inputs(m, torch.float16, seed=5)
    w_t = w.t()
    expected = torch.mm(x, w_t)
    if out_dtype is not None:
        expected = torch.mm(x, w_t, out_dtype=out_dtype) if x.is_cuda else expected.float()
    plan = SmallMLinearPlan(m, N, K, torch.float16, out_dtype)
    assert torch.equal(plan.run(x, w, w_t), expected)
    assert torch.equal(plan.run(x, w), expected)  # w_t defaults to w.t()
    assert torch.equal(linear_op(m, N, K, torch.float16)(x, w, w_t), torch.mm(x, w_t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_candidates_fit_in_an_sm90_blocks_shared_memory(dtype):
    """A config whose pipelined tiles exceed 227 KiB compiles but fails at launch on an H100 / H200 (the session's
    sm_90 cubin check measured float32 BLOCK_N=64, BLOCK_K=256 at 4 stages: 245760 bytes)."""
    x, w = torch.empty(16, 4096, dtype=dtype), torch.empty(4096, 4096, dtype=dtype)
    configs = _configs(x, w)
    assert all(pipeline_shared_bytes(c, x.element_size()) <= SM90_MAX_SHARED_BYTES for c in configs)
    too_big = {"BLOCK_N": 64, "BLOCK_K": 256, "num_stages": 4}
    left_out = [c for c in CANDIDATES if c not in configs]
    if dtype == torch.float32:
        assert pipeline_shared_bytes(too_big, 4) == 245760
        assert left_out and all(c.items() >= too_big.items() and c["num_warps"] == 4 for c in left_out)
        assert len(configs) == 20
    else:
        assert left_out == []


def test_more_than_16_rows_has_no_candidates_and_never_searches(monkeypatch):
    x16, w = torch.empty(16, 4096), torch.empty(4096, 4096)
    assert len(_configs(x16, w)) == 20  # float32: 4 of the 24 need more shared memory than an sm_90 block has
    assert _configs(torch.empty(17, 4096), w) == []
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    set_bench_func(lambda run: pytest.fail("nothing is timed above 16 rows"))
    x, w = _inputs(17, torch.float32)
    before = get_autotune_stats()
    with autotune_warmup(AutotuneKernelType.GENERAL):
        out = SmallMLinearPlan(17, N, K, torch.float32).run(x, w)
    assert (get_autotune_stats() - before).searches == 0
    assert torch.equal(out, torch.mm(x, w.t()))


def test_candidates_with_slices_shorter_than_a_block_are_left_out():
    small = _configs(torch.empty(1, K), torch.empty(N, K))
    assert small and all(c["SPLIT_K"] == 1 or K >= c["SPLIT_K"] * c["BLOCK_K"] for c in small)
    assert {c["SPLIT_K"] for c in small} == {1, 2}


@pytest.mark.parametrize("fastest", [{"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 8,
                                      "num_stages": 3}, None], ids=["triton-faster", "cublas-faster"])  # fmt: skip
def test_search_adopts_a_triton_config_only_when_it_is_faster(monkeypatch, isolated_autotune, fastest):
    """Level 1, GENERAL warm-up at 3 rows: every candidate runs through the real kernel (accuracy gate against
    cuBLAS) and the timer decides. The winner is stored under the one run key of every M <= 16, and a later
    1-row plan at level 0 launches it; when cuBLAS is fastest the entry is null and cuBLAS keeps running."""
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    launched = []
    launcher = _launch_small_m_linear.fn

    def recording_launcher(*args, run_config=None, **kwargs):
        launched.append(run_config)
        return launcher(*args, run_config=run_config, **kwargs)

    def timer(run):
        run()
        return 0.5 if launched[-1] == fastest else 1.0

    monkeypatch.setattr(_launch_small_m_linear, "fn", recording_launcher)
    set_bench_func(timer)
    x, w = _inputs(3, torch.float32, seed=7)
    before = get_autotune_stats()
    with autotune_warmup(AutotuneKernelType.GENERAL):
        out = SmallMLinearPlan(3, N, K, torch.float32).run(x, w)
    done = get_autotune_stats() - before
    _assert_matches(out, x, w, torch.float32)
    candidates = len(_configs(x, w))
    assert done.searches == 1 and done.candidates_timed == candidates + 1 and done.candidates_rejected == 0
    (path,) = store.iter_config_files(isolated_autotune, "small_m_linear")
    data = json.loads(path.read_text())
    assert data["static_key"] == {"N": N, "K": K, "dtype": "torch.float32", "out_dtype": "torch.float32"}
    assert data["configs"] == {"16": fastest}
    _launch_small_m_linear.clear_cache()
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "0")
    launched.clear()
    x1, w1 = _inputs(1, torch.float32, seed=8)
    out1 = SmallMLinearPlan(1, N, K, torch.float32).run(x1, w1)
    assert launched == [fastest]
    if fastest is None:
        assert torch.equal(out1, torch.mm(x1, w1.t()))
    else:
        _assert_matches(out1, x1, w1, torch.float32)


def test_a_search_times_every_launch_on_the_next_copy_of_the_weight(monkeypatch, caplog):
    """Level 1: the default and every candidate are timed on a ring of the weight's copies (COLD_BYTES over 4 weights
    here: 4), each launch reading the next one, as a decode step reads weights from HBM; the call itself computes on
    the caller's weight. A weight of half COLD_BYTES or more, or a ring without memory, is timed alone."""
    from lightllm.kernels.linear import cold_weights

    x, w = _inputs(2, torch.float32, seed=9)
    size = w.numel() * w.element_size()
    monkeypatch.setattr(cold_weights, "COLD_BYTES", 4 * size)
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    read = []
    next_copy = cold_weights.WeightRing.next
    monkeypatch.setattr(cold_weights.WeightRing, "next", lambda self: read.append(next_copy(self)) or read[-1])

    def timer(run):
        before = len(read)
        for _ in range(3):
            run()
        assert len(read) == before + 3  # each launch took the next copy
        return 1.0

    set_bench_func(timer)
    with autotune_warmup(AutotuneKernelType.GENERAL):
        out = SmallMLinearPlan(2, N, K, torch.float32).run(x, w)
    _assert_matches(out, x, w, torch.float32)
    assert len({copy.data_ptr() for copy, _ in read}) == 4 and all(torch.equal(copy, w) for copy, _ in read)
    assert all(view.data_ptr() == copy.data_ptr() and view.shape == (K, N) for copy, view in read)
    named = {"w": w, "x": x}
    monkeypatch.setattr(cold_weights, "COLD_BYTES", 2 * size)
    assert cold_weights.cold_weight_inputs(named) is named

    def no_memory(*args):
        raise torch.OutOfMemoryError("out of memory")

    monkeypatch.setattr(cold_weights, "COLD_BYTES", 4 * size)
    monkeypatch.setattr(cold_weights, "WeightRing", no_memory)
    with caplog.at_level("INFO", logger=cold_weights.__name__):
        assert cold_weights.cold_weight_inputs(named) is named
    assert "no memory for 4 copies of a (100, 300) weight" in caplog.text


def test_bad_inputs_are_value_errors():
    x, w = _inputs(2, torch.float32)
    with pytest.raises(ValueError, match=r"dtype expected one of .* got torch.int32"):
        SmallMLinearPlan(2, N, K, torch.int32)
    with pytest.raises(ValueError, match=r"out_dtype expected torch.float32 \(x's\) or torch.float32, got "
                                         r"torch.float16"):  # fmt: skip
        SmallMLinearPlan(2, N, K, torch.float32, torch.float16)
    with pytest.raises(ValueError, match=r"expected m >= 0, n >= 1, k >= 1, got m -1, n 100, k 300"):
        SmallMLinearPlan(-1, N, K, torch.float32)
    with pytest.raises(ValueError, match=r"run_config needs 1 <= m <= 16 .* got m 17"):
        SmallMLinearPlan(17, N, K, torch.float32, run_config=CANDIDATES[0])
    plan = SmallMLinearPlan(2, N, K, torch.float32)
    with pytest.raises(ValueError, match=r"x expected the planned \(2, 300\) torch.float32, got \(3, 300\)"):
        plan.run(torch.randn(3, K), w)
    with pytest.raises(ValueError, match=r"w expected the planned \(100, 300\) torch.float32, got \(100, 300\) "
                                         r"torch.float16"):  # fmt: skip
        plan.run(x, w.half())
    with pytest.raises(ValueError, match=r"contiguous last dims .* x strides \(1, 2\)"):
        plan.run(torch.randn(K, 2).t(), w)
    with pytest.raises(ValueError, match=r"on one device, got x strides \(300, 1\) on meta, w strides \(300, 1\) on"):
        plan.run(x.to("meta"), w)
    with pytest.raises(ValueError, match=r"w_t expected w.s transposed view \(300, 100\), got \(300, 100\) at another"):
        plan.run(x, w, w.clone().t())
    with pytest.raises(ValueError, match=r"out expected a \(2, 100\) torch.float32 tensor .* got \(2, 100\) "
                                         r"torch.float16"):  # fmt: skip
        plan.run(x, w, out=torch.empty(2, N, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"expected x \[M, K\] and w \[N, K\], got x \(2, 300\), w \(100, 299\)"):
        small_m_linear(x, w[:, :299])
    assert module.MAX_ROWS == 16


def test_a_plan_settled_on_cublas_skips_its_checks_after_the_first_run():
    """Nothing tuned: the first run checks and settles on cuBLAS; the layers after it call torch.mm directly (no
    input check), with the same bits; a plan whose config is a Triton one keeps checking every run."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 300, generator=g), torch.randn(100, 300, generator=g)
    plan = SmallMLinearPlan(3, 100, 300, torch.float32)
    checks, real = [], plan.inputs

    class Counted:
        def check(self, *given):
            checks.append(given)
            return real.check(*given)

    plan.inputs = Counted()
    first, second = plan.run(x, w), plan.run(x, w)
    assert len(checks) == 1 and torch.equal(first, torch.mm(x, w.t())) and torch.equal(second, first)
    fixed = SmallMLinearPlan(3, 100, 300, torch.float32, run_config=dict(CANDIDATES[0]))
    fixed.run(x, w)
    with pytest.raises(ValueError, match=r"small_m_linear plan: x expected the planned \(3, 300\)"):
        fixed.run(x[:, :200].contiguous(), w[:, :200].contiguous())
