"""The sampler's draws follow the distribution each request asked for, rows of a batch sampled together."""

import pytest
import torch

from lightllm.engine.sampler import SamplingParams, filtered_sorted, sample

SETS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=6, top_p=0.7),
    SamplingParams(temperature=1.1, min_p=0.035),
    SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.2),
    SamplingParams(),  # greedy
]


def expected(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """float64 reference: temperature, then exactly top_k, then the smallest set reaching top_p, then the tokens of
    at least min_p times the most likely one's probability."""
    probs = torch.softmax(row.double() / p.temperature, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[: p.top_k or len(row)]] = True
    probs = torch.where(keep, probs, 0.0) / probs[keep].sum()
    q = probs[order]
    if p.top_p < 1:
        mass_before = q.cumsum(0) - q
        assert (mass_before - p.top_p).abs().min() > 1e-3, "a boundary this close would test float rounding"
        q = torch.where(mass_before >= p.top_p, 0.0, q)
    if p.min_p:
        ratio = q / q[0]
        assert (ratio - p.min_p).abs().min() > 1e-3, "a boundary this close would test float rounding"
        q = torch.where(ratio < p.min_p, 0.0, q)
    out = torch.zeros_like(probs)
    out[order] = q / q.sum()
    return out


def test_draws_follow_each_rows_distribution_in_one_mixed_batch():
    torch.manual_seed(0)
    vocab, n = 12, 4000
    base = torch.randn(len(SETS), vocab) * 1.5
    which = torch.arange(len(SETS)).repeat(n)  # the sets interleaved, as requests are in a batch
    logits = base[which]
    tokens, logprobs = sample(logits, [SETS[i] for i in which.tolist()], [None] * len(which))
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1))
    for s, p in enumerate(SETS):
        got = tokens[which == s]
        if p.temperature == 0:
            assert torch.equal(got, base[s].argmax().expand_as(got))
            continue
        freq = torch.bincount(got, minlength=vocab).double() / n
        want = expected(base[s], p)
        assert torch.all(freq[want == 0] == 0), f"set {s}: drew a token its top_k/top_p/min_p excludes"
        if p.min_p:  # min_p keeps more than one token here, and drops some that top_k/top_p keep
            assert 1 < (want > 0).sum() < (expected(base[s], SamplingParams(**{**vars(p), "min_p": 0.0})) > 0).sum()
        sigma = (want * (1 - want) / n).sqrt()
        assert torch.all((freq - want).abs() <= 5 * sigma + 1e-9), f"set {s}: {freq} vs {want}"


@pytest.mark.parametrize("vocab, top_p, kept", [(2, 0.5, 1), (4, 0.75, 3), (4, 0.8, 4)])
def test_top_p_keeps_the_smallest_set_that_reaches_it_at_exact_ties(vocab, top_p, kept):
    """Equal logits: the probabilities and their sums are exact, so a token whose more likely ones already reach
    top_p is dropped, not kept (0.5 + 0.5 with top_p 0.5 keeps one token)."""
    logits = torch.zeros(1, vocab)
    tokens = [sample(logits, [SamplingParams(temperature=1.0, top_p=top_p)], [None])[0].item() for _ in range(300)]
    assert len(set(tokens)) == kept


def test_a_row_of_top_p_1_keeps_every_token_beside_one_that_filters():
    """A batch that filters by top_p sorts every row; a row of top_p 1 keeps all its tokens, though its float32
    cumulative sum passes 1 in the tail."""
    logits = torch.randn(2, 32000, generator=torch.Generator().manual_seed(0)) * 4  # the sum passes 1 at ~22000
    _, probs, _ = filtered_sorted(logits, [SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0)])
    assert (probs[1] > 0).all() and (probs[0] == 0).any()


