"""The linear-attention backend: prefill writes each request's final states into its own slot (whatever the batch
order), decode advances only its requests' slots; on a GPU, fla-core's prefill and the Triton decode against the
torch references."""

import pytest
import torch

import lightllm.layers.linear_attention as la

from lightllm.kernels.linear_attention.reference import (
    causal_conv1d_prefill_ref,
    gated_delta_rule_varlen_ref,
    gdn_gates_ref,
)
from lightllm.layers.infer_state import InferState
from lightllm.layers.linear_attention import (
    LinearAttentionBackend,
    LinearAttentionShape,
    LinearAttentionState,
)

SHAPE = LinearAttentionShape(key_heads=2, value_heads=4, key_dim=16, value_dim=8, conv_kernel=4)
GPU_SHAPE = LinearAttentionShape(key_heads=2, value_heads=4, key_dim=64, value_dim=64, conv_kernel=4)  # Triton's dims


def batch(lens, slots, device="cpu"):
    """InferState of a packed prefill (``lens`` tokens into ``slots``) or, with ``lens`` None, a one-token decode."""
    i32 = dict(dtype=torch.int32, device=device)
    if lens is None:
        return InferState(is_prefill=False, b_req_idx=torch.tensor(slots, **i32), req_to_token=None,
                          b_seq_len=None, out_token_idx=None, positions=None, max_len_in_batch=1)  # fmt: skip
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0)[:-1].tolist()])
    return InferState(is_prefill=True, b_req_idx=torch.tensor(slots, **i32), req_to_token=None, b_seq_len=None,
                      out_token_idx=None, positions=None, max_len_in_batch=max(lens), b_q_start=starts.to(**i32),
                      b_q_len=torch.tensor(lens, **i32), max_q_len=max(lens))  # fmt: skip


def inputs(tokens, seed=0, s=SHAPE):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    hk, hv = s.key_heads, s.value_heads
    return dict(x=r(tokens, s.conv_channels), weight=r(s.conv_channels, s.conv_kernel), q=r(tokens, hk, s.key_dim),
                k=r(tokens, hk, s.key_dim), v=r(tokens, hv, s.value_dim), a=r(tokens, hv), b=r(tokens, hv),
                A_log=r(hv) * 0.5, dt_bias=r(hv) * 0.5)  # fmt: skip


def backend(slots=4, device="cpu", dtype=torch.float32, shape=SHAPE):
    state = LinearAttentionState(1, slots, shape, dtype, torch.float32, device)
    return LinearAttentionBackend(state, torch.device(device))


