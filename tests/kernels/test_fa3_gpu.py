"""FA3 decode on a Hopper GPU with whatever provider is installed (the fa3-fwd wheel on our H200)."""

import json

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, store
from lightllm.common.kv_cache import KVCacheManager
from lightllm.kernels.attention.decode import fa3
from lightllm.kernels.attention.decode.reference import decode_attention_ref

pytestmark = pytest.mark.gpu


@pytest.fixture
def provider():
    p = fa3.find_fa3_provider()
    if p is None:
        pytest.skip("no FlashAttention-3 provider installed (carry the fa3-fwd wheel)")
    fa3._launch_fa3_decode.clear_cache()
    yield fa3.require_fa3("cuda")
    fa3._launch_fa3_decode.clear_cache()


def make(batch, q_len, q_heads, kv_heads, head_dim, lens, max_len, contiguous):
    m = KVCacheManager((batch + 1) * max_len, batch + 1, max_len, device="cuda", contiguous_slots=contiguous)
    k = torch.randn(m.req_to_token.table.numel(), kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = []
    for n in lens:
        s = m.add_request()
        m.extend(s, n)
        slots.append(s)
    q = torch.randn(batch, q_len, q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    idx = torch.tensor(slots, dtype=torch.int32, device="cuda")
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q.squeeze(1) if q_len == 1 else q, m.table, k, v, idx, seq


@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("head_dim, q_heads, kv_heads", [(128, 32, 8), (256, 24, 4)])
@pytest.mark.parametrize("lens", [[1, 4097, 300, 9000], [16384] * 8], ids=["ragged", "B8-16K"])
def test_matches_reference(provider, q_len, head_dim, q_heads, kv_heads, lens):
    lens = [max(n, q_len) for n in lens]  # the q_len new tokens are part of each request's KV
    for layout in ("paged", "slots") if provider.paged else ("slots",):
        q, table, k, v, idx, seq = make(len(lens), q_len, q_heads, kv_heads, head_dim, lens, 16384, layout == "slots")
        out = fa3.fa3_decode_attention(q, k, v, table, idx, seq, max(lens), layout=layout, provider=provider)
        ref = decode_attention_ref(q, k, v, table, idx, seq)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"{layout}: relative error {err:.2e}"


def test_tuning_stores_and_restart_reuses(provider, monkeypatch, isolated_autotune):
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    q, table, k, v, idx, seq = make(16, 1, 32, 8, 128, [5] * 16, 32768, contiguous=not provider.paged)
    with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
        fa3.fa3_decode_attention(q, k, v, table, idx, seq, 8192, provider=provider)
    record = fa3._launch_fa3_decode.last_search
    assert record is not None and record.run_key == (16, 1, 8192)  # capped at 8192
    assert len(record.default_ms) == 5 and record.rule == "never_slower_than_default"  # 8K, 4K, 2K, 1K, 512
    (path,) = store.iter_config_files(isolated_autotune, "fa3_decode")
    chosen = json.loads(path.read_text())["configs"]["[16,1,8192]"]
    fa3._launch_fa3_decode.clear_cache()  # a restart: level 0 reads the file, no search
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "0")
    calls = []
    real = fa3._launch_fa3_decode.fn
    monkeypatch.setattr(
        fa3._launch_fa3_decode,
        "fn",
        lambda *a, run_config=None, **kw: calls.append(run_config) or real(*a, run_config=run_config, **kw),
    )
    out = fa3.fa3_decode_attention(q, k, v, table, idx, seq, 8192, provider=provider)
    assert calls == [chosen] and fa3._launch_fa3_decode.last_search is record
    assert ((out.double() - decode_attention_ref(q, k, v, table, idx, seq)).norm()).isfinite()
