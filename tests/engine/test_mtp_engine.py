"""MTP speculative decoding through ``Engine.step()`` on the CPU (float32, tiny Qwen3.5 folders with an MTP head):
greedy output equals MTP off token for token, acceptance follows the head's construction, ends are honoured
inside an accepted run, and sampled drafts keep the output distribution."""

import gc
import importlib.util
import json
import os
import weakref

import pytest
import torch

from lightllm.engine.args import EngineArgs
from lightllm.engine.engine import Engine
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams
from lightllm.tools.make_tiny_model import make_tiny_qwen3_5

from tests.engine.test_sampler import SETS, expected
from tests.engine.test_scheduler import run_all

GEN = torch.Generator().manual_seed(4)
PROMPTS = [torch.randint(3, 400, (n,), generator=GEN).tolist() for n in (1, 6, 40, 13)]
LENGTHS = {0: 9, 1: 14, 2: 5, 3: 11}  # max_new_tokens per prompt: steps end at different places


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory):
    return str(make_tiny_qwen3_5(tmp_path_factory.mktemp("mtp-random"), mtp=True, seed=7))


@pytest.fixture(scope="module")
def agree_dir(tmp_path_factory):
    return str(make_tiny_qwen3_5(tmp_path_factory.mktemp("mtp-agree"), mtp="agree", seed=7))


@pytest.fixture(scope="module")
def half_dir(tmp_path_factory):
    """The agreeing head with the noise benchmarks/mtp.py picks for a 50 % acceptance at these widths."""
    bench = load_benchmark("mtp_e2e")
    out = tmp_path_factory.mktemp("mtp-half")
    probe = make_tiny_qwen3_5(out / "probe", seed=7)
    vocab = json.loads((probe / "config.json").read_text())["vocab_size"]
    noise = bench.noise_for_acceptance(0.5, 64, vocab)
    return str(make_tiny_qwen3_5(out / "half", mtp="agree", mtp_noise=noise, seed=7))


def engine(model_dir, observer=None, **opts):
    args = dict(model_dir=model_dir, data_type="fp32", device="cpu", batch_max_tokens=16, max_req_total_len=64,
                running_max_req_size=4)  # fmt: skip
    return Engine(ModelRunner(EngineArgs(**{**args, **opts})), eos_ids=[], observer=observer)


def greedy(lengths=LENGTHS, **extra):
    return {i: SamplingParams(max_new_tokens=n, ignore_eos=True, **extra) for i, n in lengths.items()}


def load_benchmark(name):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class SpecCounts:
    def __init__(self):
        self.drafts = self.accepted = 0

    def on_queues(self, *a): ...

    def on_token(self, *a): ...

    def on_step(self, *a): ...

    def on_spec(self, drafts, accepted):
        self.drafts += drafts
        self.accepted += accepted


@pytest.mark.parametrize("head", ["random", "agree"])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_greedy_output_is_the_same_with_mtp_off_and_on(random_dir, agree_dir, head, step):
    model_dir = random_dir if head == "random" else agree_dir
    want, _ = run_all(engine(model_dir), PROMPTS, params=greedy())  # the 40-token prompt prefills in 3 chunks
    got, reasons = run_all(engine(model_dir, mtp_mode="eagle_with_att", mtp_step=step), PROMPTS, params=greedy())
    assert got == want
    assert set(reasons.values()) == {"length"} and {i: len(t) for i, t in got.items()} == LENGTHS


def token_events(eng, prompts, params):
    """Every request's token events ``{i: [(token id, logprob, top logprobs)]}``, stepping until all finished."""
    outs, done = {i: [] for i in range(len(prompts))}, set()

    def emitter(i):
        def emit(ev):
            if ev.kind == "token":
                outs[i].append((ev.token_id, ev.logprob, ev.top_logprobs))
            else:
                done.add(i)

        return emit

    for i, p in enumerate(prompts):
        eng.submit(Request(str(i), p, params[i], emitter(i)))
    while len(done) < len(prompts):
        assert eng.step()
    return outs


