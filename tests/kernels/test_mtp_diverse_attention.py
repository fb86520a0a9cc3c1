"""MTP diverse decode attention (the N + 1 tokens of an MTP verify step) against the float64 reference, its
argument checks, its representative rebuild over the existing pool, a forced search, and the attention backend's
routing of q_len > 1 on Triton. Interpreter shapes are tiny; the GPU shapes are in the ``gpu`` tests at the end."""

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, set_bench_func
from lightllm.kernels.attention.decode import flash_decode, mtp_diverse
from lightllm.kernels.attention.decode.mtp_diverse import MTPDiverseDecodePlan, mtp_diverse_decode_attention
from lightllm.kernels.attention.decode.reference import decode_attention_ref
from lightllm.kernels.attention.decode.splits import num_splits, split_token_ranges
from lightllm.layers.attention import AttentionBackend, make_pool
from lightllm.layers.infer_state import InferState

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# BLOCK_N 16 and WAVES 8 on the interpreter's 4 "SMs": short requests get one 16-key block per split, so tiny lengths
# cross split boundaries.
MANY_SPLITS = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "WAVES": 8}
ONE_SPLIT = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "WAVES": 1}


def make_batch(batch, q_len, q_heads, kv_heads, head_dim, lens, dtype, pool=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_len, q_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(pool, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(pool, kv_heads, head_dim, generator=g).to(dtype)
    max_len = max(max(lens), 1)
    req_to_token = torch.randperm(pool, generator=g)[: (batch + 1) * max_len].view(batch + 1, max_len).int()
    b_req_idx = torch.randperm(batch + 1, generator=g)[:batch].int()  # slots out of order, one unused
    b_seq_len = torch.tensor(lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, k, v, req_to_token, b_req_idx, b_seq_len)]


def run(q, k, v, r2t, idx, seq, max_len, **kw):
    out = torch.full_like(q, float("nan"))  # every element must be written
    mtp_diverse_decode_attention(q, k, v, r2t, idx, seq, max_len, out=out, **kw)
    return out


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def lens_for(n):
    """0 (padded row), L = N + 1 exactly, lengths whose first visible length L - N falls at or before a split
    boundary (16, 32: one 16-key block per split under ``MANY_SPLITS``) while the last token's L falls after it (some
    tokens see a split, the others none), and a length of several blocks per split."""
    return [0, n + 1, 16 + 1, 32 + max(1, n // 2), 257]


SHAPES = [(64, 2, 2), (128, 6, 2), (256, 8, 1)]  # (head_dim, q_heads, kv_heads): groups 1, 3, 8


@pytest.mark.parametrize("n", [1, 2, 3, 4], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("head_dim, q_heads, kv_heads", SHAPES, ids=[f"d{d}-g{hq // hk}" for d, hq, hk in SHAPES])
def test_matches_reference(n, head_dim, q_heads, kv_heads):
    lens = lens_for(n)
    q, k, v, r2t, idx, seq = make_batch(len(lens), n + 1, q_heads, kv_heads, head_dim, lens, torch.float32, seed=n)
    out = run(q, k, v, r2t, idx, seq, 300, run_config=MANY_SPLITS)
    n_splits = num_splits(len(lens), kv_heads, 300, MANY_SPLITS["BLOCK_N"], MANY_SPLITS["WAVES"], q.device)
    for length in lens[2:4]:  # the boundary the test relies on: a split starts in [L - N, L)
        assert any(length - n <= lo < length for lo, hi in split_token_ranges(length, n_splits, 16) if lo < hi)
    ref = decode_attention_ref(q, k, v, r2t, idx, seq)
    assert not out.isnan().any(), "unwritten output"
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # the padded row


def test_min_blocks_two_merges_the_two_block_splits():
    """``MIN_BLOCKS`` 2 over a grid of one-block splits: a 3-token group straddles two-block splits (L = 33: keys 30-32,
    split 1 holds 32 alone) and every row still merges exactly the splits it sees."""
    cfg = {**MANY_SPLITS, "MIN_BLOCKS": 2}
    lens = [0, 4, 33, 65, 257]
    q, k, v, r2t, idx, seq = make_batch(len(lens), 3, 4, 2, 64, lens, torch.float32, seed=13)
    n_splits = num_splits(len(lens), 2, 300, 16, 8, q.device)
    assert split_token_ranges(33, n_splits, 16, 2)[:3] == [(0, 32), (32, 33), (33, 33)]
    assert split_token_ranges(33, n_splits, 16) != split_token_ranges(33, n_splits, 16, 2)
    out = run(q, k, v, r2t, idx, seq, 300, run_config=cfg)
    assert not out.isnan().any(), "unwritten output"
    torch.testing.assert_close(out.double(), decode_attention_ref(q, k, v, r2t, idx, seq), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cfg", [ONE_SPLIT, MANY_SPLITS], ids=["one-split", "many-splits"])
def test_fp16_and_a_graph_maximum_above_the_real_lengths(cfg):
    lens = [4, 200, 65]
    q, k, v, r2t, idx, seq = make_batch(3, 4, 6, 2, 128, lens, torch.float16, seed=7)
    out = run(q, k, v, r2t, idx, seq, 1024, run_config=cfg)
    torch.testing.assert_close(out.double(), decode_attention_ref(q, k, v, r2t, idx, seq), rtol=3e-3, atol=3e-3)


def test_tokens_that_see_no_key_get_zero():
    """A graph's padded rows hold length 1 (q_len 3): only the last token sees a key, so its output is that key's
    V; the tokens that see none get 0 (the reference has no softmax there). At length 2 only token 0 sees none."""
    q, k, v, r2t, idx, seq = make_batch(2, 3, 4, 2, 64, [1, 2], torch.float32, seed=5)
    out = run(q, k, v, r2t, idx, seq, 128, run_config=MANY_SPLITS)
    first_key = r2t[idx[0].long(), 0].long()
    torch.testing.assert_close(out[0, 2], v[first_key].repeat_interleave(2, dim=0))  # group 2: heads share V
    ref = decode_attention_ref(q, k, v, r2t, idx, seq)
    torch.testing.assert_close(out[1, 1:].double(), ref[1, 1:], rtol=1e-4, atol=1e-4)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2])) and torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))


