"""Penalties, logit bias and min_tokens: the batched logits processor against a float64 reference built from each
request's token lists, the fast path, and the offline API honouring them on the tiny model."""

import pytest
import torch

from lightllm.engine.logits_processor import LogitsProcessor
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams, sample
from lightllm.llm import LLM

VOCAB = 16
EOS = 3


def reference(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """float64, from the request's token lists: bias, min_tokens, repetition (HF), frequency and presence (OpenAI)."""
    p, x = req.params, logits.double().clone()
    for token, bias in p.logit_bias.items():
        x[token] += bias
    if len(req.output_ids) < p.min_tokens:
        x[[EOS, *p.stop_token_ids]] = float("-inf")
    for token in set(req.prompt_ids) | set(req.output_ids):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token in set(req.output_ids):
        x[token] -= p.frequency_penalty * req.output_ids.count(token) + p.presence_penalty
    return x


PARAMS = [
    SamplingParams(max_new_tokens=8),  # nothing to do: its row is left as it is
    SamplingParams(max_new_tokens=8, presence_penalty=1.5, frequency_penalty=-0.5),
    SamplingParams(max_new_tokens=8, repetition_penalty=1.7),
    SamplingParams(max_new_tokens=8, repetition_penalty=0.6, frequency_penalty=2.0),
    SamplingParams(max_new_tokens=8, logit_bias={2: 100.0, 7: -30.5}),
    SamplingParams(max_new_tokens=8, min_tokens=3, stop_token_ids=[9]),
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_mixed_batch_matches_the_reference_step_after_step(device):
    torch.manual_seed(0)
    proc = LogitsProcessor(VOCAB, torch.device(device), [EOS])
    reqs = [Request(str(i), [1, 2, 2, 5 + i], p, lambda ev: None) for i, p in enumerate(PARAMS)]
    for step in range(6):
        live = reqs if step != 2 else reqs[::-1]  # rows need not come in the order they were handed out
        logits = torch.randn(len(live), VOCAB) * 3
        got = proc.apply(logits.to(device), live).cpu()
        want = torch.stack([reference(row, r) for row, r in zip(logits, live)])
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)
        tokens = torch.tensor([(step * 5 + 3 * i) % VOCAB for i in range(len(live))], device=device)  # repeats, EOS
        proc.record(live, tokens)
        for r, t in zip(live, tokens.tolist()):
            r.output_ids.append(t)
    assert proc.rows_in_use == len(PARAMS) - 1
    freed = reqs[1].sampling_row
    proc.release(reqs[1])
    late = Request("late", [4], SamplingParams(max_new_tokens=4, presence_penalty=2.0), lambda ev: None)
    logits = torch.randn(1, VOCAB)
    torch.testing.assert_close(proc.apply(logits.to(device), [late]).cpu().double(), reference(logits[0], late)[None])
    assert late.sampling_row == freed, "a released row is handed out again, cleared"


def test_a_request_handed_in_with_generated_tokens_counts_them_from_its_first_step():
    """A row filled for a request that already has output (the engine never hands one in: its rows outlive
    preemption) counts those tokens for the penalties and ``min_tokens``, as the reference over its lists does."""
    torch.manual_seed(2)
    proc = LogitsProcessor(VOCAB, torch.device("cpu"), [EOS])
    reqs = [Request(str(i), [1, 2, 5], p, lambda ev: None, output_ids=[7, 7, 2]) for i, p in enumerate(PARAMS)]
    logits = torch.randn(len(reqs), VOCAB) * 3
    want = torch.stack([reference(row, r) for row, r in zip(logits, reqs)])
    torch.testing.assert_close(proc.apply(logits, reqs).double(), want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_pending_tokens_count_as_generated_and_record_many_keeps_them(device):
    """MTP decides verify position ``k`` as if the ``k`` drafts before it were generated: ``apply(pending=...)``
    equals the reference over the token lists with them appended, changes no table, and ``record_many`` then
    records each request's emitted tokens (repeats included)."""
    torch.manual_seed(1)
    proc = LogitsProcessor(VOCAB, torch.device(device), [EOS])
    reqs = [Request(str(i), [1, 2, 2, 5 + i], p, lambda ev: None) for i, p in enumerate(PARAMS)]
    proc.apply(torch.randn(len(reqs), VOCAB).to(device), reqs)  # hand out the rows
    for step in range(3):
        drafts = torch.randint(0, VOCAB, (len(reqs), 3))
        drafts[:, 1] = drafts[:, 0]  # a draft repeating the one before it counts twice
        for k in range(drafts.shape[1] + 1):
            logits = torch.randn(len(reqs), VOCAB) * 3
            got = proc.apply(logits.to(device), reqs, pending=drafts[:, :k].to(device)).cpu()
            want = []
            for row, r, d in zip(logits, reqs, drafts[:, :k].tolist()):
                ahead = Request(r.id, r.prompt_ids, r.params, lambda ev: None, output_ids=r.output_ids + d)
                want.append(reference(row, ahead))
            torch.testing.assert_close(got.double(), torch.stack(want), rtol=1e-6, atol=1e-5)
        emitted = [drafts[i, : (i + step) % 4].tolist() for i in range(len(reqs))]  # 0 to 3 tokens each
        proc.record_many(reqs, emitted)
        for r, e in zip(reqs, emitted):
            r.output_ids += e
    logits = torch.randn(len(reqs), VOCAB) * 3
    want = torch.stack([reference(row, r) for row, r in zip(logits, reqs)])
    torch.testing.assert_close(proc.apply(logits.to(device), reqs).cpu().double(), want, rtol=1e-6, atol=1e-5)


def test_min_tokens_holds_eos_and_stop_token_ids_back_then_lets_them_through():
    proc = LogitsProcessor(VOCAB, torch.device("cpu"), [EOS])
    req = Request("r", [1], SamplingParams(max_new_tokens=8, min_tokens=2, stop_token_ids=[9]), lambda ev: None)
    logits = torch.zeros(1, VOCAB)
    logits[0, [EOS, 9]] = 50.0
    drawn = []
    for _ in range(3):
        tokens, _ = sample(proc.apply(logits, [req]), [req.params], [None], raw_logits=logits)
        proc.record([req], tokens)
        drawn.append(tokens.item())
    assert drawn[0] not in (EOS, 9) and drawn[1] not in (EOS, 9) and drawn[2] in (EOS, 9)


def test_min_tokens_leaves_eos_alone_under_ignore_eos():
    """With ignore_eos, EOS ends nothing, so min_tokens holds back only the stop token ids (vLLM's rule too): EOS
    keeps the model's probability from the first token on."""
    proc = LogitsProcessor(VOCAB, torch.device("cpu"), [EOS])
    params = SamplingParams(max_new_tokens=8, min_tokens=4, stop_token_ids=[9], ignore_eos=True)
    req = Request("r", [1], params, lambda ev: None)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    changed = proc.apply(logits, [req])
    assert changed[0, 9] == float("-inf") and changed[0, EOS] == logits[0, EOS]
    assert torch.equal(changed[0, [t for t in range(VOCAB) if t != 9]], logits[0, [t for t in range(VOCAB) if t != 9]])


def test_min_tokens_with_nothing_to_hold_back_changes_nothing():
    """min_tokens under ignore_eos without stop token ids (or on a model without EOS) holds no token back: the
    first such request, before any table of held-back tokens exists, is drawn as if it had none (it once raised)."""
    for eos, ignore_eos in (([EOS], True), ([], False)):
        proc = LogitsProcessor(VOCAB, torch.device("cpu"), eos)
        req = Request("r", [1], SamplingParams(max_new_tokens=8, min_tokens=4, ignore_eos=ignore_eos), lambda ev: None)
        logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
        assert torch.equal(proc.apply(logits, [req]), logits)


def test_requests_without_any_pay_nothing():
    proc = LogitsProcessor(VOCAB, torch.device("cpu"), [EOS])
    reqs = [Request(str(i), [1, 2], SamplingParams(temperature=1.0, top_k=4), lambda ev: None) for i in range(3)]
    logits = torch.randn(3, VOCAB)
    assert proc.apply(logits, reqs) is logits
    proc.record(reqs, torch.tensor([1, 2, 3]))
    assert proc.capacity == 0 and proc._tables == {}


def test_logprobs_are_of_the_model_distribution_not_the_biased_one():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    proc = LogitsProcessor(VOCAB, torch.device("cpu"), [EOS])
    reqs = [Request(str(i), [1], SamplingParams(logit_bias={11: 100.0}), lambda ev: None) for i in range(2)]
    changed = proc.apply(logits, reqs)
    tokens, logprobs = sample(changed, [r.params for r in reqs], [None, None], raw_logits=logits)
    assert tokens.tolist() == [11, 11]
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[:, 11])


@pytest.mark.parametrize("kwargs, message", [
    (dict(presence_penalty=2.5), r"presence_penalty expected a number in \[-2, 2\], got 2.5"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty expected a number in"),
    (dict(repetition_penalty=0), r"repetition_penalty expected a finite number > 0 \(1 = off\), got 0"),
    (dict(repetition_penalty=float("inf")), r"repetition_penalty expected a finite number > 0 \(1 = off\), got inf"),
    (dict(logit_bias={"5": 1.0}), "logit_bias expected non-negative integer token ids as keys, got '5'"),
    (dict(logit_bias={5: 101}), r"logit_bias\[5\] expected a number in \[-100, 100\], got 101"),
    (dict(min_tokens=20), r"min_tokens expected an integer in \[0, max_new_tokens 16\], got 20"),
    (dict(top_logprobs=21), r"top_logprobs expected an integer in \[0, 20\], got 21"),
    (dict(stop_token_ids=[-1]), r"stop_token_ids expected a list of non-negative integers, got \[-1\]"),
], ids=["presence", "frequency-nan", "repetition", "repetition-inf", "bias-key", "bias-value", "min-tokens",
        "top-logprobs", "stop-ids"])  # fmt: skip
def test_bad_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_token_ids_outside_the_vocabulary_are_named():
    with pytest.raises(ValueError, match=r"logit_bias: token ids expected in \[0, 16\), got \[16, 99\]"):
        SamplingParams(logit_bias={99: 1, 16: 2, 3: 0}).check_token_ids(VOCAB)
    with pytest.raises(ValueError, match=r"stop_token_ids: token ids expected in \[0, 16\)"):
        SamplingParams(stop_token_ids=[16]).check_token_ids(VOCAB)


# ---- offline: LLM.generate honours them ------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    return LLM(data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=64, running_max_req_size=4)


def test_offline_generate_honours_penalties_bias_and_min_tokens(llm):
    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    plain = llm.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert any(len(set(o.token_ids)) < len(o.token_ids) for o in plain), "greedy repeats itself on this model"
    no_repeats = llm.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True, presence_penalty=2.0,
                                                      repetition_penalty=100.0))  # fmt: skip
    for o in no_repeats:
        assert len(set(o.token_ids)) == len(o.token_ids)
        assert not set(o.token_ids) & set(o.prompt_token_ids)
    biased = llm.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True, logit_bias={77: 100, 78: -5},
                                                  logprobs=True, top_logprobs=2))  # fmt: skip
    assert [o.token_ids for o in biased] == [[77] * 5] * 2
    for o in biased:  # logprobs of the model's own distribution: the alternatives rank above the forced token
        assert all(top[0][1] >= lp for top, lp in zip(o.top_logprobs, o.logprobs))
    first = plain[0].token_ids[0]
    held = llm.generate(prompts[0], SamplingParams(max_new_tokens=6, min_tokens=4, stop_token_ids=[first]))
    assert first not in held[0].token_ids[:4] and len(held[0].token_ids) >= 4
    with pytest.raises(ValueError, match="logit_bias: token ids expected in"):
        llm.generate(prompts, SamplingParams(logit_bias={10**6: 1.0}))
