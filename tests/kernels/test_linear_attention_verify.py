"""The MTP verify kernels of the linear-attention layers (gated delta rule and conv1d over N + 1 tokens, writing
the state after every token into per-step slots) against their references: N + 1 sequential single-token updates.
"""

import pytest
import torch

from lightllm.kernels.linear_attention.conv1d_verify import CausalConv1dVerifyPlan, causal_conv1d_verify
from lightllm.kernels.linear_attention import gated_delta_verify as gdv
from lightllm.kernels.linear_attention.gated_delta_verify import GatedDeltaVerifyPlan, gated_delta_verify
from lightllm.kernels.linear_attention.verify_reference import causal_conv1d_verify_ref, gated_delta_verify_ref

from tests.kernels.test_linear_attention_kernels import assert_refused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HK, DK, DV, BATCH, SPARE = 2, 16, 32, 3, 2  # SPARE: slots no request uses
NAN_STATE = float("nan")


@pytest.fixture(autouse=True)
def fresh_tuner_state():
    gdv._launch_gated_delta_verify.clear_cache()
    yield
    gdv._launch_gated_delta_verify.clear_cache()


def make_slots(batch, tokens, src_in_dst, g):
    """Per-step slots for every request in no particular order, and each request's source slot: one of its own
    destination slots (as the engine reuses them), or a slot of its own apart from them."""
    slots = batch * (tokens + 1) + SPARE
    perm = torch.randperm(slots, generator=g).int()
    dst = perm[: batch * tokens].view(batch, tokens)
    if src_in_dst:
        src = torch.stack([dst[i, i % tokens] for i in range(batch)])
    else:
        src = perm[batch * tokens : batch * (tokens + 1)]
    return slots, src.contiguous(), dst.contiguous()


def make_verify(tokens, hv, state_dtype=torch.float32, src_in_dst=False, seed=0, batch=BATCH, dtype=torch.float32):
    """q/k/v as strided views of one conv output ``[batch * tokens, C]`` (as the model splits it), random gates (one
    softplus input above its linear threshold of 20), a random pool whose destination slots hold NaN (so a slot the
    kernel fails to write shows), and the slots."""
    g = torch.Generator().manual_seed(seed)
    rows = batch * tokens
    conv_out = torch.randn(rows, 2 * HK * DK + hv * DV + 5, generator=g).to(dtype)  # +5: rows are not packed
    q = conv_out[:, : HK * DK].view(batch, tokens, HK, DK)
    k = conv_out[:, HK * DK : 2 * HK * DK].view(batch, tokens, HK, DK)
    v = conv_out[:, 2 * HK * DK : 2 * HK * DK + hv * DV].view(batch, tokens, hv, DV)
    a = torch.randn(rows, hv, generator=g).mul(3).to(dtype).view(batch, tokens, hv)
    a[0, 0, 0] = 25.0
    b = torch.randn(rows, hv, generator=g).mul(2).to(dtype).view(batch, tokens, hv)
    A_log, dt_bias = torch.randn(hv, generator=g), torch.randn(hv, generator=g)
    slots, src, dst = make_slots(batch, tokens, src_in_dst, g)
    pool = torch.randn(slots, hv, DK, DV, generator=g).to(state_dtype)
    pool[sorted(set(dst.flatten().tolist()) - set(src.tolist()))] = NAN_STATE
    tensors = q, k, v, a, b, A_log, dt_bias, pool, src, dst
    return [t.to(DEVICE) for t in tensors]


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def untouched_slots(pool, dst):
    return sorted(set(range(pool.shape[0])) - set(dst.flatten().tolist()))


