import pytest
import torch

from lightllm.kernels.attention.prefill import context_attention, context_attention_ref

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
