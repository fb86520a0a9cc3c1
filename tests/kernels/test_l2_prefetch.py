"""The L2 prefetch: which chunks it issues (the kernel's record mode, against the Python oracle, under the interpreter
as on a GPU), its byte budget, its input checks, and on an sm_90 GPU that a prefetch in eager or captured code changes
no result."""

import pytest
import torch

from lightllm.kernels import l2_prefetch as pf


@pytest.mark.parametrize("nbytes, budget", [
    (4096, 1 << 30),  # less than one chunk
    (pf.CHUNK_BYTES, 1 << 30),  # exactly one
    (33 * pf.CHUNK_BYTES + 4096, 1 << 30),  # two programs, the last chunk partial
    (40 * pf.CHUNK_BYTES, 5 * pf.CHUNK_BYTES + 100),  # cut by the budget, rounded down to 16 bytes
])  # fmt: skip
def test_recorded_chunks_match_the_oracle(nbytes, budget):
    t = torch.randn(nbytes // 2, generator=torch.Generator().manual_seed(nbytes)).to(torch.bfloat16)
    if torch.cuda.is_available():
        t = t.cuda()
    n = pf.prefetch_bytes(t, budget)
    assert n == min(nbytes, budget) // 16 * 16
    want = pf.chunk_ranges(n)
    slots = pf.CHUNKS_PER_PROGRAM * -(-len(want) // pf.CHUNKS_PER_PROGRAM)
    record = torch.full((2 * slots,), -7, dtype=torch.int64, device=t.device)
    before = t.clone()
    pf.l2_prefetch(t, budget, record=record)
    got = record.view(-1, 2).cpu()
    assert [tuple(r) for r in got[: len(want)].tolist()] == want  # every chunk, in order, none twice
    assert (got[len(want) :] == -7).all()  # nothing past the end
    assert sum(size for _, size in want) == n and all(size % 16 == 0 and size > 0 for _, size in want)
    assert torch.equal(t, before)


def test_zero_budget_issues_nothing():
    t = torch.randn(1 << 16).to(torch.bfloat16)
    record = torch.full((64,), -7, dtype=torch.int64)
    pf.l2_prefetch(t, 0, record=record)
    pf.l2_prefetch(t, 15, record=record)  # below the 16-byte granule
    assert (record == -7).all()


def test_a_strided_tensor_is_refused_by_name():
    t = torch.randn(64, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="l2_prefetch: expected a contiguous tensor"):
        pf.l2_prefetch(t.t(), 1 << 20)
    with pytest.raises(ValueError, match="16-byte aligned"):
        pf.l2_prefetch(t.view(-1)[1:], 1 << 20)


def test_nothing_is_issued_off_sm90():
    assert not pf.can_prefetch(torch.device("cpu"))
    pf.l2_prefetch(torch.randn(1 << 16).to(torch.bfloat16), 1 << 20)  # a no-op, not an error


@pytest.mark.gpu
def test_prefetch_changes_no_result_eager_or_captured():
    if not pf.can_prefetch(torch.device("cuda")):
        pytest.skip("needs compute capability 9.0")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(4096, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    x = torch.randn(1, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    want = x @ w.t()
    before = w.clone()
    for evict_last in (False, True):
        pf.l2_prefetch(w, 1 << 30, evict_last=evict_last)
        assert torch.equal(x @ w.t(), want)
        out = torch.empty_like(want)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            pf.l2_prefetch(w, 8 << 20, evict_last=evict_last)
            torch.mm(x, w.t(), out=out)
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    assert torch.equal(w, before)
