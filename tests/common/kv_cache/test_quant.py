import pytest
import torch

from lightllm.common.kv_cache import dequantize_int4_ref, dequantize_int8_ref, quantize_int4_ref, quantize_int8_ref
from lightllm.common.kv_cache.quant import INT8_SCALE_MAX, round_up_scale_bits

QUANT = {
    "int8": (quantize_int8_ref, dequantize_int8_ref, 127),
    "int4": (quantize_int4_ref, dequantize_int4_ref, 7),
}


def _error_bound(x, scale, group_size, qmax):
    """Per-element bound on |x - dequant(quant(x))|: half a step, plus what a scale rounded below absmax / qmax costs
    at the clamped end of the group (qmax * (scale32 - scale16)), plus float32 slack. A scale rounded up (INT8's, to
    7 significant bits) clamps nothing."""
    xg = x.float().unflatten(-1, (-1, group_size))
    scale32 = torch.clamp_min(xg.abs().amax(-1) / qmax, 1e-7)
    s16 = scale.float()
    per_group = s16 / 2 + qmax * (scale32 - s16).clamp_min(0)
    return (per_group.unsqueeze(-1) + 1e-6 * xg.abs()).flatten(-2)


@pytest.mark.parametrize("magnitude", [1.0, 1e-4, 300.0], ids=["unit", "tiny-subnormal-scales", "large"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("head_dim, group_size", [(64, 8), (64, 32), (128, 16), (256, 128)], ids=str)
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_round_trip_error_within_bound(kind, head_dim, group_size, dtype, magnitude):
    quant, dequant, qmax = QUANT[kind]
    if kind == "int8" and group_size == 128:
        group_size = head_dim  # one group per head
    torch.manual_seed(0)
    x = (torch.randn(3, 4, head_dim) * magnitude).to(dtype)
    q, scale = quant(x, group_size)
    assert scale.dtype == torch.float16 and scale.shape == (3, 4, head_dim // group_size)
    assert (scale > 0).all()
    deq = dequant(q, scale, group_size)
    assert deq.dtype == torch.float32 and deq.shape == x.shape
    err = (x.float() - deq).abs()
    bound = _error_bound(x, scale, group_size, qmax)
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    # where the scale is a normal float16 the bound is tight: about half a step (subnormal scales lose precision)
    step = scale.float().repeat_interleave(group_size, -1)
    normal = step >= 2**-14
    assert (bound <= step * 0.6 + 1e-6 * x.float().abs())[normal].all()
    assert normal.any() == (magnitude >= 1)


def test_int8_codes_exact_with_half_to_even():
    # group 0 has absmax 127 -> scale exactly 1.0, so x / scale is x and ties stay ties
    x = torch.tensor([127.0, -63.5, 0.5, 1.5, 2.5, -2.5, -0.5, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    q, scale = quantize_int8_ref(x, group_size=8)
    assert q.dtype == torch.int8
    assert q.tolist() == [127, -64, 0, 2, 2, -2, 0, 3] + [0] * 8
    assert scale.dtype == torch.float16 and scale[0].item() == 1.0
    assert scale[1].item() == round_up_scale_bits(torch.tensor(1e-7).half()).item() > 0  # all-zero group: a floor
    assert dequantize_int8_ref(q, scale, 8).tolist() == [127.0, -64.0, 0.0, 2.0, 2.0, -2.0, 0.0, 3.0] + [0.0] * 8


@pytest.mark.parametrize("magnitude", [1e-6, 1e-3, 1.0, 300.0, 1e5], ids=str)
def test_int8_scales_have_7_significant_bits_and_an_exact_decode_bias(magnitude):
    """What the decode kernel's one-FMA dequantization needs (stage1._int8_word_to_f16): ``72 * scale`` exact in
    float16 and finite, so each scale has its 4 low mantissa bits clear and is at most 512; it is the float16 scale
    rounded up (never down: the group's absmax still maps inside +-127), by under 1/64 (a subnormal one: 2**-20)."""
    torch.manual_seed(1)
    x = torch.randn(64, 4, 128) * magnitude * torch.logspace(-1, 1, 64)[:, None, None]
    q, scale = quantize_int8_ref(x, 8)
    bits = scale.view(torch.int16).int()
    assert (bits & 15 == 0).all() and (scale.float() <= INT8_SCALE_MAX).all() and (scale > 0).all()
    bias = scale.float() * 72
    assert torch.equal(bias.half().float(), bias)
    rounded = torch.clamp(x.unflatten(-1, (-1, 8)).abs().amax(-1) / 127, 1e-7, INT8_SCALE_MAX).half().float()
    assert (scale.float() >= rounded).all() and (scale.float() < rounded * (1 + 1 / 64) + 2.0**-20).all()
    if magnitude == 1e5:  # past 127 x 512 the codes saturate at the largest scale
        assert (scale.float() == INT8_SCALE_MAX).any() and (q.abs() == 127).any()


def test_round_up_scale_bits_rounds_up_to_a_multiple_of_16_ulps():
    s = torch.tensor([0x3C00, 0x3C01, 0x3C0F, 0x3C10, 0x3C11, 0x3FF1, 0x0001, 0x000F], dtype=torch.int16)
    got = round_up_scale_bits(s.view(torch.float16)).view(torch.int16).tolist()
    assert got == [0x3C00, 0x3C10, 0x3C10, 0x3C10, 0x3C20, 0x4000, 0x0010, 0x0010]


def test_int4_packing_layout_exact_bytes():
    # D = 8, group 4: group 0 = elements 0..3 (low half), group 1 = elements 4..7 (high half); absmax 7 -> scale 1
    x = torch.tensor([[-7.0, -1.0, 0.0, 3.0, 7.0, 2.0, -3.0, 5.0]])
    packed, scale = quantize_int4_ref(x, group_size=4)
    # nibbles q + 8: low half [1, 7, 8, 11], high half [15, 10, 5, 13]; byte j = low[j] | high[j] << 4
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0xF1, 0xA7, 0x58, 0xDB]]
    assert scale.tolist() == [[1.0, 1.0]]
    assert dequantize_int4_ref(packed, scale, 4).tolist() == x.tolist()


def test_int4_packing_pairs_element_j_with_j_plus_half():
    # D = 16, group 2: each half holds 4 groups. Integer codes with absmax 7 per group -> scale 1 everywhere.
    codes = torch.tensor([7, -7, 1, -7, 7, 2, -7, 3, 7, 0, -7, -1, 7, 6, -7, -6], dtype=torch.float32)
    packed, scale = quantize_int4_ref(codes, group_size=2)
    nib = (codes + 8).to(torch.int64)
    expected = [int(nib[j]) | (int(nib[j + 8]) << 4) for j in range(8)]
    assert packed.tolist() == expected and (scale == 1).all()
    assert (packed & 15).tolist() == nib[:8].tolist() and (packed >> 4).tolist() == nib[8:].tolist()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_all_zero_group_has_nonzero_scale_and_no_nan(kind):
    quant, dequant, _ = QUANT[kind]
    x = torch.zeros(2, 32)
    x[1, :8] = torch.linspace(-1, 1, 8)  # one live group next to zero groups
    q, scale = quant(x, 8)
    assert (scale > 0).all() and not scale.isnan().any()
    deq = dequant(q, scale, 8)
    assert not deq.isnan().any() and (deq[0] == 0).all() and (deq[1, 8:] == 0).all()
    if kind == "int4":
        assert ((q & 15) == 8).sum() + ((q >> 4) == 8).sum() >= 56  # zeros encode as nibble 8


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: quantize_int8_ref(torch.randn(4, 16), 3), "group_size expected a divisor of head_dim = 16, got 3"),
        (lambda: quantize_int8_ref(torch.randn(4, 16), 32), "group_size expected a divisor of head_dim = 16, got 32"),
        (lambda: quantize_int8_ref(torch.randn(4, 16), 0), "group_size expected a positive int, got 0"),
        (lambda: quantize_int4_ref(torch.randn(4, 16), 16), r"group_size expected a divisor of head_dim // 2 = 8"),
        (lambda: quantize_int4_ref(torch.randn(4, 16), 3), r"group_size expected a divisor of head_dim // 2 = 8"),
        (lambda: quantize_int4_ref(torch.randn(4, 18), 2), r"group_size expected a divisor of head_dim // 2 = 9"),
        (lambda: quantize_int4_ref(torch.randn(4, 15), 3), "head_dim expected an even value for INT4, got 15"),
        (lambda: quantize_int8_ref(torch.ones(4, 16, dtype=torch.int32), 8), "x expected a floating tensor"),
        (
            lambda: dequantize_int8_ref(torch.zeros(2, 16, dtype=torch.int8), torch.ones(2, 4), 8),
            r"scale expected torch.float16 \(2, 2\), got torch.float32 \(2, 4\)",
        ),
        (
            lambda: dequantize_int4_ref(torch.zeros(2, 8, dtype=torch.int8), torch.ones(2, 2).half(), 8),
            "q expected dtype torch.uint8, got torch.int8",
        ),
    ],
    ids=[
        "int8-g3",
        "int8-g-too-big",
        "int8-g0",
        "int4-g-straddles-halves",
        "int4-g3",
        "int4-half-odd",
        "int4-odd-dim",
        "int8-int-input",
        "int8-dequant-scale",
        "int4-dequant-dtype",
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