def test_stage1_writes_zero_and_minus_inf_where_a_token_sees_none_of_a_split():
    """L = 65, N = 3, one 16-key block per split: split 4 holds key 64 alone, which only the last token sees."""
    q, k, v, r2t, idx, seq = make_batch(1, 4, 4, 2, 64, [65], torch.float32, seed=9)
    mid_o, mid_lse = mtp_diverse._stage1(q, k, v, r2t, idx, seq, 300, 0.125, MANY_SPLITS)
    assert split_token_ranges(65, mid_lse.shape[-1], 16)[:5] == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 65)]
    assert torch.equal(mid_lse[0, :3, :, 4], torch.full((3, 4), float("-inf")))
    assert torch.equal(mid_o[0, :3, :, 4], torch.zeros(3, 4, 64))
    assert mid_lse[0, 3, :, 4].isfinite().all() and mid_lse[0, :, :, :4].isfinite().all()


def test_q_len_one_is_plain_decode():
    lens = [70, 3]
    q, k, v, r2t, idx, seq = make_batch(2, 1, 4, 2, 64, lens, torch.float32, seed=2)
    out = run(q, k, v, r2t, idx, seq, 128, run_config=MANY_SPLITS)
    plain = flash_decode.gqa_decode_attention(q[:, 0], k, v, r2t, idx, seq, 128, run_config=MANY_SPLITS)
    torch.testing.assert_close(out[:, 0], plain, rtol=1e-5, atol=1e-5)


def test_bad_inputs_name_the_argument_and_the_allowed_values():
    q, k, v, r2t, idx, seq = make_batch(2, 3, 4, 2, 64, [3, 4], torch.float32)
    cases = [
        (dict(q=q[:, 0]), r"q expected a \[batch, q_len, q_heads, head_dim\] tensor .* got \(2, 4, 64\)"),
        (dict(q=q.to(torch.int32)), "q expected .* torch.int32"),
        (dict(q=torch.randn(2, 6, 4, 64)), r"q_len expected 1..5 \(mtp_step \+ 1\), got 6"),
        (
            dict(q=torch.randn(2, 3, 4, 96), k=torch.randn(8, 2, 96)),
            r"head_dim expected one of \(64, 128, 256\), got 96",
        ),
        (dict(k=k.half()), "k_cache expected .* torch.float32 tensor, got .* torch.float16"),
        (dict(v=v[:, :1]), "kv_heads expected"),
        (dict(q=torch.randn(2, 3, 18, 64), k=k[:, :1], v=v[:, :1]), r"kv_heads expected .* 1..8 x kv_heads, got 1"),
        (dict(r2t=r2t.long()), "req_to_token expected an int32"),
        (dict(seq=seq.long()), r"b_seq_len expected an int32 \[2\] tensor"),
        (dict(idx=idx[:1]), r"b_req_idx expected an int32 \[2\] tensor on cpu, got \(1,\)"),
        (dict(max_len=0), "max_len_in_batch expected a length >= 1, got 0"),
    ]
    for override, message in cases:
        a = {**dict(q=q, k=k, v=v, r2t=r2t, idx=idx, seq=seq, max_len=8), **override}
        with pytest.raises(ValueError, match="mtp diverse attention: " + message):
            mtp_diverse_decode_attention(a["q"], a["k"], a["v"], a["r2t"], a["idx"], a["seq"], a["max_len"])


