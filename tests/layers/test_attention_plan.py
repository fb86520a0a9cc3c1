"""The attention backend plans once per forward, explicitly, before any layer runs (from the batch metadata and the
pool's shapes): argument checks, FA3's page table and the tuned config; every layer only runs the plan. Runs the GPU
code path on the CPU (Triton interpreter, a torch FA3)."""

import pytest
import torch

from lightllm.layers.attention import AttentionBackend, make_pool
from lightllm.layers.infer_state import InferState
from lightllm.kernels.attention.decode import fa3, flash_decode
from lightllm.kernels.attention.decode.reference import decode_attention_ref
from lightllm.kernels.attention.prefill.context_attention import (
    CachedPrefix,
    _launch_context_attention,
    context_attention_ref,
)

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, POOL = 3, 2, 4, 64, 64


def gpu_path_backend(decode_backend="triton", monkeypatch=None, provider=None):
    pool = make_pool("None", POOL, LAYERS, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        pool.k[layer].copy_(torch.randn(pool.k[layer].shape, generator=g))
        pool.v[layer].copy_(torch.randn(pool.v[layer].shape, generator=g))
    if decode_backend == "fa3":
        monkeypatch.setattr(fa3, "require_fa3", lambda device, flag=None: provider)
    backend = AttentionBackend(pool, decode_backend, torch.device("cpu"))
    backend.on_gpu = True  # the GPU kernels, under the interpreter
    return backend


def decode_state(lens, req_to_token):
    return InferState(
        is_prefill=False,
        b_req_idx=torch.tensor([1, 0], dtype=torch.int32),
        req_to_token=req_to_token,
        b_seq_len=torch.tensor(lens, dtype=torch.int32),
        out_token_idx=torch.zeros(len(lens), dtype=torch.int64),
        positions=torch.tensor([n - 1 for n in lens]),
        max_len_in_batch=max(lens),
    )


def counting(monkeypatch, owner, name):
    calls = []
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


def test_triton_decode_checks_and_resolves_once_per_step(monkeypatch, isolated_autotune):
    backend = gpu_path_backend()
    req_to_token = torch.arange(2 * 32, dtype=torch.int32).view(2, 32)
    checks = counting(monkeypatch, flash_decode, "_check")
    plans = counting(monkeypatch, flash_decode._launch_gqa_flash_decode, "plan")
    state = decode_state([9, 20], req_to_token)
    backend.plan_decode(state, Q_HEADS, torch.float32)
    assert len(checks) == 1 and len(plans) == 1  # before any layer
    g = torch.Generator().manual_seed(1)
    for layer in range(LAYERS):
        q = torch.randn(2, Q_HEADS, HEAD_DIM, generator=g)
        out = backend.decode(layer, q, state)
        ref = decode_attention_ref(q, backend.pool.k[layer], backend.pool.v[layer], req_to_token, state.b_req_idx,
                                   state.b_seq_len)  # fmt: skip
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    assert len(checks) == 1 and len(plans) == 1
    backend.plan_decode(decode_state([9, 20], req_to_token), Q_HEADS, torch.float32)  # the next step plans again
    assert len(checks) == 2 and len(plans) == 2


def test_a_layer_with_other_shapes_is_refused_by_the_plan(isolated_autotune):
    backend = gpu_path_backend()
    req_to_token = torch.arange(2 * 32, dtype=torch.int32).view(2, 32)
    state = decode_state([9, 20], req_to_token)
    backend.plan_decode(state, Q_HEADS, torch.float32)
    backend.decode(0, torch.randn(2, Q_HEADS, HEAD_DIM), state)
    with pytest.raises(ValueError, match=r"plan: q expected the planned \(2, 4, 64\) torch.float32, got \(2, 8, 64\)"):
        backend.decode(1, torch.randn(2, 2 * Q_HEADS, HEAD_DIM), state)
    with pytest.raises(
        ValueError, match=r"plan: q expected the planned \(2, 4, 64\) torch.float32, got .* torch.float64"
    ):
        backend.decode(1, torch.randn(2, Q_HEADS, HEAD_DIM, dtype=torch.float64), state)


def test_a_layer_without_a_plan_is_refused(isolated_autotune):
    backend = gpu_path_backend()
    state = decode_state([9, 20], torch.arange(2 * 32, dtype=torch.int32).view(2, 32))
    with pytest.raises(RuntimeError, match=r"call plan_decode\(state, ...\) once per forward, before the first layer"):
        backend.decode(0, torch.randn(2, Q_HEADS, HEAD_DIM), state)


def test_fa3_page_table_gathered_once_per_step(monkeypatch, isolated_autotune):
    from tests.kernels.test_fa3 import FakeFA3

    fake = FakeFA3()
    provider = fa3.FA3Provider("fake_fa3", "0", True, True, fake)
    pool = make_pool("None", POOL, LAYERS, KV_HEADS, HEAD_DIM, torch.float16, torch.device("cpu"))
    for layer in range(LAYERS):
        pool.k[layer].copy_(torch.randn(pool.k[layer].shape).half())
        pool.v[layer].copy_(torch.randn(pool.v[layer].shape).half())
    monkeypatch.setattr(fa3, "require_fa3", lambda device, flag=None: provider)
    backend = AttentionBackend(pool, "fa3", torch.device("cpu"))
    backend.on_gpu = True
    req_to_token = torch.randperm(POOL)[:64].int().view(2, 32)
    checks = counting(monkeypatch, fa3, "_check")
    state = decode_state([9, 20], req_to_token)
    backend.plan_decode(state, Q_HEADS, torch.float16)
    for layer in range(LAYERS):
        q = torch.randn(2, Q_HEADS, HEAD_DIM).half()
        out = backend.decode(layer, q, state)
        ref = decode_attention_ref(q, pool.k[layer], pool.v[layer], req_to_token, state.b_req_idx, state.b_seq_len)
        torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-3)
    tables = [c["page_table"] for c in fake.calls]
    assert len(tables) == LAYERS and all(t is tables[0] for t in tables) and len(checks) == 1
    assert torch.equal(tables[0], req_to_token[state.b_req_idx.long(), :20])


