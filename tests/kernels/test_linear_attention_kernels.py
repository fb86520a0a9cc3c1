"""The Triton linear-attention decode kernels (gated delta rule, conv1d update) against the torch references, and
how the gated delta decode is tuned: in the DECODE_ATTENTION phase, timed on a dummy state pool, never the real one.
"""

import json

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, set_bench_func, store, tuner
from lightllm.common.autotuner.keys import freeze
from lightllm.kernels.linear_attention import gated_delta_decode as gdd
from lightllm.kernels.linear_attention.conv1d_update import CausalConv1dUpdatePlan, causal_conv1d_update
from lightllm.kernels.linear_attention.gated_delta_decode import GatedDeltaDecodePlan, gated_delta_decode
from lightllm.kernels.linear_attention.reference import causal_conv1d_update_ref, gated_delta_decode_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HK, DK, DV, SLOTS = 2, 16, 32, 7
TUNED = gdd._launch_gated_delta_decode


@pytest.fixture(autouse=True)
def fresh_tuner_state():
    TUNED.clear_cache()
    yield
    TUNED.clear_cache()


def make_decode(batch, hv, dtype=torch.float32, state_dtype=torch.float32, seed=0, hk=HK, dk=DK, dv=DV):
    """q/k/v as strided views of one conv output row per request (as the model splits it), random gates (one
    softplus input above its linear threshold of 20), a random pool and slots in no particular order."""
    g = torch.Generator().manual_seed(seed)
    conv_out = torch.randn(batch, 2 * hk * dk + hv * dv + 5, generator=g).to(dtype)  # +5: rows are not packed
    q = conv_out[:, : hk * dk].view(batch, hk, dk)
    k = conv_out[:, hk * dk : 2 * hk * dk].view(batch, hk, dk)
    v = conv_out[:, 2 * hk * dk : 2 * hk * dk + hv * dv].view(batch, hv, dv)
    a = torch.randn(batch, hv, generator=g).mul(3).to(dtype)
    a[0, 0] = 25.0
    b = torch.randn(batch, hv, generator=g).mul(2).to(dtype)
    A_log, dt_bias = torch.randn(hv, generator=g), torch.randn(hv, generator=g)
    pool = torch.randn(SLOTS, hv, dk, dv, generator=g).to(state_dtype)
    state_idx = torch.randperm(SLOTS, generator=g)[:batch].int()
    tensors = q, k, v, a, b, A_log, dt_bias, pool, state_idx
    return [t.to(DEVICE) for t in tensors]


def reference(q, k, v, a, b, A_log, dt_bias, pool, state_idx):
    """Output and new pool from the float32 reference, on copies."""
    pool = pool.clone()
    out = gated_delta_decode_ref(q, k, v, a, b, A_log, dt_bias, pool, state_idx)
    return out, pool


def check_decode(out, pool, before, ref_out, ref_pool, state_idx, dtype):
    assert not out.isnan().any(), "some output elements were never written"
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
    s_tol = 2e-5 if pool.dtype == torch.float32 else 1.6e-2  # bf16: one rounding, sometimes the other way
    torch.testing.assert_close(pool.float(), ref_pool.float(), rtol=s_tol, atol=s_tol)
    untouched = sorted(set(range(SLOTS)) - set(state_idx.tolist()))
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["state-fp32", "state-bf16"])
@pytest.mark.parametrize("hv", [2, 4, 8], ids=["hv=hk", "hv=2hk", "hv=4hk"])
@pytest.mark.parametrize(
    "config",
    [None, {"BV": 8, "num_warps": 1}, {"BV": 16, "num_warps": 2}, {"BV": 32, "num_warps": 2}],
    ids=["default", "bv8", "bv16", "bv32"],
)
def test_gated_delta_decode_matches_reference(state_dtype, hv, config):
    q, k, v, a, b, A_log, dt_bias, pool, idx = make_decode(3, hv, state_dtype=state_dtype)
    before = pool.clone()
    ref_out, ref_pool = reference(q, k, v, a, b, A_log, dt_bias, pool, idx)
    out = torch.full(v.shape, float("nan"), device=DEVICE)
    gated_delta_decode(q, k, v, a, b, A_log, dt_bias, pool, idx, out=out, run_config=config)
    check_decode(out, pool, before, ref_out, ref_pool, idx, torch.float32)


