"""The fused per-layer kernels of the Qwen3 forward against their torch references: residual add + RMSNorm,
q/k norm + rotary over the fused qkv output, SiLU(gate) * up over the fused gate/up output.

Fresh random data per case, outputs NaN-filled so an unwritten element fails; float32 inputs are compared with
the references computed in float64, float16 inputs with the references' own float16 rounding steps (to about one
float16 ulp) and with float64 (loosely).
"""

import pytest
import torch

from lightllm.kernels.kv_cache_write import KVLayers
from lightllm.kernels.activation import SiluMulPlan, _launch_silu_mul, silu_mul, silu_mul_ref
from lightllm.kernels.norm.add_rmsnorm import AddRMSNormPlan, _launch_add_rmsnorm, add_rmsnorm, add_rmsnorm_ref
from lightllm.kernels.norm.qk_norm_rope import (
    QKNormRopePlan,
    _launch_qk_norm_rope,
    qk_norm_rope,
    qk_norm_rope_kv_ref,
    qk_norm_rope_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])


@pytest.fixture(autouse=True)
def fresh_tuner_state():
    for launcher in (_launch_add_rmsnorm, _launch_qk_norm_rope, _launch_silu_mul):
        launcher.clear_cache()
    yield


def _close(out, ref64, ref_same_dtype):
    assert not out.isnan().any(), "some output elements were never written"
    if out.dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref64, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref_same_dtype.float(), rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(out.double(), ref64, rtol=2e-2, atol=2e-2)


# ---- residual add + RMSNorm ----


@DTYPES
@pytest.mark.parametrize(
    "rows, n, config",
    [
        (1, 64, None),
        (5, 100, None),
        (3, 300, {"BLOCK_N": 512, "num_warps": 4}),  # one pass, masked tail
        (3, 300, {"BLOCK_N": 64, "num_warps": 1}),  # two chunked passes, ragged last chunk
        (0, 64, None),
    ],
    ids=["row1", "rows5-N100", "onepass", "twopass", "empty"],
)
def test_add_rmsnorm_matches_reference(dtype, rows, n, config):
    torch.manual_seed(rows * 1000 + n)
    residual = torch.randn(rows, n, dtype=dtype, device=DEVICE) * 2
    x = torch.randn(rows, n, dtype=dtype, device=DEVICE)
    w = torch.rand(n, dtype=dtype, device=DEVICE) + 0.5
    h64, h_same = residual.double(), residual.clone()
    ref64, ref_same = add_rmsnorm_ref(h64, x.double(), w.double()), add_rmsnorm_ref(h_same, x, w)
    out = torch.full_like(x, float("nan"))
    add_rmsnorm(residual, x, w, 1e-6, out=out, run_config=config)
    _close(out, ref64, ref_same)
    _close(residual, h64, h_same)  # the sum, written back in place
    assert torch.equal(residual, h_same)  # rounded once to the dtype, as h + x is