def run_prefill(be, t, lens, slots):
    plan = be.plan(batch(lens, slots, be.state.conv.device))
    conv = be.conv_prefill(0, t["x"], t["weight"], plan)
    out = be.delta_prefill(0, t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"], t["dt_bias"], plan)
    return conv, out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_prefill_bounds_from_the_hosts_lengths_equal_the_devices(device):
    """An InferState built with the host's lengths (``packed_prefill``) gives the plan its bounds without reading
    the device; the same bounds as from ``b_q_len``, on the host for the references and on the device for fla."""
    lens, slots = [5, 1, 7], [2, 0, 1]
    be = backend(device=device)
    from_device = be.plan(batch(lens, slots, device))
    state = batch(lens, slots, device)
    state.q_lens_host = tuple(lens)
    from_host = be.plan(state)
    assert from_host.cu_seqlens_cpu.tolist() == from_device.cu_seqlens_cpu.tolist() == [0, 5, 6, 13]
    assert from_host.cu_seqlens.device == from_device.cu_seqlens.device
    assert from_host.cu_seqlens.tolist() == [0, 5, 6, 13] and from_host.cu_seqlens.dtype == torch.int64
    if device == "cuda":
        assert torch.equal(from_host.offsets, from_device.offsets)
    packed = InferState.packed_prefill(slots, torch.zeros(3, 16, dtype=torch.int32), [0, 0, 0], lens,
                                       torch.arange(13), torch.device(device))  # fmt: skip
    assert packed.q_lens_host == (5, 1, 7)


def test_prefill_writes_each_final_state_into_its_own_slot():
    be, t, lens = backend(), inputs(12), [5, 7]
    be.state.conv[0, 0] = 7.0  # slots no request of the batch owns keep what they hold
    be.state.ssm[0, 3] = 7.0
    conv, out = run_prefill(be, t, lens, slots=[2, 1])  # the first request's slot is the higher one
    cu = torch.tensor([0, 5, 12])
    want_conv, want_conv_states = causal_conv1d_prefill_ref(t["x"], t["weight"], cu)
    g, beta = gdn_gates_ref(t["a"], t["b"], t["A_log"], t["dt_bias"])
    want_out, want_finals = gated_delta_rule_varlen_ref(t["q"], t["k"], t["v"], g, beta, cu)
    assert torch.equal(conv, want_conv) and torch.equal(out, want_out)
    assert torch.equal(be.state.conv[0, 2], want_conv_states[0]) and torch.equal(
        be.state.conv[0, 1], want_conv_states[1]
    )
    assert torch.equal(be.state.ssm[0, 2], want_finals[0]) and torch.equal(be.state.ssm[0, 1], want_finals[1])
    assert (be.state.conv[0, 0] == 7).all() and (be.state.ssm[0, 3] == 7).all()


def test_decode_advances_only_its_requests_slots():
    be, t = backend(), inputs(12)
    run_prefill(be, t, [5, 7], slots=[2, 1])
    before = (be.state.conv.clone(), be.state.ssm.clone())
    d = inputs(2, seed=1)
    plan = be.plan(batch(None, [1, 2]))
    x = be.conv_decode(0, d["x"], t["weight"], plan)
    q, k, v = x[:, :32].view(2, 2, 16), x[:, 32:64].view(2, 2, 16), x[:, 64:].view(2, 4, 8)
    out = be.delta_decode(0, q, k, v, d["a"], d["b"], t["A_log"], t["dt_bias"], plan)
    assert out.shape == (2, 4, 8) and out.isfinite().all()
    for slot in (0, 3):
        assert torch.equal(be.state.conv[0, slot], before[0][0, slot]) and torch.equal(
            be.state.ssm[0, slot], before[1][0, slot]
        )
    for slot in (1, 2):
        assert not torch.equal(be.state.ssm[0, slot], before[1][0, slot])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gpu_conv_path_matches_the_per_request_reference(dtype):
    """The GPU prefill's conv (``conv1d_prefill``'s kernels, under the interpreter on the CPU) from the plan's token
    layout, against the reference: requests shorter than the kernel (their window zero-padded on the left) and one
    token long, each window written into its own slot."""
    lens, slots = [1, 2, 9, 5], [3, 0, 2, 1]
    t = inputs(sum(lens))
    x, weight = t["x"].to(dtype), t["weight"].to(dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    be = backend(dtype=dtype, slots=5)
    be.on_gpu = True
    be.state.conv[0, 4] = 7.0  # no request's slot: kept
    plan = be.plan(batch(lens, slots))
    assert plan.offsets.tolist() == [0, 0, 1, *range(9), *range(5)] and torch.equal(plan.cu_seqlens, cu)
    assert plan.seq_ids.tolist() == [0, 1, 1, *[2] * 9, *[3] * 5]
    out = be.conv_prefill(0, x, weight, plan)
    want_out, want_states = causal_conv1d_prefill_ref(x, weight, cu)
    assert out.dtype == dtype and torch.allclose(out.float(), want_out.float(), atol=1e-5 if dtype == torch.float32
                                                 else 2e-3, rtol=1e-3)  # fmt: skip
    assert torch.equal(be.state.conv[0, slots], want_states) and (be.state.conv[0, 4] == 7).all()


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[1, 70, 9], [1, 33, 9]], ids=["chunked", "recurrent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_prefill_and_decode_match_the_references(dtype, lens):
    """fla-core's prefill (chunked with a request longer than RECURRENT_MAX_TOKENS and fla's 64-token chunk, else
    its fused recurrent kernel) and the Triton decode kernels (the GPU path) against the CPU references, with
    grouped value heads, several sequences and unordered slots."""
    slots = [3, 0, 2]
    s = GPU_SHAPE
    t, d = inputs(sum(lens), s=s), inputs(3, seed=1, s=s)
    ref, gpu = backend(shape=s), backend(device="cuda", dtype=dtype, shape=s)
    to = lambda v: v.to(device="cuda", dtype=dtype)  # noqa: E731
    want = run_prefill(ref, t, lens, slots)
    got = run_prefill(gpu, {n: to(v) for n, v in t.items()}, lens, slots)
    tol = 5e-3 if dtype == torch.float32 else 1e-1  # fp32: fla's dots may run in tf32
    for w, g in zip(want, got):
        assert torch.allclose(g.float().cpu(), w, atol=tol, rtol=tol)
    assert torch.allclose(gpu.state.ssm.cpu(), ref.state.ssm, atol=tol, rtol=tol)
    outs = []
    for be, conv in ((ref, lambda v: v), (gpu, to)):
        plan = be.plan(batch(None, slots, be.state.conv.device))
        x = be.conv_decode(0, conv(d["x"]), conv(t["weight"]), plan)
        kd = s.key_heads * s.key_dim  # q, k, v: strided views of the conv output, as the model passes them
        q, k = x[:, :kd].view(3, s.key_heads, -1), x[:, kd : 2 * kd].view(3, s.key_heads, -1)
        v = x[:, 2 * kd :].view(3, s.value_heads, -1)
        outs.append(be.delta_decode(0, q, k, v, conv(d["a"]), conv(d["b"]), conv(t["A_log"]), conv(t["dt_bias"]),
                                    plan).float().cpu())  # fmt: skip
    assert torch.allclose(outs[1], outs[0], atol=tol, rtol=tol)
    assert torch.allclose(gpu.state.ssm.cpu(), ref.state.ssm, atol=tol, rtol=tol)
    assert torch.allclose(gpu.state.conv.float().cpu(), ref.state.conv, atol=tol, rtol=tol)


def chunk_batch(lens, slots, prefix):
    state = batch(lens, slots)
    state.b_prefix_len = torch.tensor(prefix, dtype=torch.int32)
    state.max_prefix_len = max(prefix)
    return state


PER_TOKEN = ("x", "q", "k", "v", "a", "b")


def rows(t, idx):
    return {n: (v[idx] if n in PER_TOKEN else v) for n, v in t.items()}


@pytest.mark.parametrize("conv_path", ["reference", "gpu_packed"])
def test_chunked_prefill_continues_each_slots_states(conv_path):
    """A prefill chunk that continues a request (b_prefix_len > 0) starts from its slot's conv window and recurrent
    state: two chunks give the outputs and final states of one whole prefill. Request B's first chunk is shorter
    than the conv window; request C starts fresh in the second step from a slot holding a finished request's
    states, which it must not read. The GPU path's conv (its Triton kernels, under the interpreter) runs here too;
    its delta rule is fla-core's (GPU test below)."""
    whole_lens, slots = [9, 3, 6], [2, 0, 1]
    t = inputs(sum(whole_lens), seed=4)
    starts = [0, 9, 12]
    ref = backend()
    want_conv, want_out = run_prefill(ref, t, whole_lens, slots)

    be = backend()
    be.on_gpu = conv_path == "gpu_packed"
    be.state.conv[0, 1] = 7.0  # a finished request's states in C's slot
    be.state.ssm[0, 1] = 7.0
    steps = [([(0, 0, 4), (1, 0, 1)], [2, 0]), ([(0, 4, 9), (1, 1, 3), (2, 0, 6)], [2, 0, 1])]
    got_conv = torch.full_like(want_conv, float("nan"))
    got_out = torch.full_like(want_out, float("nan"))
    for pieces, step_slots in steps:
        idx = torch.cat([torch.arange(starts[r] + a, starts[r] + b) for r, a, b in pieces])
        u = rows(t, idx)
        plan = be.plan(chunk_batch([b - a for _, a, b in pieces], step_slots, [a for _, a, _ in pieces]))
        got_conv[idx] = be.conv_prefill(0, u["x"], u["weight"], plan)
        if not be.on_gpu:
            got_out[idx] = be.delta_prefill(0, u["q"], u["k"], u["v"], u["a"], u["b"], u["A_log"], u["dt_bias"],
                                            plan)  # fmt: skip
    torch.testing.assert_close(got_conv, want_conv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(be.state.conv, ref.state.conv, rtol=0, atol=0)
    if not be.on_gpu:
        torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(be.state.ssm, ref.state.ssm, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_chunked_prefill_continues_the_states(dtype):
    """fla-core with the slot's recurrent state as initial_state and the packed conv with the slot's window: a
    request prefilled in two chunks (the first longer than fla's 64-token chunk) against the CPU references."""
    s = GPU_SHAPE
    lens, slots = [100, 5], [3, 1]
    t = inputs(sum(lens), seed=5, s=s)
    ref, gpu = backend(shape=s), backend(device="cuda", dtype=dtype, shape=s)
    want_conv, want_out = run_prefill(ref, t, lens, slots)
    to = lambda v: v.to(device="cuda", dtype=dtype)  # noqa: E731
    got_conv, got_out = torch.zeros_like(want_conv), torch.zeros_like(want_out)
    for pieces, prefix in (([(0, 0, 70), (1, 0, 2)], [0, 0]), ([(0, 70, 100), (1, 2, 5)], [70, 2])):
        starts = [0, 100]
        idx = torch.cat([torch.arange(starts[r] + a, starts[r] + b) for r, a, b in pieces])
        u = {n: to(v) for n, v in rows(t, idx).items()}
        state = chunk_batch([b - a for _, a, b in pieces], slots, prefix)
        state.b_req_idx, state.b_q_start, state.b_q_len, state.b_prefix_len = (
            x.cuda() for x in (state.b_req_idx, state.b_q_start, state.b_q_len, state.b_prefix_len)
        )
        plan = gpu.plan(state)
        got_conv[idx] = gpu.conv_prefill(0, u["x"], u["weight"], plan).float().cpu()
        got_out[idx] = gpu.delta_prefill(0, u["q"], u["k"], u["v"], u["a"], u["b"], u["A_log"], u["dt_bias"],
                                         plan).float().cpu()  # fmt: skip
    tol = 5e-3 if dtype == torch.float32 else 1e-1
    assert torch.allclose(got_conv, want_conv, atol=tol, rtol=tol)
    assert torch.allclose(got_out, want_out, atol=tol, rtol=tol)
    assert torch.allclose(gpu.state.ssm.cpu(), ref.state.ssm, atol=tol, rtol=tol)


def test_kernel_decode_plans_once_per_forward_and_matches_the_references(monkeypatch):
    """The GPU decode path under the interpreter over two layers: the conv update's and the delta rule's plans are
    made at the first layer (checks once), every layer writes the forward's one output buffer (consumed before the
    next layer) and the states advance as the references advance them."""
    from lightllm.kernels.linear_attention import conv1d_update, gated_delta_decode
    from lightllm.kernels.linear_attention.reference import causal_conv1d_update_ref, gated_delta_decode_ref

    s = LinearAttentionShape(key_heads=2, value_heads=4, key_dim=16, value_dim=16, conv_kernel=4)
    g = torch.Generator().manual_seed(3)
    state = LinearAttentionState(2, 4, s, torch.float32, torch.float32, "cpu")
    kernels = LinearAttentionBackend(state, torch.device("cpu"))
    kernels.on_gpu = True  # the Triton kernels, under the interpreter
    kernels.state.conv.copy_(torch.randn(kernels.state.conv.shape, generator=g))
    kernels.state.ssm.copy_(torch.randn(kernels.state.ssm.shape, generator=g) * 0.1)
    conv_ref, ssm_ref = kernels.state.conv.clone(), kernels.state.ssm.clone()
    made = []
    for module, name in ((conv1d_update, "CausalConv1dUpdatePlan"), (gated_delta_decode, "GatedDeltaDecodePlan")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: made.append(_name) or _real(*a, **k))
    plan = kernels.plan(batch(None, [2, 0]))
    slots, kd = torch.tensor([2, 0], dtype=torch.int32), 2 * 16
    outs = []
    for layer in range(2):
        t = inputs(2, seed=10 + layer, s=s)
        mixed = kernels.conv_decode(layer, t["x"], t["weight"], plan)
        want_mixed = causal_conv1d_update_ref(t["x"], conv_ref[layer], t["weight"], slots)
        torch.testing.assert_close(mixed, want_mixed, rtol=1e-5, atol=1e-5)
        q, k, v = mixed[:, :kd].view(2, 2, 16), mixed[:, kd : 2 * kd].view(2, 2, 16), mixed[:, 2 * kd :].view(2, 4, 16)
        out = kernels.delta_decode(layer, q, k, v, t["a"], t["b"], t["A_log"], t["dt_bias"], plan)
        rq, rk, rv = (want_mixed[:, :kd].view(2, 2, 16), want_mixed[:, kd : 2 * kd].view(2, 2, 16),
                      want_mixed[:, 2 * kd :].view(2, 4, 16))  # fmt: skip
        want = gated_delta_decode_ref(rq, rk, rv, t["a"], t["b"], t["A_log"], t["dt_bias"], ssm_ref[layer], slots)
        torch.testing.assert_close(out, want.to(out.dtype), rtol=1e-4, atol=1e-4)
        outs.append(out)
    assert made == ["CausalConv1dUpdatePlan", "GatedDeltaDecodePlan"]
    assert outs[0] is outs[1]  # one output buffer per forward
    torch.testing.assert_close(kernels.state.conv, conv_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernels.state.ssm, ssm_ref, rtol=1e-4, atol=1e-4)


def test_float32_prefill_on_the_gpu_path_takes_the_reference(monkeypatch):
    """fla-core's chunk kernels do not compile for float32 inputs (Triton 3.6, H200), so the GPU path hands float32
    models to the torch reference; 16-bit inputs still go to fla-core."""
    import lightllm.layers.linear_attention as la

    calls = []

    def fake_fla(q, k, v, g, beta, plan, init=None):
        calls.append(v.dtype)
        return v.float(), torch.zeros(len(plan.cu_seqlens_cpu) - 1, v.shape[1], q.shape[-1], v.shape[-1])

    monkeypatch.setattr(la, "_fla_chunk", fake_fla)
    monkeypatch.setattr(la, "_fla_recurrent", fake_fla)
    lens, slots, t = [1, 9], [3, 0], inputs(10)
    ref = backend()
    want = run_prefill(ref, t, lens, slots)
    gpu_path = backend()
    gpu_path.on_gpu = True
    got = run_prefill(gpu_path, t, lens, slots)
    assert calls == [] and all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want))
    assert torch.allclose(gpu_path.state.ssm, ref.state.ssm, atol=1e-6)
    half = backend(dtype=torch.bfloat16)
    half.on_gpu = True
    run_prefill(half, {n: v.to(torch.bfloat16) for n, v in t.items()}, lens, slots)
    assert calls == [torch.bfloat16]


@pytest.mark.parametrize("lens, path", [([1, 9], "recurrent"), ([64, 3], "recurrent"), ([65, 3], "chunk"),
                                        ([1, 200], "chunk")])  # fmt: skip
def test_short_prefills_take_the_recurrent_kernel(monkeypatch, lens, path):
    """On the GPU path a 16-bit prefill goes token by token when no request brings more than RECURRENT_MAX_TOKENS
    new tokens (one launch, little host work), chunked otherwise; both get the same inputs, slots' states as
    initial state included, and the final states land in the slots."""
    import lightllm.layers.linear_attention as la

    assert la.RECURRENT_MAX_TOKENS == 64
    calls = []

    def fake(name):
        def fla(q, k, v, g, beta, plan, init=None):
            calls.append((name, plan.max_q_len, init is None))
            finals = torch.full((len(plan.cu_seqlens_cpu) - 1, v.shape[1], q.shape[-1], v.shape[-1]), 0.5)
            return v.float(), finals

        return fla

    monkeypatch.setattr(la, "_fla_chunk", fake("chunk"))
    monkeypatch.setattr(la, "_fla_recurrent", fake("recurrent"))
    t = inputs(sum(lens))
    be = backend(dtype=torch.bfloat16)
    be.on_gpu = True
    slots = [3, 0]
    run_prefill(be, {n: v.to(torch.bfloat16) for n, v in t.items()}, lens, slots)
    assert calls == [(path, max(lens), True)]
    assert (be.state.ssm[0, slots] == 0.5).all()
    calls.clear()
    plan = be.plan(chunk_batch(lens, slots, [4, 0]))  # a continued request: the slots' states go in
    u = {n: v.to(torch.bfloat16) for n, v in t.items()}
    be.delta_prefill(0, u["q"], u["k"], u["v"], u["a"], u["b"], u["A_log"], u["dt_bias"], plan)
    assert calls == [(path, max(lens), False)]


def test_recurrent_fla_kernel_matches_the_reference_under_the_interpreter():
    """fla-core's fused recurrent kernel as ``_fla_recurrent`` calls it (its gates and betas by name, the packing's
    bounds, float32 initial states, the final states out), run by Triton's interpreter, against the torch
    reference: three requests of 1, 5 and 9 tokens, grouped value heads."""
    import lightllm.layers.linear_attention as la
    from lightllm.kernels.linear_attention.reference import gated_delta_rule_varlen_ref, gdn_gates_ref

    lens, s = [1, 5, 9], SHAPE
    t = inputs(sum(lens), seed=7)
    g, beta = gdn_gates_ref(t["a"], t["b"], t["A_log"], t["dt_bias"])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    init = torch.randn(3, s.value_heads, s.key_dim, s.value_dim, generator=torch.Generator().manual_seed(8)) * 0.1
    plan = la.LinearAttentionPlan(torch.arange(3, dtype=torch.int32), cu, cu, max_q_len=max(lens))
    for start in (None, init):
        out, finals = la._fla_recurrent(t["q"], t["k"], t["v"], g, beta, plan, start)
        want_out, want_finals = gated_delta_rule_varlen_ref(t["q"], t["k"], t["v"], g, beta, cu, initial_states=start)
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(finals, want_finals, rtol=1e-5, atol=1e-5)


def test_short_prefill_on_the_gpu_path_continues_the_states_under_the_interpreter():
    """The backend's GPU path end to end (packed conv, fla's fused recurrent kernel in float16 under the
    interpreter): a request prefilled in two short chunks, the second starting from its slot's states, beside a
    fresh request in a slot holding a finished request's states, against one whole float32 reference prefill."""
    whole_lens, slots, starts = [9, 6], [2, 1], [0, 9]
    t = inputs(sum(whole_lens), seed=9)
    ref = backend()
    want_conv, want_out = run_prefill(ref, t, whole_lens, slots)
    be = backend(dtype=torch.float16)
    be.on_gpu = True
    be.state.ssm[0, 1] = 7.0  # must not be read: request B starts fresh
    half = {n: v.half() for n, v in t.items()}
    got_conv, got_out = torch.full_like(want_conv, float("nan")), torch.full_like(want_out, float("nan"))
    for pieces, step_slots, prefix in (([(0, 0, 4)], [2], [0]), ([(0, 4, 9), (1, 0, 6)], [2, 1], [4, 0])):
        idx = torch.cat([torch.arange(starts[r] + a, starts[r] + b) for r, a, b in pieces])
        u = rows(half, idx)
        plan = be.plan(chunk_batch([b - a for _, a, b in pieces], step_slots, prefix))
        assert plan.max_q_len <= 64
        x = be.conv_prefill(0, u["x"], u["weight"], plan)
        assert x.dtype == torch.float16
        got_conv[idx] = x.float()
        got_out[idx] = be.delta_prefill(0, u["q"], u["k"], u["v"], u["a"], u["b"], u["A_log"], u["dt_bias"],
                                        plan).float()  # fmt: skip
    torch.testing.assert_close(got_conv, want_conv, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got_out, want_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(be.state.ssm, ref.state.ssm, rtol=2e-2, atol=2e-2)


def padded_batch(n, bucket, slot, pad_slot, prefix):
    """A prefill graph's state: one request of ``n`` tokens after ``prefix`` padded to ``bucket`` rows."""
    i32 = dict(dtype=torch.int32)
    slots = torch.tensor([slot, pad_slot, pad_slot], **i32)  # as the staging's: the padding's slot twice
    return InferState(is_prefill=True, b_req_idx=torch.tensor([slot], **i32), req_to_token=None, b_seq_len=None,
                      out_token_idx=None, positions=None, max_len_in_batch=bucket, b_q_start=torch.zeros(1, **i32),
                      b_q_len=torch.tensor([n], **i32), max_q_len=bucket, b_prefix_len=torch.tensor([prefix], **i32),
                      max_prefix_len=64, state_idx=slots, padded=True)  # fmt: skip


@pytest.mark.parametrize(
    "gpu_path, n, bucket",
    [(False, 3, 16), (False, 16, 16), (True, 3, 16), (True, 16, 16), (False, 70, 128), (False, 128, 128)],
    ids=["padded", "fills-the-bucket", "padded-gpu-interpreter", "fills-the-bucket-gpu-interpreter",
         "chunked-bucket", "fills-a-chunked-bucket"],
)  # fmt: skip
def test_padded_prefill_keeps_the_padding_out_of_the_requests_states(gpu_path, n, bucket):
    """A prefill graph's padded rows (``InferState.padded``): a request continued after 5 tokens with ``n`` more,
    padded to 16 rows of random garbage, gives the outputs and final states of its unpadded prefill; the padding
    runs from and into the padding slot only. On the GPU path: the packed conv and fla's fused recurrent kernel in
    float16 under the interpreter (with an empty padding sequence when the request fills the bucket). A bucket past
    RECURRENT_MAX_TOKENS (fla's chunked kernels on a GPU) adds an empty third sequence from the padding slot."""
    slot, pad_slot, other = 2, 3, 1
    t = inputs(5 + bucket, seed=11)
    dtype = torch.float16 if gpu_path else torch.float32
    ref, be = backend(), backend(dtype=dtype)
    be.on_gpu = gpu_path
    for b in (ref, be):  # the request's first 5 tokens, from a plain prefill
        run_prefill(b, rows(t, torch.arange(5)), [5], [slot])
    be.state.ssm[0, other] = 7.0
    plan = ref.plan(chunk_batch([n], [slot], [5]))
    u = rows(t, torch.arange(5, 5 + n))
    want_conv = ref.conv_prefill(0, u["x"], u["weight"], plan)
    want_out = ref.delta_prefill(0, u["q"], u["k"], u["v"], u["a"], u["b"], u["A_log"], u["dt_bias"], plan)
    plan = be.plan(padded_batch(n, bucket, slot, pad_slot, 5))
    assert plan.max_q_len == bucket and plan.cu_seqlens.tolist() == [0, n, bucket] + [bucket] * (bucket > 64)
    assert (plan.chunk_indices is not None) == (bucket > 64)
    u = {k: v.to(dtype) for k, v in rows(t, torch.arange(5, 5 + bucket)).items()}
    got_conv = be.conv_prefill(0, u["x"], u["weight"], plan)
    got_out = be.delta_prefill(0, u["q"], u["k"], u["v"], u["a"], u["b"], u["A_log"], u["dt_bias"], plan)
    tol = dict(rtol=2e-2, atol=2e-2) if gpu_path else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_conv[:n].float(), want_conv, **tol)
    torch.testing.assert_close(got_out[:n].float(), want_out, **tol)
    for pool, want in ((be.state.conv, ref.state.conv), (be.state.ssm, ref.state.ssm)):
        torch.testing.assert_close(pool[0, slot].float(), want[0, slot].float(), **tol)
    assert (be.state.ssm[0, other] == 7.0).all()
    # the padding ran as a fresh sequence of its own: its slot holds that sequence's final states
    pad = rows(t, torch.arange(5 + n, 5 + bucket))
    fresh = backend()
    if n < bucket:
        run_prefill(fresh, pad, [bucket - n], [pad_slot])
    want_pad = [fresh.state.ssm[0, pad_slot]]
    if bucket > 64:  # chunked: the empty third sequence's zero state goes to the same slot, either may land last
        want_pad.append(torch.zeros_like(want_pad[0]))
    assert any(torch.allclose(be.state.ssm[0, pad_slot].float(), w, **tol) for w in want_pad)


def test_padded_prefill_bounds_are_checked(monkeypatch):
    be = backend()
    be.on_gpu = True
    monkeypatch.setattr(la, "CHUNKED_GRAPH_MAX_TOKENS", 0)
    with pytest.raises(ValueError, match=r"at most RECURRENT_MAX_TOKENS \(64\) rows on a GPU, or "
                                         r"CHUNKED_GRAPH_MAX_TOKENS \(0\), got 128"):  # fmt: skip
        be.plan(padded_batch(3, 128, 2, 3, 0))
    state = padded_batch(3, 16, 2, 3, 0)
    state.state_idx = torch.tensor([2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"expected one request and 2 state slots, got 1 requests and 1 slots"):
        be.plan(state)


@pytest.mark.parametrize("bucket", [128, 100, 512])
def test_static_chunk_indices_are_flas_with_a_spare_row_on_the_empty_sequence(bucket):
    """For every request length a bucket serves, the padded layout ``[n, bucket - n, 0]``: the rows fla-core derives
    on the host, then (when the padding ends on a chunk boundary with the request) one spare row, chunk 0 of the
    empty last sequence; always the same row count."""
    from fla.ops.utils.index import prepare_chunk_indices

    rows = -(-bucket // la.FLA_CHUNK) + 1
    for n in range(1, bucket + 1):
        cu = torch.tensor([0, n, bucket, bucket])
        got = la.static_chunk_indices(cu, la.FLA_CHUNK, rows)
        want = prepare_chunk_indices(cu, la.FLA_CHUNK, cu_seqlens_cpu=cu)
        assert got.shape == (rows, 2) and len(want) in (rows - 1, rows)
        assert torch.equal(got[: len(want)], want), n
        assert all(row == [2, 0] for row in got[len(want) :].tolist()), n


def test_chunked_padded_plans_need_chunked_graphs_on(monkeypatch):
    """On a GPU a padded plan past RECURRENT_MAX_TOKENS needs CHUNKED_GRAPH_MAX_TOKENS to reach its rows."""
    be = backend()
    be.on_gpu = True
    monkeypatch.setattr(la, "CHUNKED_GRAPH_MAX_TOKENS", 128)
    plan = be.plan(padded_batch(3, 128, 2, 3, 0))
    assert plan.chunk_indices.shape == (3, 2) and plan.chunk_indices.tolist() == [[0, 0], [1, 0], [1, 1]]
    assert plan.state_idx.tolist() == [2, 3, 3] and plan.cu_seqlens_cpu is None
    with pytest.raises(ValueError, match=r"CHUNKED_GRAPH_MAX_TOKENS \(128\), got 256"):
        be.plan(padded_batch(3, 256, 2, 3, 0))