def test_prefill_checks_and_resolves_once_per_step(monkeypatch, isolated_autotune):
    backend = gpu_path_backend()
    plans = counting(monkeypatch, _launch_context_attention, "plan")
    lens = [3, 5]
    state = InferState(
        is_prefill=True,
        b_req_idx=torch.tensor([0, 1], dtype=torch.int32),
        req_to_token=torch.arange(2 * 8, dtype=torch.int32).view(2, 8),
        b_seq_len=torch.tensor(lens, dtype=torch.int32),
        out_token_idx=torch.arange(8),
        positions=torch.tensor([0, 1, 2, 0, 1, 2, 3, 4]),
        max_len_in_batch=5,
        b_q_start=torch.tensor([0, 3], dtype=torch.int32),
        b_q_len=torch.tensor(lens, dtype=torch.int32),
        max_q_len=5,
    )
    backend.plan_prefill(state, Q_HEADS, torch.float32)
    for layer in range(LAYERS):
        q, k, v = torch.randn(8, Q_HEADS, HEAD_DIM), torch.randn(8, KV_HEADS, HEAD_DIM), torch.randn(8, KV_HEADS, 64)
        out = backend.prefill(layer, q, k, v, state)
        torch.testing.assert_close(out.double(), context_attention_ref(q, k, v, state.b_q_start, state.b_q_len),
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
    assert len(plans) == 1


@pytest.mark.parametrize("paged", [True, False])
def test_fa3_prefill_reads_prefix_and_new_tokens_from_the_pool(monkeypatch, paged):
    """--llm_prefill_att_backend fa3: planned once per forward; every layer's new K/V, written to the pool first (as
    the models do), and its cached prefix are attended through the provider; the same as the reference."""
    from tests.kernels.test_fa3_prefill import FakeVarlenFA3

    fake = FakeVarlenFA3()
    provider = fa3.FA3Provider("fake_fa3", "0", paged, True, fake)
    monkeypatch.setattr(fa3, "require_fa3", lambda device, flag=None: provider)
    rows, row_len = 3, 16  # the slots layout: row r owns tokens r * row_len + [0, row_len)
    pool = make_pool("None", rows * row_len, LAYERS, KV_HEADS, HEAD_DIM, torch.float16, torch.device("cpu"))
    backend = AttentionBackend(pool, "triton", torch.device("cpu"), prefill_backend="fa3")
    backend.on_gpu = True
    g = torch.Generator().manual_seed(3)
    for layer in range(LAYERS):  # the requests' cached prefixes (and everything else) random
        pool.k[layer].copy_(torch.randn(pool.k[layer].shape, generator=g).half())
        pool.v[layer].copy_(torch.randn(pool.v[layer].shape, generator=g).half())
    req_to_token = torch.arange(rows * row_len, dtype=torch.int32).view(rows, row_len)
    prefix, new = [6, 0], [3, 5]
    out_token_idx = torch.cat([req_to_token[r, p : p + n].long() for r, p, n in zip((2, 1), prefix, new)])
    state = InferState.packed_prefill([2, 1], req_to_token, prefix, new, out_token_idx, torch.device("cpu"))
    from lightllm.kernels.attention.prefill import fa3_prefill

    checks = counting(monkeypatch, fa3_prefill, "check_pool")
    backend.plan_prefill(state, Q_HEADS, torch.float16)
    for layer in range(LAYERS):
        q = torch.randn(8, Q_HEADS, HEAD_DIM, generator=g).half()
        k, v = (torch.randn(8, KV_HEADS, HEAD_DIM, generator=g).half() for _ in range(2))
        backend.write_kv(layer, k, v, state.out_token_idx)
        out = backend.prefill(layer, q, k, v, state)
        ref = context_attention_ref(q, k, v, state.b_q_start, state.b_q_len,
                                    prefix=CachedPrefix(req_to_token, state.b_req_idx, state.b_prefix_len),
                                    k_cache=pool.k[layer], v_cache=pool.v[layer])  # fmt: skip
        torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-3)
    assert len(fake.calls) == LAYERS and len(checks) == 1