def check_verify(out, pool, before, ref_out, ref_pool, dst):
    assert not out.isnan().any(), "some output elements were never written"
    assert not pool[dst.long()].isnan().any(), "some destination slot was never written"
    got, want = pool[dst.long()].float(), ref_pool[dst.long()].float()
    if pool.dtype == torch.float32:
        tol = 2e-5 if out.dtype == torch.float32 else 2e-3
        torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    else:
        # bf16 state: each token's store rounds (Triton's interpreter rounds toward zero, torch to nearest: up to one
        # ulp, 2^-7 relative, per token), and the next token carries it on, mixed across the state.
        tokens = dst.shape[1]
        torch.testing.assert_close(out.float(), ref_out.float(), rtol=1e-2, atol=1e-2)
        bound = tokens * 2**-7  # the state's entries are O(1): random initial slots
        torch.testing.assert_close(got, want, rtol=bound, atol=bound)
        assert rel_err(got, want) < tokens * 2**-8
    untouched = untouched_slots(pool, dst)
    assert torch.equal(pool[untouched], before[untouched])


def verify_reference(q, k, v, a, b, A_log, dt_bias, pool, src, dst):
    ref_pool = pool.clone()
    return gated_delta_verify_ref(q, k, v, a, b, A_log, dt_bias, ref_pool, src, dst), ref_pool


@pytest.mark.parametrize("src_in_dst", [False, True], ids=["src-apart", "src-in-dst"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["state-fp32", "state-bf16"])
@pytest.mark.parametrize("hv", [HK, 3 * HK], ids=["hv=hk", "hv=3hk"])
@pytest.mark.parametrize("n", [1, 2, 3, 4], ids=lambda n: f"N={n}")
def test_gated_delta_verify_matches_sequential_decodes(n, hv, state_dtype, src_in_dst):
    inputs = make_verify(n + 1, hv, state_dtype, src_in_dst, seed=n)
    q, k, v, a, b, A_log, dt_bias, pool, src, dst = inputs
    before = pool.clone()
    ref_out, ref_pool = verify_reference(*inputs)
    out = torch.full(v.shape, float("nan"), device=DEVICE)
    assert gated_delta_verify(q, k, v, a, b, A_log, dt_bias, pool, src, dst, out=out) is out
    check_verify(out, pool, before, ref_out, ref_pool, dst)


@pytest.mark.parametrize("config", [{"BV": 8, "num_warps": 1}, {"BV": 16, "num_warps": 2}], ids=["bv8-w1", "bv16-w2"])
def test_gated_delta_verify_other_configs_and_fp16_inputs(config):
    """Other V tiles (several programs per head write disjoint slices of one slot); fp16 activations, whose output
    is fp16 and whose beta is rounded to fp16 as the reference does."""
    inputs = make_verify(4, 2 * HK, src_in_dst=True, seed=5, dtype=torch.float16)
    q, k, v, a, b, A_log, dt_bias, pool, src, dst = inputs
    before = pool.clone()
    ref_out, ref_pool = verify_reference(*inputs)
    out = gated_delta_verify(q, k, v, a, b, A_log, dt_bias, pool, src, dst, run_config=config)
    assert out.dtype == torch.float16
    check_verify(out, pool, before, ref_out, ref_pool, dst)


def test_verify_state_equals_that_many_plain_decodes():
    """What the next step relies on: the slot of token t holds exactly the state t + 1 single-token decodes leave,
    bf16 rounding between tokens included."""
    from lightllm.kernels.linear_attention.gated_delta_decode import gated_delta_decode

    q, k, v, a, b, A_log, dt_bias, pool, src, dst = make_verify(3, 2 * HK, torch.bfloat16, seed=6)
    decoded = pool.clone()
    gated_delta_verify(q, k, v, a, b, A_log, dt_bias, pool, src, dst)
    for t in range(3):
        gated_delta_decode(q[:, t], k[:, t], v[:, t], a[:, t], b[:, t], A_log, dt_bias, decoded, src)
        got, want = pool[dst[:, t].long()], decoded[src.long()]
        if DEVICE == "cpu":  # the interpreter runs both kernels' float32 steps alike: bit for bit
            assert torch.equal(got, want)
        else:  # compiled, their reductions may round differently: within one bf16 ulp
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)


