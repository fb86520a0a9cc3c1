"""The fused per-layer kernels of the Qwen3.5 forward against transformers' own modules and float64 math:
zero-centred RMSNorm (with and without the residual add), q/k norm + partial rotary over the gated qkv output (and
the KV cache write in the same launch), the attention output gate, the gated RMSNorm of the DeltaNet output.

Fresh random data per case, outputs NaN-filled so an unwritten element fails. float16 inputs are compared with
transformers' modules run in float16: the kernels take the same float32 steps and roundings, so nearly every element
is bit-equal (a different rounding order differs in about a third of them); float32 inputs with float64 math.
"""

import pytest
import torch
import torch.nn.functional as F

from lightllm.kernels.gates import SigmoidGatePlan, _launch_sigmoid_gate_mul, sigmoid_gate_mul, sigmoid_gate_mul_ref
from lightllm.kernels.norm.add_rmsnorm import _launch_add_rmsnorm, add_rmsnorm
from lightllm.kernels.norm.gated_rmsnorm import (
    GatedRMSNormPlan,
    _launch_gated_rmsnorm,
    gated_rmsnorm,
    gated_rmsnorm_ref,
)
from lightllm.kernels.kv_cache_write import KVLayers
from lightllm.kernels.norm.qk_norm_rope import (
    QKNormRopePlan,
    _launch_qk_norm_rope,
    qk_norm_rope,
    qk_norm_rope_kv_ref,
    qk_norm_rope_ref,
)
from lightllm.kernels.norm.rmsnorm import _launch_rmsnorm, rmsnorm

transformers_qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
EPS = 1e-6