@pytest.mark.parametrize("head", ["random", "agree"])
def test_a_batch_mixing_plain_and_processed_greedy_requests_matches_mtp_off(random_dir, agree_dir, head):
    """Every verify position of every request is decided from one read, those with a penalty, a bias or min_tokens
    as if the drafts before the position were accepted: with MTP on, one batch of plain and processed requests gives
    MTP off's tokens, logprobs (of the model's own distribution) and top logprobs. (The agreeing model continues
    token t with t + 1: the min_tokens request's stop token is the target at the first position it is allowed.)"""
    model_dir = random_dir if head == "random" else agree_dir
    params = [SamplingParams(max_new_tokens=9, ignore_eos=True),
              SamplingParams(max_new_tokens=12, ignore_eos=True, repetition_penalty=1.5, frequency_penalty=0.5),
              SamplingParams(max_new_tokens=7, ignore_eos=True, top_logprobs=3),
              SamplingParams(max_new_tokens=10, ignore_eos=True, logit_bias={PROMPTS[3][0]: 5.0}),
              SamplingParams(max_new_tokens=11, ignore_eos=True),
              SamplingParams(max_new_tokens=10, ignore_eos=True, min_tokens=3, top_logprobs=2,
                             stop_token_ids=[PROMPTS[2][4] + 4])]  # fmt: skip
    prompts = PROMPTS + [PROMPTS[1][::-1], PROMPTS[2][:5]]
    want = token_events(engine(model_dir, running_max_req_size=6), prompts, params)
    got = token_events(
        engine(model_dir, running_max_req_size=6, mtp_mode="eagle_with_att", mtp_step=3), prompts, params
    )
    if head == "agree":  # the stop token ends it at the first position min_tokens lets it through
        assert [t for t, _, _ in want[5]] == [PROMPTS[2][4] + i for i in (1, 2, 3, 4)]
    for i in want:
        assert [t for t, _, _ in got[i]] == [t for t, _, _ in want[i]], i
        torch.testing.assert_close([lp for _, lp, _ in got[i]], [lp for _, lp, _ in want[i]], atol=1e-4, rtol=0)
        for (_, _, top_got), (_, _, top_want) in zip(got[i], want[i]):
            assert (top_got is None) == (top_want is None)
            if top_want is not None:
                assert [t for t, _ in top_got] == [t for t, _ in top_want]
                torch.testing.assert_close([v for _, v in top_got], [v for _, v in top_want], atol=1e-4, rtol=0)


@pytest.mark.parametrize("head", ["random", "agree"])
def test_preemption_under_a_small_cache_gives_the_same_tokens(random_dir, agree_dir, head):
    model_dir = random_dir if head == "random" else agree_dir
    prompts, lengths = PROMPTS[1:] + [PROMPTS[1]], {0: 20, 1: 20, 2: 20, 3: 20}
    want, _ = run_all(engine(model_dir), prompts, params=greedy(lengths))
    tight = engine(model_dir, mtp_mode="eagle_with_att", mtp_step=2, max_total_token_num=90)
    preempted, real = [], tight.scheduler._preempt
    tight.scheduler._preempt = lambda req: (preempted.append(req.id), real(req))
    got, _ = run_all(tight, prompts, params=greedy(lengths))
    assert preempted, "the cache was meant to run out"
    assert got == want
    assert tight.runner.kv.num_free_tokens == 90 - 1  # all freed but the padding token


@pytest.mark.parametrize("head, low, high", [("agree", 0.9, 1.0), ("half", 0.3, 0.7), ("random", 0.0, 0.1)])
def test_acceptance_follows_the_heads_construction(random_dir, agree_dir, half_dir, head, low, high):
    counts, n = SpecCounts(), 2
    lengths = {i: 1 + 5 * (n + 1) for i in range(3)}  # the first token, then 5 full steps
    model_dir = {"agree": agree_dir, "half": half_dir, "random": random_dir}[head]
    eng = engine(model_dir, observer=counts, mtp_mode="eagle_with_att", mtp_step=n)
    run_all(eng, PROMPTS[1:], params=greedy(lengths))
    if head == "agree":  # every step emits n + 1 tokens
        assert counts.drafts == 3 * 5 * n
    assert low <= counts.accepted / counts.drafts <= high, counts.accepted / counts.drafts