def test_fa3_prefill_refuses_a_quantized_pool(monkeypatch):
    monkeypatch.setattr(fa3, "require_fa3", lambda device, flag=None: None)
    pool = make_pool("int8kv", POOL, LAYERS, KV_HEADS, HEAD_DIM, torch.float16, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"--llm_prefill_att_backend fa3 expected --llm_kv_type None"):
        AttentionBackend(pool, "triton", torch.device("cpu"), prefill_backend="fa3")
    with pytest.raises(ValueError, match=r"--llm_prefill_att_backend expected one of \('triton', 'fa3'\)"):
        AttentionBackend(pool, "triton", torch.device("cpu"), prefill_backend="auto")


def test_a_forward_whose_first_layer_is_not_attention_plans_before_it(monkeypatch, isolated_autotune):
    """A hybrid model (Qwen3.5's linear-attention first layers, MTP): the forward plans from the batch and the pool
    before its first layer, whatever that layer is; nothing is planned by a layer. A fake forward: a linear
    layer, then the attention layers."""
    backend = gpu_path_backend()
    req_to_token = torch.arange(2 * 32, dtype=torch.int32).view(2, 32)
    events = []
    real_plan = flash_decode.GQADecodePlan.__init__
    monkeypatch.setattr(flash_decode.GQADecodePlan, "__init__",
                        lambda self, *a, **k: events.append("plan") or real_plan(self, *a, **k))  # fmt: skip
    state = decode_state([9, 20], req_to_token)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, Q_HEADS * HEAD_DIM, generator=g)
    mix = torch.randn(Q_HEADS * HEAD_DIM, 3 * Q_HEADS * HEAD_DIM, generator=g) / 16

    def forward():
        backend.plan_decode(state, Q_HEADS, torch.float32)
        x = h.tanh() * 2  # layer 0: not attention; it touches no attention plan
        events.append("layer 0")
        outs = []
        for layer in range(1, LAYERS):
            q = (x @ mix)[:, : Q_HEADS * HEAD_DIM].reshape(2, Q_HEADS, HEAD_DIM).contiguous() * layer
            events.append(f"layer {layer}")
            outs.append((q, backend.decode(layer, q, state).clone()))  # the next layer's call overwrites it
        return outs

    outs = forward()
    assert events == ["plan", "layer 0"] + [f"layer {i}" for i in range(1, LAYERS)]  # planned once, first
    for layer, (q, out) in enumerate(outs, start=1):
        ref = decode_attention_ref(q, backend.pool.k[layer], backend.pool.v[layer], req_to_token, state.b_req_idx,
                                   state.b_seq_len)  # fmt: skip
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_type", ["None", "int8kv"])
def test_kv_writes_check_once_per_forward(monkeypatch, kv_type):
    """The first KV write of a forward (a token_idx not seen before) checks the caches and plans the later layers'
    writes, which check only their shapes; each layer's KV lands as the reference writes it."""
    from lightllm.kernels import kv_cache_write as kvw

    pool = make_pool(kv_type, POOL, LAYERS, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    backend = AttentionBackend(pool, "triton", torch.device("cpu"))
    backend.on_gpu = True  # the GPU kernels, under the interpreter
    reference = make_pool(kv_type, POOL, LAYERS, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    checks = counting(monkeypatch, kvw, "_check_cache")
    g = torch.Generator().manual_seed(1)
    for forward in range(2):
        token_idx = torch.tensor([3 + forward, 9 + forward])
        for layer in range(LAYERS):
            k, v = (torch.randn(2, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
            backend.write_kv(layer, k, v, token_idx)
            if kv_type == "None":
                kvw.write_kv_ref(k, v, reference.k[layer], reference.v[layer], token_idx)
            else:
                kvw.write_kv_int8_ref(k, v, reference.k[layer], reference.v[layer], reference.k_scale[layer],
                                      reference.v_scale[layer], token_idx, reference.group_size)  # fmt: skip
        assert len(checks) == (forward + 1) * (2 if kv_type == "None" else 4)  # k/v caches (and scales), once
    for name in ("k", "v") + (("k_scale", "v_scale") if kv_type != "None" else ()):
        assert torch.equal(getattr(pool, name), getattr(reference, name)), name