def test_padding_rows_sharing_a_scratch_slot_touch_only_that_slot():
    """A graph's padding rows may point every source and destination at one scratch slot: the real rows and
    every other slot are exact."""
    q, k, v, a, b, A_log, dt_bias, pool, src, dst = make_verify(2, 2 * HK, seed=7, batch=4)
    scratch = int(untouched_slots(pool, dst)[0])
    src[2:], dst[2:] = scratch, scratch
    before = pool.clone()
    out = gated_delta_verify(q, k, v, a, b, A_log, dt_bias, pool, src, dst)
    real = [x[:2] for x in (q, k, v, a, b)]
    ref_pool = before.clone()
    ref_out = gated_delta_verify_ref(*real, A_log, dt_bias, ref_pool, src[:2], dst[:2])
    torch.testing.assert_close(out[:2], ref_out, rtol=2e-5, atol=2e-5)
    others = [s for s in range(pool.shape[0]) if s != scratch]
    torch.testing.assert_close(pool[others], ref_pool[others], rtol=2e-5, atol=2e-5, equal_nan=True)


def test_gated_delta_verify_empty_batch_launches_nothing():
    q, k, v, a, b, A_log, dt_bias, pool, src, dst = make_verify(2, HK)
    before = pool.clone()
    out = gated_delta_verify(q[:0], k[:0], v[:0], a[:0], b[:0], A_log, dt_bias, pool, src[:0], dst[:0])
    assert out.shape == (0, 2, HK, DV) and torch.equal(pool.nan_to_num(), before.nan_to_num())


def test_gated_delta_verify_bad_arguments_name_the_argument():
    q, k, v, a, b, A_log, dt_bias, pool, src, dst = make_verify(3, 2 * HK)

    def call(**changed):
        args = dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, ssm_state=pool, src_idx=src, dst_idx=dst)
        gated_delta_verify(**{**args, **changed})

    cases = [
        (dict(src_idx=src.long()), r"src_idx expected a contiguous int32 \[3\] tensor, got \(3,\) torch.int64"),
        (dict(src_idx=src[:2]), r"src_idx expected a contiguous int32 \[3\] tensor, got \(2,\) torch.int32"),
        (dict(src_idx=dst[:, 0]), r"src_idx expected a contiguous int32 \[3\] tensor, got .* strides \(3,\)"),
        (
            dict(dst_idx=dst[:, :2]),
            r"dst_idx expected an int32 \[3, 3\] tensor with a contiguous last dim, got \(3, 2\)",
        ),
        (dict(dst_idx=dst.long()), r"dst_idx expected an int32 \[3, 3\] tensor .*, got \(3, 3\) torch.int64"),
        (dict(dst_idx=dst.t().contiguous().t()), r"dst_idx expected .* contiguous last dim, got .* strides \(1, 3\)"),
        (
            dict(ssm_state=pool.half()),
            r"ssm_state expected one of .*torch.float32, torch.bfloat16.*, got torch.float16",
        ),
        (dict(ssm_state=pool[..., :16]), r"ssm_state expected a \[slots, 4, 16, 32\] tensor, got \(\d+, 4, 16, 16\)"),
        (dict(ssm_state=pool.transpose(2, 3).contiguous().transpose(2, 3)), "ssm_state expected each slot contiguous"),
        (dict(v=v[:, :, :3]), r"v_heads expected a multiple of k_heads \(2\), got 3"),
        (dict(v=v[:2]), r"v expected a \[3, 3, v_heads, head_v_dim\] tensor, got \(2, 3, 4, 32\)"),
        (dict(q=q[:, :, :, :12], k=k[:, :, :, :12]), r"head_k_dim expected one of \(16, 32, 64, 128, 256\), got 12"),
        (dict(v=v[..., :24]), r"head_v_dim expected one of \(16, 32, 64, 128, 256\), got 24"),
        (dict(q=q[:, 0]), r"q expected a \[batch, T, k_heads, head_k_dim\] tensor, got \(3, 2, 16\)"),
        (dict(q=q.int()), r"q expected one of .*, got torch.int32"),
        (dict(k=k.half()), r"plan: k expected the planned \(3, 3, 2, 16\) torch.float32, got .* torch.float16"),
        (dict(a=a[..., :2]), r"plan: a expected the planned \(3, 3, 4\) torch.float32, got \(3, 3, 2\) torch.float32"),
        (dict(A_log=A_log[:3]), r"plan: A_log expected the planned \(4,\), got \(3,\)"),
        (dict(q=q.transpose(2, 3).contiguous().transpose(2, 3)), "q expected a contiguous last dim, got last-dim"),
        (dict(b=b.transpose(1, 2).contiguous().transpose(1, 2)), "b expected a contiguous last dim"),
        (dict(dst_idx=dst.to("meta")), "dst_idx expected ssm_state's device cpu, got meta"),
    ]
    assert_refused(call, cases if DEVICE == "cpu" else cases[:-1])
    many = make_verify(6, HK)
    with pytest.raises(ValueError, match=r"q expected T = N \+ 1 tokens per request in \(2, 3, 4, 5\) .*, got 6"):
        gated_delta_verify(*many)
    with pytest.raises(ValueError, match=r"run_config expected a dict with BV dividing 32 and num_warps in"):
        gated_delta_verify(q, k, v, a, b, A_log, dt_bias, pool, src, dst, run_config={"BV": 24, "num_warps": 4})
    with pytest.raises(ValueError, match=r"out expected a \(3, 3, 4, 32\) torch.float32 tensor"):
        gated_delta_verify(q, k, v, a, b, A_log, dt_bias, pool, src, dst, out=torch.empty(3, 3, 4, 32).half())