def test_stop_token_and_length_end_a_request_inside_an_accepted_run(agree_dir):
    """The agreeing model continues ``t`` with ``t + 1``: every draft is accepted, 4 tokens per step."""
    prompts = [[50, 60, 100], [7, 200]]
    params = {0: SamplingParams(max_new_tokens=30, stop_token_ids=[106]), 1: SamplingParams(max_new_tokens=6)}
    want, want_reasons = run_all(engine(agree_dir), prompts, params=params)
    got, reasons = run_all(engine(agree_dir, mtp_mode="eagle_with_att", mtp_step=3), prompts, params=params)
    assert got == want == {0: [101, 102, 103, 104, 105, 106], 1: [201, 202, 203, 204, 205, 206]}
    assert reasons == want_reasons == {0: "stop", 1: "length"}


def test_offline_llm_counts_the_accepted_draft_tokens(agree_dir):
    from lightllm import LLM

    llm = LLM(agree_dir, data_type="fp32", device="cpu", max_req_total_len=64, running_max_req_size=2,
              mtp_mode="eagle_with_att", mtp_step=3)  # fmt: skip
    out = llm.generate([[30, 31]], SamplingParams(max_new_tokens=9, ignore_eos=True))[0]
    assert out.token_ids == list(range(32, 41))
    assert out.num_accepted_draft_tokens == 6  # the first token, then 2 steps of 3 accepted drafts + 1


def test_a_dropped_llm_with_mtp_frees_its_runner_at_once(agree_dir):
    """No reference cycle through the MTP objects: ``del llm`` frees the runner (on a GPU its weights, KV and graphs)
    without waiting for a garbage collection, so a next engine sizes its KV pool from that memory."""
    from lightllm import LLM

    llm = LLM(agree_dir, data_type="fp32", device="cpu", max_req_total_len=64, running_max_req_size=2,
              mtp_mode="eagle_with_att", mtp_step=2)  # fmt: skip
    assert llm.generate([[30, 31]], SamplingParams(max_new_tokens=5, ignore_eos=True))[0].token_ids == [
        32,
        33,
        34,
        35,
        36,
    ]
    runner, engine = weakref.ref(llm.runner), weakref.ref(llm.engine)
    gc.collect()
    gc.disable()
    try:
        del llm
        assert runner() is None and engine() is None
    finally:
        gc.enable()


def test_seeded_sampling_with_mtp_gives_the_same_tokens_twice(random_dir):
    params = {i: SamplingParams(max_new_tokens=8, temperature=0.9, top_k=20, seed=3 + i, ignore_eos=True)
              for i in range(3)}  # fmt: skip
    runs = [run_all(engine(random_dir, mtp_mode="eagle_with_att", mtp_step=2), PROMPTS[:3], params=params)[0]
            for _ in range(2)]  # fmt: skip
    assert runs[0] == runs[1] and all(len(t) == 8 for t in runs[0].values())


def first_mtp_step(model_dir, params):
    """Prefill ``PROMPTS`` with MTP step 3, then one decode step: the tokens each request emitted in that step."""
    eng = engine(model_dir, mtp_mode="eagle_with_att", mtp_step=3, batch_max_tokens=128)
    got = {i: [] for i in params}
    for i, p in params.items():
        eng.submit(Request(str(i), PROMPTS[i], p, lambda ev, i=i: got[i].append(ev.token_id)))
    while not all(got.values()):  # every prompt prefilled (its first token out): the next step decodes them all
        assert eng.step()
    before = {i: len(t) for i, t in got.items()}
    assert eng.step()
    return {i: t[before[i] :] for i, t in got.items()}


