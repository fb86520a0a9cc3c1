"""The linear-attention decode kernels on a GPU at Qwen3.5-27B's shapes (tp 1: 16 key heads, 48 value heads,
128/128 head dims, conv channels 2 * 16 * 128 + 48 * 128), against the torch references and fla-core's fused
recurrent gated delta rule (the anchor)."""

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup
from lightllm.kernels.linear_attention import gated_delta_decode as gdd
from lightllm.kernels.linear_attention.conv1d_update import causal_conv1d_update
from lightllm.kernels.linear_attention.reference import causal_conv1d_update_ref, gated_delta_decode_ref

pytestmark = pytest.mark.gpu

HK, HV, DK, DV, TAPS, SLOTS = 16, 48, 128, 128, 4, 80
CHANNELS = 2 * HK * DK + HV * DV
BATCHES = [1, 7, 64]
STATE_DTYPES = [torch.float32, torch.bfloat16]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make_decode(batch, state_dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    conv_out = torch.randn(batch, CHANNELS, generator=g, device="cuda").bfloat16()
    q = conv_out[:, : HK * DK].view(batch, HK, DK)
    k = conv_out[:, HK * DK : 2 * HK * DK].view(batch, HK, DK)
    v = conv_out[:, 2 * HK * DK :].view(batch, HV, DV)
    a = torch.randn(batch, HV, generator=g, device="cuda").mul(2).bfloat16()
    b = torch.randn(batch, HV, generator=g, device="cuda").mul(2).bfloat16()
    A_log = torch.randn(HV, generator=g, device="cuda")
    dt_bias = torch.randn(HV, generator=g, device="cuda")
    pool = torch.randn(SLOTS, HV, DK, DV, generator=g, device="cuda").mul(0.1).to(state_dtype)
    idx = torch.randperm(SLOTS, generator=g, device="cuda")[:batch].int()
    return q, k, v, a, b, A_log, dt_bias, pool, idx


def check_against_reference(out, pool, before, inputs):
    q, k, v, a, b, A_log, dt_bias, _, idx = inputs
    ref_pool = before.clone()
    ref_out = gated_delta_decode_ref(q, k, v, a, b, A_log, dt_bias, ref_pool, idx)
    assert not out.isnan().any() and out.dtype == torch.bfloat16
    assert rel_err(out, ref_out) < 1e-2
    assert rel_err(pool, ref_pool) < (1e-5 if pool.dtype == torch.float32 else 1e-2)
    untouched = torch.ones(SLOTS, dtype=torch.bool, device="cuda")
    untouched[idx.long()] = False
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=["state-fp32", "state-bf16"])
@pytest.mark.parametrize("batch", BATCHES)
def test_gpu_gated_delta_decode_matches_reference(batch, state_dtype):
    inputs = make_decode(batch, state_dtype)
    pool = inputs[7]
    before = pool.clone()
    out = torch.full((batch, HV, DV), float("nan"), dtype=torch.bfloat16, device="cuda")
    gdd.gated_delta_decode(*inputs, out=out)
    check_against_reference(out, pool, before, inputs)


@pytest.mark.parametrize("batch", BATCHES)
def test_gpu_every_candidate_matches_reference(batch):
    inputs = make_decode(batch, torch.float32, seed=1)
    q, v = inputs[0], inputs[2]
    for cfg in gdd._configs(q, v):
        pool = inputs[7]
        before = pool.clone()
        out = gdd.gated_delta_decode(*inputs, run_config=cfg)
        check_against_reference(out, pool, before, inputs)
        pool.copy_(before)


def test_gpu_search_leaves_the_real_pool_to_the_call(monkeypatch, isolated_autotune):
    """Level 1 in the DECODE_ATTENTION scope with the CUDA-graph timer: one search per batch size on a dummy pool;
    the real pool advances exactly one step, as the reference's."""
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    tuned = gdd._launch_gated_delta_decode
    tuned.clear_cache()
    inputs = make_decode(16, torch.float32, seed=2)
    pool = inputs[7]
    before = pool.clone()
    with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
        out = gdd.gated_delta_decode(*inputs)
    record = tuned.last_search
    assert record.run_key == 16 and len(record.timings) == len(gdd._configs(inputs[0], inputs[2]))
    assert len(list(isolated_autotune.rglob("*.json"))) == 1
    check_against_reference(out, pool, before, inputs)
    tuned.clear_cache()


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["state-bf16", "state-fp32"])
@pytest.mark.parametrize("batch", BATCHES)
def test_gpu_conv1d_update_matches_reference(batch, state_dtype):
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(batch, CHANNELS, generator=g, device="cuda").bfloat16()
    weight = torch.randn(CHANNELS, TAPS, generator=g, device="cuda").bfloat16()
    pool = torch.randn(SLOTS, TAPS - 1, CHANNELS, generator=g, device="cuda").to(state_dtype)
    idx = torch.randperm(SLOTS, generator=g, device="cuda")[:batch].int()
    ref_pool = pool.clone()
    ref = causal_conv1d_update_ref(x, ref_pool, weight, idx)
    out = torch.full_like(x, float("nan"))
    causal_conv1d_update(x, pool, weight, idx, out=out)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-2
    assert torch.equal(pool, ref_pool)  # the shift copies values


@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=["state-fp32", "state-bf16"])
@pytest.mark.parametrize("batch", BATCHES)
def test_gpu_gated_delta_decode_matches_fla(batch, state_dtype):
    """fla-core's fused recurrent kernel on the same inputs and initial states (gates computed in its kernel; beta
    given as sigmoid(b) in bf16, the rounding both our kernel and transformers apply)."""
    fla = pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core is not installed (pip install fla-core)")
    inputs = make_decode(batch, state_dtype, seed=4)
    q, k, v, a, b, A_log, dt_bias, pool, idx = inputs
    initial = pool[idx.long()]
    want_out, want_state = fla.fused_recurrent_gated_delta_rule(
        q.contiguous()[:, None], k.contiguous()[:, None], v.contiguous()[:, None], g=a[:, None],
        beta=b.sigmoid()[:, None], initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
    )  # fmt: skip
    out = gdd.gated_delta_decode(*inputs)
    assert rel_err(out, want_out[:, 0]) < 1e-2
    assert rel_err(pool[idx.long()], want_state) < (1e-5 if state_dtype == torch.float32 else 1e-2)