def test_add_rmsnorm_plan_checks_each_layer_and_bad_inputs():
    plan = AddRMSNormPlan((4, 64), torch.float32)
    w = torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match=r"add_rmsnorm plan: residual expected the planned \(4, 64\) torch.float32, "
                                         r"got \(5, 64\)"):  # fmt: skip
        plan.run(torch.zeros(5, 64, device=DEVICE), torch.zeros(5, 64, device=DEVICE), w)
    with pytest.raises(
        ValueError, match=r"x expected the planned \(4, 64\) torch.float32, got \(4, 64\) torch.float16"
    ):
        plan.run(torch.zeros(4, 64, device=DEVICE), torch.zeros(4, 64, device=DEVICE, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="contiguous last dim"):
        plan.run(torch.zeros(64, 4, device=DEVICE).t(), torch.zeros(4, 64, device=DEVICE), w)
    with pytest.raises(ValueError, match=r"add_rmsnorm: out expected a \(4, 64\) torch.float32"):
        plan.run(torch.zeros(4, 64, device=DEVICE), torch.zeros(4, 64, device=DEVICE), w, out=torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"residual expected a \[rows, N\] tensor of .*, got \(2, 3, 4\)"):
        AddRMSNormPlan((2, 3, 4), torch.float32)
    with pytest.raises(ValueError, match=r"add_rmsnorm: residual expected \[rows, N\], got shape \(8,\)"):
        add_rmsnorm(torch.zeros(8), torch.zeros(8), torch.ones(8))


# ---- q/k RMSNorm + rotary over the fused qkv output ----


def _tables(positions, d, dtype, theta=10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)


@DTYPES
@pytest.mark.parametrize(
    "tokens, q_heads, kv_heads, d, config",
    [
        (1, 4, 2, 16, None),
        (5, 4, 2, 32, {"BLOCK_H": 4, "num_warps": 2}),  # one block of q heads, one of k heads
        (3, 6, 2, 16, {"BLOCK_H": 4, "num_warps": 1}),  # blocks straddle q and k heads, masked last block
        (4, 2, 1, 24, {"BLOCK_H": 1, "num_warps": 1}),  # head_dim not a power of two
        (0, 4, 2, 16, None),
    ],
    ids=["tok1", "tok5", "straddle", "d24", "empty"],
)
def test_qk_norm_rope_matches_reference(dtype, tokens, q_heads, kv_heads, d, config):
    torch.manual_seed(tokens * 100 + q_heads * 10 + d)
    width = (q_heads + 2 * kv_heads) * d
    qkv = torch.randn(tokens, width, dtype=dtype, device=DEVICE) * 3
    qw = torch.rand(d, dtype=dtype, device=DEVICE) + 0.5
    kw = torch.rand(d, dtype=dtype, device=DEVICE) + 0.5
    cos, sin = _tables(64, d, dtype)
    positions = torch.randint(0, 64, (tokens,), dtype=torch.int32, device=DEVICE)
    before = qkv.clone()
    q, k = qk_norm_rope(qkv, qw, kw, cos, sin, positions, q_heads, kv_heads, 1e-6, run_config=config)
    gathered = lambda table: table[positions.long()][:, None, :]  # noqa: E731
    q64, k64 = qk_norm_rope_ref(qkv.double(), qw.double(), kw.double(), gathered(cos).double(),
                                gathered(sin).double(), q_heads, kv_heads)  # fmt: skip
    q_same, k_same = qk_norm_rope_ref(qkv, qw, kw, gathered(cos), gathered(sin), q_heads, kv_heads)
    assert q.shape == (tokens, q_heads, d) and k.shape == (tokens, kv_heads, d)
    _close(q, q64, q_same)
    _close(k, k64, k_same)
    assert torch.equal(qkv, before)  # read only, v included


def test_qk_norm_rope_outputs_are_prefilled_nan_and_all_written(monkeypatch):
    """The plan allocates q and k itself; a NaN-filling allocator proves every element is written."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    cos, sin = _tables(16, 16, torch.float32)
    qkv = torch.randn(3, 8 * 16, device=DEVICE)
    ones, positions = torch.ones(16, device=DEVICE), torch.tensor([0, 5, 15], device=DEVICE)
    q, k = qk_norm_rope(qkv, ones, ones, cos, sin, positions, 4, 2, run_config={"BLOCK_H": 4, "num_warps": 1})
    assert not q.isnan().any() and not k.isnan().any()


def test_qk_norm_rope_bad_inputs():
    cos, sin = _tables(16, 16, torch.float32)
    pos = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"cos and sin expected \[positions, R\] torch.float32 with R even in \[2, "
                                         r"head_dim 8\], got \(16, 16\)"):  # fmt: skip
        QKNormRopePlan(3, 4, 2, 8, torch.float32, cos, sin, pos)  # more rotary dims than the head has
    with pytest.raises(ValueError, match=r"positions expected an int32/int64 \[4\] tensor, got \(3,\)"):
        QKNormRopePlan(4, 4, 2, 16, torch.float32, cos, sin, pos)
    with pytest.raises(ValueError, match="an even head_dim, got 4, 2, 15"):
        QKNormRopePlan(3, 4, 2, 15, torch.float32, cos, sin, pos)
    with pytest.raises(ValueError, match="dtype expected one of"):
        QKNormRopePlan(3, 4, 2, 16, torch.int8, cos, sin, pos)
    plan = QKNormRopePlan(3, 4, 2, 16, torch.float32, cos, sin, pos)
    w = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match=r"qk_norm_rope plan: qkv expected the planned \(3, 128\) torch.float32, "
                                         r"got \(3, 112\)"):  # fmt: skip
        plan.run(torch.zeros(3, 112, device=DEVICE), w, w)
    with pytest.raises(ValueError, match=r"k_weight expected the planned \(16,\) torch.float32, got \(8,\)"):
        plan.run(torch.zeros(3, 128, device=DEVICE), w, torch.ones(8, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous last dim"):
        plan.run(torch.zeros(128, 3, device=DEVICE).t(), w, w)


@DTYPES
@pytest.mark.parametrize(
    "tokens, q_heads, kv_heads, d, gated, config",
    [
        (1, 4, 2, 16, False, None),
        (5, 6, 2, 16, False, {"BLOCK_H": 4, "num_warps": 1}),  # blocks straddle q and k heads
        (3, 2, 1, 24, False, {"BLOCK_H": 1, "num_warps": 1}),  # head_dim not a power of two
        (4, 4, 2, 16, True, {"BLOCK_H": 2, "num_warps": 1}),  # gated q heads: v starts after the wider q
        (0, 4, 2, 16, False, None),
    ],
    ids=["tok1", "straddle", "d24", "gated", "empty"],
)
def test_qk_norm_rope_writes_the_kv_cache_in_the_same_launch(dtype, tokens, q_heads, kv_heads, d, gated, config):
    """With ``kv_layers``, each token's k (as returned) and v go to its slot of the run's layer, bit for bit what
    the separate KV write stores; q and k as without; every other slot and layer untouched."""
    torch.manual_seed(7 * tokens + d + gated)
    layers, slots = 3, 20
    qkv = torch.randn(tokens, ((2 if gated else 1) * q_heads + 2 * kv_heads) * d, dtype=dtype, device=DEVICE) * 3
    qw, kw = (torch.rand(d, dtype=dtype, device=DEVICE) + 0.5 for _ in range(2))
    cos, sin = _tables(64, d, dtype)
    positions = torch.randint(0, 64, (tokens,), device=DEVICE)
    token_idx = torch.randperm(slots, device=DEVICE)[:tokens].to(torch.int32)
    k_pool = torch.full((layers, slots, kv_heads, d), float("nan"), dtype=dtype, device=DEVICE)
    v_pool = torch.full_like(k_pool, float("nan"))
    plan = QKNormRopePlan(tokens, q_heads, kv_heads, d, dtype, cos, sin, positions, run_config=config, gated=gated,
                          kv_layers=KVLayers(k_pool, v_pool), token_idx=token_idx)  # fmt: skip
    q, k = plan.run(qkv, qw, kw, layer=1)
    gathered = lambda table: table[positions][:, None, :]  # noqa: E731
    k_ref, v_ref = torch.full_like(k_pool[1], float("nan")), torch.full_like(v_pool[1], float("nan"))
    q_same, k_same = qk_norm_rope_kv_ref(qkv, qw, kw, gathered(cos), gathered(sin), q_heads, kv_heads, k_ref, v_ref,
                                         token_idx, gated=gated)  # fmt: skip
    q64, k64 = qk_norm_rope_ref(qkv.double(), qw.double(), kw.double(), gathered(cos).double(),
                                gathered(sin).double(), q_heads, kv_heads, gated=gated)  # fmt: skip
    _close(q, q64, q_same)
    _close(k, k64, k_same)
    written = token_idx.long()
    assert torch.equal(k_pool[1][written], k) and torch.equal(v_pool[1][written], v_ref[written])
    assert torch.equal(v_pool[1][written], qkv[:, qkv.shape[1] - kv_heads * d :].reshape(tokens, kv_heads, d))
    others = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    others[written] = False
    assert k_pool[1][others].isnan().all() and v_pool[1][others].isnan().all()
    assert k_pool[[0, 2]].isnan().all() and v_pool[[0, 2]].isnan().all()


def test_qk_norm_rope_kv_write_checks():
    cos, sin = _tables(16, 16, torch.float32)
    pos, idx = torch.zeros(3, dtype=torch.int32, device=DEVICE), torch.arange(3, device=DEVICE)
    pool = torch.zeros(2, 8, 2, 16, device=DEVICE)
    layers = KVLayers(pool, pool.clone())
    with pytest.raises(ValueError, match="kv_layers and token_idx expected together, got only kv_layers"):
        QKNormRopePlan(3, 4, 2, 16, torch.float32, cos, sin, pos, kv_layers=layers)
    with pytest.raises(ValueError, match=r"kv_layers expected kv_heads, head_dim, dtype \(4, 16, torch.float32\), got "
                                         r"\(2, 16, torch.float32\)"):  # fmt: skip
        QKNormRopePlan(3, 4, 4, 16, torch.float32, cos, sin, pos, kv_layers=layers, token_idx=idx)
    with pytest.raises(ValueError, match=r"token_idx expected a contiguous int32/int64 \[3\] tensor on \S+, got \(2,\) "
                                         r"torch.int64"):  # fmt: skip
        QKNormRopePlan(3, 4, 2, 16, torch.float32, cos, sin, pos, kv_layers=layers, token_idx=idx[:2])
    plan = QKNormRopePlan(3, 4, 2, 16, torch.float32, cos, sin, pos, kv_layers=layers, token_idx=idx)
    qkv, w = torch.zeros(3, 128, device=DEVICE), torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="layer expected with kv_layers .and only then., got layer None with "
                                         "kv_layers set"):  # fmt: skip
        plan.run(qkv, w, w)
    with pytest.raises(ValueError, match="got layer 0 with kv_layers None"):
        QKNormRopePlan(3, 4, 2, 16, torch.float32, cos, sin, pos).run(qkv, w, w, 0)
    with pytest.raises(ValueError, match=r"k_pool expected a contiguous \[num_layers, num_tokens, kv_heads, head_dim\] "
                                         r"tensor of .*, got torch.float32 \(8, 2, 16\)"):  # fmt: skip
        KVLayers(pool[0], pool[0])
    with pytest.raises(ValueError, match=r"v_pool expected k_pool's torch.float32 \(2, 8, 2, 16\) on \S+, got "
                                         r"torch.float16"):  # fmt: skip
        KVLayers(pool, pool.half())


# ---- SiLU(gate) * up over the fused gate/up output ----


@DTYPES
@pytest.mark.parametrize(
    "rows, n, config",
    [
        (1, 64, None),
        (5, 100, None),
        (3, 300, {"BLOCK_N": 128, "num_warps": 1}),  # several column blocks, ragged last one
        (0, 64, None),
    ],
    ids=["row1", "rows5-N100", "blocks", "empty"],
)
def test_silu_mul_matches_reference(dtype, rows, n, config):
    torch.manual_seed(rows * 1000 + n)
    gate_up = torch.randn(rows, 2 * n, dtype=dtype, device=DEVICE) * 4
    out = torch.full((rows, n), float("nan"), dtype=dtype, device=DEVICE)
    silu_mul(gate_up, out=out, run_config=config)
    _close(out, silu_mul_ref(gate_up.double()), silu_mul_ref(gate_up))


def test_silu_mul_plan_checks():
    plan = SiluMulPlan(4, 32, torch.float32)
    with pytest.raises(ValueError, match=r"silu_mul plan: gate_up expected the planned \(4, 64\) torch.float32, "
                                         r"got \(4, 62\)"):  # fmt: skip
        plan.run(torch.zeros(4, 62, device=DEVICE))
    with pytest.raises(ValueError, match=r"silu_mul: out expected a \(4, 32\) torch.float32"):
        plan.run(torch.zeros(4, 64, device=DEVICE), out=torch.zeros(4, 64, device=DEVICE))
    with pytest.raises(ValueError, match=r"silu_mul: gate_up expected \[rows, 2 \* I\], got shape \(4, 7\)"):
        silu_mul(torch.zeros(4, 7, device=DEVICE))


@pytest.mark.parametrize("kernel", ["add_rmsnorm", "qk_norm_rope", "silu_mul"])
def test_each_candidate_compiles_and_passes_the_accuracy_gate(kernel, monkeypatch):
    """Level 1 in the GENERAL warmup: every candidate config runs the real kernel (interpreted here) and the tuner's
    accuracy gate compares it with the default; none is rejected, and the result still matches the reference."""
    from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, get_autotune_stats

    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    torch.manual_seed(7)
    before = get_autotune_stats()
    with autotune_warmup(AutotuneKernelType.GENERAL):
        if kernel == "add_rmsnorm":
            residual, x, w = (
                torch.randn(3, 64, device=DEVICE),
                torch.randn(3, 64, device=DEVICE),
                torch.rand(64, device=DEVICE),
            )
            h = residual.double()
            ref = add_rmsnorm_ref(h, x.double(), w.double())
            out = add_rmsnorm(residual, x, w)
            torch.testing.assert_close(residual.double(), h)  # added once, whatever the search ran
        elif kernel == "qk_norm_rope":
            cos, sin = _tables(8, 16, torch.float32)
            qkv, qw, kw = (
                torch.randn(2, 8 * 16, device=DEVICE),
                torch.rand(16, device=DEVICE) + 0.5,
                torch.rand(16, device=DEVICE) + 0.5,
            )
            pos = torch.tensor([3, 7], device=DEVICE)
            out = torch.cat(qk_norm_rope(qkv, qw, kw, cos, sin, pos, 4, 2), dim=1)
            g = lambda t: t[pos][:, None, :].double()  # noqa: E731
            ref = torch.cat(qk_norm_rope_ref(qkv.double(), qw.double(), kw.double(), g(cos), g(sin), 4, 2), dim=1)
        else:
            gate_up = torch.randn(3, 2 * 300, device=DEVICE)
            ref, out = silu_mul_ref(gate_up.double()), silu_mul(gate_up)
    done = get_autotune_stats() - before
    assert done.searches == 1 and done.candidates_timed > 1 and done.candidates_rejected == 0
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


# ---- on the GPU, at Qwen3-8B's widths in bfloat16 ----

Q8B = dict(hidden=4096, q_heads=32, kv_heads=8, head_dim=128, intermediate=12288)


def _close_bf16(out, ref_same_dtype, ref64):
    """Within two bfloat16 rounding steps of the same-dtype reference (the float32 norm's last bit may differ, and
    rotary rounds twice more) and within bfloat16's error of the float64 math."""
    assert not out.isnan().any(), "some output elements were never written"
    torch.testing.assert_close(out.float(), ref_same_dtype.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), ref64, rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 128, 4096])