def test_plan_checks_once_and_refuses_other_layers(monkeypatch):
    q, k, v, a, b, A_log, dt_bias, pool, src, dst = make_verify(2, 2 * HK, seed=8)
    checked = []
    real_check = gdv._check_plan
    monkeypatch.setattr(gdv, "_check_plan", lambda *args: checked.append(args) or real_check(*args))
    plan = GatedDeltaVerifyPlan(q.shape, v.shape, q.dtype, pool.shape, pool.dtype, src, dst)
    for layer_pool in [pool.clone() for _ in range(3)]:  # three layers, each its own pool
        before = layer_pool.clone()
        ref_out, ref_pool = verify_reference(q, k, v, a, b, A_log, dt_bias, layer_pool, src, dst)
        out = plan.run(q, k, v, a, b, A_log, dt_bias, layer_pool)
        check_verify(out, layer_pool, before, ref_out, ref_pool, dst)
    assert len(checked) == 1
    with pytest.raises(ValueError, match=r"gated delta verify plan: ssm_state expected the planned \(\d+, 4, 16, 32\) "
                                         r"torch.float32, got \(\d+, 4, 16, 32\) torch.bfloat16"):  # fmt: skip
        plan.run(q, k, v, a, b, A_log, dt_bias, pool.bfloat16())


# ---- conv1d verify ----------------------------------------------------------------------------------------