def test_gated_delta_decode_fp16_inputs_and_repeated_steps():
    """fp16 activations (output in fp16, beta rounded to fp16 as the reference does); three steps in a row keep
    agreeing with the reference carried the same way."""
    q, k, v, a, b, A_log, dt_bias, pool, idx = make_decode(4, 4, dtype=torch.float16, seed=3)
    ref_pool = pool.clone()
    for step in range(3):
        before = pool.clone()
        ref_out = gated_delta_decode_ref(q, k, v, a, b, A_log, dt_bias, ref_pool, idx)
        out = gated_delta_decode(q, k, v, a, b, A_log, dt_bias, pool, idx)
        assert out.dtype == torch.float16
        check_decode(out, pool, before, ref_out, ref_pool, idx, torch.float16)
        q, k = k.roll(1, 0), q.roll(1, 0)  # new tokens


def test_padding_rows_sharing_a_scratch_slot_touch_only_that_slot():
    """A graph's padding rows may all point at one scratch slot: the real rows and every other slot are exact."""
    q, k, v, a, b, A_log, dt_bias, pool, _ = make_decode(4, 4, seed=11)
    idx = torch.tensor([3, 5, 0, 0], dtype=torch.int32, device=DEVICE)  # rows 2 and 3 pad onto slot 0
    x, conv_pool, weight, _ = make_conv(4, 40, 4, torch.float32, torch.float32, seed=11)
    before, conv_before = pool.clone(), conv_pool.clone()
    out = gated_delta_decode(q, k, v, a, b, A_log, dt_bias, pool, idx)
    y = causal_conv1d_update(x, conv_pool, weight, idx)
    ref_out, ref_pool = reference(q[:2], k[:2], v[:2], a[:2], b[:2], A_log, dt_bias, before, idx[:2])
    torch.testing.assert_close(out[:2], ref_out, rtol=2e-5, atol=2e-5)
    ref_conv_pool = conv_before.clone()
    torch.testing.assert_close(y[:2], causal_conv1d_update_ref(x[:2], ref_conv_pool, weight, idx[:2]), rtol=1e-5,
                               atol=1e-5)  # fmt: skip
    real = [1, 2, 3, 4, 5, 6]  # every slot but the scratch one
    torch.testing.assert_close(pool[real], ref_pool[real], rtol=2e-5, atol=2e-5)
    assert torch.equal(conv_pool[real], ref_conv_pool[real])


def assert_refused(call, cases):
    """``call(**changed)`` raises a ValueError matching ``message`` for every ``(changed, message)`` case (shared
    with the verify kernels' tests)."""
    for changed, message in cases:
        with pytest.raises(ValueError, match=message):
            call(**changed)


def test_gated_delta_decode_empty_batch_launches_nothing():
    q, k, v, a, b, A_log, dt_bias, pool, idx = make_decode(3, 4)
    before = pool.clone()
    out = gated_delta_decode(q[:0], k[:0], v[:0], a[:0], b[:0], A_log, dt_bias, pool, idx[:0])
    assert out.shape == (0, 4, DV) and torch.equal(pool, before)


def test_gated_delta_decode_bad_arguments_name_the_argument():
    q, k, v, a, b, A_log, dt_bias, pool, idx = make_decode(3, 4)

    def call(**changed):
        args = dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ssm_state=pool, state_idx=idx)
        gated_delta_decode(**{**args, **changed})

    cases = [
        (dict(state_idx=idx.long()), r"state_idx expected an int32 \[3\] tensor, got \(3,\) torch.int64"),
        (dict(state_idx=idx[:2]), r"state_idx expected an int32 \[3\] tensor, got \(2,\)"),
        (
            dict(ssm_state=pool.half()),
            r"ssm_state expected one of .*torch.float32, torch.bfloat16.*, got torch.float16",
        ),
        (dict(ssm_state=pool[:, :, :, :16]), r"ssm_state expected a \[slots, 4, 16, 32\] tensor, got \(7, 4, 16, 16\)"),
        (dict(ssm_state=pool.transpose(2, 3).contiguous().transpose(2, 3)), "ssm_state expected each slot contiguous"),
        (dict(v=v[:, :3]), r"v_heads expected a multiple of k_heads \(2\), got 3"),
        (dict(q=q[:, :, :12], k=k[:, :, :12]), r"head_k_dim expected one of \(16, 32, 64, 128, 256\), got 12"),
        (dict(v=v[:, :, :24]), r"head_v_dim expected one of \(16, 32, 64, 128, 256\), got 24"),
        (dict(q=q.int()), r"q expected one of .*, got torch.int32"),
        (dict(k=k.half()), r"plan: k expected the planned \(3, 2, 16\) torch.float32, got \(3, 2, 16\) torch.float16"),
        (dict(v=v.half()), r"plan: v expected the planned .* torch.float32, got .* torch.float16"),
        (dict(a=a[:, :2]), r"plan: a expected the planned \(3, 4\) torch.float32, got \(3, 2\) torch.float32"),
        (dict(A_log=A_log[:3]), r"plan: A_log expected the planned \(4,\), got \(3,\)"),
        (dict(q=q.transpose(1, 2).contiguous().transpose(1, 2)), "q expected a contiguous last dim"),
        (dict(b=b.t().contiguous().t()), "b expected a contiguous last dim"),
        (dict(state_idx=idx.to("meta")), "state_idx expected ssm_state's device cpu, got meta"),
    ]
    assert_refused(call, cases if DEVICE == "cpu" else cases[:-1])
    with pytest.raises(ValueError, match=r"run_config expected a dict with BV dividing 32 and num_warps in"):
        gated_delta_decode(q, k, v, a, b, A_log, dt_bias, pool, idx, run_config={"BV": 24, "num_warps": 4})
    with pytest.raises(ValueError, match=r"out expected a \(3, 4, 32\) torch.float32 tensor"):
        gated_delta_decode(q, k, v, a, b, A_log, dt_bias, pool, idx, out=torch.empty(3, 4, 32, dtype=torch.float16))