def test_plan_checks_once_and_refuses_other_shapes():
    q, k, v, r2t, idx, seq = make_batch(2, 3, 4, 2, 64, [3, 90], torch.float32, pool=512)
    plan = MTPDiverseDecodePlan(q.shape, q.dtype, k, v, r2t, idx, seq, 128)
    ref = decode_attention_ref(q, k, v, r2t, idx, seq)
    for _ in range(2):  # two layers
        torch.testing.assert_close(plan.run(q, k, v).double(), ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"mtp diverse attention plan: q expected the planned \(2, 3, 4, 64\) "
                                         r"torch.float32, got \(2, 2, 4, 64\)"):  # fmt: skip
        plan.run(q[:, :2], k, v)
    with pytest.raises(ValueError, match=r"k_cache expected the planned \(512, 2, 64\) torch.float32, got "
                                         r"\(256, 2, 64\)"):  # fmt: skip
        plan.run(q, k[:256], v[:256])
    with pytest.raises(ValueError, match=r"out expected a \(2, 3, 4, 64\) torch.float32 tensor"):
        plan.run(q, k, v, out=torch.empty(2, 3, 4, 32))


def test_plan_reusing_outputs_shares_one_output_and_one_set_of_partials_across_layers():
    q, k, v, r2t, idx, seq = make_batch(2, 3, 4, 2, 64, [3, 90], torch.float32, pool=512)
    plan = MTPDiverseDecodePlan(q.shape, q.dtype, k, v, r2t, idx, seq, 128, reuse_outputs=True)
    first = plan.run(q, k, v)
    torch.testing.assert_close(first.double(), decode_attention_ref(q, k, v, r2t, idx, seq), rtol=1e-4, atol=1e-4)
    partials = {shape: tuple(t.data_ptr() for t in ts) for shape, ts in plan._scratch.items()}
    q2, k2, v2 = (torch.randn_like(t) for t in (q, k, v))  # the next layer: fresh data, same shapes
    second = plan.run(q2, k2, v2)
    assert second is first and len(partials) == 1
    assert {shape: tuple(t.data_ptr() for t in ts) for shape, ts in plan._scratch.items()} == partials
    torch.testing.assert_close(second.double(), decode_attention_ref(q2, k2, v2, r2t, idx, seq), rtol=1e-4, atol=1e-4)


# ---- tuning ---------------------------------------------------------------------------------------------


def named_args(q, k, v, r2t, idx, seq, max_len):
    out = torch.empty_like(q)
    return dict(q=q, k_cache=k, v_cache=v, req_to_token=r2t, b_req_idx=idx, b_seq_len=seq, max_len_in_batch=max_len,
                out=out, sm_scale=0.125)  # fmt: skip


def test_rebuild_is_every_group_at_the_tuning_lengths_over_the_same_pool(monkeypatch):
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "1024")
    q, k, v, r2t, idx, seq = make_batch(3, 4, 4, 2, 64, [5, 6, 9], torch.float32, pool=700)
    named = named_args(q, k, v, r2t, idx, seq, 2048)
    scenarios = mtp_diverse.representative_mtp_groups(named)
    assert [int(s["b_seq_len"][0]) for s in scenarios] == [1024, 512]  # the ladder, capped at nothing here
    table = scenarios[0]["req_to_token"]
    assert table.shape == (3, 1024) and table.dtype == torch.int32
    assert torch.equal(table.flatten().long(), torch.arange(3 * 1024) % 700)  # modulo over the existing pool
    for s in scenarios:
        assert s["k_cache"] is k and s["v_cache"] is v and s["q"] is q and s["req_to_token"] is table
        assert s["b_seq_len"].tolist() == [s["b_seq_len"][0]] * 3 and s["b_req_idx"].tolist() == [0, 1, 2]
        assert s["out"] is not named["out"] and s["out"].shape == q.shape and s["max_len_in_batch"] == 2048
    capped = mtp_diverse.representative_mtp_groups(named_args(q, k, v, r2t, idx, seq, 300))
    assert [int(s["b_seq_len"][0]) for s in capped] == [300]  # a graph serving 300 tokens tunes at 300