def per_position_decide(self, batch, drafts, logits, chooser):
    """The reference for ``SpecDecoder._decide``: verify position by position for the requests still going, the
    logits processor applied over the tokens recorded at the positions before (a device read at every position),
    the sampling rule drawn for those requests only. Token ids only (logprobs are not compared here)."""
    from lightllm.engine.request import Event
    from lightllm.engine.spec_decode import _Outcome, accept_or_resample, draw_rows, filtered_probs

    proc, n, drafts = self.engine.processor, self.step_drafts, drafts.tolist()
    q_row = {i: j for j, i in enumerate(chooser.sampled)}
    outcomes, active = [_Outcome() for _ in batch], list(range(len(batch)))
    for k in range(n + 1):
        reqs = [batch[i] for i in active]
        changed = proc.apply(logits[active, k], reqs)
        tokens = changed.argmax(dim=-1)
        going = [k < n and t == drafts[i][k] for t, i in zip(tokens.tolist(), active)]
        sampled = [j for j, r in enumerate(reqs) if not r.params.greedy]
        if sampled:
            p = filtered_probs(changed[sampled], [reqs[j].params for j in sampled])
            generators = [reqs[j].generator for j in sampled]
            if k < n:
                q = torch.stack([chooser.q[k][q_row[active[j]]] for j in sampled])
                at = torch.tensor([drafts[active[j]][k] for j in sampled], device=logits.device)
                drawn, took = accept_or_resample(p, q, at, generators)
                for j, t in zip(sampled, took.tolist()):
                    going[j] = t
            else:
                drawn = draw_rows(p, generators)
            tokens[sampled] = drawn
        proc.record(reqs, tokens)
        still = []
        for j, (i, tok) in enumerate(zip(active, tokens.tolist())):
            batch[i].output_ids.append(tok)
            outcomes[i].events.append(Event("token", tok, 0.0, draft=going[j]))
            outcomes[i].reason = self.engine.scheduler.finish_reason(batch[i], tok)
            if outcomes[i].reason is None and going[j]:
                outcomes[i].accepted += 1
                still.append(i)
        active = still
        if not active:
            break
    return outcomes


SAMPLED_PLAIN = [dict(temperature=0.7), dict(temperature=1.0, top_k=30), dict(temperature=0.8, top_p=0.9),
                 dict(temperature=1.2, top_k=50, top_p=0.8)]  # fmt: skip
# the agreeing main model continues token t with t + 1, so a stop token id k + 2 past a prompt's last token is
# the target at verify position k: min_tokens lets it through there only when the drafts before it count
SAMPLED_PROCESSED = [dict(temperature=0.9, repetition_penalty=1.8, min_tokens=3, stop_token_ids=[PROMPTS[0][-1] + 4]),
                     dict(temperature=1.0, frequency_penalty=2.0, presence_penalty=1.0, top_k=40, min_tokens=2,
                          stop_token_ids=[PROMPTS[1][-1] + 3]),
                     dict(temperature=0.8, top_p=0.95, logit_bias={PROMPTS[2][-1] + 2: -100.0}),
                     dict(repetition_penalty=1.3, presence_penalty=2.0)]  # fmt: skip


MIXED = [SAMPLED_PLAIN[0], SAMPLED_PLAIN[1], SAMPLED_PROCESSED[2], SAMPLED_PROCESSED[3]]


# each seed set covers a rejection at the first draft, a step past accepted drafts and a fully accepted one (or one
# that a stop token ends: min_tokens let it through only because the drafts before it counted), and a sampled
# request whose bias bans the target's choice
@pytest.mark.parametrize(
    "extras, seed, lengths",
    [(SAMPLED_PLAIN, 10, [1, 1, 3, 4]), (SAMPLED_PROCESSED, 28, [1, 1, 3, 4]), (MIXED, 32, [1, 1, 3, 4])],
    ids=["plain", "processed", "mixed"],
)
def test_one_read_acceptance_draws_what_the_per_position_reference_draws(half_dir, monkeypatch, extras, seed, lengths):
    """Every verify position of a step is decided on the device at once (position ``k`` as if the drafts before it
    were accepted: penalties count them) and read once; a step of seeded sampled requests, with or without
    penalties and bias (and a greedy penalised one), emits the tokens of the position-by-position reference from
    the same generator states: the same rule, each generator drawn in the same order up to its first rejection."""
    from lightllm.engine.spec_decode import SpecDecoder

    params = {i: SamplingParams(max_new_tokens=12, seed=seed + i, ignore_eos=True, **e) for i, e in enumerate(extras)}
    at_once = first_mtp_step(half_dir, params)
    monkeypatch.setattr(SpecDecoder, "_decide", per_position_decide)
    each = first_mtp_step(half_dir, params)
    assert at_once == each
    assert sorted(len(t) for t in at_once.values()) == lengths, at_once  # events: a finish counts too


