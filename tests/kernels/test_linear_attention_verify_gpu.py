"""The MTP verify kernels of the linear-attention layers on a GPU at Qwen3.5-27B's shapes (tp 1: 16 key heads,
48 value heads, 128/128 head dims, conv channels 2 * 16 * 128 + 48 * 128), against the torch references (N + 1
sequential single-token updates), the single-token Triton kernel run N + 1 times, and fla-core's fused recurrent
gated delta rule over the N + 1 tokens (the anchor)."""

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup
from lightllm.kernels.linear_attention import gated_delta_verify as gdv
from lightllm.kernels.linear_attention.conv1d_verify import causal_conv1d_verify
from lightllm.kernels.linear_attention.gated_delta_decode import gated_delta_decode
from lightllm.kernels.linear_attention.verify_reference import causal_conv1d_verify_ref, gated_delta_verify_ref

pytestmark = pytest.mark.gpu

HK, HV, DK, DV, TAPS = 16, 48, 128, 128, 4
CHANNELS = 2 * HK * DK + HV * DV
BATCHES = [1, 16, 64]
STEPS = [1, 3]
STATE_DTYPES = [torch.float32, torch.bfloat16]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make_verify(batch, tokens, state_dtype, seed=0):
    """bf16 activations as strided views of one conv output ``[batch * tokens, C]``; every request's source slot is
    one of its own destination slots for odd requests and apart from them for even ones; two spare slots."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = batch * tokens
    conv_out = torch.randn(rows, CHANNELS, generator=g, device="cuda").bfloat16()
    q = conv_out[:, : HK * DK].view(batch, tokens, HK, DK)
    k = conv_out[:, HK * DK : 2 * HK * DK].view(batch, tokens, HK, DK)
    v = conv_out[:, 2 * HK * DK :].view(batch, tokens, HV, DV)
    a = torch.randn(rows, HV, generator=g, device="cuda").mul(2).bfloat16().view(batch, tokens, HV)
    b = torch.randn(rows, HV, generator=g, device="cuda").mul(2).bfloat16().view(batch, tokens, HV)
    A_log = torch.randn(HV, generator=g, device="cuda")
    dt_bias = torch.randn(HV, generator=g, device="cuda")
    slots = batch * (tokens + 1) + 2
    perm = torch.randperm(slots, generator=g, device="cuda").int()
    dst = perm[:rows].view(batch, tokens).contiguous()
    src = perm[rows : rows + batch].clone()
    src[1::2] = dst[1::2, -1]
    pool = torch.randn(slots, HV, DK, DV, generator=g, device="cuda").mul(0.1).to(state_dtype)
    return q, k, v, a, b, A_log, dt_bias, pool, src, dst


def check_against_reference(out, pool, before, inputs):
    q, k, v, a, b, A_log, dt_bias, _, src, dst = inputs
    ref_pool = before.clone()
    ref_out = gated_delta_verify_ref(q, k, v, a, b, A_log, dt_bias, ref_pool, src, dst)
    assert not out.isnan().any() and out.dtype == torch.bfloat16
    assert rel_err(out, ref_out) < 1e-2
    written = dst.flatten().long()
    assert rel_err(pool[written], ref_pool[written]) < (1e-5 if pool.dtype == torch.float32 else 1e-2)
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device="cuda")
    untouched[written] = False
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=["state-fp32", "state-bf16"])
@pytest.mark.parametrize("n", STEPS, ids=lambda n: f"N={n}")
@pytest.mark.parametrize("batch", BATCHES)
def test_gpu_gated_delta_verify_matches_reference(batch, n, state_dtype):
    inputs = make_verify(batch, n + 1, state_dtype)
    pool = inputs[7]
    before = pool.clone()
    out = torch.full(inputs[2].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    gdv.gated_delta_verify(*inputs, out=out)
    check_against_reference(out, pool, before, inputs)


@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=["state-fp32", "state-bf16"])
@pytest.mark.parametrize("n", STEPS, ids=lambda n: f"N={n}")
def test_gpu_verify_equals_plain_decodes(n, state_dtype):
    """Token t's slot holds the state t + 1 single-token decodes leave (bf16 rounding between tokens included),
    and its output is theirs: two compiled kernels may round a reduction differently, so a bf16 rounding may rarely
    go the other way (and carry on), far below the error of skipping the rounding between tokens."""
    q, k, v, a, b, A_log, dt_bias, pool, src, dst = make_verify(16, n + 1, state_dtype, seed=1)
    decoded = pool.clone()
    out = gdv.gated_delta_verify(q, k, v, a, b, A_log, dt_bias, pool, src, dst)
    tol = 1e-6 if state_dtype == torch.float32 else 1e-4
    for t in range(n + 1):
        o = gated_delta_decode(q[:, t], k[:, t], v[:, t], a[:, t], b[:, t], A_log, dt_bias, decoded, src)
        assert rel_err(out[:, t], o) < 1e-3
        assert rel_err(pool[dst[:, t].long()], decoded[src.long()]) < tol


@pytest.mark.parametrize("n", STEPS, ids=lambda n: f"N={n}")
def test_gpu_every_candidate_matches_reference(n):
    inputs = make_verify(16, n + 1, torch.float32, seed=2)
    pool = inputs[7]
    before = pool.clone()
    for cfg in gdv._configs(inputs[0], inputs[2]):
        out = gdv.gated_delta_verify(*inputs, run_config=cfg)
        check_against_reference(out, pool, before, inputs)
        pool.copy_(before)


def test_gpu_search_leaves_the_real_pool_bit_identical(monkeypatch, isolated_autotune):
    """Level 1 in the DECODE_ATTENTION scope with the CUDA-graph timer: planning with the real arguments searches on
    the dummy pool (run key 16 requests * 4 tokens) and leaves the real pool bit-identical; the plan's run then
    writes it once, as the reference."""
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    tuned = gdv._launch_gated_delta_verify
    tuned.clear_cache()
    inputs = make_verify(13, 4, torch.float32, seed=3)
    pool = inputs[7]
    before = pool.clone()
    out = torch.empty(inputs[2].shape, dtype=torch.bfloat16, device="cuda")
    with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
        plan = tuned.plan(*inputs, out)
        torch.cuda.synchronize()
        assert torch.equal(pool, before)
        plan.run(*inputs, out)
    record = tuned.last_search
    assert record.run_key == 64 and len(record.timings) == len(gdv._configs(inputs[0], inputs[2]))
    assert len(list(isolated_autotune.rglob("*.json"))) == 1
    check_against_reference(out, pool, before, inputs)
    tuned.clear_cache()


@pytest.mark.parametrize("n", STEPS, ids=lambda n: f"N={n}")
def test_gpu_gated_delta_verify_matches_fla(n):
    """fla-core's fused recurrent kernel over the N + 1 tokens from the same initial states (fp32 state, so no
    rounding between tokens on either side): our outputs and our last token's slot against its outputs and its
    final state."""
    fla = pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core is not installed (pip install fla-core)")
    q, k, v, a, b, A_log, dt_bias, pool, src, dst = make_verify(16, n + 1, torch.float32, seed=4)
    initial = pool[src.long()]
    want_out, want_state = fla.fused_recurrent_gated_delta_rule(
        q.contiguous(), k.contiguous(), v.contiguous(), g=a, beta=b.sigmoid(), initial_state=initial,
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
        dt_bias=dt_bias,
    )  # fmt: skip
    out = gdv.gated_delta_verify(q, k, v, a, b, A_log, dt_bias, pool, src, dst)
    assert rel_err(out, want_out) < 1e-2
    assert rel_err(pool[dst[:, -1].long()], want_state) < 1e-5


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["state-bf16", "state-fp32"])
@pytest.mark.parametrize("n", STEPS, ids=lambda n: f"N={n}")
@pytest.mark.parametrize("batch", BATCHES)
def test_gpu_conv1d_verify_matches_reference(batch, n, state_dtype):
    tokens = n + 1
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(batch, tokens, CHANNELS, generator=g, device="cuda").bfloat16()
    weight = torch.randn(CHANNELS, TAPS, generator=g, device="cuda").bfloat16()
    slots = batch * (tokens + 1)
    pool = torch.randn(slots, TAPS - 1, CHANNELS, generator=g, device="cuda").to(state_dtype)
    perm = torch.randperm(slots, generator=g, device="cuda").int()
    dst = perm[: batch * tokens].view(batch, tokens).contiguous()
    src = dst[:, 0].clone()  # the source among the destinations
    ref_pool = pool.clone()
    ref = causal_conv1d_verify_ref(x, ref_pool, weight, src, dst)
    out = torch.full_like(x, float("nan"))
    causal_conv1d_verify(x, pool, weight, src, dst, out=out)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-2
    assert torch.equal(pool, ref_pool)  # windows copy values