@pytest.mark.parametrize("p", SETS[:6], ids=["t", "topk", "topp", "topk-topp", "minp", "all"])
def test_a_seed_gives_the_same_tokens_whoever_shares_the_batch(p):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=g)

    def run(rows):
        gen = torch.Generator().manual_seed(7)
        return [sample(logits[rows], [p] * len(rows), [gen if r == 1 else None for r in rows])[0][rows.index(1)].item()
                for _ in range(20)]  # fmt: skip

    alone = run([1])
    assert run([0, 1, 2]) == alone and run([2, 1]) == alone
    assert len(set(alone)) > 1  # it really samples


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens expected a positive integer"),
        (dict(temperature=-1), "temperature expected"),
        (dict(top_p=0), "top_p expected"),
        (dict(top_k=-2), "top_k expected"),
        (dict(min_p=1.5), r"min_p expected a number in \[0, 1\] \(0 = off\), got 1.5"),
        (dict(min_p=-0.1), "min_p expected"),
        (dict(min_p=float("nan")), "min_p expected"),
        (dict(seed="x"), "seed expected"),
        (dict(stop=["ok", 7]), r"stop expected a string or a list of strings, got \['ok', 7\]"),
        (dict(stop=7), "stop expected a string or a list of strings, got 7"),
        (dict(stop=["x"] * 17), "stop: at most 16 strings, got 17"),
        (dict(temperature=True), r"temperature expected a number in \[0, 100\], got True"),
        (dict(top_p=True), r"top_p expected a number in \(0, 1\], got True"),
        (dict(logprobs=5), "logprobs expected a bool, got 5"),  # vLLM's count of top logprobs: top_logprobs here
        (dict(ignore_eos="false"), "ignore_eos expected a bool, got 'false'"),
        (dict(stop_token_ids=7), "stop_token_ids expected a list of non-negative integers, got 7"),
        (dict(stop_token_ids="ab"), "stop_token_ids expected a list of non-negative integers, got 'ab'"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=100),
        dict(top_p=1.0),
        dict(min_p=1.0),
        dict(max_new_tokens=4, min_tokens=4),
        dict(top_logprobs=20),
        dict(presence_penalty=2.0, frequency_penalty=-2.0),
        dict(logit_bias={0: 100.0, 1: -100.0}),
        dict(seed=2**63 - 1),
    ],
    ids=lambda kwargs: ",".join(kwargs),
)
def test_the_edge_of_each_documented_range_is_accepted(kwargs):
    """Each range's closed end constructs and is kept as given (the messages say [0, 100], (0, 1], [0, 1],
    [0, max_new_tokens], [0, 20], [-2, 2], [-100, 100], [0, 2**63))."""
    p = SamplingParams(**kwargs)
    assert {name: getattr(p, name) for name in kwargs} == kwargs


def test_sampler():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    greedy, lp = sample(logits, [SamplingParams()] * 3, [None] * 3)
    assert torch.equal(greedy, logits.argmax(-1))
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).max(-1).values)
    top1, _ = sample(logits, [SamplingParams(temperature=1.0, top_k=1)] * 3, [None] * 3)
    assert torch.equal(top1, greedy)
    nucleus, _ = sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 3, [None] * 3)
    assert torch.equal(nucleus, greedy)
    draws = [sample(logits, [SamplingParams(temperature=1.0)] * 3, [torch.Generator().manual_seed(7)] * 3)[0]
             for _ in range(2)]  # fmt: skip
    assert torch.equal(draws[0], draws[1])  # seeded: reproducible


def test_a_tiny_temperature_is_greedy():
    """logits / 1e-40 overflows float32 to inf: below GREEDY_TEMPERATURE the row is taken greedily instead."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3)) * 5
    for t in (1e-40, 1e-6):
        tokens, _ = sample(logits, [SamplingParams(temperature=t)] * 4, [None] * 4)
        assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_top_k_beyond_the_vocabulary_keeps_every_token(top_p):
    """2**63 does not fit int64: it must mean "every token", as top_k 0 does, not fail the draw."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))

    def draws(top_k):
        gen = torch.Generator().manual_seed(11)
        p = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
        return [sample(logits, [p] * 3, [gen] * 3)[0].tolist() for _ in range(10)]

    assert draws(2**63) == draws(10**30) == draws(50) == draws(0)


def test_a_row_without_a_finite_distribution_takes_its_argmax_and_spares_the_others():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(5))
    logits[1, 7] = float("inf")
    logits[2, 9] = 3e38  # finite, but 3e38 / 0.5 is not
    for p in (SamplingParams(temperature=0.5), SamplingParams(temperature=0.5, top_k=10, top_p=0.9)):
        draws = [sample(logits, [p] * 3, [None] * 3)[0].tolist() for _ in range(30)]
        assert all(d[1] == 7 and d[2] == 9 for d in draws)
        assert len({d[0] for d in draws}) > 1  # the healthy row is still sampled


@pytest.mark.parametrize("seed", [-1, 2**63, True])
def test_a_seed_outside_int64_is_refused(seed):
    with pytest.raises(ValueError, match=r"seed expected an integer in \[0, 2\*\*63\)"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_argmax_rows_is_torch_argmax_with_its_ties_and_nans(dtype):
    from lightllm.engine.sampler import argmax_rows

    nan, inf = float("nan"), float("inf")
    x = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[1, [3, 9]] = 10.0  # a tie: the first
    x[2, 7], x[3] = nan, -inf  # a NaN is the maximum; a row of -inf
    x[4, [2, 5]] = torch.tensor([inf, nan], dtype=dtype)
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))
    assert got[:5].tolist() == [int(x[0].argmax()), 3, 7, 0, 5]
    assert torch.equal(argmax_rows(x[::2, 1:]), x[::2, 1:].argmax(dim=-1))  # a strided view