# ---- the speculative-sampling rule ------------------------------------------------------------------------


@pytest.mark.parametrize("p", SETS[:6], ids=["t", "topk", "topp", "topk-topp", "minp", "all"])
def test_filtered_probs_is_the_distribution_the_sampler_draws_from(p):
    from lightllm.engine.spec_decode import filtered_probs

    row = torch.randn(12, generator=torch.Generator().manual_seed(2)) * 1.5
    torch.testing.assert_close(filtered_probs(row[None], [p])[0].double(), expected(row, p), atol=1e-6, rtol=0)


@pytest.mark.parametrize("p", SETS[:6], ids=["t", "topk", "topp", "topk-topp", "minp", "all"])
@pytest.mark.parametrize("bad", ["+inf", "nan"])
def test_a_row_that_is_not_a_distribution_takes_the_token_plain_sampling_takes(p, bad):
    """Logits that overflowed: acceptance, resampling and the bonus draw all give the sampler's own fallback token
    (its most likely), never an arbitrary one (the argmax of NaN probabilities, token 0)."""
    from lightllm.engine.sampler import sample_rows
    from lightllm.engine.spec_decode import accept_or_resample, draw_rows, filtered_probs

    row = torch.randn(1, 12, generator=torch.Generator().manual_seed(2))
    if bad == "nan":
        row[0, :] = float("nan")
    else:
        row[0, 7] = float("inf")
    plain = sample_rows(row, [p]).tolist()
    probs = filtered_probs(row, [p])
    assert torch.isfinite(probs).all() and probs.sum().item() == 1.0
    drafts = torch.tensor([(plain[0] + 1) % 12])  # a draft other than that token: rejected, then resampled
    q = torch.softmax(torch.randn(1, 12), dim=-1)
    assert draw_rows(probs, [None]).tolist() == plain == accept_or_resample(probs, q, drafts, [None])[0].tolist()


@pytest.mark.parametrize("case", ["random", "q lacks a token of p", "q equals p"])
def test_accepted_or_resampled_drafts_are_distributed_as_the_target(case):
    from lightllm.engine.spec_decode import accept_or_resample

    g = torch.Generator().manual_seed(0)
    vocab, n = 6, 6000
    p = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    q = p.clone() if case == "q equals p" else torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    if case == "q lacks a token of p":
        q[0] = 0.0
        q /= q.sum()
    drafts = torch.multinomial(q, n, replacement=True, generator=g)
    # every row at once (no read of the device inside): most rows draw from the global generator, every 10th is
    # seeded with a generator of its own, as a seeded request's row is
    torch.manual_seed(1)
    generators = [torch.Generator().manual_seed(i) if i % 10 == 0 else None for i in range(n)]
    got, accepted = accept_or_resample(p.expand(n, vocab), q.expand(n, vocab), drafts, generators)
    assert torch.equal(got[accepted], drafts[accepted])  # an accepted row keeps its draft
    if case == "q equals p":
        assert bool(accepted.all())  # u * q < p always: u < 1
    freq = torch.bincount(got, minlength=vocab).double() / n
    sigma = (p.double() * (1 - p.double()) / n).sqrt()
    assert torch.all((freq - p.double()).abs() <= 5 * sigma + 1e-9), f"{freq} vs {p}"


def test_a_draft_the_target_excludes_is_never_accepted_even_at_u_0(monkeypatch):
    """``torch.rand`` can give exactly 0: a draft of target probability 0 (blocked by min_tokens, cut by top-k/p) must
    still be resampled, as plain sampling never draws it."""
    from lightllm.engine import spec_decode

    monkeypatch.setattr(spec_decode, "uniform_rows", lambda n, generators, device: torch.zeros(n, device=device))
    p = torch.tensor([[0.0, 0.5, 0.5]]).expand(64, 3)
    q = torch.full((64, 3), 1 / 3)
    got, accepted = spec_decode.accept_or_resample(p, q, torch.zeros(64, dtype=torch.int64), [None] * 64)
    assert not accepted.any() and bool((got != 0).all())