@pytest.mark.parametrize("env, max_len", [("3", 2048), ("1024", 3)], ids=["env", "launch-max"])
def test_rebuild_refuses_a_length_shorter_than_the_group(monkeypatch, env, max_len):
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", env)
    q, k, v, r2t, idx, seq = make_batch(2, 4, 4, 2, 64, [3, 3], torch.float32, pool=64)
    with pytest.raises(ValueError, match=r"representative KV length expected at least q_len = mtp_step \+ 1 = 4 "
                                         r".* got 3 \(LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN capped at "
                                         rf"max_len_in_batch = {max_len}\)"):  # fmt: skip
        mtp_diverse.representative_mtp_groups(named_args(q, k, v, r2t, idx, seq, max_len))


def test_search_times_representative_groups_over_the_existing_pool(monkeypatch):
    """Level 1 in the DECODE_ATTENTION scope: one search per key, every candidate timed at each tuning length over
    the caller's pool; the caller's tensors are untouched and its own output is right."""
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "512")
    tuned = mtp_diverse._launch_mtp_diverse_decode
    tuned.clear_cache()
    cfgs = [{"BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "WAVES": w} for w in (1, 8)]
    monkeypatch.setattr(tuned, "configs_gen_func", lambda q: cfgs)
    timed = []
    set_bench_func(lambda run_fn: timed.append(run_fn()) or 1.0)
    q, k, v, r2t, idx, seq = make_batch(2, 3, 4, 2, 64, [3, 70], torch.float32, pool=600)
    before = [t.clone() for t in (q, k, v, r2t, idx, seq)]
    launches = []
    real_launch = tuned.fn

    def spy(*args, **kwargs):
        named = tuned.named_arguments(args, kwargs)
        launches.append((named["k_cache"], named["req_to_token"], named["b_seq_len"], named["max_len_in_batch"]))
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(tuned, "fn", spy)
    try:
        with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
            outs = [run(q, k, v, r2t, idx, seq, 1024) for _ in range(2)]  # 2 layers, 1 key
        record = tuned.last_search
    finally:
        tuned.clear_cache()
    rebuilt = [c for c in launches if c[1] is not r2t]
    # the default and 2 candidates at the one tuning length (512, capped by nothing), each timed twice (the re-timing)
    assert len(timed) == 3 * 2
    assert record.run_key == (2, 512) and tuned.kernel_type == AutotuneKernelType.DECODE_ATTENTION
    assert all(c[0] is k and c[3] == 1024 and c[2].tolist() == [512, 512] for c in rebuilt)
    assert all(int(c[1].max()) < k.shape[0] for c in rebuilt)
    for t, b in zip((q, k, v, r2t, idx, seq), before):
        assert torch.equal(t, b)
    ref = decode_attention_ref(q, k, v, r2t, idx, seq)
    for out in outs:
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


def test_declared_as_a_decode_attention_kernel_keyed_like_plain_decode(monkeypatch):
    from lightllm.common.autotuner import tuner

    assert "mtp_diverse_decode" in tuner.kernel_names(AutotuneKernelType.DECODE_ATTENTION)
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "4096")
    q = torch.empty(16, 4, 24, 256, dtype=torch.bfloat16)
    k = torch.empty(8, 4, 256, dtype=torch.bfloat16)
    tuned = mtp_diverse._launch_mtp_diverse_decode
    assert tuned.run_key_func(q, 32768) == flash_decode.split_kv_run_key(q[:, 0], 32768) == (16, 4096)
    assert mtp_diverse._static_key(q, k) == {
        "group": 6,
        "head_dim": 256,
        "q_len": 4,
        "q_dtype": "torch.bfloat16",
        "kv_dtype": "torch.bfloat16",
    }
    assert tuned.configs_gen_func(q) == flash_decode.split_kv_configs(None)
    assert len(tuned.configs_gen_func(q)) == 24


# ---- the attention backend routes MTP verify on Triton here ---------------------------------------------


def verify_state(lens, q_len, req_to_token):
    tokens = torch.zeros(len(lens) * q_len, dtype=torch.long)
    return InferState(
        is_prefill=False,
        b_req_idx=torch.tensor([1, 0], dtype=torch.int32),
        req_to_token=req_to_token,
        b_seq_len=torch.tensor(lens, dtype=torch.int32),
        out_token_idx=tokens,
        positions=tokens,
        max_len_in_batch=max(lens),
        q_len=q_len,
    )


def test_triton_backend_runs_mtp_verify_through_the_diverse_plan(isolated_autotune):
    pool = make_pool("None", 128, 2, 2, 64, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(4)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    backend = AttentionBackend(pool, "triton", torch.device("cpu"))
    backend.on_gpu = True  # the GPU kernels, under the interpreter
    req_to_token = torch.randperm(128, generator=g)[:80].int().view(2, 40)
    state = verify_state([7, 33], 3, req_to_token)
    plan = backend.plan_decode(state, 4, torch.float32)
    assert isinstance(plan, MTPDiverseDecodePlan)
    for layer in range(2):
        q = torch.randn(2 * 3, 4, 64, generator=g)  # [batch * q_len, q_heads, D], as the layers pass it
        out = backend.decode(layer, q, state)
        ref = decode_attention_ref(q.view(2, 3, 4, 64), pool.k[layer], pool.v[layer], req_to_token, state.b_req_idx,
                                   state.b_seq_len)  # fmt: skip
        assert out.shape == q.shape
        torch.testing.assert_close(out.view(2, 3, 4, 64).double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_type, name", [("int8kv", "int8"), ("int4kv", "int4")])
def test_triton_backend_refuses_mtp_verify_over_quantized_kv(kv_type, name):
    pool = make_pool(kv_type, 128, 1, 2, 64, torch.float16, torch.device("cpu"))
    backend = AttentionBackend(pool, "triton", torch.device("cpu"))
    backend.on_gpu = True
    state = verify_state([7, 33], 4, torch.zeros(2, 40, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match=rf"reads bf16/fp16 KV, got {name} KV \(--llm_kv_type {kv_type}\)"):
        backend.plan_decode(state, 4, torch.float16)


# ---- GPU: Qwen3.5's full-attention shape ------------------------------------------------------------------


def qwen35_batch(batch, n, kv_len, seed):
    """d256, 24 q / 4 KV heads, bf16 on the GPU; ragged lengths in [N + 1, kv_len], the first at kv_len."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens = torch.randint(n + 1, kv_len + 1, (batch,), generator=g, device="cuda", dtype=torch.int32)
    lens[0] = kv_len
    pool = (batch + 1) * kv_len
    q = torch.randn(batch, n + 1, 24, 256, generator=g, device="cuda").bfloat16()
    k = torch.randn(pool, 4, 256, generator=g, device="cuda").bfloat16()
    v = torch.randn(pool, 4, 256, generator=g, device="cuda").bfloat16()
    r2t = torch.randperm(pool, generator=g, device="cuda").int().view(batch + 1, kv_len)
    idx = torch.randperm(batch + 1, generator=g, device="cuda")[:batch].int()
    return q, k, v, r2t, idx, lens


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 3], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.parametrize("kv_len", [1024, 8192], ids=["1K", "8K"])
def test_gpu_qwen35_shape_matches_reference_and_per_row_plain_decode(n, batch, kv_len):
    """Launched for a 32K graph; against the float64 reference (first eight requests: it loops in Python) and
    against the plain decode kernel run once per query token, token t at length L - N + t."""
    q, k, v, r2t, idx, seq = qwen35_batch(batch, n, kv_len, seed=batch + n)
    out = run(q, k, v, r2t, idx, seq, 32768)
    assert not out.isnan().any()
    check = min(batch, 8)
    ref = decode_attention_ref(q[:check], k, v, r2t, idx[:check], seq[:check])
    assert rel_err(out[:check], ref) < 1e-2
    for t in range(n + 1):
        plain = flash_decode.gqa_decode_attention(q[:, t].contiguous(), k, v, r2t, idx, seq - n + t, 32768)
        assert rel_err(out[:, t], plain) < 1e-2


@pytest.mark.gpu
def test_gpu_search_runs_once_per_key_at_representative_length(monkeypatch, isolated_autotune):
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    tuned = mtp_diverse._launch_mtp_diverse_decode
    tuned.clear_cache()
    q, k, v, r2t, idx, seq = qwen35_batch(16, 3, 64, seed=0)  # a graph's dummy batch: tiny real lengths
    before = [t.clone() for t in (q, k, v, r2t, idx, seq)]
    try:
        with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
            for _ in range(3):  # three layers of a graph serving up to 32K tokens, one key
                out = run(q, k, v, r2t, idx, seq, 32768)
        record = tuned.last_search
        assert record.run_key == (16, 32768) and len(record.default_ms) == 4
        assert len(record.timings) == len(flash_decode.split_kv_configs(q))
        assert len(list(isolated_autotune.rglob("*.json"))) == 1
    finally:
        tuned.clear_cache()
    for t, b in zip((q, k, v, r2t, idx, seq), before):
        assert torch.equal(t, b)
    assert rel_err(out, decode_attention_ref(q, k, v, r2t, idx, seq)) < 1e-2
