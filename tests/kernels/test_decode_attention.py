import json
import logging
import math

import pytest
import torch
import triton
import triton.language as tl

from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, set_bench_func
from lightllm.common.autotuner.keys import freeze, key_to_json
from lightllm.common.kv_cache.quant import (
    INT8_SCALE_MAX,
    dequantize_int4_ref,
    dequantize_int8_ref,
    quantize_int4_ref,
    quantize_int8_ref,
    round_up_scale_bits,
)
from lightllm.kernels.attention.decode import (
    gqa_decode_attention,
    gqa_decode_attention_int4kv,
    gqa_decode_attention_int8kv,
)
from lightllm.kernels.attention.decode import flash_decode, splits
from lightllm.kernels.attention.decode.stage1 import INT8_PTX_BIAS, INT8_PTX_UNIT, _load_kv_halves
from lightllm.kernels.attention.decode.reference import decode_attention_ref
from lightllm.kernels.attention.decode.splits import split_token_ranges

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Relative (Frobenius) error of the quantized-KV output against attention over the unquantized KV, for
# random normal K/V, group 8: INT8 steps are absmax/127 per group, INT4 steps absmax/7.
QUANT_ERROR_BOUND = {"int8": 2e-2, "int4": 2.5e-1}


def make_batch(batch, q_heads, kv_heads, head_dim, lens, dtype, pool=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(pool, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(pool, kv_heads, head_dim, generator=g).to(dtype)
    max_len = max(lens)
    req_to_token = torch.randperm(pool, generator=g)[: (batch + 1) * max_len].view(batch + 1, max_len).int()
    b_req_idx = torch.randperm(batch + 1, generator=g)[:batch].int()  # slots out of order, one unused
    b_seq_len = torch.tensor(lens, dtype=torch.int32)
    tensors = q, k, v, req_to_token, b_req_idx, b_seq_len
    return [t.to(DEVICE) for t in tensors]


def quantize(k, v, kind, group=8):
    quant, dequant = {
        "int8": (quantize_int8_ref, dequantize_int8_ref),
        "int4": (quantize_int4_ref, dequantize_int4_ref),
    }[kind]
    kq, ks = quant(k, group)
    vq, vs = quant(v, group)
    return kq, vq, ks, vs, dequant(kq, ks, group), dequant(vq, vs, group)


def run(kind, q, k, v, req_to_token, b_req_idx, b_seq_len, max_len, group=8, **kw):
    out = torch.full_like(q, float("nan"))
    if kind == "none":
        gqa_decode_attention(q, k, v, req_to_token, b_req_idx, b_seq_len, max_len, out=out, **kw)
        return out, (k, v)
    kq, vq, ks, vs, kd, vd = quantize(k, v, kind, group)
    fn = gqa_decode_attention_int8kv if kind == "int8" else gqa_decode_attention_int4kv
    fn(q, kq, vq, ks, vs, req_to_token, b_req_idx, b_seq_len, max_len, out=out, quant_group=group, **kw)
    return out, (kd, vd)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


SHAPES = [(64, 4, 4), (128, 8, 2), (256, 12, 1)]  # (head_dim, q_heads, kv_heads): groups 1, 4, 12


@pytest.mark.parametrize("kind", ["none", "int8", "int4"])
@pytest.mark.parametrize("head_dim, q_heads, kv_heads", SHAPES, ids=[f"d{d}-g{hq // hk}" for d, hq, hk in SHAPES])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"]
)  # quantized KV: fp32 dequantizes in fp32, 16-bit queries through the float16 path (stage1.py; bf16: GPU tests)
def test_matches_reference(kind, head_dim, q_heads, kv_heads, dtype):
    lens = [1, 77, 300, 129]  # length 1, not multiples of the block, ragged
    q, k, v, r2t, idx, seq = make_batch(4, q_heads, kv_heads, head_dim, lens, dtype)
    cfg = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "WAVES": 2}
    out, (kd, vd) = run(kind, q, k, v, r2t, idx, seq, max(lens), run_config=cfg)
    assert not out.isnan().any(), "unwritten output"
    ref = decode_attention_ref(q, kd, vd, r2t, idx, seq)
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    if kind != "none":
        exact = decode_attention_ref(q, k, v, r2t, idx, seq)
        assert rel_err(out, exact) < QUANT_ERROR_BOUND[kind]


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("group", [16, 32])
def test_quantized_groups_and_wide_tiles(kind, group):
    """Larger quant groups and a 128-token tile, codes over their whole range (KV spread over two orders of magnitude
    per token), float16 queries."""
    lens = [130, 1, 257]
    q, k, v, r2t, idx, seq = make_batch(3, 8, 2, 128, lens, torch.float16, seed=5)
    g = torch.Generator().manual_seed(6)
    spread = torch.logspace(-1, 1, k.shape[0])[torch.randperm(k.shape[0], generator=g)].to(k.device)
    k, v = (k.float() * spread[:, None, None]).half(), (v.float() * spread[:, None, None]).half()
    cfg = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 1, "WAVES": 1}
    out, (kd, vd) = run(kind, q, k, v, r2t, idx, seq, max(lens), group=group, run_config=cfg)
    assert not out.isnan().any(), "unwritten output"
    ref = decode_attention_ref(q, kd, vd, r2t, idx, seq)
    torch.testing.assert_close(out.double(), ref, rtol=3e-3, atol=3e-3 * ref.abs().max().item())


