"""FA3 adapter logic on the CPU with a torch stand-in for ``flash_attn_with_kvcache`` (GPU runs: -m gpu)."""

import json
import sys
import types

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, set_bench_func, store
from lightllm.common.kv_cache import KVCacheManager
from lightllm.kernels.attention.decode import fa3
from lightllm.kernels.attention.decode.reference import decode_attention_ref


class FakeFA3:
    """Implements the FA3 call in float64 torch, checking the arguments the way the real one needs them."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k_cache, v_cache, cache_seqlens=None, cache_batch_idx=None, page_table=None,
                 softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, num_splits=0):  # fmt: skip
        assert q.dim() == 4 and k_cache.dim() == 4 and causal and window_size == (-1, -1) and softcap == 0.0
        self.calls.append({"num_splits": num_splits, "page_table": page_table, "seqlens": cache_seqlens.clone()})
        batch, q_len, q_heads, _ = q.shape
        out = torch.empty_like(q)
        for b in range(batch):
            n = int(cache_seqlens[b])
            if page_table is not None:
                assert k_cache.shape[1] == 1 and n <= page_table.shape[1]
                tokens = page_table[b, :n].long()
                k, v = k_cache[tokens, 0], v_cache[tokens, 0]
            else:
                row = int(cache_batch_idx[b]) if cache_batch_idx is not None else b
                assert n <= k_cache.shape[1]
                k, v = k_cache[row, :n], v_cache[row, :n]
            table = torch.arange(n, dtype=torch.int32)[None]
            one = decode_attention_ref(q[b : b + 1], k, v, table, torch.zeros(1, dtype=torch.int32),
                                       torch.tensor([n], dtype=torch.int32), softmax_scale)  # fmt: skip
            out[b] = one[0].to(q.dtype)
        return out


def install(monkeypatch, name, paged=True, split=True, fp16=True):
    fake = FakeFA3()
    mod = types.ModuleType(name)
    mod.flash_attn_with_kvcache = fake
    monkeypatch.setitem(sys.modules, name, mod)
    if name == "fa3_fwd_interface":
        cfg = types.ModuleType("fa3_fwd_config")
        cfg.CONFIG = {"build_flags": {"FLASHATTENTION_DISABLE_PAGEDKV": not paged,
                                      "FLASHATTENTION_DISABLE_SPLIT": not split,
                                      "FLASHATTENTION_DISABLE_FP16": not fp16}}  # fmt: skip
        monkeypatch.setitem(sys.modules, "fa3_fwd_config", cfg)
    fa3.find_fa3_provider.cache_clear()
    return fake


@pytest.fixture(autouse=True)
def no_real_providers(monkeypatch):
    for name in ("flash_attn_interface", "sgl_kernel", "sgl_kernel.flash_attn", "fa3_fwd_interface", "fa3_fwd_config"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    fa3.find_fa3_provider.cache_clear()
    fa3._launch_fa3_decode.clear_cache()
    yield
    fa3.find_fa3_provider.cache_clear()
    fa3._launch_fa3_decode.clear_cache()


def test_no_provider_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fa3, "is_hopper", lambda device: True)
    assert fa3.find_fa3_provider() is None
    with pytest.raises(RuntimeError, match="no FlashAttention-3 provider found; install .*fa3-fwd"):
        fa3.require_fa3("cuda")
    with pytest.raises(RuntimeError, match=r"needs a Hopper GPU \(sm90, H100/H200\), found no GPU; use --llm_decode"):
        fa3.require_fa3("cpu")  # the device first: no install makes it run FA3


def test_detects_fa3_fwd_capabilities_and_needs_hopper(monkeypatch):
    install(monkeypatch, "fa3_fwd_interface", paged=False, fp16=False)  # the fa3-fwd 0.0.3 wheel's build flags
    p = fa3.find_fa3_provider()
    assert (p.name, p.paged, p.split, p.fp16) == ("fa3_fwd_interface", False, True, False)
    assert "paged=no" in p.describe() and "split=yes" in p.describe() and "fp16=no" in p.describe()
    assert p.dtype_problem(torch.bfloat16) is None and "built without float16" in p.dtype_problem(torch.float16)
    assert p.dtype_problem(torch.float32) == "FA3 runs bfloat16/float16 models, got torch.float32"
    with pytest.raises(RuntimeError, match="needs a Hopper GPU .*use --llm_decode_att_backend triton"):
        fa3.require_fa3("cpu")


def test_prefers_full_builds(monkeypatch):
    install(monkeypatch, "fa3_fwd_interface", paged=False)
    install(monkeypatch, "flash_attn_interface")
    assert fa3.find_fa3_provider().name == "flash_attn_interface" and fa3.find_fa3_provider().paged


def make_cache(batch, q_heads, kv_heads, head_dim, lens, contiguous=False, seed=0, max_len=64):
    g = torch.Generator().manual_seed(seed)
    m = KVCacheManager(8 * max_len, max_reqs=8, max_len=max_len, device="cpu", contiguous_slots=contiguous)
    k = torch.randn(8 * max_len, kv_heads, head_dim, generator=g).half()
    v = torch.randn(8 * max_len, kv_heads, head_dim, generator=g).half()
    slots = []
    for n in lens:
        s = m.add_request()
        if not contiguous:
            m.extend(m.add_request(), 3)  # interleave another request so tokens are not contiguous
        m.extend(s, n)
        slots.append(s)
    b_req_idx = torch.tensor(slots, dtype=torch.int32)
    b_seq_len = torch.tensor(lens, dtype=torch.int32)
    return m.table, k, v, b_req_idx, b_seq_len


@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("layout", ["paged", "slots"])
def test_layouts_match_reference(monkeypatch, layout, q_len):
    fake = install(monkeypatch, "flash_attn_interface")
    provider = fa3.find_fa3_provider()
    table, k, v, idx, seq = make_cache(3, 8, 2, 64, [5, 17, 40], contiguous=layout == "slots")
    q = torch.randn(3, q_len, 8, 64).half() if q_len > 1 else torch.randn(3, 8, 64).half()
    out = fa3.fa3_decode_attention(q, k, v, table, idx, seq, 48, layout=layout, provider=provider)
    ref = decode_attention_ref(q, k, v, table, idx, seq)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-3)
    call = fake.calls[-1]
    assert call["num_splits"] == 0  # level 0, nothing cached: FA3's own heuristic
    if layout == "paged":
        assert call["page_table"].shape == (3, 48)  # width = max_len_in_batch, not the table's
        assert torch.equal(call["page_table"], table[idx.long(), :48])


def test_layout_errors(monkeypatch):
    install(monkeypatch, "fa3_fwd_interface", paged=False)
    provider = fa3.find_fa3_provider()
    table, k, v, idx, seq = make_cache(2, 4, 2, 64, [3, 4])
    q = torch.randn(2, 4, 64).half()
    with pytest.raises(ValueError, match="layout expected 'slots' .*has no paged KV"):
        fa3.fa3_decode_attention(q, k, v, table, idx, seq, 8, layout="paged", provider=provider)
    with pytest.raises(ValueError, match="k_cache expected 512 tokens"):
        fa3.fa3_decode_attention(q, k[:100], v[:100], table, idx, seq, 8, provider=provider)
    with pytest.raises(ValueError, match="q expected"):
        fa3.fa3_decode_attention(q.float(), k, v, table, idx, seq, 8, provider=provider)


def test_num_splits_search_and_restart(monkeypatch, isolated_autotune):
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "1024")
    fake = install(monkeypatch, "flash_attn_interface")
    provider = fa3.find_fa3_provider()
    speed = {0: 1.0, 1: 3.0, 2: 0.9, 4: 0.5, 8: 0.7, 16: 0.8, 32: 0.9}  # ms; 4 splits wins

    def bench(run):
        run()
        return speed[fake.calls[-1]["num_splits"]]

    set_bench_func(bench)
    table, k, v, idx, seq = make_cache(2, 8, 2, 64, [5, 9], max_len=2048)
    q = torch.randn(2, 8, 64).half()
    with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
        for _ in range(2):  # two layers, one search
            # a launch serving up to 2048 tokens (a graph's maximum) on tiny real lengths
            out = fa3.fa3_decode_attention(q, k, v, table, idx, seq, 2048, provider=provider)
    timed = [c for c in fake.calls if not torch.equal(c["seqlens"], seq)]  # the rebuilt batches
    assert sorted({c["num_splits"] for c in timed}) == [0, 1, 2, 4, 8, 16, 32]  # one space at every length
    assert {int(c["seqlens"][0]) for c in timed} == {1024, 512}  # the tuning ladder, every request
    assert all(int(c["page_table"].max()) < k.shape[0] for c in timed)  # over the existing pool
    assert fake.calls[-1]["num_splits"] == 4 and fake.calls[-1]["page_table"].shape == (2, 2048)
    torch.testing.assert_close(out.double(), decode_attention_ref(q, k, v, table, idx, seq), rtol=2e-3, atol=2e-3)
    (path,) = store.iter_config_files(isolated_autotune, "fa3_decode")
    data = json.loads(path.read_text())
    assert data["configs"] == {"[2,1,1024]": {"num_splits": 4}}
    key = data["static_key"]
    assert key["provider"].startswith("flash_attn_interface==") and key["page_size"] == 1 and key["causal"]

    fa3._launch_fa3_decode.clear_cache()  # a restart: level 0, the stored split count, no search
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "0")
    fake.calls.clear()
    fa3.fa3_decode_attention(q, k, v, table, idx, seq, 2048, provider=provider)
    assert [c["num_splits"] for c in fake.calls] == [4]


@pytest.mark.parametrize("eight_at_512, chosen", [(0.99, 8), (1.03, 0)], ids=["8-never-loses", "all-lose-once"])
def test_a_split_slower_than_the_heuristic_at_any_ladder_length_is_never_frozen(monkeypatch, eight_at_512, chosen):
    """Ladder 1024, 512. 4 splits is best at 1024 and 5 % slower than the heuristic (0) at 512: it has the least
    worst-case loss, yet must not be frozen. 8 splits wins when it never loses to the heuristic; else the heuristic.
    """
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "1024")
    fake = install(monkeypatch, "flash_attn_interface")
    speed = {0: (1.0, 1.0), 4: (0.6, 1.05), 8: (0.8, eight_at_512)}  # ms at (1024, 512); any other split 2 ms

    def bench(run):
        run()
        call = fake.calls[-1]
        return speed.get(call["num_splits"], (2.0, 2.0))[int(call["seqlens"][0]) == 512]

    set_bench_func(bench)
    table, k, v, idx, seq = make_cache(2, 8, 2, 64, [5, 9], max_len=2048)
    q = torch.randn(2, 8, 64).half()
    with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
        fa3.fa3_decode_attention(q, k, v, table, idx, seq, 2048, provider=fa3.find_fa3_provider())
    assert fake.calls[-1]["num_splits"] == chosen
    record = fa3._launch_fa3_decode.last_search
    assert record.rule == "never_slower_than_default" and len(record.default_ms) == 2


def test_fa3_times_a_quarter_of_the_tuning_length_too(monkeypatch):
    """Splits differ from FA3's heuristic by a few % at most: a loss at 8K is not seen from 4K and 16K alone."""
    install(monkeypatch, "flash_attn_interface")
    table, k, v, idx, seq = make_cache(2, 8, 2, 64, [5, 9])
    named = {"q": torch.randn(2, 1, 8, 64).half(), "k_cache": k.unsqueeze(1), "page_table": table[:2],
             "max_len_in_batch": 40000}  # fmt: skip
    batches = fa3._representative_batches(named)
    assert [int(b["cache_seqlens"][0]) for b in batches] == [32768, 16384, 8192, 4096, 1024]
    assert all(b["page_table"].shape == (2, 40000) for b in batches)


