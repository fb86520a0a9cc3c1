from types import SimpleNamespace

import pytest
import torch

from lightllm.common.kv_cache.quant import INT8_SCALE_MAX
from lightllm.kernels.kv_cache_write import (
    write_kv,
    write_kv_int4,
    write_kv_int4_ref,
    write_kv_int8,
    write_kv_int8_ref,
    write_kv_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_TOKENS, KV_HEADS, N_NEW = 16, 2, 5
# Sentinels no writer produces: NaN for floats, -128 for INT8 codes (clamped to +-127), byte 0 for INT4 (nibbles 1..15).
SENTINEL = {torch.int8: -128, torch.uint8: 0}
BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}

FLOAT_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
INT8_CASES = [(64, 8), (64, 64), (128, 16), (128, 32), (256, 32), (256, 256)]
INT4_CASES = [(64, 8), (64, 32), (128, 16), (128, 64), (256, 32), (256, 128)]
INT8_IDS = [f"d{d}-g{g}" for d, g in INT8_CASES]
INT4_IDS = [f"d{d}-g{g}" for d, g in INT4_CASES]


def _dtype_id(dtype):
    return str(dtype).replace("torch.", "")


def _pool(shape, dtype):
    return torch.full(shape, SENTINEL.get(dtype, float("nan")), dtype=dtype, device=DEVICE)


def _same_bits(got, want, name):
    assert got.shape == want.shape and got.dtype == want.dtype, name
    if got.dtype in BITS:
        got, want = got.view(BITS[got.dtype]), want.view(BITS[want.dtype])
    mismatch = (got != want).sum().item()
    assert mismatch == 0, f"{name}: {mismatch} of {got.numel()} elements differ from the reference"


def _inputs(head_dim, dtype, idx_dtype=torch.int64, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(N_NEW, KV_HEADS, head_dim, generator=g) * scale).to(dtype).to(DEVICE)
    v = torch.randn(N_NEW, KV_HEADS, head_dim, generator=g).to(dtype).to(DEVICE)
    idx = torch.randperm(NUM_TOKENS, generator=g)[:N_NEW].to(idx_dtype).to(DEVICE)
    return k, v, idx


def _check_untouched_rows(tensors, idx):
    rest = torch.ones(NUM_TOKENS, dtype=torch.bool, device=DEVICE)
    rest[idx.long()] = False
    for t in tensors:
        fill = SENTINEL.get(t.dtype)
        rows, written = t[rest], t[~rest]
        if fill is None:
            assert rows.isnan().all() and not written.isnan().any()
        else:
            assert (rows == fill).all() and not (written == fill).any()