def test_gpu_8b_shapes_match_references(tokens):
    torch.manual_seed(tokens)
    bf16, dev, s = torch.bfloat16, "cuda", Q8B
    # residual add + RMSNorm over the hidden states
    residual = torch.randn(tokens, s["hidden"], dtype=bf16, device=dev) * 4
    x = torch.randn(tokens, s["hidden"], dtype=bf16, device=dev)
    w = (torch.rand(s["hidden"], device=dev) + 0.5).to(bf16)
    h64, h_same = residual.double(), residual.clone()
    ref64, ref_same = add_rmsnorm_ref(h64, x.double(), w.double()), add_rmsnorm_ref(h_same, x, w)
    out = add_rmsnorm(residual, x, w)
    assert torch.equal(residual, h_same)
    _close_bf16(out, ref_same, ref64)
    # q/k norm + rotary over the fused qkv output, positions up to 40960
    d, qh, kvh = s["head_dim"], s["q_heads"], s["kv_heads"]
    qkv = torch.randn(tokens, (qh + 2 * kvh) * d, dtype=bf16, device=dev) * 3
    qw, kw = ((torch.rand(d, device=dev) + 0.5).to(bf16) for _ in range(2))
    cos, sin = _tables(40960, d, bf16, theta=1e6)
    cos, sin = cos.to(dev), sin.to(dev)
    pos = torch.randint(0, 40960, (tokens,), device=dev)
    q, k = qk_norm_rope(qkv, qw, kw, cos, sin, pos, qh, kvh)
    g = lambda t: t[pos][:, None, :]  # noqa: E731
    q_same, k_same = qk_norm_rope_ref(qkv, qw, kw, g(cos), g(sin), qh, kvh)
    q64, k64 = qk_norm_rope_ref(qkv.double(), qw.double(), kw.double(), g(cos).double(), g(sin).double(), qh, kvh)
    _close_bf16(q, q_same, q64)
    _close_bf16(k, k_same, k64)
    # SiLU(gate) * up over the fused gate/up output
    gate_up = torch.randn(tokens, 2 * s["intermediate"], dtype=bf16, device=dev) * 4
    _close_bf16(silu_mul(gate_up), silu_mul_ref(gate_up), silu_mul_ref(gate_up.double()))