def test_plan_checks_once_and_refuses_other_layers(monkeypatch):
    q, k, v, a, b, A_log, dt_bias, pool, idx = make_decode(3, 4)
    checked = []
    real_check = gdd._check_plan
    monkeypatch.setattr(gdd, "_check_plan", lambda *args: checked.append(args) or real_check(*args))
    plan = GatedDeltaDecodePlan(q.shape, v.shape, q.dtype, pool.shape, pool.dtype, idx)
    pools = [pool.clone() for _ in range(3)]  # three layers, each its own pool
    for layer_pool in pools:
        before = layer_pool.clone()
        ref_out, ref_pool = reference(q, k, v, a, b, A_log, dt_bias, layer_pool, idx)
        check_decode(plan.run(q, k, v, a, b, A_log, dt_bias, layer_pool), layer_pool, before, ref_out, ref_pool, idx,
                     torch.float32)  # fmt: skip
    assert len(checked) == 1
    with pytest.raises(ValueError, match=r"gated delta decode plan: ssm_state expected the planned \(7, 4, 16, 32\) "
                                         r"torch.float32, got \(7, 4, 16, 32\) torch.bfloat16"):  # fmt: skip
        plan.run(q, k, v, a, b, A_log, dt_bias, pool.bfloat16())  # another state dtype is another tuning key


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["state-fp32", "state-bf16"])
def test_gated_delta_decode_matches_fla(state_dtype):
    """fla-core's fused recurrent gated delta rule (the outside oracle) on the same inputs and initial states: gates
    computed in its kernel, beta given as sigmoid(b) in b's dtype (the rounding transformers and ours apply)."""
    fla = pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core is not installed (pip install fla-core)")
    q, k, v, a, b, A_log, dt_bias, pool, idx = make_decode(3, 4, dtype=torch.float16, state_dtype=state_dtype, seed=9)
    want_out, want_state = fla.fused_recurrent_gated_delta_rule(
        q.contiguous()[:, None], k.contiguous()[:, None], v.contiguous()[:, None], g=a[:, None],
        beta=b.sigmoid()[:, None], initial_state=pool[idx.long()], output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
    )  # fmt: skip
    out = gated_delta_decode(q, k, v, a, b, A_log, dt_bias, pool, idx)
    torch.testing.assert_close(out.float(), want_out[:, 0].float(), rtol=2e-3, atol=2e-3)
    tol = 2e-5 if state_dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(pool[idx.long()].float(), want_state, rtol=tol, atol=tol)


# ---- conv1d update ----------------------------------------------------------------------------------------


def make_conv(batch, channels, taps, dtype, state_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels + 3, generator=g).to(dtype)[:, :channels]  # a strided view
    pool = torch.randn(SLOTS, taps - 1, channels, generator=g).to(state_dtype)
    weight = torch.randn(channels, taps, generator=g).to(dtype)
    state_idx = torch.randperm(SLOTS, generator=g)[:batch].int()
    return [t.to(DEVICE) for t in (x, pool, weight, state_idx)]