def test_capture_launches_what_the_warmup_chose_whatever_earlier_starts_stored(monkeypatch, isolated_autotune):
    """Starts at several tuning lengths share one config dir; the graph's maximum (2048) is at or above each.
    An earlier start leaves entries under other run keys (one under the graph's maximum); the capture after each
    warm-up must still launch exactly the split count that warm-up chose."""
    from lightllm.common.autotuner import tuner

    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    fake = install(monkeypatch, "flash_attn_interface")
    provider = fa3.find_fa3_provider()
    favourite = {}

    def bench(run):
        run()
        return 0.5 if fake.calls[-1]["num_splits"] == favourite["splits"] else 1.0

    set_bench_func(bench)
    table, k, v, idx, seq = make_cache(2, 8, 2, 64, [5, 9], max_len=2048)
    q = torch.randn(2, 8, 64).half()
    for tuning_len, splits in ((4096, 8), (1024, 4), (512, 2), (1024, 4)):
        tuner.clear_all_caches()  # a restart; the files stay
        monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", str(tuning_len))
        favourite["splits"] = splits
        with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
            fa3.fa3_decode_attention(q, k, v, table, idx, seq, 2048, provider=provider)
        chosen = fake.calls[-1]["num_splits"]
        monkeypatch.setattr(tuner, "_is_capturing", lambda: True)
        fake.calls.clear()
        fa3.fa3_decode_attention(q, k, v, table, idx, seq, 2048, provider=provider)  # the capture
        monkeypatch.setattr(tuner, "_is_capturing", lambda: False)
        assert chosen == splits and [c["num_splits"] for c in fake.calls] == [chosen], tuning_len
    (path,) = store.iter_config_files(isolated_autotune, "fa3_decode")
    assert json.loads(path.read_text())["configs"] == {
        "[2,1,2048]": {"num_splits": 8},
        "[2,1,1024]": {"num_splits": 4},
        "[2,1,512]": {"num_splits": 2},
    }