def test_processed_logits_read_the_changed_rows_and_the_others_as_they_are():
    """``ProcessedLogits`` keeps a copy of the processed requests' rows only; its argmax and its rows at a position
    equal those of the whole batch with those rows replaced, in any order and mix of rows."""
    from lightllm.engine.spec_decode import ProcessedLogits

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 3, 40, generator=g)
    changed = torch.randn(2, 3, 40, generator=g)
    whole = logits.clone()
    whole[[1, 3]] = changed
    view = ProcessedLogits(logits, [1, 3], changed)
    assert torch.equal(view.argmax(), whole.argmax(dim=-1))
    for k in range(3):
        for rows in ([0, 3, 1], [2, 4], [3], [4, 1, 0, 2, 3]):
            assert torch.equal(view.at(k, rows), whole[rows, k])
    plain = ProcessedLogits(logits)
    assert torch.equal(plain.argmax(), logits.argmax(dim=-1)) and torch.equal(plain.at(2, [4, 0]), logits[[4, 0], 2])


def test_a_seeded_rows_draws_do_not_depend_on_its_neighbours():
    """``draw_rows`` and ``accept_or_resample`` draw a seeded row with its own generator: the same seed gives the same
    token and acceptance alone or among other rows, seeded or not."""
    from lightllm.engine.spec_decode import accept_or_resample, draw_rows

    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(5, 50, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(5, 50, generator=g) * 2, -1)
    drafts = torch.multinomial(q, 1, generator=g).squeeze(1)

    def seeded():
        return [None, torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(8), None]

    many = draw_rows(p, seeded())
    alone = draw_rows(p[1:2], [torch.Generator().manual_seed(7)])
    assert many[1] == alone[0] and many[3] == draw_rows(p[3:4], [torch.Generator().manual_seed(8)])[0]
    tokens, accepted = accept_or_resample(p, q, drafts, seeded())
    one, took = accept_or_resample(p[3:4], q[3:4], drafts[3:4], [torch.Generator().manual_seed(8)])
    assert (tokens[3], accepted[3]) == (one[0], took[0])


def test_a_stop_string_inside_an_accepted_run_ends_the_text_there(agree_dir):
    from lightllm import LLM

    opts = dict(data_type="fp32", device="cpu", max_req_total_len=64, running_max_req_size=2)
    off = LLM(agree_dir, **opts)
    tokens = off.generate([[280, 299]], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
    pieces = [off.tokenizer.decode([t]) for t in tokens]
    at = next(i for i in range(3, len(pieces)) if pieces[i].strip() and pieces[i] not in "".join(pieces[:i]))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, stop=[pieces[at]])
    want = off.generate([[280, 299]], params)[0]
    got = LLM(agree_dir, mtp_mode="eagle_with_att", mtp_step=3, **opts).generate([[280, 299]], params)[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "stop")
    assert got.token_ids == tokens[: at + 1] and got.num_accepted_draft_tokens >= 2


def test_a_failed_acceptance_ends_its_steps_requests_and_the_engine_serves_on(agree_dir, monkeypatch):
    """The one-read acceptance fails (here: its logsumexp): the step's requests, plain and penalised, end with
    "error" and give their KV back; a request submitted afterwards is served to its length."""
    eng = engine(agree_dir, mtp_mode="eagle_with_att", mtp_step=2)
    free = eng.runner.kv.num_free_tokens
    reasons = {}

    def submit(rid, params):
        eng.submit(Request(rid, PROMPTS[1], params, lambda ev: ev.kind == "finish" and reasons.update(
            {rid: ev.finish_reason})))  # fmt: skip

    submit("plain", SamplingParams(max_new_tokens=8, ignore_eos=True))
    submit("penalised", SamplingParams(max_new_tokens=8, ignore_eos=True, repetition_penalty=1.2))
    assert eng.step()
    while eng.scheduler.waiting or eng.scheduler.prefilling:
        assert eng.step()

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    with monkeypatch.context() as m:
        m.setattr(torch, "logsumexp", broken)
        assert eng.step()
    assert reasons == {"plain": "error", "penalised": "error"}
    submit("later", SamplingParams(max_new_tokens=8, ignore_eos=True, repetition_penalty=1.2))
    while eng.step():
        pass
    assert reasons["later"] == "length" and eng.runner.kv.num_free_tokens == free