@pytest.mark.parametrize("taps", [2, 4])
@pytest.mark.parametrize(
    "dtype, state_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float16, torch.float32)],
    ids=["fp32", "fp16", "fp16-state-fp32"],
)
@pytest.mark.parametrize("config", [None, {"BLOCK_C": 16, "num_warps": 1}], ids=["default", "block16"])
def test_conv1d_update_matches_reference(taps, dtype, state_dtype, config):
    x, pool, weight, idx = make_conv(3, 40, taps, dtype, state_dtype)  # 40 channels: block 16 has a ragged tail
    before = pool.clone()
    ref_pool = pool.clone()
    ref = causal_conv1d_update_ref(x.double().to(dtype), ref_pool, weight, idx)
    out = torch.full(x.shape, float("nan"), dtype=dtype, device=DEVICE)
    causal_conv1d_update(x, pool, weight, idx, out=out, run_config=config)
    assert not out.isnan().any(), "some output elements were never written"
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    assert torch.equal(pool, ref_pool)  # the shift copies values: exact
    untouched = sorted(set(range(SLOTS)) - set(idx.tolist()))
    assert torch.equal(pool[untouched], before[untouched])


def test_conv1d_update_bad_arguments_name_the_argument():
    x, pool, weight, idx = make_conv(3, 40, 4, torch.float32, torch.float32)

    def call(**changed):
        causal_conv1d_update(**{**dict(x=x, conv_state=pool, weight=weight, state_idx=idx), **changed})

    cases = [
        (dict(state_idx=idx.long()), r"state_idx expected an int32 \[3\] tensor, got \(3,\) torch.int64"),
        (dict(conv_state=pool[:, :, :32]), r"conv_state expected a \[slots, K - 1 >= 1, 40\] tensor, got \(7, 3, 32\)"),
        (dict(conv_state=pool[:, :0]), r"conv_state expected a \[slots, K - 1 >= 1, 40\] tensor, got \(7, 0, 40\)"),
        (dict(weight=weight[:, :3]), r"plan: weight expected the planned \(40, 4\) torch.float32, got \(40, 3\)"),
        (dict(weight=weight.t().contiguous().t()), "weight expected contiguous"),
        (dict(x=x.int()), r"x expected a \[batch, channels\] tensor of .*, got \(3, 40\) torch.int32"),
        (dict(x=x.t().contiguous().t()), "x expected a contiguous last dim"),
        (dict(conv_state=pool.to(torch.int8)), "conv_state expected one of .*, got torch.int8"),
    ]
    assert_refused(call, cases)
    with pytest.raises(ValueError, match="run_config expected a dict with BLOCK_C a power of two >= 16"):
        causal_conv1d_update(x, pool, weight, idx, run_config={"BLOCK_C": 24, "num_warps": 4})