def test_quantized_candidates_add_two_warp_programs():
    q = torch.empty(2, 8, 128)
    plain = flash_decode.split_kv_configs(q)
    quant = flash_decode.quant_split_kv_configs(q)
    assert all(c in quant for c in plain) and {c["num_warps"] for c in quant} - {c["num_warps"] for c in plain} == {2}
    assert {c["num_stages"] for c in quant if c["num_warps"] == 2} == {2, 3}
    many = [c for c in quant if c["WAVES"] > 8]  # two-warp programs only, all four (BLOCK_N, stages) at 16 and 32
    assert len(many) == 8 and {c["num_warps"] for c in many} == {2} and {c["WAVES"] for c in many} == {16, 32}
    assert len(quant) == len(plain) * 2 + 8 and len({json.dumps(c, sort_keys=True) for c in quant}) == len(quant)
    assert flash_decode._launch_gqa_flash_decode_int8kv.configs_gen_func is flash_decode.quant_split_kv_configs


def test_ptx_path_only_on_a_gpu_for_whole_words_and_aligned_rows(monkeypatch):
    """The PTX dequantization runs where it can: a GPU outside the interpreter, quant groups of whole 32-bit words,
    4-byte aligned K/V rows; anything else takes the per-element path (the GPU tests check both give one result)."""
    from types import SimpleNamespace

    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "interpret", False)
    gpu_q, cpu_q = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    k = torch.zeros(16, 2, 64, dtype=torch.int8)
    assert flash_decode._ptx_path(gpu_q, k, k, 8)
    assert not flash_decode._ptx_path(cpu_q, k, k, 8)
    assert not flash_decode._ptx_path(gpu_q, k, k, 2)  # a group is not whole words
    shifted = torch.zeros(16 * 2 * 64 + 1, dtype=torch.int8)[1:].view(16, 2, 64)  # rows off 4-byte alignment
    assert not flash_decode._ptx_path(gpu_q, shifted, k, 8) and not flash_decode._ptx_path(gpu_q, k, shifted, 8)
    narrow = torch.zeros(16, 2, 66, dtype=torch.int8)[:, :, :64]  # aligned start, 66-byte row stride
    assert not flash_decode._ptx_path(gpu_q, narrow, k, 8)
    previous = flash_decode.set_ptx_dequant(False)
    try:
        assert not flash_decode._ptx_path(gpu_q, k, k, 8)
    finally:
        assert flash_decode.set_ptx_dequant(previous) is False
    monkeypatch.setattr(knobs.runtime, "interpret", True)
    assert not flash_decode._ptx_path(gpu_q, k, k, 8)


def test_register_cap_only_for_small_ptx_programs_up_to_head_dim_128():
    """The PTX path's 2- and 4-warp programs keep the occupancy they had before the queries moved to registers; the
    8-warp ones, the per-element path and head_dim 256 (where the caps spill) run uncapped."""
    assert flash_decode.register_cap(2, True, 128) == 168 and flash_decode.register_cap(4, True, 64) == 128
    assert flash_decode.register_cap(8, True, 128) is None
    assert flash_decode.register_cap(2, False, 128) is None and flash_decode.register_cap(2, True, 256) is None


