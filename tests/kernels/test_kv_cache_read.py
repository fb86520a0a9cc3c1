import pytest
import torch

from lightllm.common.kv_cache.quant import (
    dequantize_int4_ref,
    dequantize_int8_ref,
    quantize_int4_ref,
    quantize_int8_ref,
)
from lightllm.kernels.kv_cache_read import gather_dequant_kv, gather_dequant_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_same(got, want):
    """Bit for bit, except bfloat16 under the interpreter, whose float32 -> bfloat16 cast truncates where the GPU
    (and torch) round to nearest even: one bfloat16 step apart at most there."""
    if DEVICE == "cuda" or got.dtype != torch.bfloat16:
        assert torch.equal(got, want)  # NaN (an unwritten element) fails too
    else:
        assert not got.isnan().any()
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)


def make_layer(quant, tokens, heads, head_dim, group, seed=0):
    """One layer of a quantized pool from random K/V spread over two orders of magnitude per token (codes over their
    whole range, scales far apart)."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-1, 1, tokens)[torch.randperm(tokens, generator=g)][:, None, None]
    k = torch.randn(tokens, heads, head_dim, generator=g) * spread
    v = torch.randn(tokens, heads, head_dim, generator=g) * spread
    quantize = quantize_int8_ref if quant == "int8" else quantize_int4_ref
    (kq, ks), (vq, vs) = quantize(k, group), quantize(v, group)
    return [t.to(DEVICE) for t in (kq, ks, vq, vs)]


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("head_dim, group", [(64, 8), (128, 32), (256, 16), (128, 1)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bit_for_bit_the_reference(quant, head_dim, group, out_dtype):
    """Repeated, out-of-order token indices, a count that is not a multiple of the tile; every element written."""
    kq, ks, vq, vs = make_layer(quant, 300, 3, head_dim, group)
    idx = torch.randint(0, 300, (77,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    idx[5] = idx[40] = 299
    out = tuple(torch.full((77, 3, head_dim), float("nan"), dtype=out_dtype, device=DEVICE) for _ in range(2))
    k, v = gather_dequant_kv(kq, ks, vq, vs, idx, quant, group, out_dtype, out=out)
    assert k is out[0] and v is out[1]
    ref_k, ref_v = gather_dequant_kv_ref(kq, ks, vq, vs, idx, quant, group, out_dtype)
    assert_same(k, ref_k)
    assert_same(v, ref_v)
    # the reference is the format's own dequantization of the gathered rows
    deq = dequantize_int8_ref if quant == "int8" else dequantize_int4_ref
    torch.testing.assert_close(ref_k.double(), deq(kq[idx.long()], ks[idx.long()], group).to(out_dtype).double())


def test_int8_group_wider_than_half_the_head_dim_and_int32_indices():
    """INT8 groups may span the whole head dim (only INT4's layout splits it in halves)."""
    kq, ks, vq, vs = make_layer("int8", 40, 2, 64, 64, seed=2)
    idx = torch.tensor([3, 39, 0, 3], dtype=torch.int32, device=DEVICE)
    k, v = gather_dequant_kv(kq, ks, vq, vs, idx, "int8", 64, torch.bfloat16)
    ref_k, ref_v = gather_dequant_kv_ref(kq, ks, vq, vs, idx, "int8", 64, torch.bfloat16)
    assert_same(k, ref_k)
    assert_same(v, ref_v)


def test_no_tokens():
    kq, ks, vq, vs = make_layer("int4", 8, 1, 64, 8)
    k, v = gather_dequant_kv(kq, ks, vq, vs, torch.empty(0, dtype=torch.int64, device=DEVICE), "int4", 8, torch.half)
    assert k.shape == v.shape == (0, 1, 64)


def test_bad_inputs_name_the_argument():
    kq, ks, vq, vs = make_layer("int8", 16, 2, 64, 8)
    idx = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="quant expected 'int8' or 'int4', got 'fp8'"):
        gather_dequant_kv(kq, ks, vq, vs, idx, "fp8", 8, torch.half)
    with pytest.raises(ValueError, match="k_codes expected a 3-d torch.uint8 tensor"):
        gather_dequant_kv(kq, ks, vq, vs, idx, "int4", 8, torch.half)  # int8 codes given as INT4
    with pytest.raises(ValueError, match="group_size expected a divisor of 64, got 3"):
        gather_dequant_kv(kq, ks, vq, vs, idx, "int8", 3, torch.half)
    with pytest.raises(ValueError, match=r"k_scale expected shape \(16, 2, 4\)"):
        gather_dequant_kv(kq, ks, vq, vs, idx, "int8", 16, torch.half)
    with pytest.raises(ValueError, match="v_codes expected k_codes' shape"):
        gather_dequant_kv(kq, ks, vq[:8], vs, idx, "int8", 8, torch.half)
    with pytest.raises(ValueError, match="token_idx expected a 1-d int32/int64 tensor"):
        gather_dequant_kv(kq, ks, vq, vs, idx.float(), "int8", 8, torch.half)
    with pytest.raises(ValueError, match="out_dtype expected one of"):
        gather_dequant_kv(kq, ks, vq, vs, idx, "int8", 8, torch.int8)
    with pytest.raises(ValueError, match=r"out expected two contiguous torch.float16 tensors of shape \(4, 2, 64\)"):
        gather_dequant_kv(kq, ks, vq, vs, idx, "int8", 8, torch.half, out=(torch.empty(4, 2, 64),) * 2)
    with pytest.raises(NotImplementedError, match="head_dim must be a power of two"):
        gather_dequant_kv(kq[..., :48], ks[..., :6], vq[..., :48], vs[..., :6], idx, "int8", 8, torch.half)
