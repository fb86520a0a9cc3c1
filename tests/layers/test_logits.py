"""logits_fp32: float32 logits from the model's hidden rows and lm_head, one GEMM on a GPU."""

import pytest
import torch
import torch.nn.functional as F

from lightllm.layers.logits import logits_fp32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cpu_logits_are_the_gemm_then_the_cast(dtype):
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(5, 64, generator=g).to(dtype), torch.randn(300, 64, generator=g).to(dtype)
    out = logits_fp32(h, w)
    assert out.dtype == torch.float32 and out.shape == (5, 300)
    assert torch.equal(out, F.linear(h, w).float())


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64])
def test_gpu_bf16_logits_are_float32_accumulations(rows):
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(rows, 1024, device="cuda", generator=g).bfloat16()
    w = (0.05 * torch.randn(32000, 1024, device="cuda", generator=g)).bfloat16()
    out = logits_fp32(h, w)
    assert out.dtype == torch.float32 and out.shape == (rows, 32000) and bool(torch.isfinite(out).all())
    ref = (h.double() @ w.double().t()).float()
    rounded = F.linear(h, w).float()  # the bf16 GEMM then the cast: one bf16 rounding of every logit
    # float32 output keeps the accumulator's precision: far inside one bf16 rounding (2^-8 relative)
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert (out - ref).abs().max() < (rounded - ref).abs().max()
