"""Chunked prefill in the attention backend: each request's new tokens attend to its cached prefix in the pool
(bf16/fp16 as stored, INT8/INT4 dequantized) and causally to themselves. The CPU path (references) and the GPU path
(the Triton kernel under the interpreter) against float64 attention over the whole sequence."""

import pytest
import torch

from lightllm.kernels.attention.prefill.context_attention import context_attention_ref
from lightllm.layers.attention import AttentionBackend, make_pool
from lightllm.layers.infer_state import InferState

KV_HEADS, Q_HEADS, HEAD_DIM, POOL = 2, 4, 64, 128


def _state(prefix_lens, new_lens, table, slots):
    out_token_idx = torch.cat([table[s, p : p + n].long() for s, p, n in zip(slots, prefix_lens, new_lens)])
    return InferState.packed_prefill(slots, table, prefix_lens, new_lens, out_token_idx, table.device)


@pytest.mark.parametrize("kv_type", ["None", "int8kv", "int4kv"])
@pytest.mark.parametrize("path", ["cpu", "gpu_kernel"])
def test_prefill_over_a_cached_prefix(kv_type, path, isolated_autotune):
    g = torch.Generator().manual_seed(3)
    prefix_lens, new_lens, slots = [13, 0, 33], [4, 6, 1], [2, 0, 1]
    pool = make_pool(kv_type, POOL, 2, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"), 8)
    backend = AttentionBackend(pool, "triton", torch.device("cpu"))
    table = torch.randperm(POOL, generator=g).to(torch.int32)[: 3 * 40].view(3, 40)
    layer = 1
    for s, p in zip(slots, prefix_lens):  # the earlier chunks' K/V, written as the engine writes them
        if p:
            kp, vp = torch.randn(p, KV_HEADS, HEAD_DIM, generator=g), torch.randn(p, KV_HEADS, HEAD_DIM, generator=g)
            backend.write_kv(layer, kp, vp, table[s, :p].long())
    state = _state(prefix_lens, new_lens, table, slots)
    total = sum(new_lens)
    q = torch.randn(total, Q_HEADS, HEAD_DIM, generator=g)
    k, v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=g), torch.randn(total, KV_HEADS, HEAD_DIM, generator=g)
    backend.write_kv(layer, k, v, state.out_token_idx)
    k_pool, v_pool = backend._dequantized(layer, torch.float32)  # what the pool holds, as the prefix is read
    if path == "gpu_kernel":
        backend.on_gpu = True  # the Triton kernels under the interpreter
    backend.plan_prefill(state, Q_HEADS, torch.float32)
    out = backend.prefill(layer, q, k, v, state).clone()
    # the next layer's call of the same plan (a quantized prefix: the gather without its checks, into the buffers
    # of the first) gives the same for the same pool layer
    torch.testing.assert_close(backend.prefill(layer, q, k, v, state), out, rtol=0, atol=0)
    start = 0
    for s, p, n in zip(slots, prefix_lens, new_lens):  # oracle: the whole sequence's causal attention, last n rows
        rows = table[s, :p].long()
        ks, vs = torch.cat([k_pool[rows], k[start : start + n]]), torch.cat([v_pool[rows], v[start : start + n]])
        qs = torch.cat([torch.zeros(p, Q_HEADS, HEAD_DIM), q[start : start + n]])
        i32 = dict(dtype=torch.int32)
        want = context_attention_ref(qs, ks, vs, torch.tensor([0], **i32), torch.tensor([p + n], **i32))[p:]
        torch.testing.assert_close(out[start : start + n].double(), want, rtol=1e-4, atol=1e-4)
        start += n