def make_conv(tokens, channels, taps, dtype, state_dtype, src_in_dst=False, seed=0, batch=BATCH):
    """x as a strided view of one ``[batch * tokens, channels + 3]`` buffer; destination slots hold NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch * tokens, channels + 3, generator=g).to(dtype)[:, :channels].view(batch, tokens, channels)
    slots, src, dst = make_slots(batch, tokens, src_in_dst, g)
    pool = torch.randn(slots, taps - 1, channels, generator=g).to(state_dtype)
    pool[sorted(set(dst.flatten().tolist()) - set(src.tolist()))] = NAN_STATE
    weight = torch.randn(channels, taps, generator=g).to(dtype)
    return [t.to(DEVICE) for t in (x, pool, weight, src, dst)]


@pytest.mark.parametrize("src_in_dst", [False, True], ids=["src-apart", "src-in-dst"])
@pytest.mark.parametrize(
    "dtype, state_dtype, taps, config",
    [
        (torch.float32, torch.float32, 4, None),
        (torch.float16, torch.float16, 2, None),
        (torch.float16, torch.float32, 4, {"BLOCK_C": 16, "num_warps": 1}),
    ],
    ids=["fp32-k4", "fp16-k2", "fp16-state-fp32-k4-block16"],
)
@pytest.mark.parametrize("n", [1, 2, 3, 4], ids=lambda n: f"N={n}")
def test_conv1d_verify_matches_sequential_updates(n, dtype, state_dtype, taps, config, src_in_dst):
    x, pool, weight, src, dst = make_conv(n + 1, 40, taps, dtype, state_dtype, src_in_dst, seed=n)  # 40: ragged
    before = pool.clone()
    ref_pool = pool.clone()
    ref = causal_conv1d_verify_ref(x.double().to(dtype), ref_pool, weight, src, dst)
    out = torch.full(x.shape, float("nan"), dtype=dtype, device=DEVICE)
    assert causal_conv1d_verify(x, pool, weight, src, dst, out=out, run_config=config) is out
    assert not out.isnan().any(), "some output elements were never written"
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    assert not pool[dst.long()].isnan().any(), "some destination slot was never written"
    assert torch.equal(pool[dst.long()], ref_pool[dst.long()])  # windows copy values: exact
    untouched = untouched_slots(pool, dst)
    assert torch.equal(pool[untouched], before[untouched])


def test_conv1d_verify_bad_arguments_name_the_argument():
    x, pool, weight, src, dst = make_conv(3, 40, 4, torch.float32, torch.float32)

    def call(**changed):
        causal_conv1d_verify(**{**dict(x=x, conv_state=pool, weight=weight, src_idx=src, dst_idx=dst), **changed})

    cases = [
        (dict(src_idx=src.long()), r"src_idx expected a contiguous int32 \[3\] tensor, got \(3,\) torch.int64"),
        (dict(src_idx=dst[:, 1]), r"src_idx expected a contiguous int32 \[3\] tensor, got .* strides \(3,\)"),
        (dict(dst_idx=dst[:2]), r"dst_idx expected an int32 \[3, 3\] tensor with a contiguous last dim, got \(2, 3\)"),
        (
            dict(conv_state=pool[:, :, :32]),
            r"conv_state expected a \[slots, K - 1 >= 1, 40\] tensor, got \(\d+, 3, 32\)",
        ),
        (dict(weight=weight[:, :3]), r"plan: weight expected the planned \(40, 4\) torch.float32, got \(40, 3\)"),
        (dict(weight=weight.t().contiguous().t()), "weight expected contiguous, got strides"),
        (dict(x=x[:, 0]), r"x expected a \[batch, T, channels\] tensor of .*, got \(3, 40\) torch.float32"),
        (dict(x=x[:, :1], dst_idx=dst[:, :1]), r"x expected T = N \+ 1 tokens per request in \(2, 3, 4, 5\) .*, got 1"),
        (dict(x=x.transpose(1, 2).contiguous().transpose(1, 2)), "x expected a contiguous last dim"),
        (dict(conv_state=pool.to(torch.int8)), "conv_state expected one of .*, got torch.int8"),
        (dict(src_idx=src.to("meta")), "src_idx expected conv_state's device cpu, got meta"),
    ]
    assert_refused(call, cases if DEVICE == "cpu" else cases[:-1])
    with pytest.raises(ValueError, match="run_config expected a dict with BLOCK_C a power of two >= 16"):
        causal_conv1d_verify(x, pool, weight, src, dst, run_config={"BLOCK_C": 24, "num_warps": 4})


def test_conv1d_verify_plan_runs_every_layer():
    x, pool, weight, src, dst = make_conv(2, 40, 4, torch.float32, torch.float32, src_in_dst=True, seed=5)
    plan = CausalConv1dVerifyPlan(x.shape, x.dtype, pool.shape, pool.dtype, weight.dtype, src, dst)
    for layer_pool in [pool.clone() for _ in range(2)]:
        ref_pool = layer_pool.clone()
        ref = causal_conv1d_verify_ref(x, ref_pool, weight, src, dst)
        torch.testing.assert_close(plan.run(x, layer_pool, weight), ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(layer_pool.nan_to_num(), ref_pool.nan_to_num())
    with pytest.raises(ValueError, match=r"conv1d verify plan: x expected the planned \(3, 2, 40\) torch.float32"):
        plan.run(x[:2], pool, weight)