def _run_quant(writer, ref, code_shape, code_dtype, k, v, idx, group_size):
    head_dim = k.shape[-1]
    caches = [_pool(code_shape, code_dtype) for _ in range(2)]
    scales = [_pool((NUM_TOKENS, KV_HEADS, head_dim // group_size), torch.float16) for _ in range(2)]
    expected = [t.clone() for t in caches + scales]
    writer(k, v, *caches, *scales, idx, group_size)
    ref(k, v, *expected, idx, group_size)
    for name, got, want in zip(("k_cache", "v_cache", "k_scale", "v_scale"), caches + scales, expected):
        _same_bits(got, want, name)
    _check_untouched_rows(caches + scales, idx)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=["idx32", "idx64"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256], ids=lambda d: f"d{d}")
def test_write_kv_copy(head_dim, dtype, idx_dtype):
    k, v, idx = _inputs(head_dim, dtype, idx_dtype)
    shape = (NUM_TOKENS, KV_HEADS, head_dim)
    k_cache, v_cache = _pool(shape, dtype), _pool(shape, dtype)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    write_kv(k, v, k_cache, v_cache, idx)
    write_kv_ref(k, v, k_want, v_want, idx)
    _same_bits(k_cache, k_want, "k_cache")
    _same_bits(v_cache, v_want, "v_cache")
    _check_untouched_rows([k_cache, v_cache], idx)


def test_write_kv_strided_inputs_and_pool_layer():
    """k/v as slices of a fused qkv output, caches as one layer of a [layers, tokens, heads, dim] pool."""
    torch.manual_seed(3)
    qkv = torch.randn(N_NEW, 4 * KV_HEADS, 64, device=DEVICE)
    k, v = qkv[:, 2 * KV_HEADS : 3 * KV_HEADS], qkv[:, 3 * KV_HEADS :]
    idx = torch.tensor([9, 2, 15, 0, 4], device=DEVICE)
    pool_k, pool_v = _pool((3, NUM_TOKENS, KV_HEADS, 64), torch.float32), _pool(
        (3, NUM_TOKENS, KV_HEADS, 64), torch.float32
    )
    write_kv(k, v, pool_k[1], pool_v[1], idx)
    assert torch.equal(pool_k[1][idx], k) and torch.equal(pool_v[1][idx], v)
    assert pool_k[0].isnan().all() and pool_k[2].isnan().all() and pool_v[0].isnan().all()
    _check_untouched_rows([pool_k[1], pool_v[1]], idx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=_dtype_id)
@pytest.mark.parametrize("head_dim, group_size", INT8_CASES, ids=INT8_IDS)
def test_write_kv_int8(head_dim, group_size, dtype):
    k, v, idx = _inputs(head_dim, dtype, seed=head_dim + group_size)
    k[0, 0, :group_size] = 0  # an all-zero group: floor scale, zero codes
    shape = (NUM_TOKENS, KV_HEADS, head_dim)
    _run_quant(write_kv_int8, write_kv_int8_ref, shape, torch.int8, k, v, idx, group_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=_dtype_id)
@pytest.mark.parametrize("head_dim, group_size", INT4_CASES, ids=INT4_IDS)
def test_write_kv_int4(head_dim, group_size, dtype):
    k, v, idx = _inputs(head_dim, dtype, seed=head_dim + group_size)
    k[0, 0, :group_size] = 0
    shape = (NUM_TOKENS, KV_HEADS, head_dim // 2)
    _run_quant(write_kv_int4, write_kv_int4_ref, shape, torch.uint8, k, v, idx, group_size)


def _tie_heavy(head_dim, group_size, qmax, dtype):
    """Groups whose absmax is exactly qmax (scale 1.0), filled with half-integers: every x / scale is a tie."""
    g = torch.Generator().manual_seed(7)
    x = torch.randint(-2 * qmax, 2 * qmax + 1, (N_NEW, KV_HEADS, head_dim), generator=g).float() / 2
    x.view(N_NEW, KV_HEADS, -1, group_size)[..., 0] = qmax
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=_dtype_id)
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quant_writers_round_ties_to_even(kind, dtype):
    head_dim, group_size = 64, 16
    if kind == "int8":
        writer, ref, code_shape, code_dtype, qmax = write_kv_int8, write_kv_int8_ref, head_dim, torch.int8, 127
    else:
        writer, ref, code_shape, code_dtype, qmax = write_kv_int4, write_kv_int4_ref, head_dim // 2, torch.uint8, 7
    k = _tie_heavy(head_dim, group_size, qmax, dtype)
    v = -k
    idx = torch.arange(N_NEW, device=DEVICE, dtype=torch.int32) * 3
    _run_quant(writer, ref, (NUM_TOKENS, KV_HEADS, code_shape), code_dtype, k, v, idx, group_size)


@pytest.mark.parametrize("kind, big, top", [("int8", 9e6, INT8_SCALE_MAX), ("int4", 5e5, 65504.0)])
def test_a_group_past_qmax_times_the_largest_scale_saturates_instead_of_reading_nan(kind, big, top):
    """float32 K: a group whose absmax / QMAX passes the largest scale (INT8: 512, so its codes times their scales
    stay inside float16; INT4: float16's largest) takes that scale and saturated codes (an infinite scale made every
    code 0 and read 0 x inf = NaN), bit for bit as the reference."""
    head_dim, group_size = 64, 8
    k, v, idx = _inputs(head_dim, torch.float32, seed=11)
    k[1, 0, :group_size] *= big
    if kind == "int8":
        writer, ref, code_shape, code_dtype = write_kv_int8, write_kv_int8_ref, head_dim, torch.int8
    else:
        writer, ref, code_shape, code_dtype = write_kv_int4, write_kv_int4_ref, head_dim // 2, torch.uint8
    _run_quant(writer, ref, (NUM_TOKENS, KV_HEADS, code_shape), code_dtype, k, v, idx, group_size)
    caches = [_pool((NUM_TOKENS, KV_HEADS, code_shape), code_dtype) for _ in range(2)]
    scales = [_pool((NUM_TOKENS, KV_HEADS, head_dim // group_size), torch.float16) for _ in range(2)]
    writer(k, v, *caches, *scales, idx, group_size)
    assert scales[0][idx[1], 0, 0].item() == top and torch.isfinite(scales[0][idx]).all()


@pytest.mark.parametrize("writer", [write_kv, write_kv_int8, write_kv_int4], ids=["copy", "int8", "int4"])
def test_no_tokens_is_a_no_op(writer):
    k = torch.empty(0, KV_HEADS, 64, device=DEVICE)
    idx = torch.empty(0, dtype=torch.int64, device=DEVICE)
    if writer is write_kv:
        cache = _pool((NUM_TOKENS, KV_HEADS, 64), torch.float32)
        writer(k, k, cache, cache, idx)
        assert cache.isnan().all()
        return
    code_dtype, code_dim = (torch.int8, 64) if writer is write_kv_int8 else (torch.uint8, 32)
    cache = _pool((NUM_TOKENS, KV_HEADS, code_dim), code_dtype)
    scale = _pool((NUM_TOKENS, KV_HEADS, 8), torch.float16)
    writer(k, k, cache, cache, scale, scale, idx, 8)
    assert (cache == SENTINEL[code_dtype]).all() and scale.isnan().all()


def _bad_arg_tensors():
    t = SimpleNamespace(k=torch.randn(3, 2, 64, device=DEVICE), idx=torch.arange(3, device=DEVICE))
    t.cache = torch.zeros(8, 2, 64, device=DEVICE)
    t.c8 = torch.zeros(8, 2, 64, dtype=torch.int8, device=DEVICE)
    t.c4 = torch.zeros(8, 2, 32, dtype=torch.uint8, device=DEVICE)
    t.s = torch.zeros(8, 2, 8, dtype=torch.float16, device=DEVICE)
    t.k96 = torch.randn(3, 2, 96, device=DEVICE)
    t.c96 = torch.zeros(8, 2, 96, dtype=torch.int8, device=DEVICE)
    t.s96 = torch.zeros(8, 2, 3, dtype=torch.float16, device=DEVICE)
    return t


BAD_ARGS = [
    ("copy-int-input", lambda t: write_kv(t.k.int(), t.k.int(), t.cache, t.cache, t.idx), "k_new expected a tensor of"),
    ("copy-v-shape", lambda t: write_kv(t.k, t.k[:2], t.cache, t.cache, t.idx), r"v_new expected torch.float32 \(3, 2"),
    (
        "copy-cache-dtype",
        lambda t: write_kv(t.k, t.k, t.cache.half(), t.cache, t.idx),
        r"k_cache expected torch.float32 \[num_tokens, 2, 64\]",
    ),
    (
        "copy-cache-heads",
        lambda t: write_kv(t.k, t.k, t.cache, t.cache[:, :1], t.idx),
        r"v_cache expected torch.float32 \[num_tokens, 2, 64\]",
    ),
    ("copy-idx-float", lambda t: write_kv(t.k, t.k, t.cache, t.cache, t.idx.float()), "token_idx expected int32/int64"),
    ("copy-idx-len", lambda t: write_kv(t.k, t.k, t.cache, t.cache, t.idx[:2]), r"token_idx expected \[3\]"),
    (
        "copy-strided-last-dim",
        lambda t: write_kv(t.k[..., ::2], t.k[..., ::2], t.cache, t.cache, t.idx),
        "k_new expected .* contiguous last dim",
    ),
    ("copy-2d-input", lambda t: write_kv(t.k[0], t.k[0], t.cache, t.cache, t.idx), r"k_new expected \[n, kv_heads"),
    (
        "int8-cache-dtype",
        lambda t: write_kv_int8(t.k, t.k, t.c4, t.c8, t.s, t.s, t.idx, 8),
        r"k_cache expected torch.int8 \[num_tokens, 2, 64\]",
    ),
    (
        "int4-cache-shape",
        lambda t: write_kv_int4(t.k, t.k, t.c4, t.c8, t.s, t.s, t.idx, 8),
        r"v_cache expected torch.uint8 \[num_tokens, 2, 32\]",
    ),
    (
        "int8-scale-dtype",
        lambda t: write_kv_int8(t.k, t.k, t.c8, t.c8, t.s.float(), t.s, t.idx, 8),
        "k_scale expected torch.float16",
    ),
    (
        "int8-scale-groups",
        lambda t: write_kv_int8(t.k, t.k, t.c8, t.c8, t.s, t.s, t.idx, 16),
        r"k_scale expected torch.float16 \[num_tokens, 2, 4\]",
    ),
    (
        "int8-group-not-dividing",
        lambda t: write_kv_int8(t.k, t.k, t.c8, t.c8, t.s, t.s, t.idx, 12),
        "group_size expected a divisor of head_dim = 64",
    ),
    (
        "int4-group-straddles",
        lambda t: write_kv_int4(t.k, t.k, t.c4, t.c4, t.s, t.s, t.idx, 64),
        "group_size expected a divisor of head_dim // 2 = 32",
    ),
    (
        "int8-num-tokens-mismatch",
        lambda t: write_kv_int8(t.k, t.k, t.c8, t.c8[:4], t.s, t.s, t.idx, 8),
        "expected the same num_tokens, got 8, 4, 8, 8",
    ),
]


@pytest.mark.parametrize("call, match", [c[1:] for c in BAD_ARGS], ids=[c[0] for c in BAD_ARGS])
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call(_bad_arg_tensors())


def test_unsupported_head_dim_raises_not_implemented():
    t = _bad_arg_tensors()
    with pytest.raises(NotImplementedError, match="head_dim must be a power of two for this kernel, got 96"):
        write_kv_int8(t.k96, t.k96, t.c96, t.c96, t.s96, t.s96, t.idx, 32)


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_a_forwards_write_plan_writes_every_layer_as_the_public_function(quant, monkeypatch):
    """KVWritePlan, made at a forward's first layer: later layers (other caches, other inputs) are written as the
    public function writes them, and checked only for their shapes; a layer of another shape is refused."""
    from lightllm.kernels import kv_cache_write as kvw

    head_dim, group = 64, 8
    code_dtype, code_dim = {"none": (torch.float32, head_dim), "int8": (torch.int8, head_dim),
                            "int4": (torch.uint8, head_dim // 2)}[quant]  # fmt: skip
    layers = [[_pool((NUM_TOKENS, KV_HEADS, code_dim), code_dtype) for _ in range(2)] for _ in range(3)]
    scales = [[_pool((NUM_TOKENS, KV_HEADS, head_dim // group), torch.float16) for _ in range(2)] for _ in range(3)]
    want = [[t.clone() for t in caches] for caches in layers]
    want_scales = [[t.clone() for t in s] for s in scales]
    plan, checks = None, []
    real_check = kvw._check_cache
    monkeypatch.setattr(kvw, "_check_cache", lambda *a, **k: checks.append(a[1]) or real_check(*a, **k))
    idx = _inputs(head_dim, torch.float32)[2]  # the forward's token slots, fixed by the plan
    for layer in range(3):
        k, v, _ = _inputs(head_dim, torch.float32, seed=layer)
        extra = () if quant == "none" else tuple(scales[layer])
        if plan is None:
            plan = kvw.KVWritePlan(quant, k, v, *layers[layer], idx, *extra, group_size=group)
        plan.run(k, v, *layers[layer], *extra)
        if quant == "none":
            write_kv_ref(k, v, *want[layer], idx)
        else:
            ref = write_kv_int8_ref if quant == "int8" else write_kv_int4_ref
            ref(k, v, *want[layer], *want_scales[layer], idx, group)
        for got, expected in zip(layers[layer] + (scales[layer] if extra else []),
                                 want[layer] + (want_scales[layer] if extra else [])):  # fmt: skip
            _same_bits(got, expected, f"layer {layer}")
    n_checks = len(checks)
    assert n_checks in (2, 4)  # the caches (and scales) once, at the plan: never per layer
    with pytest.raises(ValueError, match=r"k_new expected the planned"):
        k, v, _ = _inputs(head_dim, torch.float16)
        plan.run(k, v, *layers[0], *(() if quant == "none" else scales[0]))