def test_one_requests_failed_acceptance_ends_it_alone(agree_dir, monkeypatch):
    """One request's acceptance raises (here: whenever its rows are processed, as an out-of-vocabulary bias that got
    past validation would): the batch is decided again request by request, that request ends with "error", and its
    neighbours (greedy, sampled with a seed, with top logprobs) emit what they emit in a batch without it."""
    from lightllm.engine.spec_decode import SpecDecoder

    params = {"greedy": SamplingParams(max_new_tokens=8, ignore_eos=True, top_logprobs=2),
              "seeded": SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, seed=5),
              "bad": SamplingParams(max_new_tokens=8, ignore_eos=True, repetition_penalty=1.3)}  # fmt: skip
    processed = SpecDecoder._processed

    def failing(self, batch, drafts, logits):
        if any(r.id == "bad" for r in batch):
            raise RuntimeError("index out of range")
        return processed(self, batch, drafts, logits)

    monkeypatch.setattr(SpecDecoder, "_processed", failing)

    def run(ids):
        eng = engine(agree_dir, mtp_mode="eagle_with_att", mtp_step=2)
        free = eng.runner.kv.num_free_tokens
        events, reasons = {rid: [] for rid in ids}, {}

        def emit(rid):
            return lambda ev: (events[rid].append((ev.token_id, ev.logprob, ev.top_logprobs)) if ev.kind == "token"
                               else reasons.update({rid: ev.finish_reason}))  # fmt: skip

        for i, rid in enumerate(ids):
            eng.submit(Request(rid, PROMPTS[i], params[rid], emit(rid)))
        while eng.step():
            pass
        return events, reasons, eng.runner.kv.num_free_tokens == free

    with_bad, reasons, freed = run(["greedy", "seeded", "bad"])
    alone, alone_reasons, _ = run(["greedy", "seeded"])
    assert reasons == {"greedy": "length", "seeded": "length", "bad": "error"} and freed
    for rid, want in alone.items():  # the same tokens; logprobs to float32 rounding (another batch, another matmul)
        got = with_bad[rid]
        assert [t for t, _, _ in got] == [t for t, _, _ in want] and len(want) == 8
        assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in want], abs=1e-4)
        for (_, _, top_got), (_, _, top_want) in zip(got, want):
            assert (top_got is None) == (top_want is None) == (rid != "greedy")
            if top_want is not None:
                assert [t for t, _ in top_got] == [t for t, _ in top_want] and len(top_want) == 2
                assert [v for _, v in top_got] == pytest.approx([v for _, v in top_want], abs=1e-4)


def test_an_abort_from_a_token_callback_ends_the_request_there_as_without_mtp(agree_dir):
    """Every draft of the agreeing head is accepted (4 tokens a step): an abort made in the second token's callback
    emits none of the run's later tokens and ends the request with the abort's reason, as a one-token step would,
    also for a request whose run reaches its length in that step; the other request is untouched."""

    def run(eng):
        outs, reasons = {0: [], 1: [], 2: []}, {}
        kv = eng.runner.kv
        free = (kv.num_free_slots, kv.num_free_tokens)

        def emitter(i):
            def emit(ev):
                if ev.kind != "token":
                    reasons[i] = ev.finish_reason
                    return
                outs[i].append(ev.token_id)
                if i < 2 and len(outs[i]) == 2:
                    eng.abort(str(i), "stop")

            return emit

        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (4, 30, 6)]
        for i, p in enumerate(params):
            eng.submit(Request(str(i), [50, 60, 100], p, emitter(i)))
        while len(reasons) < 3:
            assert eng.step()
        assert (kv.num_free_slots, kv.num_free_tokens) == free  # every slot and token back
        return outs, reasons

    want = run(engine(agree_dir))
    got = run(engine(agree_dir, mtp_mode="eagle_with_att", mtp_step=3))
    assert got == want == ({0: [101, 102], 1: [101, 102], 2: [101, 102, 103, 104, 105, 106]},
                           {0: "stop", 1: "stop", 2: "length"})  # fmt: skip