def test_quantized_programs_peel_their_first_block_up_to_head_dim_128():
    """Stage 1 keeps the queries in registers by peeling its first block: INT8/INT4 with 16-bit queries, up to
    head_dim 128 unless a benchmark moves the bound (and gets the previous one back)."""
    assert flash_decode.peel_queries(True, 64) and flash_decode.peel_queries(True, 128)
    assert not flash_decode.peel_queries(True, 256) and not flash_decode.peel_queries(False, 128)
    previous = flash_decode.set_peel_max_head_dim(256)
    try:
        assert previous == 128 and flash_decode.peel_queries(True, 256)
    finally:
        assert flash_decode.set_peel_max_head_dim(previous) == 256
    assert not flash_decode.peel_queries(True, 256)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_peeled_first_block_gives_the_loop_s_result_at_head_dim_256(kind):
    """The peel only moves the first block out of the loop: at head_dim 256 (not peeled by default) forcing it gives
    the unpeeled output, bit for bit under the interpreter (a compiled kernel may contract its arithmetic otherwise),
    over splits of several blocks, of one partial block, and a one-token request."""
    lens = [70, 1, 33]
    q, k, v, r2t, idx, seq = make_batch(3, 6, 1, 256, lens, torch.bfloat16, seed=8)
    cfg = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "WAVES": 1}
    plain, (kd, vd) = run(kind, q, k, v, r2t, idx, seq, max(lens), run_config=cfg)
    previous = flash_decode.set_peel_max_head_dim(256)
    try:
        peeled, _ = run(kind, q, k, v, r2t, idx, seq, max(lens), run_config=cfg)
    finally:
        flash_decode.set_peel_max_head_dim(previous)
    assert not peeled.isnan().any(), "unwritten output"
    exact = DEVICE == "cpu"
    torch.testing.assert_close(peeled, plain, rtol=0 if exact else 2**-7, atol=0 if exact else 1e-3)
    ref = decode_attention_ref(q, kd, vd, r2t, idx, seq)
    torch.testing.assert_close(peeled.double(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("waves, block_n", [(1, 32), (4, 16)])
def test_split_counts_and_empty_request(waves, block_n):
    """Many splits with few chunks (most splits empty), a padded request of length 0 (output 0)."""
    lens = [0, 5, 600]
    q, k, v, r2t, idx, seq = make_batch(3, 4, 2, 64, lens, torch.float32, seed=3)
    cfg = {"BLOCK_N": block_n, "num_warps": 2, "num_stages": 1, "WAVES": waves}
    out, _ = run("none", q, k, v, r2t, idx, seq, 2048, run_config=cfg)  # graph max > real
    ref = decode_attention_ref(q, k, v, r2t, idx, seq)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_split_token_ranges_cover_every_token_once():
    """Each split takes whole BLOCK_N blocks, in order; the splits with work come first; a request with no more
    blocks than splits gives each block its own split."""
    for seq_len in (0, 1, 15, 16, 17, 100, 1024, 5000):
        for n_splits in (1, 3, 17, 64):
            for block_n in (16, 32, 64):
                ranges = split_token_ranges(seq_len, n_splits, block_n)
                assert len(ranges) == n_splits
                assert [t for a, b in ranges for t in range(a, b)] == list(range(seq_len))
                used = [a < b for a, b in ranges]
                assert used == sorted(used, reverse=True), ranges
                assert all(a % block_n == 0 for a, b in ranges if a < b)
                blocks = -(-seq_len // block_n)
                if blocks <= n_splits:
                    assert sum(used) == blocks
    # The frozen-graph case of issue 17: 17 splits (B=8, WAVES 8 on 132 SMs) at L = 1K with BLOCK_N 32. Whole
    # 256-token chunks kept 4 of them busy with 256 tokens each; blocks keep 16 busy with 64.
    ranges = split_token_ranges(1024, 17, 32)
    assert sum(a < b for a, b in ranges) == 16 and max(b - a for a, b in ranges) == 64


def test_min_blocks_gives_every_split_with_work_that_many_blocks():
    """With ``min_blocks`` each split with work but the last takes at least that many blocks; every token is still
    covered once, in order, and a request with enough blocks per split is cut as without it."""
    for seq_len in (0, 1, 16, 17, 100, 1024, 5000):
        for n_splits in (1, 3, 17, 64):
            for least in (1, 2, 4):
                ranges = split_token_ranges(seq_len, n_splits, 16, least)
                assert [t for a, b in ranges for t in range(a, b)] == list(range(seq_len))
                work = [(a, b) for a, b in ranges if a < b]
                assert ranges[: len(work)] == work and all(b - a >= least * 16 for a, b in work[:-1])
                if -(-seq_len // 16) >= least * n_splits:
                    assert ranges == split_token_ranges(seq_len, n_splits, 16)
    # the H200 case of the grid sized for 32K (d256, B=1, WAVES 2: 64 splits of BLOCK_N 64) at 4K: 64 one-block
    # splits, or 32 of two blocks
    assert sum(a < b for a, b in split_token_ranges(4096, 64, 64)) == 64
    assert sum(a < b for a, b in split_token_ranges(4096, 64, 64, 2)) == 32


def test_min_blocks_config_key():
    """Absent means 1 (configs stored before the key); anything but an int >= 1 is refused by name; the candidates
    carry it only with 2 and 4 waves, every one besides a twin without it."""
    assert splits.min_blocks({"BLOCK_N": 32}) == 1 and splits.min_blocks({"MIN_BLOCKS": 2}) == 2
    for bad in (0, -1, 2.0, "2", True):
        with pytest.raises(ValueError, match=f"MIN_BLOCKS expected an int >= 1, got {bad!r}"):
            splits.min_blocks({"MIN_BLOCKS": bad})
    for configs in (flash_decode.split_kv_configs(None), flash_decode.quant_split_kv_configs(None)):
        twos = [c for c in configs if "MIN_BLOCKS" in c]
        assert twos and all(c["MIN_BLOCKS"] == 2 and c["WAVES"] in (2, 4) for c in twos)
        assert all({k: v for k, v in c.items() if k != "MIN_BLOCKS"} in configs for c in twos)


def test_num_splits_gives_every_split_work_at_the_launch_maximum(monkeypatch):
    """The split count follows the waves and SMs, and is cut to what the longest request the launch serves can keep
    busy: no split of a graph is empty for every length it replays."""
    monkeypatch.setattr(splits, "_num_sms", lambda device: 132)  # an H200
    for batch, kv_heads in ((1, 8), (8, 8), (16, 4), (64, 8), (128, 4)):
        for max_len in (1, 100, 1024, 32768):
            for block_n in (32, 64):
                for waves in (1, 2, 4, 8):
                    n = splits.num_splits(batch, kv_heads, max_len, block_n, waves, "cuda")
                    assert 1 <= n <= max(1, -(-waves * 132 // (batch * kv_heads)))
                    assert all(a < b for a, b in split_token_ranges(max_len, n, block_n)), (batch, max_len, n)
    # 132 wanted at B=1, 8 KV heads, WAVES 8; 32K has 1024 blocks of 32, 8 per split: 128 splits hold them all
    assert splits.num_splits(1, 8, 32768, 32, 8, "cuda") == 128


def _split_partials_ref(q, k, v, tokens, sm_scale, group):
    """float64 output ``[q_heads, D]`` and base-2 log-sum-exp ``[q_heads]`` of ``q [q_heads, D]`` over ``tokens``."""
    kk = k[tokens].double().repeat_interleave(group, dim=1)
    vv = v[tokens].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.double(), kk) * sm_scale
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), vv), scores.logsumexp(-1) / math.log(2)


@pytest.mark.parametrize("least", [1, 2], ids=["min1", "min2"])
@pytest.mark.parametrize("kind", ["none", "int8", "int4"])
def test_stage1_partials_are_exactly_the_split_ranges(kind, least):
    """Every split with work holds attention over exactly its ``split_token_ranges`` tokens; the others are never
    written (the NaN stays) and never merged (the output has none), in a grid sized for a graph of 4096 tokens.
    With ``MIN_BLOCKS`` 2 the 3-block request takes 2 splits instead of 3, and stage 2 merges exactly those."""
    lens = [1, 37, 200]  # 1, 3 and 13 blocks of 16 over 11 splits
    q, k, v, r2t, idx, seq = make_batch(3, 4, 1, 64, lens, torch.float32, seed=7)
    kq, vq, ks, vs, kd, vd = (k, v, None, None, k, v) if kind == "none" else quantize(k, v, kind)
    cfg = {"BLOCK_N": 16, "num_warps": 2, "num_stages": 1, "WAVES": 8, **({"MIN_BLOCKS": 2} if least == 2 else {})}
    n_splits = splits.num_splits(3, 1, 4096, 16, 8, q.device)
    assert n_splits == 11
    shape = (3, 4, n_splits, 64)
    nan = float("nan")
    scratch = {shape: (torch.full(shape, nan, device=DEVICE), torch.full(shape[:-1], nan, device=DEVICE))}
    out = torch.full_like(q, float("nan"))
    flash_decode._launch_split_kv(q, kq, vq, ks, vs, r2t, idx, seq, 4096, out, 0.125, kind, 8 if kind != "none" else 0,
                                  scratch, cfg)  # fmt: skip
    mid_o, mid_lse = scratch[shape]
    ranges = [split_token_ranges(n, n_splits, 16, least) for n in lens]
    assert [sum(lo < hi for lo, hi in r) for r in ranges] == [1, 3 if least == 1 else 2, 7]  # 200: 2 blocks a split
    for b in range(len(lens)):
        tokens = r2t[int(idx[b])].long()
        for s, (lo, hi) in enumerate(ranges[b]):
            if lo == hi:
                assert mid_o[b, :, s].isnan().all() and mid_lse[b, :, s].isnan().all(), (b, s)
                continue
            o_ref, lse_ref = _split_partials_ref(q[b], kd, vd, tokens[lo:hi], 0.125, 4)
            torch.testing.assert_close(mid_o[b, :, s].double(), o_ref, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(mid_lse[b, :, s].double(), lse_ref, rtol=1e-5, atol=1e-5)
    assert not out.isnan().any(), "stage 2 read an empty split"
    torch.testing.assert_close(
        out.double(), decode_attention_ref(q, kd, vd, r2t, idx, seq, 0.125), rtol=1e-4, atol=1e-4
    )


GRIDS = {"many-splits": {"BLOCK_N": 16, "num_warps": 2, "num_stages": 1, "WAVES": 8},
         "one-split": {"BLOCK_N": 32, "num_warps": 2, "num_stages": 1, "WAVES": 1}}  # fmt: skip


@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("kind", ["none", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_graph_grid_serves_short_and_mixed_lengths(grid, kind, dtype):
    """A grid sized for a 32K graph over requests of 1, one block, one block + 1, a ragged length and a few blocks:
    every output written and right, with more splits than a request has blocks, or one split."""
    lens = [1, 16, 17, 45, 130]
    q, k, v, r2t, idx, seq = make_batch(5, 4, 2, 64, lens, dtype, seed=11)
    cfg = GRIDS[grid]
    n_splits = splits.num_splits(5, 2, 32768, cfg["BLOCK_N"], cfg["WAVES"], q.device)
    assert n_splits == (4 if grid == "many-splits" else 1)  # many: more splits than the short requests' blocks
    out, (kd, vd) = run(kind, q, k, v, r2t, idx, seq, 32768, run_config=cfg)
    assert not out.isnan().any(), "unwritten output"
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(out.double(), decode_attention_ref(q, kd, vd, r2t, idx, seq), rtol=tol, atol=tol)


def test_bad_inputs_name_the_argument():
    q, k, v, r2t, idx, seq = make_batch(2, 4, 2, 64, [3, 4], torch.float32)
    cases = [
        (dict(q=q.to(torch.int32)), "q expected"),
        (
            dict(q=torch.randn(2, 4, 96, device=DEVICE), k=torch.randn(8, 2, 96, device=DEVICE)),
            "head_dim expected one of",
        ),
        (dict(k=k.half()), "k_cache expected"),
        (dict(k=k[:, :1]), "kv_heads expected"),
        (dict(r2t=r2t.long()), "req_to_token expected"),
        (dict(seq=seq.long()), "b_seq_len expected"),
        (dict(idx=idx[:1]), "b_req_idx expected"),
    ]
    for override, message in cases:
        a = {**dict(q=q, k=k, v=v, r2t=r2t, idx=idx, seq=seq), **override}
        with pytest.raises(ValueError, match=message):
            gqa_decode_attention(a["q"], a["k"], a["v"], a["r2t"], a["idx"], a["seq"], 8)
    kq, vq, ks, vs, _, _ = quantize(k, v, "int8")
    with pytest.raises(ValueError, match="quant_group expected a power of two dividing 32"):
        gqa_decode_attention_int8kv(q, kq, vq, ks, vs, r2t, idx, seq, 8, quant_group=3)
    kq64, vq64, ks64, vs64, _, _ = quantize(k, v, "int8", 64)  # one group per row: stage 1 reads halves
    with pytest.raises(ValueError, match="quant_group expected a power of two dividing 32, got 64"):
        gqa_decode_attention_int8kv(q, kq64, vq64, ks64, vs64, r2t, idx, seq, 8, quant_group=64)
    with pytest.raises(ValueError, match="k_scale expected a float16"):
        gqa_decode_attention_int8kv(q, kq, vq, ks.float(), vs, r2t, idx, seq, 8)
    with pytest.raises(ValueError, match="k_cache expected .* torch.uint8"):
        gqa_decode_attention_int4kv(q, kq, vq, ks, vs, r2t, idx, seq, 8)
    strided = torch.zeros(ks.shape[0], ks.shape[1], 2 * ks.shape[2], dtype=ks.dtype, device=ks.device)[..., ::2]
    with pytest.raises(ValueError, match=r"v_scale expected contiguous rows of 8 scales .*, got \(32, 16, 2\)"):
        gqa_decode_attention_int8kv(q, kq, vq, ks, strided.copy_(vs), r2t, idx, seq, 8)
    padded = torch.zeros(ks.shape[0], ks.shape[1], ks.shape[2] + 2, dtype=ks.dtype, device=ks.device)[..., :-2]
    with pytest.raises(ValueError, match="k_scale expected contiguous rows of 8 scales"):  # rows 10 apart: not whole
        gqa_decode_attention_int8kv(q, kq, vq, padded.copy_(ks), vs, r2t, idx, seq, 8)


def test_step_plan_checks_once_and_refuses_other_shapes():
    """The plan runs the public function's checks (same errors) once; its run checks only the planned shapes."""
    q, k, v, r2t, idx, seq = make_batch(2, 4, 2, 64, [3, 9], torch.float32, pool=512)
    with pytest.raises(ValueError, match=r"kv expected one of \('none', 'int8', 'int4'\), got 'fp8'"):
        flash_decode.GQADecodePlan("fp8", q.shape, q.dtype, k, v, r2t, idx, seq, 16)
    with pytest.raises(ValueError, match="b_seq_len expected an int32"):
        flash_decode.GQADecodePlan("none", q.shape, q.dtype, k, v, r2t, idx, seq.long(), 16)
    with pytest.raises(ValueError, match="head_dim expected one of"):
        flash_decode.GQADecodePlan("none", (2, 4, 48), q.dtype, k, v, r2t, idx, seq, 16)
    plan = flash_decode.GQADecodePlan("none", q.shape, q.dtype, k, v, r2t, idx, seq, 16)
    ref = decode_attention_ref(q, k, v, r2t, idx, seq)
    for _ in range(2):  # two layers
        torch.testing.assert_close(plan.run(q, k, v).double(), ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"plan: k_cache expected the planned \(512, 2, 64\) torch.float32, got "
                                         r"\(256, 2, 64\)"):  # fmt: skip
        plan.run(q, k[:256], v[:256])
    with pytest.raises(ValueError, match=r"k_cache expected the planned \(512, 2, 64\) torch.float32, got "
                                         r"\(512, 2, 64\) torch.float16"):  # fmt: skip
        plan.run(q, k.half(), v.half())  # another KV dtype is another tuning key
    with pytest.raises(ValueError, match=r"plan: q expected the planned \(2, 4, 64\) torch.float32, got "
                                         r"\(2, 4, 64\) torch.float16"):  # fmt: skip
        plan.run(q.half(), k, v)
    with pytest.raises(ValueError, match="out expected a"):
        plan.run(q, k, v, out=torch.empty(2, 4, 32))


def test_search_uses_representative_batch_over_existing_pool(monkeypatch):
    """Level 1 in the DECODE_ATTENTION scope: one search per key, timed on every request at the tuning
    lengths over the same pool tensors; the caller's tensors are untouched and its output is right."""
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "1024")
    tuned = flash_decode._launch_gqa_flash_decode
    tuned.clear_cache()
    cfgs = [{"BLOCK_N": 256, "num_warps": 2, "num_stages": 1, "WAVES": w} for w in (1, 4)]
    monkeypatch.setattr(tuned, "configs_gen_func", lambda q: cfgs)
    seen = []

    def bench(run_fn):
        seen.append(run_fn)
        run_fn()
        return 1.0

    set_bench_func(bench)
    q, k, v, r2t, idx, seq = make_batch(2, 4, 2, 64, [3, 9], torch.float32, pool=512)
    before = [t.clone() for t in (q, k, v, r2t, idx, seq)]
    calls = []
    real_launch = tuned.fn

    def spy(*args, **kwargs):
        named = tuned.named_arguments(args, kwargs)
        calls.append((named["k_cache"], named["req_to_token"], named["b_seq_len"], named["max_len_in_batch"]))
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(tuned, "fn", spy)
    with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
        # a launch that serves up to 2048 tokens (a graph's maximum) on a dummy batch of tiny real lengths
        out1, _ = run("none", q, k, v, r2t, idx, seq, 2048)
        out2, _ = run("none", q, k, v, r2t, idx, seq, 2048)  # same key: no second search
    tuned.clear_cache()
    timed = [c for c in calls if c[1] is not r2t]
    assert len(seen) == 3 * 2 * 2  # (default + 2 configs) x lengths [1024, 512] x 2 (all three re-timed)
    assert {int(c[2][0]) for c in timed} == {1024, 512} and all(c[3] == 2048 for c in timed)
    assert all(c[0] is k for c in timed)  # the existing pool, no new KV
    assert all(int(c[1].max()) < k.shape[0] and c[1].shape == (2, 1024) for c in timed)
    for t, b in zip((q, k, v, r2t, idx, seq), before):
        assert torch.equal(t, b)
    ref = decode_attention_ref(q, k, v, r2t, idx, seq)
    for out in (out1, out2):
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad", [{"num_warps": 2}, {"BLOCK_N": 100}, {"BLOCK_N": "256"}], ids=["keys", "value", "type"])
@pytest.mark.parametrize("level", [0, 1])
def test_cached_config_outside_the_candidates_is_a_miss(monkeypatch, caplog, isolated_autotune, bad, level):
    """Valid JSON the kernel cannot run: one warning, then the default (level 0) or a fresh search (level 1)."""
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", str(level))
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "512")
    tuned = flash_decode._launch_gqa_flash_decode
    tuned.clear_cache()
    q, k, v, r2t, idx, seq = make_batch(2, 4, 2, 64, [3, 9], torch.float32, pool=512)
    static_key = freeze(flash_decode._static_key(q, k, "none", 0))
    run_key = flash_decode.split_kv_run_key(q, 2048)
    tuned.store.save(static_key, static_key, {run_key: (bad, {})})
    cfg = {"BLOCK_N": 64, "num_warps": 2, "num_stages": 1, "WAVES": 1}  # one cheap candidate
    monkeypatch.setattr(tuned, "configs_gen_func", lambda q: [cfg])
    launched = []
    real_launch = tuned.fn

    def spy(*args, run_config=None, **kwargs):
        launched.append(run_config)
        return real_launch(*args, run_config=run_config, **kwargs)

    def bench(run_fn):
        run_fn()
        return 0.5 if launched[-1] == cfg else 1.0  # the candidate beats the default

    monkeypatch.setattr(tuned, "fn", spy)
    set_bench_func(bench)
    with caplog.at_level(logging.WARNING, logger="lightllm.common.autotuner"):
        with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
            out, _ = run("none", q, k, v, r2t, idx, seq, 2048)
    tuned.clear_cache()
    (warning,) = [r.getMessage() for r in caplog.records if "gqa_flash_decode" in r.getMessage()]
    assert "not among the kernel's candidates" in warning and key_to_json(bad) in warning
    assert bad not in launched and launched[-1] == (cfg if level == 1 else None)
    torch.testing.assert_close(out.double(), decode_attention_ref(q, k, v, r2t, idx, seq), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["none", "int8", "int4"])
@pytest.mark.parametrize("head_dim, q_heads, kv_heads", [(128, 32, 8), (256, 24, 4)])
def test_gpu_large_bf16(kind, head_dim, q_heads, kv_heads):
    lens = [1, 4097, 16384, 777, 30000, 8192, 255, 12000]
    q, k, v, r2t, idx, seq = make_batch(8, q_heads, kv_heads, head_dim, lens, torch.bfloat16, pool=300000)
    out, (kd, vd) = run(kind, q, k, v, r2t, idx, seq, 32768)
    assert not out.isnan().any()
    ref = decode_attention_ref(q, kd.to(torch.bfloat16), vd.to(torch.bfloat16), r2t, idx, seq)
    assert rel_err(out, ref) < 1e-2
    if kind != "none":
        assert rel_err(out, decode_attention_ref(q, k, v, r2t, idx, seq)) < QUANT_ERROR_BOUND[kind]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("group", [8, 32])
@pytest.mark.parametrize("head_dim, q_heads, kv_heads", [(128, 32, 8), (256, 24, 4), (64, 8, 8)])
@pytest.mark.parametrize("cfg", [{"BLOCK_N": 64, "num_warps": 2, "num_stages": 2, "WAVES": 8},
                                 {"BLOCK_N": 32, "num_warps": 8, "num_stages": 3, "WAVES": 2}])  # fmt: skip
def test_gpu_ptx_dequant_matches_element_path(kind, group, head_dim, q_heads, kv_heads, cfg):
    """The PTX word helpers (stage1.py) against per-element dequantization, codes over their whole range: the same
    float16 values (exact codes, one rounding by the scale) feed the same dots."""
    lens = [1, 300, 4097, 63, 2049]
    q, k, v, r2t, idx, seq = make_batch(5, q_heads, kv_heads, head_dim, lens, torch.bfloat16, pool=32768, seed=3)
    spread = torch.logspace(-1, 1, k.shape[0], device=k.device)[torch.randperm(k.shape[0], device=k.device)]
    k, v = (k.float() * spread[:, None, None]).bfloat16(), (v.float() * spread[:, None, None]).bfloat16()
    outs = []
    for ptx in (True, False):
        previous = flash_decode.set_ptx_dequant(ptx)
        try:
            outs.append(run(kind, q, k, v, r2t, idx, seq, 8192, group=group, run_config=cfg))
        finally:
            flash_decode.set_ptx_dequant(previous)
    (ptx_out, (kd, vd)), (element_out, _) = outs
    assert not ptx_out.isnan().any(), "unwritten output"
    # one bf16 ulp: the PTX path's V dot (a 2-wide operand) sums its tokens in another order than the element path's
    torch.testing.assert_close(ptx_out.float(), element_out.float(), rtol=2**-7, atol=2e-3)
    ref = decode_attention_ref(q, kd, vd, r2t, idx, seq)
    assert rel_err(ptx_out, ref) < 1e-2


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("least, graph_max", [(1, 64), (2, 4096), (3, 4096)])
def test_each_split_reads_exactly_its_own_blocks(kind, least, graph_max):
    """Stage 1's peeled path (16-bit queries, quantized KV, head_dim <= 128: the first block, whole blocks without
    masks, then a partial last block) over lengths around the block's multiples, splits of one, several and no
    blocks: every token past a request's end points at a slot whose scales are NaN, so a read past a split's end
    shows, and each split's partial output and log-sum-exp match float64 over exactly its tokens."""
    head_dim, q_heads, block_n, pool = 64, 4, 16, 512
    lens = [n for n in (1, 15, 16, 17, 31, 32, 33, 48, 64, 80, 95, 96, 97, 160) if n <= graph_max]
    g = torch.Generator().manual_seed(least)
    quant, dequant = {
        "int8": (quantize_int8_ref, dequantize_int8_ref),
        "int4": (quantize_int4_ref, dequantize_int4_ref),
    }[kind]
    (kq, ks), (vq, vs) = (quant(torch.randn(pool, 1, head_dim, generator=g), 8) for _ in "kv")
    kd, vd = dequant(kq, ks, 8).double(), dequant(vq, vs, 8).double()
    ks[pool - 1], vs[pool - 1] = float("nan"), float("nan")
    q = torch.randn(len(lens), q_heads, head_dim, generator=g).half()
    r2t = torch.full((len(lens), 200), pool - 1, dtype=torch.int32)
    for b, n in enumerate(lens):
        r2t[b, :n] = torch.randperm(pool - 1, generator=g)[:n].int()
    cfg = {"BLOCK_N": block_n, "num_warps": 2, "num_stages": 1, "WAVES": 8, "MIN_BLOCKS": least}
    n_splits = splits.num_splits(len(lens), 1, graph_max, block_n, 8, torch.device(DEVICE))
    shape = (len(lens), q_heads, n_splits, head_dim)
    scratch = {
        shape: (torch.full(shape, float("nan"), device=DEVICE), torch.full(shape[:-1], float("nan"), device=DEVICE))
    }
    tensors = [t.to(DEVICE) for t in (q, kq, vq, ks, vs, r2t)]
    idx = torch.arange(len(lens), dtype=torch.int32, device=DEVICE)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(tensors[0], float("nan"))
    flash_decode._launch_split_kv(*tensors, idx, seq, graph_max, out, 0.125, kind, 8, scratch, cfg)
    mid_o, mid_lse = (t.cpu().double() for t in scratch[shape])
    assert flash_decode.peel_queries(True, head_dim)
    for b, n in enumerate(lens):
        for s, (lo, hi) in enumerate(split_token_ranges(n, n_splits, block_n, least)):
            if lo == hi:  # stage 2 skips it: left unwritten
                assert mid_o[b, :, s].isnan().all() and mid_lse[b, :, s].isnan().all()
                continue
            tok = r2t[b, lo:hi].long()
            scores = torch.einsum("hd,nd->hn", q[b].double(), kd[tok, 0]) * 0.125
            torch.testing.assert_close(mid_o[b, :, s], scores.softmax(-1) @ vd[tok, 0], rtol=0, atol=5e-3)
            torch.testing.assert_close(mid_lse[b, :, s], scores.logsumexp(-1) / math.log(2), rtol=0, atol=5e-3)


def test_ptx_int8_fma_arithmetic_is_exact_for_every_code_and_format_scale():
    """The PTX INT8 helper's arithmetic (stage1._int8_word_to_f16), emulated: ``code + 128`` under 0x54 is the float16
    ``64 + (code + 128) / 16``; one FMA by the scale with the bias ``-72 * scale`` (float64 here: exact, then one
    rounding, as the FMA) is ``code * scale / 16`` rounded once, for all 255 codes and every scale of the INT8 format
    (4 low mantissa bits clear, up to 512, subnormals included); where that is a normal float16, 16 times it is the
    element path's ``code * scale``. The GPU test below runs the PTX itself."""
    u = torch.arange(1, 256, dtype=torch.int32)
    placed = (u | 0x5400).to(torch.int16).view(torch.float16).double()
    assert torch.equal(placed, 64 + u.double() / 16)
    scales = torch.arange(0x0010, 0x6001, 16, dtype=torch.int32).to(torch.int16).view(torch.float16).double()
    assert scales.max().item() == INT8_SCALE_MAX and len(scales) == 1536
    bias = (INT8_PTX_BIAS.value * scales).half().double()
    assert torch.equal(bias, INT8_PTX_BIAS.value * scales)  # exact in float16
    fma = (placed[None, :] * scales[:, None] + bias[:, None]).half()
    codes = (u - 128).double()
    assert torch.equal(fma, (codes[None, :] * scales[:, None] / INT8_PTX_UNIT.value).half())
    element = (codes[None, :] * scales[:, None]).half().double()
    normal = (element / INT8_PTX_UNIT.value).abs() >= 2**-14
    assert torch.equal(fma.double()[normal] * INT8_PTX_UNIT.value, element[normal])


@triton.jit
def _dequant_both_paths_kernel(Codes, Scales, Ptx, Element, BLOCK_N: tl.constexpr, HALF_D: tl.constexpr,
                               QGROUP: tl.constexpr):  # fmt: skip
    """One INT8 tile ``[BLOCK_N, 2 * HALF_D]`` dequantized by stage 1's PTX word path and by its element path."""
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HALF_D)
    row, srow, every = n * (2 * HALF_D), n * (2 * HALF_D // QGROUP), n < BLOCK_N
    out = n[:, None] * (2 * HALF_D) + d[None, :]
    lo, hi = _load_kv_halves(Codes, Scales, row, srow, every, d, BLOCK_N, HALF_D, 8, QGROUP, 8, True, True, tl.float16)
    tl.store(Ptx + out, lo)
    tl.store(Ptx + out + HALF_D, hi)
    lo, hi = _load_kv_halves(Codes, Scales, row, srow, every, d, BLOCK_N, HALF_D, 8, QGROUP, 8, True, False,
                             tl.float16)  # fmt: skip
    tl.store(Element + out, lo)
    tl.store(Element + out + HALF_D, hi)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [8, 32])
def test_gpu_ptx_int8_dequant_is_exact_at_a_sixteenth(group):
    """The PTX INT8 helper's one FMA with the bias ``-72 * scale``: every code (-127..127) at scales of the INT8
    format (7 significant bits, up to 512) gives exactly the element path's ``code * scale`` / 16 wherever that is a
    normal float16, and within half a subnormal ulp below (as the /16 rounds it)."""
    block_n, head_dim = 64, 128
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(-127, 128, (block_n, head_dim), generator=g, dtype=torch.int8)
    codes.view(-1)[:255] = torch.arange(-127, 128, dtype=torch.int8)
    bits = torch.randint(0x0010, 0x6000 + 1, (block_n, head_dim // group), generator=g, dtype=torch.int32)
    scales = round_up_scale_bits(bits.to(torch.int16).view(torch.float16))
    scales.view(-1)[:2] = torch.tensor([INT8_SCALE_MAX, 2.0**-10])  # the largest scale and the smallest all-normal one
    assert (scales.float() <= INT8_SCALE_MAX).all()
    codes, scales = codes.to(DEVICE), scales.to(DEVICE)
    ptx, element = (torch.full((block_n, head_dim), float("nan"), dtype=torch.float16, device=DEVICE) for _ in "ab")
    _dequant_both_paths_kernel[(1,)](codes, scales, ptx, element, BLOCK_N=block_n, HALF_D=head_dim // 2,
                                     QGROUP=group)  # fmt: skip
    exact = (codes.float() * scales.float().repeat_interleave(group, 1)).half()
    assert torch.equal(element, exact)  # the element path: exact codes, one rounding by the scale
    normal = (exact.float() / INT8_PTX_UNIT.value).abs() >= 2**-14
    assert normal.float().mean() > 0.9 and not ptx.isnan().any()
    unit = INT8_PTX_UNIT.value
    torch.testing.assert_close(ptx.float()[normal] * unit, exact.float()[normal], rtol=0, atol=0)
    assert ((ptx.float() * unit - exact.float()).abs()[~normal] <= unit * 2.0**-25).all()


@pytest.mark.gpu
def test_gpu_search_runs_once_per_key_at_representative_length(monkeypatch, isolated_autotune):
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    tuned = flash_decode._launch_gqa_flash_decode
    tuned.clear_cache()
    q, k, v, r2t, idx, seq = make_batch(16, 32, 8, 128, [5] * 16, torch.bfloat16, pool=65536)
    before = [t.clone() for t in (q, k, v, r2t, idx, seq)]
    with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
        for _ in range(3):  # three layers of a graph serving up to 32K tokens, one key
            out, _ = run("none", q, k, v, r2t, idx, seq, 32768)
    record = tuned.last_search
    assert record.run_key == (16, 32768) and len(record.default_ms) == 4
    assert len(record.timings) == len(flash_decode.split_kv_configs(q))
    assert tuned.last_search is record and len(list(isolated_autotune.rglob("*.json"))) == 1
    for t, b in zip((q, k, v, r2t, idx, seq), before):
        assert torch.equal(t, b)
    assert rel_err(out, decode_attention_ref(q, k, v, r2t, idx, seq)) < 1e-2
    tuned.clear_cache()


def test_a_bucketed_graph_at_level_0_uses_a_config_cached_without_buckets(monkeypatch, isolated_autotune):
    """A graph above a smaller bucket keys on its served floor ((2, 2048, 1024) here). At level 0, with only a
    config cached by a one-graph start (or shipped) under (2, 2048), it takes that config as the nearest key, not
    the launcher default."""
    from lightllm.kernels.attention.decode.tuning import set_decode_graph_lens

    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "0")
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "2048")
    tuned = flash_decode._launch_gqa_flash_decode
    tuned.clear_cache()
    q, k, v, r2t, idx, seq = make_batch(2, 4, 2, 64, [3, 9], torch.float32, pool=512)
    static_key = freeze(flash_decode._static_key(q, k, "none", 0))
    cached = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "WAVES": 2}
    tuned.store.save(static_key, static_key, {flash_decode.split_kv_run_key(q, 2048): (cached, {})})  # no floor
    set_decode_graph_lens([1024, 2048])
    assert flash_decode.split_kv_run_key(q, 2048) == (2, 2048, 1024)
    launched = []
    real_launch = tuned.fn

    def spy(*args, run_config=None, **kwargs):
        launched.append(run_config)
        return real_launch(*args, run_config=run_config, **kwargs)

    monkeypatch.setattr(tuned, "fn", spy)
    out, _ = run("none", q, k, v, r2t, idx, seq, 2048)
    tuned.clear_cache()
    assert launched == [cached]
    torch.testing.assert_close(out.double(), decode_attention_ref(q, k, v, r2t, idx, seq), rtol=1e-4, atol=1e-4)
