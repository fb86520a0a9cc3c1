import importlib

import pytest
import torch

from lightllm.kernels.attention.prefill import CachedPrefix, context_attention, context_attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "head_dim, q_heads, kv_heads", [(64, 4, 4), (128, 8, 2), (256, 6, 1)], ids=["d64", "d128", "d256"]
)
def test_matches_reference(dtype, head_dim, q_heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    lens = [1, 37, 70, 16]  # length 1, ragged, not multiples of the block
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    total = sum(lens)
    q = torch.randn(total, q_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    b_start = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    b_len = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    cfg = {"BLOCK_M": 32, "BLOCK_N": 16 if head_dim < 256 else 32, "num_warps": 4, "num_stages": 1}
    context_attention(q, k, v, b_start, b_len, max(lens), out=out, run_config=cfg)
    assert not out.isnan().any(), "unwritten output"
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(out.double(), context_attention_ref(q, k, v, b_start, b_len), rtol=tol, atol=tol)


def test_bad_inputs():
    q = torch.randn(4, 4, 64)
    with pytest.raises(ValueError, match="q, k, v expected"):
        context_attention(q, torch.randn(4, 2, 32), torch.randn(4, 2, 32), torch.zeros(1, dtype=torch.int32),
                          torch.ones(1, dtype=torch.int32), 4)  # fmt: skip
    with pytest.raises(ValueError, match="int32"):
        context_attention(q, torch.randn(4, 2, 64), torch.randn(4, 2, 64), torch.zeros(1), torch.ones(1), 4)


def test_views_and_outputs_it_would_read_or_write_wrongly_are_refused():
    """The kernel steps through the head dim at unit stride: a transposed view was read wrongly, and an ``out`` too
    small was written past its end (a heap corruption under the interpreter, an out-of-bounds write on a GPU)."""
    start, length = torch.zeros(1, dtype=torch.int32), torch.full((1,), 64, dtype=torch.int32)
    q, kv = torch.randn(64, 4, 64), torch.randn(64, 2, 64)
    transposed = torch.randn(64, 64, 4).transpose(1, 2)  # [64, 4, 64], last-dim stride 4
    with pytest.raises(ValueError, match=r"context_attention: q expected a contiguous last dim, got strides"):
        context_attention(transposed, kv, kv, start, length, 64)
    with pytest.raises(ValueError, match=r"context_attention: v expected a contiguous last dim"):
        context_attention(q, kv, torch.randn(64, 64, 2).transpose(1, 2), start, length, 64)
    for out in torch.zeros(2, 4, 64), torch.zeros(64, 4, 64, dtype=torch.float16), torch.zeros(64, 64, 4).mT:
        with pytest.raises(ValueError, match=r"context_attention: out expected q's \(64, 4, 64\) torch.float32"):
            context_attention(q, kv, kv, start, length, 64, out=out)
    prefix = CachedPrefix(torch.zeros(1, 8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                          torch.ones(1, dtype=torch.int32))  # fmt: skip
    cache = torch.randn(8, 64, 2).transpose(1, 2)
    with pytest.raises(ValueError, match=r"context_attention: k_cache expected a contiguous last dim"):
        context_attention(q, kv, kv, start, length, 64, prefix=prefix, k_cache=cache, v_cache=cache)


def _packed(lens, heads, kv_heads, head_dim, dtype, g):
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    total = sum(lens)
    q = torch.randn(total, heads, head_dim, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    return q, k, v, torch.tensor(starts, **i32), torch.tensor(lens, **i32)


def _cached_prefix(prefix_lens, pool_tokens, g):
    """Each request's prefix at scattered, distinct pool slots, in rows of a table that is not in batch order."""
    rows, width = len(prefix_lens) + 2, max(prefix_lens) + 5
    table = torch.full((rows, width), -1, dtype=torch.int32)  # unused cells: an out-of-range read would fault
    slots = torch.randperm(pool_tokens, generator=g)[: sum(prefix_lens)].to(torch.int32)
    req_idx = torch.randperm(rows, generator=g)[: len(prefix_lens)].to(torch.int32)
    used = 0
    for r, p in zip(req_idx.tolist(), prefix_lens):
        table[r, :p] = slots[used : used + p]
        used += p
    i32 = dict(dtype=torch.int32, device=DEVICE)
    return CachedPrefix(table.to(DEVICE), req_idx.to(DEVICE), torch.tensor(prefix_lens, **i32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "lens, prefix_lens",
    [([5, 19], [0, 0]), ([16], [37]), ([1, 33, 7, 16], [3, 0, 50, 17])],
    ids=["prefix0", "prefix_not_block_multiple", "several_requests"],
)
def test_prefix_matches_reference(dtype, lens, prefix_lens):
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    _check_prefix(lens, prefix_lens, 64, dtype, cfg, seed=sum(lens) + sum(prefix_lens))


def _check_prefix(lens, prefix_lens, head_dim, dtype, cfg, seed, heads=(8, 2)):
    """``heads`` (8 query heads over 2 KV heads), each request's prefix at scattered pool slots: every row written and
    within the dtype's error of the float64 reference."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, b_start, b_len = _packed(lens, *heads, head_dim, dtype, g)
    pool = sum(prefix_lens) + 60
    k_cache = torch.randn(pool, heads[1], head_dim, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(pool, heads[1], head_dim, generator=g).to(dtype).to(DEVICE)
    prefix = _cached_prefix(prefix_lens, pool, g)
    out = torch.full_like(q, float("nan"))
    context_attention(q, k, v, b_start, b_len, max(lens), out=out, run_config=cfg, prefix=prefix, k_cache=k_cache,
                      v_cache=v_cache)  # fmt: skip
    assert not out.isnan().any(), "unwritten output"
    want = context_attention_ref(q, k, v, b_start, b_len, prefix=prefix, k_cache=k_cache, v_cache=v_cache)
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


def test_prefix_reference_is_attention_over_the_whole_sequence():
    """The reference itself: a request split into a cached prefix and new tokens gives the rows of the unsplit
    request's causal attention (an oracle independent of how the prefix path is written)."""
    g = torch.Generator().manual_seed(7)
    q, k, v, b_start, b_len = _packed([29], 4, 2, 64, torch.float64, g)
    whole = context_attention_ref(q, k, v, b_start, b_len)
    p = 11
    table = torch.arange(29, dtype=torch.int32).unsqueeze(0)
    prefix = CachedPrefix(table, torch.zeros(1, dtype=torch.int32), torch.tensor([p], dtype=torch.int32))
    i32 = dict(dtype=torch.int32)
    tail = context_attention_ref(q[p:], k[p:], v[p:], torch.tensor([0], **i32), torch.tensor([29 - p], **i32),
                                 prefix=prefix, k_cache=k, v_cache=v)  # fmt: skip
    torch.testing.assert_close(tail, whole[p:])


def test_prefix_bad_inputs():
    q = torch.randn(4, 4, 64)
    kv = torch.randn(4, 2, 64)
    start, length = torch.zeros(1, dtype=torch.int32), torch.full((1,), 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="b_prefix_len expected int32"):
        CachedPrefix(torch.zeros(1, 8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.zeros(1))
    prefix = CachedPrefix(torch.zeros(1, 8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                          torch.ones(1, dtype=torch.int32))  # fmt: skip
    with pytest.raises(ValueError, match="expected k_cache and v_cache"):
        context_attention(q, kv, kv, start, length, 4, prefix=prefix)
    with pytest.raises(ValueError, match=r"k_cache expected \[pool tokens, 2, 64\]"):
        context_attention(q, kv, kv, start, length, 4, prefix=prefix, k_cache=torch.randn(8, 4, 64), v_cache=kv)


@pytest.mark.parametrize("splits", [2, 3, 16], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_split_prefix_matches_reference(splits, dtype):
    """The prefix read in ranges by parallel programs and merged: prefixes shorter than the split count (empty
    ranges), not block multiples, absent (0), and one request with a long prefix; every row written. Group 4 on one
    KV head: the interpreter runs a program per (request, head, block, split)."""
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "PREFIX_SPLITS": splits}
    _check_prefix([3, 1, 20, 9], [0, 70, 5, 131], 128, dtype, cfg, seed=splits, heads=(4, 1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="records the interpreter's launches: a CPU run's check")
def test_a_split_count_compiles_no_kernel_of_its_own():
    """The split count follows the chunk's token count, so a search per token bucket would compile every candidate
    again for each count if it were a constexpr (18 candidates, seven buckets on a first start). Split counts 2 to 15
    share one specialization (one with 16: Triton's divisibility class), the unsplit launch another; both build to
    sm_90 cubins."""
    from tests import ttir_lowering

    g = torch.Generator().manual_seed(5)
    q, k, v, b_start, b_len = _packed([3, 9], 2, 1, 64, torch.float16, g)  # few heads, short prefixes: a quick run
    k_cache, v_cache = (torch.randn(300, 1, 64, generator=g).half() for _ in range(2))
    prefix = _cached_prefix([20, 37], 300, g)
    with ttir_lowering.recording() as recorder:
        for splits in (1, 2, 3, 5, 9, 15):
            cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "PREFIX_SPLITS": splits}
            context_attention(q, k, v, b_start, b_len, 9, run_config=cfg, prefix=prefix, k_cache=k_cache,
                              v_cache=v_cache)  # fmt: skip
    attention = {x: n for x, n in recorder.launches.items() if x.name == "_context_attention_kernel"}  # distinct
    assert sorted((dict(x.constexprs)["SPLIT"], n) for x, n in attention.items()) == [(False, 1), (True, 5)]
    built = ttir_lowering.build_cubins(list(attention))
    assert all(b.error is None for b in built), [b.error for b in built]


def test_plan_reusing_outputs_shares_the_split_partials_across_layers():
    """A step's plan (reuse_outputs, as the attention backend makes it) makes the split partials once: two layers
    with fresh data each match the reference, through the same output and partial tensors."""
    from lightllm.kernels.attention.prefill.context_attention import ContextAttentionPlan

    g = torch.Generator().manual_seed(11)
    lens, prefix_lens = [3, 9], [70, 131]
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "PREFIX_SPLITS": 3}
    q, k, v, b_start, b_len = _packed(lens, 8, 2, 64, torch.float32, g)
    pool = sum(prefix_lens) + 60
    prefix = _cached_prefix(prefix_lens, pool, g)
    plan = ContextAttentionPlan(q.shape, k.shape, q.dtype, b_start, b_len, max(lens), None, cfg, prefix,
                                reuse_outputs=True)  # fmt: skip
    outs, partials = [], []
    for _ in range(2):  # two layers
        q, k, v = (torch.randn(t.shape, generator=g).to(DEVICE) for t in (q, k, v))
        k_cache, v_cache = (torch.randn(pool, 2, 64, generator=g).to(DEVICE) for _ in range(2))
        outs.append(plan.run(q, k, v, k_cache=k_cache, v_cache=v_cache))
        want = context_attention_ref(q, k, v, b_start, b_len, prefix=prefix, k_cache=k_cache, v_cache=v_cache)
        torch.testing.assert_close(outs[-1].double(), want, rtol=1e-4, atol=1e-4)
        partials.append({shape: tuple(t.data_ptr() for t in ts) for shape, ts in plan._scratch.items()})
    assert outs[0] is outs[1] and len(partials[0]) == 1 and partials[0] == partials[1]


def test_prefix_splits_fill_the_gpu_only_when_the_grid_is_small():
    from lightllm.kernels.attention.prefill.context_attention import MAX_PREFIX_SPLITS, prefix_splits

    assert prefix_splits(64, 132) == 5  # 128 new tokens x 32 heads at BLOCK_M 64: 2 programs per SM after the split
    assert prefix_splits(2048, 132) == 1  # a 4096-token chunk fills the GPU alone
    assert prefix_splits(1, 132) == MAX_PREFIX_SPLITS


@pytest.mark.gpu
@pytest.mark.parametrize("new, prefix_len", [(1, 8191), (128, 8000), (600, 3000)], ids=["hit", "chunk128", "chunk600"])
def test_gpu_short_chunk_after_long_prefix(new, prefix_len):
    """Qwen3-8B's heads (32/8 of 128) in bf16 at the default config, whose split count follows the grid."""
    g = torch.Generator().manual_seed(new)
    q, k, v, b_start, b_len = _packed([new], 32, 8, 128, torch.bfloat16, g)
    pool = prefix_len + 64
    k_cache = torch.randn(pool, 8, 128, generator=g).to(torch.bfloat16).to(DEVICE)
    v_cache = torch.randn(pool, 8, 128, generator=g).to(torch.bfloat16).to(DEVICE)
    prefix = _cached_prefix([prefix_len], pool, g)
    out = torch.full_like(q, float("nan"))
    context_attention(q, k, v, b_start, b_len, new, out=out, prefix=prefix, k_cache=k_cache, v_cache=v_cache)
    assert not out.isnan().any(), "unwritten output"
    want = context_attention_ref(q, k, v, b_start, b_len, prefix=prefix, k_cache=k_cache, v_cache=v_cache)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


# ---- GQA packing: one program per KV head, its rows (token, head of the group) pairs ----------------------------


@pytest.fixture
def launches(monkeypatch):
    """The attention kernel's launches as (grid, keyword arguments and the runtime split count ``splits``), still
    run."""
    module = importlib.import_module("lightllm.kernels.attention.prefill.context_attention")  # not the function
    seen = []
    launch = module._CONTEXT_ATTENTION.launch
    at = module._context_attention_kernel.arg_names.index("splits")

    def spy(grid, *args, **kwargs):
        seen.append((tuple(grid), {**kwargs, "splits": args[at]}))
        return launch(grid, *args, **kwargs)

    monkeypatch.setattr(module._CONTEXT_ATTENTION, "launch", spy)
    return seen


def _check_packed(launches, lens, prefix_lens, q_heads, kv_heads, head_dim, dtype, cfg, seed):
    """A packed run (prefix_lens None: the no-prefix kernel) writes every row within the dtype's error of the
    float64 reference, from a grid of one program per KV head."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, b_start, b_len = _packed(lens, q_heads, kv_heads, head_dim, dtype, g)
    cache = dict(prefix=None)
    if prefix_lens is not None:
        pool = sum(prefix_lens) + 60
        cache = dict(prefix=_cached_prefix(prefix_lens, pool, g),
                     k_cache=torch.randn(pool, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE),
                     v_cache=torch.randn(pool, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE))  # fmt: skip
    out = torch.full_like(q, float("nan"))
    context_attention(q, k, v, b_start, b_len, max(lens), out=out, run_config={**cfg, "PACK_GQA": True}, **cache)
    ((grid, kwargs),) = launches
    group = q_heads // kv_heads
    assert kwargs["PACK_GQA"] and grid[:2] == (len(lens), kv_heads)
    assert grid[2] == -(-max(lens) * group // cfg["BLOCK_M"]) * kwargs["splits"]
    assert kwargs["SPLIT"] == (kwargs["splits"] > 1)
    assert not out.isnan().any(), "unwritten output"
    want = context_attention_ref(q, k, v, b_start, b_len, **cache)
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


PACKED_CASES = {
    # id: lens, prefix lens, q heads, KV heads, head_dim, BLOCK_M, BLOCK_N
    "g1-d64-prefix0": ([5, 19], [0, 0], 2, 2, 64, 16, 16),
    "g4-d128-short-prefix": ([16], [37], 8, 2, 128, 32, 16),
    "g6-d64-several-requests": ([1, 33, 7, 16], [3, 0, 50, 17], 12, 2, 64, 32, 16),  # blocks cut tokens' groups
    "g6-d128-chunk-not-tile-multiple": ([23], [70], 6, 1, 128, 64, 32),
    "g4-d256": ([9, 3], [20, 0], 4, 1, 256, 16, 16),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(PACKED_CASES))
def test_packed_prefix_matches_reference(launches, case, dtype):
    lens, prefix_lens, hq, hk, d, block_m, block_n = PACKED_CASES[case]
    cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 1, "PREFIX_SPLITS": 1}
    _check_packed(launches, lens, prefix_lens, hq, hk, d, dtype, cfg, seed=len(case))


@pytest.mark.parametrize("q_heads", [4, 6], ids=["g4", "g6"])
def test_packed_without_prefix_matches_reference(launches, q_heads):
    cfg = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    _check_packed(launches, [1, 37, 20], None, q_heads, 1, 64, torch.float16, cfg, seed=q_heads)


@pytest.mark.parametrize("splits", [3, 16], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_packed_split_prefix_matches_reference(launches, splits, dtype):
    """Split prefix ranges with packed rows: the partials are written per (token, head), as the merge reads them;
    prefixes shorter than the split count, absent and long, group 6."""
    cfg = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "PREFIX_SPLITS": splits}
    _check_packed(launches, [3, 1, 20, 9], [0, 70, 5, 131], 12, 2, 64, dtype, cfg, seed=splits)
    assert launches[0][1]["splits"] == splits


def test_packed_split_count_follows_the_packed_grid(launches):
    """A 16-token chunk of 8 q heads over 2 KV heads at BLOCK_M 64 packs into 2 programs (not 8 per-head ones), so
    the prefix splits 8 ways to give the interpreter's nominal 8 SMs two programs each."""
    cfg = {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    _check_packed(launches, [16], [40], 8, 2, 64, torch.float32, cfg, seed=3)
    assert launches[0][0] == (1, 2, 8)


def test_packed_candidates_only_for_the_prefix_kernel():
    """The prefix kernel's tuner times packed configs beside every unpacked one; the no-prefix kernel and the untuned
    default stay unpacked."""
    from lightllm.kernels.attention.prefill.context_attention import _configs, _default_config, _prefix_configs

    for d, n_packed in ((128, 6), (256, 4)):
        q = torch.empty(1, 8, d)
        packed = [c for c in _prefix_configs(q) if c.get("PACK_GQA")]
        assert len(packed) == n_packed and [c for c in _prefix_configs(q) if not c.get("PACK_GQA")] == _configs(q)
        assert not any(c.get("PACK_GQA") for c in _configs(q)) and "PACK_GQA" not in _default_config(d)


def test_untuned_default_takes_the_deep_pipeline_only_where_it_fits():
    """The 3-stage 64x64 default needs a GPU with room for it (A100, H100/H200); elsewhere, and for head_dim 256, the
    1-stage tile. Either way the default is a tuned candidate, so a search can only do better."""
    from lightllm.kernels.attention.prefill.context_attention import DEEP_PIPELINE_SMEM, _configs, _default_config

    deep = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    assert _default_config(128, 227 << 10) == _default_config(64, DEEP_PIPELINE_SMEM) == deep
    assert _default_config(128, 99 << 10) == {**deep, "num_stages": 1} == _default_config(128)
    assert _default_config(256, 227 << 10) == {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    for d in (64, 128, 256):
        for smem in (0, 99 << 10, 227 << 10):
            assert _default_config(d, smem) in _configs(torch.empty(1, 8, d))


SMALLEST_GPU_SHARED_BYTES = 99 * 1024  # the least shared memory one block may opt into on a supported GPU (sm_86/89)


@pytest.mark.skipif(torch.cuda.is_available(), reason="records the interpreter's launches: a CPU run's check")
@pytest.mark.parametrize("head_dim", [128, 256], ids=["d128", "d256"])
def test_untuned_defaults_fit_the_gpus_that_take_them(head_dim):
    """Each default's launches (with and without a cached prefix) built to sm_90 cubins: the small one needs less
    shared memory than any supported GPU lets a block have, the deep one less than ``DEEP_PIPELINE_SMEM``, the least
    a GPU must have to be given it; so the untuned default never fails to launch."""
    from lightllm.kernels.attention.prefill.context_attention import DEEP_PIPELINE_SMEM, _default_config
    from tests import ttir_lowering

    g = torch.Generator().manual_seed(head_dim)
    q, k, v, b_start, b_len = _packed([5], 4, 2, head_dim, torch.float16, g)
    k_cache, v_cache = (torch.randn(16, 2, head_dim, generator=g).half() for _ in range(2))
    prefix = _cached_prefix([6], 16, g)
    for smem, limit in ((0, SMALLEST_GPU_SHARED_BYTES), (227 << 10, DEEP_PIPELINE_SMEM)):
        cfg = _default_config(head_dim, smem)
        with ttir_lowering.recording() as recorder:
            context_attention(q, k, v, b_start, b_len, 5, run_config=cfg)
            context_attention(q, k, v, b_start, b_len, 5, run_config=cfg, prefix=prefix, k_cache=k_cache,
                              v_cache=v_cache)  # fmt: skip
        built = ttir_lowering.build_cubins([x for x in recorder.launches if x.name == "_context_attention_kernel"])
        assert len(built) == 2 and all(b.error is None for b in built), [b.error for b in built]
        assert all(0 < b.shared_bytes <= limit for b in built), (cfg, [b.shared_bytes for b in built])


@pytest.mark.parametrize("head_dim", [128, 256], ids=["d128", "d256"])
def test_every_packed_candidate_matches_reference(launches, head_dim):
    """What the tuner may pick: each packed candidate at its real block sizes (fp16, group 6, a ragged chunk)."""
    from lightllm.kernels.attention.prefill.context_attention import _prefix_configs

    for cfg in [c for c in _prefix_configs(torch.empty(1, 6, head_dim)) if c.get("PACK_GQA")]:
        launches.clear()
        _check_packed(launches, [21], [45], 6, 1, head_dim, torch.float16, cfg, seed=head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("hq, hk, d", [(32, 8, 128), (24, 4, 256)], ids=["qwen3-8b", "qwen3.5-27b"])
@pytest.mark.parametrize("new, prefix_len", [(40, 5000), (300, 5000)], ids=["hit", "chunk300"])
def test_gpu_every_candidate_and_the_default(launches, hq, hk, d, new, prefix_len):
    """Each candidate (packed or not) and the device's untuned default compiles and matches
    in bf16 at the models' heads, with the split count its grid gives."""
    from lightllm.kernels.attention.prefill.context_attention import _prefix_configs, default_config

    g = torch.Generator().manual_seed(new + d)
    q, k, v, b_start, b_len = _packed([new], hq, hk, d, torch.bfloat16, g)
    pool = prefix_len + 64
    k_cache, v_cache = (torch.randn(pool, hk, d, generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    prefix = _cached_prefix([prefix_len], pool, g)
    want = context_attention_ref(q, k, v, b_start, b_len, prefix=prefix, k_cache=k_cache, v_cache=v_cache)
    for cfg in _prefix_configs(q) + [default_config(q)]:
        out = torch.full_like(q, float("nan"))
        context_attention(q, k, v, b_start, b_len, new, out=out, run_config=cfg, prefix=prefix, k_cache=k_cache,
                          v_cache=v_cache)  # fmt: skip
        packed = cfg.get("PACK_GQA", False)
        assert launches[-1][1]["PACK_GQA"] == packed and launches[-1][0][1] == (hk if packed else hq), cfg
        assert not out.isnan().any(), f"unwritten output at {cfg}"
        torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2, msg=lambda m: f"{cfg}: {m}")


def _prefix_call(lens, prefix_lens, pool, table_width, seed=3):
    g = torch.Generator().manual_seed(seed)
    q, k, v, b_start, b_len = _packed(lens, 8, 2, 64, torch.float32, g)
    k_cache = torch.randn(pool, 2, 64, generator=g).to(DEVICE)
    v_cache = torch.randn(pool, 2, 64, generator=g).to(DEVICE)
    prefix = _cached_prefix(prefix_lens, pool, g)
    table = torch.full((prefix.req_to_token.shape[0], table_width), -1, dtype=torch.int32, device=DEVICE)
    table[:, : prefix.req_to_token.shape[1]] = prefix.req_to_token
    named = dict(q=q, k=k, v=v, out=torch.empty_like(q), b_start=b_start, b_len=b_len, max_q_len=max(lens),
                 sm_scale=0.125, k_cache=k_cache, v_cache=v_cache, req_to_token=table, b_req_idx=prefix.b_req_idx,
                 b_prefix_len=prefix.b_prefix_len, scratch=None)  # fmt: skip
    return named, CachedPrefix(table, prefix.b_req_idx, prefix.b_prefix_len)


def test_prefix_tuning_times_the_chunk_after_a_long_prefix_too(monkeypatch):
    """The search's scenarios: the caller's own chunk, then the same chunk after the representative prefix over the
    existing pool (a wrapping token table, no KV made), capped by the request table's room and the pair budget;
    only the caller's when the cap is no longer than its prefixes. The caller's tensors are left as they were."""
    ca = importlib.import_module("lightllm.kernels.attention.prefill.context_attention")
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "1024")
    named, _ = _prefix_call([4, 6], [3, 5], pool=40, table_width=2048)
    before = {name: t.clone() for name, t in named.items() if isinstance(t, torch.Tensor) and name != "out"}
    own, long = ca.prefix_tuning_scenarios(named)
    assert own["out"] is not named["out"] and own["req_to_token"] is named["req_to_token"]
    assert long["out"] is not own["out"] and long["k_cache"] is named["k_cache"]  # the pool itself
    assert long["req_to_token"].shape == (2, 1024) and long["b_prefix_len"].tolist() == [1024, 1024]
    assert long["b_req_idx"].tolist() == [0, 1] and int(long["req_to_token"].max()) == 39
    assert all(torch.equal(t, named[name]) for name, t in before.items())
    monkeypatch.setattr(ca, "PREFIX_TUNING_PAIRS", 10 * 100)  # 10 new tokens: at most 100 cached ones
    assert ca.prefix_tuning_scenarios(named)[1]["b_prefix_len"].tolist() == [100, 100]
    narrow, _ = _prefix_call([4, 6], [3, 5], pool=40, table_width=10)  # room 4 <= the caller's prefix of 5
    assert len(ca.prefix_tuning_scenarios(narrow)) == 1
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "5")
    assert len(ca.prefix_tuning_scenarios(named)) == 1


def test_prefix_search_times_both_scenarios_and_answers_the_caller(monkeypatch):
    """Level 1 in the GENERAL warm-up: the default and each candidate are timed at the caller's prefix and at the
    long one; the call itself still attends over the caller's prefix (checked against the reference)."""
    from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, set_bench_func

    ca = importlib.import_module("lightllm.kernels.attention.prefill.context_attention")
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "96")
    tuned = ca._launch_context_attention_prefix
    tuned.clear_cache()
    monkeypatch.setattr(tuned, "configs_gen_func", lambda q: [{"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4,
                                                               "num_stages": 1}])  # fmt: skip
    prefixes = []
    real = tuned.fn

    def spy(*args, **kwargs):
        prefixes.append(tuned.named_arguments(args, kwargs)["b_prefix_len"].tolist())
        return real(*args, **kwargs)

    monkeypatch.setattr(tuned, "fn", spy)
    set_bench_func(lambda run: (run(), 1.0)[1])
    named, prefix = _prefix_call([4, 6], [3, 5], pool=40, table_width=256, seed=5)
    q, k, v, b_start, b_len = (named[n] for n in ("q", "k", "v", "b_start", "b_len"))
    try:
        with autotune_warmup(AutotuneKernelType.GENERAL):
            out = context_attention(q, k, v, b_start, b_len, 6, prefix=prefix, k_cache=named["k_cache"],
                                    v_cache=named["v_cache"])  # fmt: skip
        record = tuned.last_search
    finally:
        tuned.clear_cache()
    # default and candidate, each run once and timed once at the caller's prefix and at the long one, both again (the
    # re-timing); then the call
    assert prefixes == ([[3, 5]] * 2 + [[96, 96]] * 2) * 4 + [[3, 5]]
    assert len(record.default_ms) == 2 and [len(ms) for _, ms in record.timings] == [2]
    want = context_attention_ref(q, k, v, b_start, b_len, prefix=prefix, k_cache=named["k_cache"],
                                 v_cache=named["v_cache"])  # fmt: skip
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