def test_conv1d_plan_runs_every_layer():
    x, pool, weight, idx = make_conv(3, 40, 4, torch.float32, torch.float32, seed=5)
    plan = CausalConv1dUpdatePlan(x.shape, x.dtype, pool.shape, pool.dtype, weight.dtype, idx)
    for layer in range(2):
        ref_pool = pool.clone()
        ref = causal_conv1d_update_ref(x, ref_pool, weight, idx)
        torch.testing.assert_close(plan.run(x, pool, weight), ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(pool, ref_pool)
    with pytest.raises(ValueError, match=r"conv1d update plan: x expected the planned \(3, 40\) torch.float32"):
        plan.run(x[:2], pool, weight)


# ---- tuning -----------------------------------------------------------------------------------------------


def test_declared_as_decode_attention_keyed_by_batch():
    from lightllm.common.autotuner.tuner import kernel_names

    assert "gated_delta_decode" in kernel_names(AutotuneKernelType.DECODE_ATTENTION)
    assert TUNED.warmup_all_exist_config is False
    q, k, v, a, b, A_log, dt_bias, pool, idx = make_decode(3, 4)
    assert gdd._run_key(q) == 3
    assert gdd._static_key(q, v, pool.bfloat16()) == {
        "k_heads": 2, "v_heads": 4, "head_k_dim": 16, "head_v_dim": 32, "dtype": "torch.float32",
        "state_dtype": "torch.bfloat16",
    }  # fmt: skip
    big = torch.empty(1, 16, 128, device="meta"), torch.empty(1, 48, 128, device="meta")
    assert {"BV": 128, "num_warps": 4} in gdd._configs(*big) and {"BV": 128, "num_warps": 2} not in gdd._configs(*big)


class Recorder:
    """Records every launch of ``tuned`` (its pool, the ``slots`` arguments named, its config) and every tensor the
    tuner clones; a timer that makes one candidate fastest. Shared with the verify kernel's tuning tests."""

    def __init__(self, monkeypatch, fastest, tuned=TUNED, slots=("state_idx",)):
        self.launches, self.cloned = [], []
        real_launch, recorder = tuned.fn, self

        def spy(*args, run_config=None, **kwargs):
            named = tuned.named_arguments(args, kwargs)
            self.launches.append((named["ssm_state"], *(named[name] for name in slots), run_config))
            return real_launch(*args, run_config=run_config, **kwargs)

        class RecordingSnapshot(tuner._Snapshot):
            def __init__(self, tensors):
                recorder.cloned.extend(t for t in tensors.values() if isinstance(t, torch.Tensor))
                super().__init__(tensors)

        def bench(run):
            run()
            return 0.5 if self.launches[-1][-1] == fastest else 1.0

        monkeypatch.setattr(tuned, "fn", spy)
        monkeypatch.setattr(tuner, "_Snapshot", RecordingSnapshot)
        set_bench_func(bench)

    def on(self, pool):
        return [launch for launch in self.launches if launch[0].data_ptr() == pool.data_ptr()]


def test_search_times_on_a_dummy_pool_and_advances_the_real_one_once(monkeypatch, isolated_autotune):
    """Level 1 in the DECODE_ATTENTION scope: the search runs every candidate on a fresh pool of one slot per
    request, never on (nor cloning) the caller's pool; the caller's pool then advances exactly one step with the
    winner, which is stored under the batch size and reused at level 0."""
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    fastest = {"BV": 16, "num_warps": 2}
    monkeypatch.setattr(TUNED, "configs_gen_func", lambda q, v: [{"BV": 32, "num_warps": 1}, fastest])
    rec = Recorder(monkeypatch, fastest)
    q, k, v, a, b, A_log, dt_bias, pool, idx = make_decode(3, 4, seed=7)
    before = pool.clone()
    ref_out, ref_pool = reference(q, k, v, a, b, A_log, dt_bias, pool, idx)
    rng = torch.random.get_rng_state()
    with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
        out = gated_delta_decode(q, k, v, a, b, A_log, dt_bias, pool, idx)
    assert torch.equal(torch.random.get_rng_state(), rng)  # the dummy pool has its own generator
    check_decode(out, pool, before, ref_out, ref_pool, idx, torch.float32)
    assert rec.on(pool) == [(pool, idx, fastest)]  # one launch on the real pool: the call, with the winner
    timed = [launch for launch in rec.launches if launch[0] is not pool]
    assert len(timed) == 3 * 2 * 2  # default + 2 candidates, each an eager run and a timed run, all re-timed
    assert all(s.shape == (3, 4, DK, DV) and s.data_ptr() != pool.data_ptr() for s, _, _ in timed)
    assert all(i.tolist() == [2, 1, 0] for _, i, _ in timed)
    assert rec.cloned and all(t.data_ptr() != pool.data_ptr() for t in rec.cloned)
    (path,) = store.iter_config_files(isolated_autotune, "gated_delta_decode")
    assert json.loads(path.read_text())["configs"] == {"3": fastest}

    TUNED.clear_cache()
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "0")
    rec.launches.clear()
    gated_delta_decode(q, k, v, a, b, A_log, dt_bias, pool, idx)
    assert [cfg for _, _, cfg in rec.launches] == [fastest]


@pytest.mark.parametrize("phase", [AutotuneKernelType.DECODE_ATTENTION, AutotuneKernelType.GENERAL])
def test_cached_configs_are_not_warmed_on_the_real_pool(monkeypatch, isolated_autotune, phase):
    """In any warm-up scope, a kernel with cached configs normally runs each once on the caller's inputs (to
    compile them); here that would advance (or clone) the real state, so the call launches once, nothing else."""
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    q, k, v, a, b, A_log, dt_bias, pool, idx = make_decode(3, 4, seed=8)
    cached = {"BV": 16, "num_warps": 1}
    static_key = gdd._static_key(q, v, pool)
    frozen = freeze(static_key)
    TUNED.store.save(static_key, frozen, {3: (cached, {}), 5: ({"BV": 32, "num_warps": 2}, {})})
    rec = Recorder(monkeypatch, cached)
    before = pool.clone()
    ref_out, ref_pool = reference(q, k, v, a, b, A_log, dt_bias, pool, idx)
    with autotune_warmup(phase):
        out = gated_delta_decode(q, k, v, a, b, A_log, dt_bias, pool, idx)
    check_decode(out, pool, before, ref_out, ref_pool, idx, torch.float32)
    assert rec.launches == [(pool, idx, cached)] and not rec.cloned
