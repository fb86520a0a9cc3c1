"""FA3 prefill over the engine's pool (``prefill/fa3_prefill.py``): on the CPU through a float64 torch stand-in that
implements FA3's documented varlen/KV-cache semantics independently of our reference; on a Hopper GPU (-m gpu)
through the installed provider, against ``context_attention_ref``."""

import pytest
import torch

from lightllm.common.kv_cache import KVCacheManager
from lightllm.kernels.attention.decode import fa3
from lightllm.kernels.attention.prefill.context_attention import CachedPrefix, context_attention_ref
from lightllm.kernels.attention.prefill.fa3_prefill import FA3PrefillPlan


class FakeVarlenFA3:
    """``flash_attn_with_kvcache`` for packed queries (``cu_seqlens_q``), float64: request ``b``'s rows
    ``cu[b]:cu[b+1]`` attend its first ``cache_seqlens[b]`` keys, causal from the end of its KV (FA3's bottom-right
    alignment). Rows after ``cu[-1]`` stay NaN, as FA3 leaves them unwritten."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k_cache, v_cache, cache_seqlens=None, cache_batch_idx=None, page_table=None,
                 cu_seqlens_q=None, max_seqlen_q=None, softmax_scale=None, causal=False):  # fmt: skip
        assert q.dim() == 3 and k_cache.dim() == 4 and causal and cu_seqlens_q.dtype == torch.int32
        self.calls.append(dict(page_table=page_table, cu=cu_seqlens_q.clone(), max_seqlen_q=max_seqlen_q))
        out = torch.full_like(q, float("nan"))
        group = q.shape[1] // k_cache.shape[2]
        cu = cu_seqlens_q.tolist()
        for b in range(len(cu) - 1):
            rows, n = slice(cu[b], cu[b + 1]), int(cache_seqlens[b])
            assert cu[b + 1] - cu[b] <= max_seqlen_q
            if page_table is not None:
                assert k_cache.shape[1] == 1 and n <= page_table.shape[1]
                k, v = k_cache[page_table[b, :n].long(), 0], v_cache[page_table[b, :n].long(), 0]
            else:
                k, v = k_cache[int(cache_batch_idx[b]), :n], v_cache[int(cache_batch_idx[b]), :n]
            qb = q[rows].double()
            scores = torch.einsum("ihd,jhd->hij", qb, k.double().repeat_interleave(group, 1)) * softmax_scale
            keep = torch.ones(qb.shape[0], n, dtype=torch.bool).tril(diagonal=n - qb.shape[0])
            p = scores.masked_fill(~keep, float("-inf")).softmax(-1)
            out[rows] = torch.einsum("hij,jhd->ihd", p, v.double().repeat_interleave(group, 1)).to(q.dtype)
        return out


def provider_of(fake, paged):
    return fa3.FA3Provider("fake_fa3", "0", paged, True, fake)


def prefill_case(prefix_lens, new_lens, q_heads=4, kv_heads=2, head_dim=32, contiguous=False, dtype=torch.float16,
                 device="cpu", seed=0):  # fmt: skip
    """A pool whose requests hold ``prefix_lens`` cached tokens, then ``new_lens`` new ones written after them (as a
    layer writes them before attending); fresh random q/K/V (never zeros)."""
    max_len = max(p + n for p, n in zip(prefix_lens, new_lens)) + 3
    batch = len(new_lens)
    m = KVCacheManager((batch + 2) * max_len, batch + 2, max_len, device=device, contiguous_slots=contiguous)
    m.add_request()  # slot 0 unused: requests sit in rows other than their batch index
    g = torch.Generator(device=device).manual_seed(seed)
    pool_tokens = m.req_to_token.table.numel() if contiguous else (batch + 2) * max_len
    k_cache = torch.randn(pool_tokens, kv_heads, head_dim, generator=g, device=device).to(dtype)
    v_cache = torch.randn(pool_tokens, kv_heads, head_dim, generator=g, device=device).to(dtype)
    slots, new_idx = [], []
    for p, n in zip(prefix_lens, new_lens):
        s = m.add_request()
        m.extend(s, p)
        new_idx.append(m.extend(s, n))
        slots.append(s)
    new_idx = torch.cat(new_idx).to(device)
    tokens = sum(new_lens)
    q = torch.randn(tokens, q_heads, head_dim, generator=g, device=device).to(dtype)
    k, v = k_cache[new_idx], v_cache[new_idx]  # the new tokens' own K/V, as written
    i32 = dict(dtype=torch.int32, device=device)
    starts = [sum(new_lens[:i]) for i in range(batch)]
    return dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, table=m.table, b_req_idx=torch.tensor(slots, **i32),
                b_seq_len=torch.tensor([p + n for p, n in zip(prefix_lens, new_lens)], **i32),
                b_q_start=torch.tensor(starts, **i32), b_q_len=torch.tensor(new_lens, **i32),
                b_prefix_len=torch.tensor(prefix_lens, **i32), max_q_len=max(new_lens),
                max_len=max(p + n for p, n in zip(prefix_lens, new_lens)))  # fmt: skip


def plan_of(c, provider=None, layout=None, rows=None, max_q_len=None):
    rows = rows or c["q"].shape[0]
    return FA3PrefillPlan((rows, *c["q"].shape[1:]), c["q"].dtype, c["k_cache"], c["v_cache"], c["table"],
                          c["b_req_idx"], c["b_seq_len"], c["b_q_start"], c["b_q_len"], max_q_len or c["max_q_len"],
                          c["max_len"], layout=layout, provider=provider)  # fmt: skip


def reference(c):
    prefix = CachedPrefix(c["table"], c["b_req_idx"], c["b_prefix_len"])
    return context_attention_ref(c["q"], c["k"], c["v"], c["b_q_start"], c["b_q_len"], prefix=prefix,
                                 k_cache=c["k_cache"], v_cache=c["v_cache"])  # fmt: skip


CASES = {
    "no-prefix": ([0, 0, 0], [5, 1, 9]),
    "prefix": ([7, 20, 0], [4, 1, 6]),  # chunks after cached tokens, a decode-like single token, a fresh prompt
    "one-long-prefix": ([41], [3]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("paged", [True, False])
def test_plan_attends_each_requests_prefix_and_new_tokens(case, paged):
    c = prefill_case(*CASES[case], contiguous=not paged)
    fake = FakeVarlenFA3()
    out = plan_of(c, provider_of(fake, paged)).run(c["q"], c["k_cache"], c["v_cache"])
    assert not out.isnan().any()  # every row written
    torch.testing.assert_close(out.double(), reference(c), rtol=2e-3, atol=2e-3)
    (call,) = fake.calls
    assert call["cu"].tolist() == [0, *torch.cumsum(c["b_q_len"], 0).tolist()]
    assert (call["page_table"] is not None) == paged


def test_table_and_offsets_built_once_per_forward_not_per_layer():
    c = prefill_case([7, 20], [4, 6])
    fake = FakeVarlenFA3()
    plan = plan_of(c, provider_of(fake, True))
    for _ in range(3):
        plan.run(c["q"], c["k_cache"], c["v_cache"])
    assert len(fake.calls) == 3 and all(call["page_table"] is fake.calls[0]["page_table"] for call in fake.calls)
    assert torch.equal(fake.calls[0]["page_table"], c["table"][c["b_req_idx"].long(), : c["max_len"]])


def test_padding_rows_after_the_real_tokens_are_not_attended():
    """A prefill graph launches for its bucket's rows; the request's real count is b_q_len on the device."""
    c = prefill_case([12], [5])
    bucket = 16
    q = torch.cat([c["q"], torch.randn(bucket - 5, *c["q"].shape[1:]).to(c["q"].dtype)])
    fake = FakeVarlenFA3()
    out = plan_of(c, provider_of(fake, True), rows=bucket, max_q_len=bucket).run(q, c["k_cache"], c["v_cache"])
    assert fake.calls[0]["cu"].tolist() == [0, 5] and fake.calls[0]["max_seqlen_q"] == bucket
    torch.testing.assert_close(out[:5].double(), reference(c), rtol=2e-3, atol=2e-3)
    assert out[5:].isnan().all()


def test_bad_inputs_name_the_argument():
    c = prefill_case([3], [4])
    fake = FakeVarlenFA3()
    with pytest.raises(ValueError, match=r"fa3 prefill attention: q expected a \[tokens, q_heads, head_dim\] "
                                         r"float16/bfloat16 tensor, got \(4, 4, 32\) torch.float32"):  # fmt: skip
        FA3PrefillPlan(
            c["q"].shape,
            torch.float32,
            c["k_cache"],
            c["v_cache"],
            c["table"],
            c["b_req_idx"],
            c["b_seq_len"],
            c["b_q_start"],
            c["b_q_len"],
            4,
            c["max_len"],
            provider=provider_of(fake, True),
        )
    with pytest.raises(ValueError, match=r"fa3 prefill attention: layout expected 'slots' \(fake_fa3 0 has no paged "):
        plan_of(c, provider_of(fake, False), layout="paged")
    with pytest.raises(ValueError, match=r"fa3 prefill attention: b_q_len expected an int32 \[batch\] tensor"):
        plan_of({**c, "b_q_len": c["b_q_len"].long()}, provider_of(fake, True))
    with pytest.raises(ValueError, match=r"fa3 prefill attention: max_q_len expected a length in \[1, 4\]"):
        plan_of(c, provider_of(fake, True), max_q_len=5)
    with pytest.raises(ValueError, match=r"fa3 prefill attention: kv_heads expected a divisor of q_heads \(3\)"):
        plan_of({**c, "q": c["q"][:, :3]}, provider_of(fake, True))
    plan = plan_of(c, provider_of(fake, True))
    with pytest.raises(ValueError, match=r"plan: q expected the planned \(4, 4, 32\) torch.float16"):
        plan.run(c["q"][:3], c["k_cache"], c["v_cache"])
    assert not fake.calls


def test_without_fa3_the_plan_names_the_prefill_flag(monkeypatch):
    monkeypatch.setattr(fa3, "find_fa3_provider", lambda: None)
    c = prefill_case([3], [4])
    with pytest.raises(RuntimeError, match=r"--llm_prefill_att_backend fa3: FA3 needs a Hopper GPU .*, found no GPU; "
                                           r"use --llm_prefill_att_backend triton"):  # fmt: skip
        plan_of(c)


# ---- on a Hopper GPU, the installed provider ------------------------------------------------------------------


@pytest.fixture
def provider():
    p = fa3.find_fa3_provider()
    if p is None or not torch.cuda.is_available() or not fa3.is_hopper(torch.device("cuda")):
        pytest.skip("FA3 prefill needs a Hopper GPU and a FlashAttention-3 provider (carry the fa3-fwd wheel)")
    return p


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(32, 8, 128), (24, 4, 256), (16, 8, 128)])
@pytest.mark.parametrize("case", [([0, 0], [300, 77]), ([1500, 0, 37], [256, 129, 1]), ([4100], [512])])
def test_gpu_matches_reference(provider, shape, case):
    q_heads, kv_heads, head_dim = shape
    c = prefill_case(*case, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, contiguous=not provider.paged,
                     dtype=torch.bfloat16, device="cuda")  # fmt: skip
    out = plan_of(c, provider).run(c["q"], c["k_cache"], c["v_cache"])
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), reference(c), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_graph_replay_equals_eager(provider):
    """Captured once with the offsets built inside the graph, replayed after the request's lengths change."""
    c = prefill_case([900], [64], contiguous=not provider.paged, dtype=torch.bfloat16, device="cuda")
    eager = plan_of(c, provider).run(c["q"], c["k_cache"], c["v_cache"]).clone()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = plan_of(c, provider).run(c["q"], c["k_cache"], c["v_cache"])
    c["b_q_len"].fill_(40)  # fewer real rows after a shorter prefix: what the next staged request would write
    c["b_seq_len"].fill_(500 + 40)
    graph.replay()
    fresh = plan_of(c, provider).run(c["q"], c["k_cache"], c["v_cache"])
    assert torch.equal(captured[:40], fresh[:40]) and not torch.equal(captured[:40], eager[:40])