@pytest.fixture(autouse=True)
def nan_filled_empty(monkeypatch):
    """Every ``torch.empty`` starts NaN (the kernels allocate their outputs with it): an unwritten element fails."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture(autouse=True)
def fresh_tuner_state():
    for launcher in (_launch_rmsnorm, _launch_add_rmsnorm, _launch_qk_norm_rope, _launch_sigmoid_gate_mul,
                     _launch_gated_rmsnorm):  # fmt: skip
        launcher.clear_cache()
    yield


def _hf_norm(x, zero_centred_w):
    """transformers' ``Qwen3_5RMSNorm`` (weight ``w``, scale ``1 + w``) in x's dtype."""
    norm = transformers_qwen3_5.Qwen3_5RMSNorm(x.shape[-1], EPS).to(x.device)
    norm.weight.data = zero_centred_w.float()
    with torch.no_grad():
        return norm(x)


def _norm64(x, scale):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * scale.double()


def _matches(out, oracle, ref64):
    """fp32: float64 math to float32 rounding. fp16: transformers' same-dtype module bit for bit in >= 99% of the
    elements (the last float32 bit of rsqrt may differ), within one float16 step in the rest."""
    assert not out.isnan().any(), "some output elements were never written"
    if out.dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref64, rtol=1e-5, atol=1e-5)
        return
    assert (out != oracle).float().mean().item() <= 0.01
    torch.testing.assert_close(out.float(), oracle.float(), rtol=1e-3, atol=1e-3)


# ---- zero-centred RMSNorm: a float32 ``1 + w`` scales before the cast ----


@DTYPES
@pytest.mark.parametrize("rows, n, config", [(5, 100, None), (3, 300, {"BLOCK_N": 64, "num_warps": 1})],
                         ids=["onepass", "twopass"])  # fmt: skip
def test_zero_centred_norms_match_transformers(dtype, rows, n, config):
    torch.manual_seed(rows * 1000 + n)
    h = torch.randn(rows, n, dtype=dtype, device=DEVICE) * 3
    x = torch.randn(rows, n, dtype=dtype, device=DEVICE)
    w = torch.randn(n, device=DEVICE) * 0.3  # transformers' zero-centred weight
    scale = 1 + w  # what the loader keeps: float32
    out = torch.full_like(h, float("nan"))
    rmsnorm(h, scale, EPS, out=out, run_config=config)
    _matches(out, _hf_norm(h, w), _norm64(h, scale))
    residual, summed = h.clone(), h + x
    out = torch.full_like(h, float("nan"))
    add_rmsnorm(residual, x, scale, EPS, out=out, run_config=config)
    assert torch.equal(residual, summed)  # the sum rounded once, written back
    _matches(out, _hf_norm(summed, w), _norm64(summed, scale))


# ---- q/k norm + partial rotary over the gated qkv output ----


def _tables(positions, rot, dtype, theta=10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    freqs = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)


def _rope64(x, cos, sin):
    rot, half = cos.shape[-1], cos.shape[-1] // 2
    r = x[..., :rot]
    turned = torch.cat((-r[..., half:], r[..., :half]), dim=-1)
    return torch.cat((r * cos + turned * sin, x[..., rot:]), dim=-1)


@DTYPES
@pytest.mark.parametrize(
    "tokens, heads, kv_heads, d, rot, config",
    [
        (1, 4, 2, 16, 4, None),  # Qwen3.5's partial_rotary_factor 0.25
        (5, 6, 2, 16, 8, {"BLOCK_H": 4, "num_warps": 1}),  # blocks straddle q and k heads
        (3, 2, 1, 24, 24, {"BLOCK_H": 1, "num_warps": 2}),  # full rotary, head_dim not a power of two
    ],
    ids=["quarter", "straddle", "full-d24"],
)
def test_gated_qk_norm_partial_rope_matches_transformers(dtype, tokens, heads, kv_heads, d, rot, config):
    torch.manual_seed(tokens * 100 + heads * 10 + d)
    qkv = torch.randn(tokens, (2 * heads + 2 * kv_heads) * d, dtype=dtype, device=DEVICE) * 3
    wq, wk = torch.randn(d, device=DEVICE) * 0.3, torch.randn(d, device=DEVICE) * 0.3
    cos, sin = _tables(64, rot, dtype)
    positions = torch.randint(0, 64, (tokens,), device=DEVICE)
    before = qkv.clone()
    q, k = qk_norm_rope(qkv, 1 + wq, 1 + wk, cos, sin, positions, heads, kv_heads, EPS, config, gated=True)
    assert q.shape == (tokens, heads, d) and k.shape == (tokens, kv_heads, d)
    assert torch.equal(qkv, before)  # read only: the gate and v columns included

    q_in = qkv[:, : 2 * heads * d].view(tokens, heads, 2 * d)[..., :d]  # each q head is [query | gate]
    k_in = qkv[:, 2 * heads * d : (2 * heads + kv_heads) * d].view(tokens, kv_heads, d)
    c, s = cos[positions][:, None], sin[positions][:, None]
    hf_q, hf_k = transformers_qwen3_5.apply_rotary_pos_emb(_hf_norm(q_in, wq), _hf_norm(k_in, wk), cos[positions],
                                                           sin[positions])  # fmt: skip
    c64, s64 = c.double(), s.double()
    _matches(q, hf_q, _rope64(_norm64(q_in, 1 + wq), c64, s64))
    _matches(k, hf_k, _rope64(_norm64(k_in, 1 + wk), c64, s64))
    ref_q, ref_k = qk_norm_rope_ref(qkv, 1 + wq, 1 + wk, c, s, heads, kv_heads, EPS, gated=True)
    _matches(q, ref_q, _rope64(_norm64(q_in, 1 + wq), c64, s64))  # the CPU path's reference agrees too
    _matches(k, ref_k, _rope64(_norm64(k_in, 1 + wk), c64, s64))


def _kv_write_case(dtype, tokens, heads, kv_heads, d, rot, device, positions_max=64, theta=10000.0):
    """Fresh random gated qkv, float32 ``1 + w`` norm weights, partial tables, distinct slots and NaN-filled caches of
    3 layers x 20 slots (at least ``tokens``)."""
    qkv = torch.randn(tokens, (2 * heads + 2 * kv_heads) * d, dtype=dtype, device=device) * 3
    wq, wk = 1 + torch.randn(d, device=device) * 0.3, 1 + torch.randn(d, device=device) * 0.3
    cos, sin = _tables(positions_max, rot, dtype, theta)
    positions = torch.randint(0, positions_max, (tokens,), device=device)
    slots = max(20, 2 * tokens)
    token_idx = torch.randperm(slots, device=device)[:tokens].to(torch.int32)
    k_pool = torch.full((3, slots, kv_heads, d), float("nan"), dtype=dtype, device=device)
    return (
        qkv,
        wq,
        wk,
        cos.to(device),
        sin.to(device),
        positions,
        token_idx,
        k_pool,
        torch.full_like(k_pool, float("nan")),
    )


def _check_kv_written(q, k, k_pool, v_pool, layer, qkv, token_idx, plain_q, plain_k, kv_heads):
    """q and k bit for bit those of the launch without the write; the run's layer holds at each token's slot that k
    (normed, partially rotated) and qkv's raw v heads (after the wider gated q heads and the k heads); every other
    slot and layer still NaN."""
    tokens, d = q.shape[0], q.shape[-1]
    assert torch.equal(q, plain_q) and torch.equal(k, plain_k)
    written = token_idx.long()
    raw_v = qkv[:, qkv.shape[1] - kv_heads * d :].reshape(tokens, kv_heads, d)
    assert torch.equal(k_pool[layer][written], k) and torch.equal(v_pool[layer][written], raw_v)
    others = torch.ones(k_pool.shape[1], dtype=torch.bool, device=k_pool.device)
    others[written] = False
    assert k_pool[layer][others].isnan().all() and v_pool[layer][others].isnan().all()
    rest = [i for i in range(k_pool.shape[0]) if i != layer]
    assert k_pool[rest].isnan().all() and v_pool[rest].isnan().all()


@DTYPES
@pytest.mark.parametrize(
    "tokens, heads, kv_heads, d, rot, config",
    [
        (1, 4, 2, 16, 4, None),  # Qwen3.5's partial_rotary_factor 0.25
        (5, 6, 2, 16, 8, {"BLOCK_H": 4, "num_warps": 1}),  # blocks straddle q and k heads
        (4, 6, 1, 32, 8, {"BLOCK_H": 1, "num_warps": 1}),  # 27B's 6 q heads per KV head, one head per program
    ],
    ids=["quarter", "straddle", "gqa6"],
)
def test_gated_partial_rope_writes_the_kv_cache_in_the_same_launch(dtype, tokens, heads, kv_heads, d, rot, config):
    """Qwen3.5's gated attention with a float KV cache: the q/k norm + partial rotary launch also writes each token's
    K (as it returns it) and V (raw) into its slot of the run's layer; equal to ``qk_norm_rope_kv_ref`` (transformers'
    rounding steps) and to float64 math."""
    torch.manual_seed(tokens * 100 + heads * 10 + d)
    case = _kv_write_case(dtype, tokens, heads, kv_heads, d, rot, DEVICE)
    qkv, wq, wk, cos, sin, positions, token_idx, k_pool, v_pool = case
    before = qkv.clone()
    plan = QKNormRopePlan(tokens, heads, kv_heads, d, dtype, cos, sin, positions, EPS, run_config=config, gated=True,
                          weight_dtype=torch.float32, kv_layers=KVLayers(k_pool, v_pool),
                          token_idx=token_idx)  # fmt: skip
    q, k = plan.run(qkv, wq, wk, layer=1)
    assert torch.equal(qkv, before)  # read only
    plain_q, plain_k = qk_norm_rope(qkv, wq, wk, cos, sin, positions, heads, kv_heads, EPS, config, gated=True)
    _check_kv_written(q, k, k_pool, v_pool, 1, qkv, token_idx, plain_q, plain_k, kv_heads)

    c, s = cos[positions][:, None], sin[positions][:, None]
    k_ref, v_ref = (torch.full_like(k_pool[1], float("nan")) for _ in range(2))
    ref_q, ref_k = qk_norm_rope_kv_ref(qkv, wq, wk, c, s, heads, kv_heads, k_ref, v_ref, token_idx, EPS, gated=True)
    q_in = qkv[:, : 2 * heads * d].view(tokens, heads, 2 * d)[..., :d]
    k_in = qkv[:, 2 * heads * d : (2 * heads + kv_heads) * d].view(tokens, kv_heads, d)
    c64, s64 = c.double(), s.double()
    k64 = _rope64(_norm64(k_in, wk), c64, s64)
    _matches(q, ref_q, _rope64(_norm64(q_in, wq), c64, s64))
    _matches(k, ref_k, k64)
    written = token_idx.long()
    _matches(k_pool[1][written], k_ref[written], k64)  # the reference's cache holds what the kernel's does
    assert torch.equal(v_pool[1][written], v_ref[written])


def test_gated_qk_norm_rope_plan_checks():
    cos, sin = _tables(16, 4, torch.float32)
    pos = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    plan = QKNormRopePlan(3, 4, 2, 16, torch.float32, cos, sin, pos, gated=True)
    w = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match=r"qkv expected the planned \(3, 192\) torch.float32, got \(3, 128\)"):
        plan.run(torch.zeros(3, 128, device=DEVICE), w, w)  # the ungated width
    with pytest.raises(ValueError, match=r"cos and sin expected \[positions, R\] .* R even .* got \(16, 3\)"):
        QKNormRopePlan(3, 4, 2, 16, torch.float32, cos[:, :3], sin[:, :3], pos, gated=True)


# ---- the attention output gate: o * sigmoid(gate), the gate read in place ----


@DTYPES
@pytest.mark.parametrize("rows, heads, d, config", [(1, 4, 16, None), (5, 6, 24, {"BLOCK_H": 4, "num_warps": 1})],
                         ids=["row1", "masked"])  # fmt: skip
def test_sigmoid_gate_mul_reads_the_gate_in_place(dtype, rows, heads, d, config):
    torch.manual_seed(rows * 10 + heads)
    qkv = torch.randn(rows, (2 * heads + 2) * d, dtype=dtype, device=DEVICE) * 4
    gate = qkv[:, : 2 * heads * d].view(rows, heads, 2 * d)[..., d:]
    o = torch.randn(rows, heads, d, dtype=dtype, device=DEVICE)
    out = sigmoid_gate_mul(o, gate, run_config=config)
    assert out.shape == (rows, heads, d) and out.is_contiguous()
    _matches(out, o * torch.sigmoid(gate), o.double() * torch.sigmoid(gate.double()))
    _matches(out, sigmoid_gate_mul_ref(o, gate), o.double() * torch.sigmoid(gate.double()))


def test_sigmoid_gate_plan_checks():
    plan = SigmoidGatePlan(3, 4, 16, torch.float32)
    o = torch.zeros(3, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"sigmoid_gate_mul plan: gate expected the planned \(3, 4, 16\) "
                                         r"torch.float32, got \(3, 4, 8\)"):  # fmt: skip
        plan.run(o, torch.zeros(3, 4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous last dim"):
        plan.run(o, torch.zeros(3, 16, 4, device=DEVICE).transpose(1, 2))
    with pytest.raises(ValueError, match=r"sigmoid_gate_mul: o expected \[rows, heads, D\], got shape \(3, 64\)"):
        sigmoid_gate_mul(torch.zeros(3, 64), torch.zeros(3, 64))


# ---- the gated RMSNorm: weight * norm(x) * silu(z), z read in place ----


def _gated64(x, z, w):
    x, z = x.double(), z.double()
    return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * F.silu(z)


@DTYPES
@pytest.mark.parametrize("rows, heads, d, config", [(1, 4, 8, None), (5, 6, 24, {"BLOCK_H": 4, "num_warps": 2})],
                         ids=["row1", "masked"])  # fmt: skip
def test_gated_rmsnorm_matches_transformers(dtype, rows, heads, d, config):
    torch.manual_seed(rows * 10 + heads + d)
    proj = torch.randn(rows, 3 * heads * d + 2 * heads, dtype=dtype, device=DEVICE) * 3
    z = proj[:, heads * d : 2 * heads * d].view(rows, heads, d)  # as the model reads it from in_proj's output
    x = torch.randn(rows, heads, d, dtype=dtype, device=DEVICE)
    w = (torch.rand(d, device=DEVICE) + 0.5).to(dtype)
    before = proj.clone()
    out = gated_rmsnorm(x, z, w, EPS, run_config=config)
    assert out.shape == (rows, heads, d) and out.is_contiguous() and torch.equal(proj, before)
    hf = transformers_qwen3_5.Qwen3_5RMSNormGated(d, EPS).to(DEVICE)
    hf.weight.data = w
    with torch.no_grad():
        oracle = hf(x, z)
    _matches(out, oracle, _gated64(x, z, w))
    _matches(out, gated_rmsnorm_ref(x, z, w, EPS), _gated64(x, z, w))


def test_gated_rmsnorm_plan_checks():
    plan = GatedRMSNormPlan(2, 4, 8, torch.float32)
    x, w = torch.zeros(2, 4, 8, device=DEVICE), torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match=r"gated_rmsnorm plan: weight expected the planned \(8,\) torch.float32, "
                                         r"got \(4,\)"):  # fmt: skip
        plan.run(x, x, torch.ones(4, device=DEVICE))
    with pytest.raises(ValueError, match=r"z expected the planned \(2, 4, 8\) torch.float32, got \(2, 4, 8\) "
                                         r"torch.float16"):  # fmt: skip
        plan.run(x, x.half(), w)
    with pytest.raises(ValueError, match=r"expected rows >= 0, heads and head_dim >= 1 .*, got 2, 0, 8"):
        GatedRMSNormPlan(2, 0, 8, torch.float32)


@pytest.mark.parametrize("kernel", ["qk_norm_rope", "sigmoid_gate_mul", "gated_rmsnorm"])
def test_each_candidate_compiles_and_passes_the_accuracy_gate(kernel, monkeypatch):
    """Level 1 in the GENERAL warmup: every candidate config runs the real kernel (interpreted here) and the tuner's
    accuracy gate compares it with the default; none is rejected, and the result still matches float64."""
    from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, get_autotune_stats

    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    torch.manual_seed(7)
    before = get_autotune_stats()
    with autotune_warmup(AutotuneKernelType.GENERAL):
        if kernel == "qk_norm_rope":
            cos, sin = _tables(8, 4, torch.float32)
            qkv, w = torch.randn(2, 12 * 16, device=DEVICE), torch.randn(16, device=DEVICE) * 0.3
            pos = torch.tensor([3, 7], device=DEVICE)
            q, _ = qk_norm_rope(qkv, 1 + w, 1 + w, cos, sin, pos, 4, 2, gated=True)
            out = q
            q_in = qkv[:, :128].view(2, 4, 32)[..., :16]
            ref = _rope64(_norm64(q_in, 1 + w), cos[pos][:, None].double(), sin[pos][:, None].double())
        elif kernel == "sigmoid_gate_mul":
            o, gate = torch.randn(3, 4, 16, device=DEVICE), torch.randn(3, 4, 16, device=DEVICE)
            out, ref = sigmoid_gate_mul(o, gate), o.double() * torch.sigmoid(gate.double())
        else:
            x, z, w = torch.randn(3, 4, 16, device=DEVICE), torch.randn(3, 4, 16, device=DEVICE), torch.rand(16)
            out, ref = gated_rmsnorm(x, z, w.to(DEVICE)), _gated64(x, z, w.to(DEVICE))
    done = get_autotune_stats() - before
    assert done.searches == 1 and done.candidates_timed > 1 and done.candidates_rejected == 0
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


# ---- on the GPU, at Qwen3.5-27B's widths in bfloat16 ----

Q27B = dict(hidden=5120, heads=24, kv_heads=4, head_dim=256, rotary_dim=64, value_heads=48, value_dim=128)


def _close_bf16(out, oracle, ref64, rounds_once=False):
    """Within one bfloat16 step of transformers' bfloat16 module and within bfloat16's error of float64 math.

    ``rounds_once``: the kernel fuses steps that transformers rounds to bfloat16 one by one (q/k norm then rotary,
    sigmoid then the product), so more elements differ from transformers by a step; there
    it must be no less accurate than transformers against float64 instead of bit-equal to it on 99 % of the
    elements, and within two steps of it."""
    assert not out.isnan().any(), "some output elements were never written"
    rtol = 1e-2
    if rounds_once:
        ours, theirs = (out.double() - ref64).abs(), (oracle.double() - ref64).abs()
        assert ours.mean() <= theirs.mean() and ours.max() <= theirs.max(), (ours.max(), theirs.max())
        rtol = 2**-6  # transformers' two roundings can land two bfloat16 steps from the once-rounded result
    else:
        assert (out != oracle).float().mean().item() <= 0.01
    torch.testing.assert_close(out.float(), oracle.float(), rtol=rtol, atol=1e-2)
    torch.testing.assert_close(out.double(), ref64, rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 64, 4096])
def test_gpu_27b_shapes_match_transformers(tokens):
    torch.manual_seed(tokens)
    bf16, dev, s = torch.bfloat16, "cuda", Q27B
    # the input/post/final norms with the residual add
    h = torch.randn(tokens, s["hidden"], dtype=bf16, device=dev) * 4
    x = torch.randn(tokens, s["hidden"], dtype=bf16, device=dev)
    w = torch.randn(s["hidden"], device=dev) * 0.3
    summed = h + x
    out = add_rmsnorm(h, x, 1 + w)
    assert torch.equal(h, summed)
    _close_bf16(out, _hf_norm(summed, w), _norm64(summed, 1 + w))
    _close_bf16(rmsnorm(summed, 1 + w), _hf_norm(summed, w), _norm64(summed, 1 + w))
    # q/k norm + partial rotary over the gated qkv output, positions up to 262144
    d, heads, kvh, rot = s["head_dim"], s["heads"], s["kv_heads"], s["rotary_dim"]
    qkv = torch.randn(tokens, (2 * heads + 2 * kvh) * d, dtype=bf16, device=dev) * 3
    wq, wk = torch.randn(d, device=dev) * 0.3, torch.randn(d, device=dev) * 0.3
    cos, sin = _tables(262144, rot, bf16, theta=1e7)
    pos = torch.randint(0, 262144, (tokens,), device=dev)
    q, k = qk_norm_rope(qkv, 1 + wq, 1 + wk, cos, sin, pos, heads, kvh, gated=True)
    q_in = qkv[:, : 2 * heads * d].view(tokens, heads, 2 * d)[..., :d]
    k_in = qkv[:, 2 * heads * d : (2 * heads + kvh) * d].view(tokens, kvh, d)
    c, sn = cos[pos][:, None], sin[pos][:, None]
    hf_q, hf_k = transformers_qwen3_5.apply_rotary_pos_emb(_hf_norm(q_in, wq), _hf_norm(k_in, wk), cos[pos],
                                                           sin[pos])  # fmt: skip
    _close_bf16(q, hf_q, _rope64(_norm64(q_in, 1 + wq), c.double(), sn.double()), rounds_once=True)
    _close_bf16(k, hf_k, _rope64(_norm64(k_in, 1 + wk), c.double(), sn.double()), rounds_once=True)
    # the same launch writing a bf16 KV cache (the fused path of a float pool): q/k unchanged, k and the raw v stored
    case = _kv_write_case(bf16, tokens, heads, kvh, d, rot, dev, positions_max=262144, theta=1e7)
    qkv_kv, wq, wk, cos, sin, pos, token_idx, k_pool, v_pool = case
    plan = QKNormRopePlan(tokens, heads, kvh, d, bf16, cos, sin, pos, EPS, gated=True, weight_dtype=torch.float32,
                          kv_layers=KVLayers(k_pool, v_pool), token_idx=token_idx)  # fmt: skip
    q_kv, k_kv = plan.run(qkv_kv, wq, wk, layer=2)
    plain_q, plain_k = qk_norm_rope(qkv_kv, wq, wk, cos, sin, pos, heads, kvh, EPS, gated=True)
    _check_kv_written(q_kv, k_kv, k_pool, v_pool, 2, qkv_kv, token_idx, plain_q, plain_k, kvh)
    # the output gate, read in place from the qkv output
    gate = qkv[:, : 2 * heads * d].view(tokens, heads, 2 * d)[..., d:]
    o = torch.randn(tokens, heads, d, dtype=bf16, device=dev)
    _close_bf16(sigmoid_gate_mul(o, gate), o * torch.sigmoid(gate), o.double() * torch.sigmoid(gate.double()),
                rounds_once=True)  # fmt: skip
    # the gated norm, z read in place from the in_proj output (Hv 48, Dv 128; conv channels 2 * 16 * 128 + 48 * 128)
    hv, dv, channels = s["value_heads"], s["value_dim"], 2 * 16 * 128 + 48 * 128
    proj = torch.randn(tokens, channels + hv * dv + 2 * hv, dtype=bf16, device=dev) * 3
    z = proj[:, channels : channels + hv * dv].view(tokens, hv, dv)
    xo = torch.randn(tokens, hv, dv, dtype=bf16, device=dev)
    gw = (torch.rand(dv, device=dev) + 0.5).to(bf16)
    hf = transformers_qwen3_5.Qwen3_5RMSNormGated(dv, EPS).to(dev)
    hf.weight.data = gw
    with torch.no_grad():
        oracle = hf(xo, z)
    # the kernel rounds where transformers does (the norm, then the weight), so only the float32 silu can flip an
    # element by a step: the bit-equality bound, not the rounds-once accuracy bound (a coin flip on equal roundings)
    _close_bf16(gated_rmsnorm(xo, z, gw, EPS), oracle, _gated64(xo, z, gw))
